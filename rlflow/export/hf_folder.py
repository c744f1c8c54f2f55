"""``rlflow export``: write a Hugging Face folder that ``transformers`` loads.

Sources:

* ``--model-path <hf folder>``: load and re-export (a format / dtype conversion, and the
  check that a folder round-trips through rlflow).
* ``--run <run folder> [--step N]``: a learner checkpoint (:func:`params_from_run`). The
  architecture and the tokenizer come from the Hugging Face folder the run started from,
  ``model.path`` of the resolved config that the learner saves with every checkpoint
  (``--base-model`` overrides it, e.g. when the run was trained on another machine).

Every source ends in :func:`export_params`, which writes safetensors, config.json
(``model_type``, RoPE fields and the tie flag at top level) and generation_config.json, and
copies the tokenizer files. Both JSON files keep what the source folder (``--model-path``, or
the run's base model) says beyond the architecture rlflow owns: its generation settings
(sampling, penalties, EOS/pad ids) unchanged and its other config.json values
(:mod:`rlflow.models.hf_settings`).

A LoRA run (``learner.lora.rank > 0``; its checkpoints hold the adapters and a reference to
the base) exports a PEFT adapter folder (:mod:`rlflow.export.peft`), or with ``--merge`` the
merged full model through :func:`export_params`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Optional, Sequence

from rlflow.checkpoint import CheckpointError, DamagedCheckpointError
from rlflow.models.config import DecoderConfig, ModelFormatError
from rlflow.models.hf import (CONFIG_FILE, TOKENIZER_FILES, read_decoder_config, read_hf_config,
                              write_hf)


class ExportError(ValueError):
    """``rlflow export --run``: the run folder, the step or its checkpoint cannot be exported
    (the message names the folder, the step or the tensor, and what was expected)."""


class DamagedExportError(ExportError):
    """The checkpoint to export cannot be read (its files are damaged): the message names
    the step folder, the underlying error and the earlier step to export instead."""


@dataclass(frozen=True)
class ExportArgs:
    """Arguments of ``rlflow export``.

    Attributes:
      out: output folder (created; weight files in it are replaced).
      model_path: Hugging Face folder to re-export.
      run: run folder of a training run (checkpoint export).
      step: checkpoint step of ``run`` (default: the latest).
      base_model: with ``run``: the Hugging Face folder the run started from (architecture,
        tokenizer); default: ``model.path`` of the run config saved in the checkpoint.
      tokenizer_dir: folder with tokenizer files to copy (default: the source folder's).
      dtype: stored dtype; default: the source's (config.json ``torch_dtype`` of
        ``model_path``; ``model.param_dtype`` of the run) or float32.
      merge: with ``run`` of a LoRA run: write the full model with the adapters merged
        (``W + alpha / r * A @ B``) instead of the PEFT adapter folder.
    """

    out: str
    model_path: str = ""
    run: str = ""
    step: Optional[int] = None
    base_model: str = ""
    tokenizer_dir: str = ""
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    merge: bool = False

    def check(self) -> None:
        """Raises ModelFormatError on a bad combination (called by :func:`run_export`, so
        the message reaches the console unwrapped)."""
        if bool(self.model_path) == bool(self.run):
            raise ModelFormatError("give exactly one of --model-path or --run")
        if self.step is not None and not self.run:
            raise ModelFormatError("--step needs --run")
        if self.base_model and not self.run:
            raise ModelFormatError("--base-model needs --run")
        if self.merge and not self.run:
            raise ModelFormatError("--merge needs --run (of a LoRA run)")
        if not self.out:
            raise ModelFormatError("--out must be a folder path")


def export_params(params, decoder_cfg: DecoderConfig, out: str, tokenizer_dir: str | None = None,
                  dtype: str | None = None, source_dir: str | None = None) -> None:
    """Write decoder parameters as a HF folder (the seam every export source ends in).

    Args:
      params: ``nnx.State`` of the decoder's ``nnx.Param``, or the same tree as nested
        dicts of arrays (e.g. restored by orbax).
      decoder_cfg: the architecture.
      out: output folder.
      tokenizer_dir: tokenizer files to copy (None: none).
      dtype: "float32" / "bfloat16" (None: ``decoder_cfg.param_dtype``).
      source_dir: the HF folder the parameters came from (its generation_config.json and
        the config.json values rlflow does not own are kept; None: none).

    Raises:
      ModelFormatError: a parameter is missing, the dtype is unknown, or the tokenizer
        folder has no tokenizer files.
    """
    write_hf(params, decoder_cfg, out, tokenizer_dir=tokenizer_dir, dtype=dtype,
             source_dir=source_dir)


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def _source_dtype(hf_config: dict) -> str:
    dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return dtype if dtype in ("float32", "bfloat16") else "float32"


def export_hf_folder(model_path: str, out: str, *, tokenizer_dir: str | None = None,
                     dtype: str | None = None) -> None:
    """Load a HF folder into rlflow and export it again (tokenizer from the source by
    default; dtype from the source's config.json by default)."""
    from flax import nnx

    from rlflow.models.hf import load_hf

    if os.path.abspath(model_path) == os.path.abspath(out):
        raise ModelFormatError(f"--out must differ from --model-path ({out})")
    dtype = dtype or _source_dtype(read_hf_config(model_path))
    model, cfg = load_hf(model_path)
    if tokenizer_dir is None and _has_tokenizer(model_path):
        tokenizer_dir = model_path
    export_params(nnx.state(model, nnx.Param), cfg, out, tokenizer_dir, dtype,
                  source_dir=model_path)


def _base_config(meta: dict, base_model: str, where: str) -> tuple[DecoderConfig, str]:
    """``(decoder config, base folder)`` of a checkpoint from its run metadata."""
    model = (meta.get("config") or {}).get("model")
    path = base_model
    if not path:
        hint = "; give the Hugging Face folder the run started from with --base-model"
        if not model:
            raise ExportError(f"{where}: the checkpoint metadata holds no run config (it was "
                              f"not saved with run_metadata(cfg)){hint}")
        path = model.get("path") or ""
        if not path:
            raise ExportError(f"{where}: the run trained a random model (model.path is empty in "
                              f"its config), so there is no base config.json or tokenizer{hint}")
        if not os.path.isdir(path):
            raise ExportError(f"{where}: model.path={path!r} of the run config is not a folder "
                              f"on this machine{hint}")
    param_dtype = (model or {}).get("param_dtype") or "float32"
    return read_decoder_config(path, param_dtype=param_dtype), path


def _params_target(cfg: DecoderConfig):
    """The decoder's parameters as ``ShapeDtypeStruct`` on the host CPU device (an
    ``nnx.State``; the restore target, so nothing is materialised on an accelerator)."""
    import jax
    from flax import nnx

    from rlflow.models.decoder import Decoder

    params = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), params)


