"""``rlflow export``: write a Hugging Face folder that ``transformers`` loads.

Sources:

* ``--model-path <hf folder>``: load and re-export (a format / dtype conversion, and the
  check that a folder round-trips through rlflow).
* ``--run <run folder> [--step N]``: a learner checkpoint (restored by
  ``rlflow.checkpoint``; not wired yet: :func:`params_from_run` is the seam).

Every source ends in :func:`export_params`, which writes safetensors, config.json
(``model_type``, RoPE fields and the tie flag at top level), generation_config.json (every
EOS id) and copies the tokenizer files.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from rlflow.models.config import DecoderConfig, ModelFormatError
from rlflow.models.hf import CONFIG_FILE, TOKENIZER_FILES, read_hf_config, write_hf


@dataclass(frozen=True)
class ExportArgs:
    """Arguments of ``rlflow export``.

    Attributes:
      out: output folder (created; weight files in it are replaced).
      model_path: Hugging Face folder to re-export.
      run: run folder of a training run (checkpoint export).
      step: checkpoint step of ``run`` (default: the latest).
      tokenizer_dir: folder with tokenizer files to copy (default: the source folder's).
      dtype: stored dtype; default: the source's (config.json ``torch_dtype``) or float32.
    """

    out: str
    model_path: str = ""
    run: str = ""
    step: Optional[int] = None
    tokenizer_dir: str = ""
    dtype: Optional[Literal["float32", "bfloat16"]] = None

    def check(self) -> None:
        """Raises ModelFormatError on a bad combination (called by :func:`run_export`, so
        the message reaches the console unwrapped)."""
        if bool(self.model_path) == bool(self.run):
            raise ModelFormatError("rlflow export: give exactly one of --model-path or --run")
        if self.step is not None and not self.run:
            raise ModelFormatError("rlflow export: --step needs --run")
        if not self.out:
            raise ModelFormatError("rlflow export: --out must be a folder path")


def export_params(params, decoder_cfg: DecoderConfig, out: str, tokenizer_dir: str | None = None,
                  dtype: str | None = None) -> None:
    """Write decoder parameters as a HF folder (the seam every export source ends in).

    Args:
      params: ``nnx.State`` of the decoder's ``nnx.Param``, or the same tree as nested
        dicts of arrays (e.g. restored by orbax).
      decoder_cfg: the architecture.
      out: output folder.
      tokenizer_dir: tokenizer files to copy (None: none).
      dtype: "float32" / "bfloat16" (None: ``decoder_cfg.param_dtype``).

    Raises:
      ModelFormatError: a parameter is missing, the dtype is unknown, or the tokenizer
        folder has no tokenizer files.
    """
    write_hf(params, decoder_cfg, out, tokenizer_dir=tokenizer_dir, dtype=dtype)


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
        raise ModelFormatError(f"rlflow export: --out must differ from --model-path ({out})")
    dtype = dtype or _source_dtype(read_hf_config(model_path))
    model, cfg = load_hf(model_path)
    if tokenizer_dir is None and _has_tokenizer(model_path):
        tokenizer_dir = model_path
    export_params(nnx.state(model, nnx.Param), cfg, out, tokenizer_dir, dtype)


def params_from_run(run: str, step: int | None):
    """``(params, decoder_cfg, tokenizer_dir)`` of a run's checkpoint: the seam for the
    checkpoint module (``rlflow.checkpoint``)."""
    raise NotImplementedError("rlflow export --run: checkpoint export is not wired yet; "
                              "export a Hugging Face folder with --model-path")


def run_export(args: ExportArgs) -> str:
    """Carry out ``args``; returns the output folder."""
    args.check()
    if args.model_path:
        export_hf_folder(args.model_path, args.out, tokenizer_dir=args.tokenizer_dir or None,
                         dtype=args.dtype)
    else:
        params, cfg, tokenizer_dir = params_from_run(args.run, args.step)
        export_params(params, cfg, args.out, args.tokenizer_dir or tokenizer_dir, args.dtype)
    return args.out


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry: ``rlflow export --model-path DIR --out DIR [--dtype bfloat16]``."""
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = tyro.cli(ExportArgs, args=argv, prog="rlflow export")
        out = run_export(args)
    except (ModelFormatError, NotImplementedError, FileNotFoundError) as e:
        print(f"rlflow export: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(out, CONFIG_FILE)) as f:
        model_type = json.load(f)["model_type"]
    print(f"rlflow export: wrote {model_type} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