class RunParams(NamedTuple):
    """What :func:`params_from_run` read from a run's checkpoint."""
    params: Any                  # nnx.State of host numpy arrays (dtype model.param_dtype)
    config: DecoderConfig        # architecture of the base folder, param_dtype of the run
    base_model: str              # the base Hugging Face folder (config.json, tokenizer files)
    step: int                    # the checkpoint step exported
    lora: Any = None             # LoRA run: its LoraSpec (``params`` are then the adapters)


def params_from_run(run: str, step: int | None = None, *, base_model: str = "") -> RunParams:
    """The policy parameters of a run's checkpoint, ready for :func:`export_params`.

    The checkpoint is ``<run>/checkpoints/<step>/`` (``rlflow.checkpoint``; any mesh may have
    saved it). The architecture comes from ``config.json`` (+ the EOS ids of
    ``generation_config.json``) of the base Hugging Face folder: ``base_model``, or else
    ``model.path`` of the resolved run config stored in the checkpoint's ``meta`` item. Every
    saved tensor is checked against that architecture (name and shape) before any array is read.

    Args:
      run: the run folder (``ExperimentConfig.run_path``).
      step: checkpoint step (None: the latest complete one).
      base_model: overrides the run config's ``model.path`` ("" : use it).

    Returns:
      :class:`RunParams`: ``params`` an ``nnx.State`` of host numpy arrays with dtype
      ``model.param_dtype`` of the run (e.g. ``embed`` ``[V, E]``), ``config`` with the same
      ``param_dtype``, the base folder and the step read.

    Raises:
      ExportError: ``run`` is not a folder; it has no complete checkpoint; ``step`` is not
        among its checkpoints (lists the available steps); the metadata has no run config or
        ``model.path`` is empty / missing (and no ``base_model``); a saved tensor is missing,
        extra or of another shape than the base config expects (names it and both shapes).
      rlflow.models.ModelFormatError: the base folder's config.json is missing or invalid.
    """
    import jax
    from etils import epath

    from rlflow.checkpoint import Checkpointer, checkpoint_dir

    if not epath.Path(run).is_dir():
        raise ExportError(f"--run {run}: not a folder (expected a run folder with checkpoints/)")
    ckdir = checkpoint_dir(run)
    no_ckpt = (f"--run {run}: no complete checkpoint in {ckdir} (the learner saves one every "
               "checkpoint.every_steps steps and at exit)")
    absl_log = logging.getLogger("absl")        # orbax warns that read-only mode is read-only
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        ck = Checkpointer(ckdir, read_only=True)
    except CheckpointError:
        raise ExportError(no_ckpt) from None
    finally:
        absl_log.setLevel(level)
    try:
        steps = ck.all_steps()
        if not steps:
            raise ExportError(no_ckpt)
        if step is not None and step not in steps:
            raise ExportError(f"--step {step}: {ckdir} has no checkpoint for step {step}; "
                              f"available steps: {steps}")
        step = steps[-1] if step is None else step
        where = os.path.join(ckdir, str(step))
        meta = ck.run_metadata(step)
        cfg, base = _base_config(meta, base_model, where)
        lora = _lora_spec(meta, cfg, base, where)
        target = _params_target(cfg) if lora is None else _adapters_target(cfg, lora)
        try:
            restored = ck.restore(step, params_target=target, restore_opt_state=False)
        except DamagedCheckpointError as e:
            way = (f"export an earlier one with --step {e.earlier[-1]} (complete steps "
                   f"before it: {list(e.earlier)})" if e.earlier else
                   "the run has no earlier checkpoint to export")
            raise DamagedExportError(f"{e.headline}: {way}") from None
        except CheckpointError as e:
            raise ExportError(f"{where}: the saved parameters do not match the base model "
                              f"{os.path.join(base, CONFIG_FILE)}: {e}") from None
    finally:
        ck.close()
    return RunParams(jax.device_get(restored.params), cfg, base, step, lora)


def _lora_spec(meta: dict, cfg: DecoderConfig, base: str, where: str):
    """The LoRA spec of a run's checkpoint (None: full weights); checks that ``base`` is the
    architecture the adapters were trained on."""
    from rlflow.config import LoraConfig
    from rlflow.models.lora import LoraSpec, base_config_hash

    lora = (((meta.get("config") or {}).get("learner") or {}).get("lora") or {})
    if not lora.get("rank"):
        return None
    spec = LoraSpec.from_config(LoraConfig(
        rank=int(lora["rank"]), alpha=float(lora["alpha"]), targets=tuple(lora["targets"]),
        train_final_norm=bool(lora.get("train_final_norm", False)),
        train_embeddings=bool(lora.get("train_embeddings", False))))
    saved = (meta.get("lora_base") or {}).get("config_sha256")
    if saved is not None and saved != base_config_hash(cfg):
        raise ExportError(f"{where}: the LoRA adapters were trained on another base "
                          f"architecture than {os.path.join(base, CONFIG_FILE)} (config hash "
                          f"{saved[:12]} in the checkpoint, {base_config_hash(cfg)[:12]} here)")
    return spec


def _adapters_target(cfg: DecoderConfig, spec):
    """The adapter tree of ``cfg`` + ``spec`` as ``ShapeDtypeStruct`` on the host CPU."""
    import jax

    from rlflow.models.lora_decoder import abstract_adapters

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu),
                        abstract_adapters(cfg, spec))


def export_lora_run(got: RunParams, out: str, *, merge: bool, tokenizer_dir: str | None,
                    dtype: str | None) -> None:
    """Write a LoRA run's adapters as a PEFT folder, or (``merge``) the merged full model.

    The merged kernels are ``W + alpha / r * A @ B`` in float32 from the base folder's
    weights (read in the run's ``model.param_dtype``).
    """
    from flax import nnx

    from rlflow.export.peft import write_peft_adapter
    from rlflow.models.hf import copy_tokenizer, load_hf
    from rlflow.models.lora import merged_params

    if merge:
        model, _ = load_hf(got.base_model, param_dtype=got.config.param_dtype)
        params = merged_params(nnx.state(model, nnx.Param), got.params, got.lora.scale)
        export_params(params, got.config, out, tokenizer_dir, dtype, source_dir=got.base_model)
        return
    write_peft_adapter(got.params, got.lora, out, base_model=os.path.abspath(got.base_model),
                       dtype=dtype or "float32")
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, out)


def _check_out(out: str) -> None:
    """Refuse an ``--out`` the export would damage or cannot use (nothing written yet)."""
    from rlflow.run.identity import RUN_FILE

    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"--out {out} is a file; give a folder (created if missing)")
    if os.path.isfile(os.path.join(out, RUN_FILE)):
        raise ExportError(f"--out {out} is a run folder (it holds {RUN_FILE}); the export's "
                          "config.json would replace the run's own: give another folder")


def run_export(args: ExportArgs) -> str:
    """Carry out ``args``; returns the output folder.

    Raises:
      ExportError: ``--out`` is a file, or a run folder (it holds ``run.json``: the export's
        ``config.json`` would replace the run's own); and what the export steps raise.
    """
    args.check()
    _check_out(args.out)
    if args.model_path:
        export_hf_folder(args.model_path, args.out, tokenizer_dir=args.tokenizer_dir or None,
                         dtype=args.dtype)
    else:
        got = params_from_run(args.run, args.step, base_model=args.base_model)
        if os.path.abspath(got.base_model) == os.path.abspath(args.out):
            raise ExportError(f"--out must differ from the run's base model folder ({args.out})")
        tokenizer_dir = args.tokenizer_dir or (got.base_model if _has_tokenizer(got.base_model)
                                               else None)
        if got.lora is not None:
            export_lora_run(got, args.out, merge=args.merge, tokenizer_dir=tokenizer_dir,
                            dtype=args.dtype)
            return args.out
        if args.merge:
            raise ExportError(f"--merge: {args.run} is not a LoRA run (learner.lora.rank is 0); "
                              "its export is the full model already")
        export_params(got.params, got.config, args.out, tokenizer_dir, args.dtype,
                      source_dir=got.base_model)
    return args.out


class _library_stderr_held:
    """File descriptor 2 goes to a temporary file inside the block and is written back to
    the real stderr at its end, unless ``drop`` was set: then (``process_exits``: the
    console script, about to exit) it stays pointed at ``/dev/null`` for the rest of the
    process, and ``real`` is a stream to the real stderr (for the one line); in-process
    callers get fd 2 back at once. Why: after a failed checkpoint read, orbax's event loop closes while
    tensorstore's reads still finish on their own threads, and each prints a
    ``RuntimeError: Event loop is closed`` traceback through ``sys.stderr`` (no Python
    hook sees it): hundreds of lines around the one that says which file is damaged."""

    def __init__(self, process_exits: bool):
        self.process_exits = process_exits

    def __enter__(self):
        import tempfile

        sys.stderr.flush()
        self.drop, self.real = False, sys.stderr
        self._real = os.dup(2)
        self._held = tempfile.TemporaryFile()
        os.dup2(self._held.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        if self.drop and self.process_exits:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)
            os.close(null)
            self.real = os.fdopen(self._real, "w", buffering=1)
        else:
            os.dup2(self._real, 2)
            os.close(self._real)
            self._held.seek(0)
            held = self._held.read()
            if held and not self.drop:
                if hasattr(sys.stderr, "buffer"):
                    sys.stderr.buffer.write(held)
                else:
                    sys.stderr.write(held.decode(errors="replace"))
                sys.stderr.flush()
        self._held.close()
        return False


def main(argv: Sequence[str] | None = None, *, process_exits: Optional[bool] = None) -> int:
    """Console entry: ``rlflow export (--model-path DIR | --run DIR [--step N]) --out DIR
    [--dtype bfloat16]``; returns the exit status (2 with the message on stderr on bad input).
    ``process_exits`` (default: ``argv`` is None, the console script): the process ends
    after this returns (see :class:`_library_stderr_held`)."""
    import tyro

    process_exits = argv is None if process_exits is None else process_exits
    argv = list(sys.argv[1:] if argv is None else argv)
    held = None
    try:
        args = tyro.cli(ExportArgs, args=argv, prog="rlflow export")
        with _library_stderr_held(process_exits) as held:
            try:
                out = run_export(args)
            except DamagedExportError:
                held.drop = True
                raise
    except (ModelFormatError, ExportError, CheckpointError, FileNotFoundError) as e:
        print(f"rlflow export: {e}", file=held.real if held is not None else sys.stderr,
              flush=True)
        return 2
    except OSError as e:                # --out on a read-only mount, no space, ...
        where = e.filename or "the --out folder"
        print(f"rlflow export: cannot write {where}: {e.strerror or e}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(out, CONFIG_FILE)):
        print(f"rlflow export: wrote a PEFT LoRA adapter to {out}")
        return 0
    with open(os.path.join(out, CONFIG_FILE)) as f:
        model_type = json.load(f)["model_type"]
    print(f"rlflow export: wrote {model_type} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
