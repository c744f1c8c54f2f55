"""The learner's stateful shell: model, optimiser, sharded state and compiled steps.

:class:`Learner` owns the :class:`rlflow.learner.step.TrainState` on the learner's mesh and a
compiled train step per sequence bucket. The runtime feeds it rollout group records::

    learner = Learner(cfg)                       # builds/loads the model on the mesh
    metrics = learner.train_on(records)          # batch -> one optimiser step -> metrics
    learner.version                              # = optimiser steps taken

With ``learner.advantage = "gae"`` (PPO) the state also holds a value head
(``TrainState.value``, :mod:`rlflow.learner.value`), trained with the policy;
:attr:`Learner.params` (what the runtime publishes and checkpoints as the policy) stays the
policy alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from rlflow import checkpoint as ckpt_lib
from rlflow import config as config_lib
from rlflow.learner.batch import (BatchError, BatchSpec, TrainBatch, build_batch,
                                  validate_batch, with_sequence_ids)
from rlflow.learner.loss_positions import capacity_for, check_capacity
from rlflow.learner.routing_replay import routing_shape, step_routing_ids
from rlflow.learner.packing import pack_batch, pack_spec_from_config, padding_fraction
from rlflow.learner.optimizer import make_optimizer
from rlflow.learner.step import (StepSettings, TrainState, init_state, make_train_step,
                                 state_shardings)
from rlflow.learner.step_jit import (abstract_args, abstract_batch, compile_train_step,
                                     jit_train_step, step_args)
from rlflow.learner.value import init_value_head
from rlflow.mesh import batch_shards, make_mesh, param_shardings, sequence_size
from rlflow.models.decoder import validate_tokens
from rlflow.models.hf import build_model
from rlflow.models.lora import LoraSpec, base_reference, zeros_like_adapters
from rlflow.models.lora_decoder import lora_model_parts
from rlflow.run import perf

logger = logging.getLogger("rlflow.learner")
COMPILE_THREAD_NAME = "rlflow-compile"   # background compiles (rlflow.launcher.learner_hosts)


class Learner:
    """Train state + compiled step of one learner program.

    Args:
      cfg: the :class:`rlflow.config.ExperimentConfig`.
      mesh: the learner's mesh (default: ``make_mesh(cfg.learner.mesh, devices)``).
      devices: devices for the default mesh (default: all of ``jax.devices()``).
      keep_params: the step never donates :attr:`params` (each step's params are new
        arrays; see :func:`rlflow.learner.step_jit.jit_train_step`), so a weight server can send
        a published version without copying it first (:attr:`keeps_params`).
      student_tokenizer: the run's tokenizer, checked against the teacher's with
        ``teacher.path`` (default: loaded as the programs load it).

    The policy is built with ``model.param_dtype`` master parameters and
    ``learner.compute_dtype`` activations (bf16 compute with fp32 master weights when
    ``model.param_dtype = "float32"`` and ``learner.compute_dtype = "bfloat16"``). With
    ``learner.kl_coef > 0`` a frozen copy of the initial parameters is the KL reference.

    LoRA (``learner.lora.rank > 0``, :mod:`rlflow.models.lora`): the model's parameters are
    the frozen ``base`` (:attr:`base`, never donated, no gradient, no optimiser state) and
    the adapters; ``state.params`` (what is published, checkpointed, and what AdamW updates
    at ``learner.lora.lr``) are the adapters alone. The KL reference is the base itself,
    reached with all-zero adapters (no second copy of the base).
    With ``learner.advantage = "gae"`` a zero-initialised float32 value head
    (``value_graphdef``, ``state.value``) is trained jointly with the policy.
    """

    def __init__(self, cfg, *, mesh=None, devices=None, keep_params: bool = False,
                 student_tokenizer=None):
        self.cfg, self.keeps_params = cfg, keep_params
        lc = cfg.learner
        self.mesh = mesh if mesh is not None else make_mesh(lc.mesh, devices)
        model_cfg = config_lib.replace(cfg.model, dtype=lc.compute_dtype)
        model, self.model_config = build_model(model_cfg, mesh=self.mesh)
        if "linear_attention" in self.model_config.kinds and lc.shared_prefix and lc.packs:
            raise ValueError(f"learner.shared_prefix: the model ({cfg.model.path or 'random'}) "
                             "has linear_attention (gated DeltaNet) layers, whose state is one "
                             "sequence's, so a prompt cannot be shared by several completions; "
                             "set learner.shared_prefix=False")
        self.lora = LoraSpec.from_config(lc.lora)
        self.base, self.base_ref, base_sh = None, None, None
        if self.lora is None:
            self.graphdef, params = nnx.split(model, nnx.Param)
            self.tx, self.schedule = make_optimizer(lc)
        else:
            self.graphdef, params, self.base = lora_model_parts(
                model, self.model_config, self.lora, seed=lc.seed, mesh=self.mesh)
            self.base_ref = base_reference(cfg.model, self.model_config)
            base_sh = param_shardings(self.base, self.mesh)
            self.tx, self.schedule = make_optimizer(
                config_lib.replace(lc, lr=lc.lora.lr or lc.lr))
        del model
        self.settings = StepSettings.from_config(cfg, self.model_config)
        self.batch_spec = BatchSpec.from_config(cfg)
        self.pack_spec = pack_spec_from_config(cfg)        # None: rows stay padded
        # rollout routing replay (MoE): (layers, k, dtype) of the batches' routing_ids, or
        # None (dense); StepSettings.routing_replay says whether the forward uses them
        self.routing = routing_shape(self.model_config)
        self.value_graphdef, value = None, None
        if self.settings.gae:
            self.value_graphdef, value = init_value_head(self.model_config.hidden_size)
        self.shardings = state_shardings(params, self.tx, self.mesh, value)
        self.state: TrainState = init_state(params, self.tx, self.mesh, value)
        self.ref_params = None
        if lc.kl_coef > 0:
            # LoRA: zero adapters = the base model (the adapter term switched off)
            fn = zeros_like_adapters if self.lora else (
                lambda p: jax.tree.map(lambda x: x.copy(), p))
            self.ref_params = jax.jit(fn, out_shardings=self.shardings.params)(self.state.params)
        step_fn = make_train_step(self.graphdef, self.tx, self.schedule, self.settings, self.mesh,
                                  self.value_graphdef)
        self._jitted = jit_train_step(step_fn, self.shardings, self.mesh,
                                      with_ref=self.ref_params is not None, frozen_sh=base_sh,
                                      keep_params=keep_params)
        self._compiled: dict[tuple[int, int], object] = {}
        # Packed row counts this run's steps have used (checkpointed in ``extra``): a resumed
        # run picks the same counts as an uninterrupted one, so its steps have the same
        # shapes and (on CPU) bit-identical results.
        self.packed_row_counts: set[int] = set()
        # Seconds the latest step spent compiling its shape or waiting for its background
        # compile (0.0 once compiled): ``learner/compile_s``.
        self.last_compile_s = 0.0
        self._peak_flops: float | None = None     # per chip, measured on first use on CPU
        # on-policy distillation (teacher.path): a frozen teacher on this mesh, outside the
        # train state (rlflow.learner.teacher)
        self.teacher = None
        if cfg.teacher.enabled:
            from rlflow.learner.teacher import Teacher

            self.teacher = Teacher(cfg, self.mesh, student_vocab_size=self.model_config.vocab_size,
                                   student_tokenizer=student_tokenizer)

    @property
    def version(self) -> int:
        """Policy version of the current parameters (= optimiser steps taken)."""
        return int(self.state.step)

    @property
    def params(self):
        """The policy's parameters (``nnx.State``): never the value head. LoRA: the adapters
        (the base is :attr:`base`)."""
        return self.state.params

    def policy_params(self):
        """What ``nnx.merge(self.graphdef, *self.policy_params())`` builds the policy from:
        ``(params,)``, or ``(adapters, base)`` with LoRA."""
        return (self.state.params,) if self.base is None else (self.state.params, self.base)

    @property
    def value_params(self):
        """The PPO value head's parameters (``nnx.State``), or None without one."""
        return self.state.value

    def checkpoint(self, **fields) -> ckpt_lib.LearnerCheckpoint:
        """The current state as a :class:`rlflow.checkpoint.LearnerCheckpoint` at
        ``step = version``: policy ``params``, ``opt_state`` and (PPO) the value head as its
        own ``value`` item; ``fields``: the rest (``data_state``, ``extra``, ``metadata``)."""
        st = self.state
        if self.pack_spec is not None:
            fields["extra"] = {**(fields.get("extra") or {}),
                               "packed_row_counts": sorted(self.packed_row_counts)}
        if self.base_ref is not None:     # LoRA: the adapters + a reference to their base
            fields["metadata"] = {**(fields.get("metadata") or ckpt_lib.run_metadata(self.cfg)),
                                  "lora_base": self.base_ref}
        return ckpt_lib.LearnerCheckpoint(step=self.version, params=st.params,
                                          opt_state=st.opt_state, value=st.value, **fields)

    def resume(self, checkpointer: ckpt_lib.Checkpointer):
        """Restore the latest checkpoint of ``checkpointer`` onto this learner's mesh
        (``rlflow.checkpoint.resume``): params, optimiser state, step and (PPO) value head.

        Returns: the restored :class:`rlflow.checkpoint.LearnerCheckpoint`, or None (fresh
        start: no checkpoint, or ``checkpoint.resume="never"``).

        Raises: :class:`rlflow.checkpoint.CheckpointError` when the checkpoint does not fit
        the state, e.g. a PPO learner resuming a checkpoint saved without a value head.
        """
        st = self.state
        restored = ckpt_lib.resume(checkpointer, params_target=st.params,
                                   opt_state_target=st.opt_state, value_target=st.value)
        if restored is None:
            return None
        if self.base_ref is not None:
            check_lora_base(restored.metadata, self.base_ref, checkpointer.directory,
                            restored.step)
        step = jax.device_put(np.int32(restored.step), self.shardings.step)
        self.state = TrainState(step, restored.params, restored.opt_state, restored.value)
        self.packed_row_counts = {int(r) for r in
                                  (restored.extra or {}).get("packed_row_counts", ())}
        return restored

    def compiled_step(self, rows: int, seq: int):
        """The AOT-compiled step for ``[rows, seq]`` batches (compiled once per shape).

        Packed (``learner.packing``): after the first packed shape, the worst-case row count
        (``PackSpec.row_counts[-1]``, the one a later step that needs more rows uses) is
        compiled on a background thread while the steps run, so that step does not stall
        unless the compile is still running when it comes. The seconds this call spent
        compiling or waiting for a compile are :attr:`last_compile_s`.
        """
        t0 = time.perf_counter()
        key = (rows, seq)
        waited = key not in self._compiled or \
            isinstance(self._compiled[key], concurrent.futures.Future)
        if key not in self._compiled:
            self._compiled[key] = self._compile(rows, seq)
            spec = self.pack_spec
            if spec is not None and seq == spec.pack_length and \
                    (spec.row_counts[-1], seq) not in self._compiled:
                self._compiled[(spec.row_counts[-1], seq)] = self._compile_in_background(
                    spec.row_counts[-1], seq)
        compiled = self._compiled[key]
        if isinstance(compiled, concurrent.futures.Future):
            compiled = self._compiled[key] = compiled.result()   # re-raises its error
        self.last_compile_s = time.perf_counter() - t0 if waited else 0.0
        return compiled

    def _compile(self, rows: int, seq: int, args=None):
        t0 = time.perf_counter()
        compiled = compile_train_step(self._jitted, args or self._abstract_args(rows, seq))
        logger.info("compiled train step for batch %dx%d in %.1f s", rows, seq,
                    time.perf_counter() - t0)
        return compiled

    def _abstract_args(self, rows: int, seq: int) -> tuple:
        # shapes and shardings only: taken here, before a step donates the state's buffers
        return abstract_args(self.state, abstract_batch(rows, seq, self.mesh, self.routing),
                             self.ref_params, self.base)

    def _compile_in_background(self, rows: int, seq: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        args = self._abstract_args(rows, seq)

        def run():
            try:
                future.set_result(self._compile(rows, seq, args))
            except BaseException as e:  # noqa: BLE001 - raised where the step needs it
                future.set_exception(e)

        # not a daemon: the interpreter waits for it at exit (a daemon thread stopped inside
        # an XLA compile aborts the process: "FATAL: exception not rethrown")
        threading.Thread(target=run, daemon=False, name=COMPILE_THREAD_NAME).start()
        return future

    def build_batch(self, records: Sequence[Mapping], version: int | None = None
                    ) -> tuple[TrainBatch, dict]:
        """:func:`rlflow.learner.batch.build_batch` at ``version`` (default: the current
        version; the learner program passes the version a step in flight will make, so it
        builds the next batch without waiting for that step), then (with
        ``learner.packing``) :func:`rlflow.learner.packing.pack_batch`; the info adds
        ``learner/padding_fraction`` (padded positions of the one-row-per-sample batch) and,
        packed, ``learner/packed_padding_fraction``, ``batch/packed_rows``. Packed, a step
        takes the smallest row count an earlier step of the run used that holds its rows,
        else the worst case (:meth:`rlflow.learner.packing.PackSpec.rows_for`): a run has at
        most two packed shapes. With a teacher (``teacher.path``) the packed batch's
        advantages are the distillation advantages
        (:meth:`rlflow.learner.teacher.Teacher.apply`; info adds ``distill/reverse_kl`` and
        ``distill/teacher_time_s``). The counts used are :attr:`packed_row_counts`, checkpointed,
        so a resumed run packs as the uninterrupted one would; a count joins them when a step
        runs at it (:meth:`dispatch_on_device`), not when a batch is built."""
        version = self.version if version is None else version
        batch, info = build_batch(records, self.batch_spec, version)
        if self.pack_spec is None:
            info = {**info, "learner/padding_fraction": padding_fraction(batch.attention_mask)}
        else:
            batch, pinfo = pack_batch(batch, self.pack_spec, self.packed_row_counts)
            info = {**info, **pinfo}
        if self.teacher is not None:           # waits for a step in flight, then scores
            batch, tinfo = self.teacher.apply(batch, wait=self.state.step)
            info = {**info, **tinfo}
        return batch, {**info, **self.batch_flops(batch)}

    def batch_flops(self, batch: TrainBatch) -> dict[str, float]:
        """``batch/tokens`` (real tokens) and ``batch/model_flops`` (the step's model FLOPs,
        :func:`rlflow.run.perf.train_flops`) of a host batch."""
        n, t = perf.sequence_lengths(batch.attention_mask, batch.positions, batch.segment_ids)
        return {"batch/tokens": int(n.sum()),
                "batch/model_flops": perf.train_flops(self.model_config, n, t)}

    def perf_metrics(self, info: Mapping, seconds: float) -> dict[str, float]:
        """``perf/mfu``, ``perf/tokens_per_s_per_chip`` and ``perf/model_flops_per_s_per_chip``
        of a step whose :meth:`build_batch` info is ``info`` and whose compute took
        ``seconds`` (its compile left out: ``learner/step_time_s - learner/compile_s``);
        :func:`rlflow.run.perf.learner_perf_metrics`. The peak is the table's for TPUs /
        GPUs, a ``jnp.dot`` in ``learner.compute_dtype`` measured once on CPU."""
        if self._peak_flops is None:
            self._peak_flops = perf.peak_flops_per_chip(self.mesh.devices.flat[0],
                                                        self.cfg.learner.compute_dtype)
        out = perf.learner_perf_metrics(info["batch/model_flops"], info["batch/tokens"],
                                        seconds, chips=self.mesh.devices.size,
                                        peak_per_chip=self._peak_flops)
        out.pop("perf/model_flops")          # logged as batch/model_flops
        return out

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on a host batch; returns the step metrics as floats.

        Raises: as :meth:`check_batch`.
        """
        return pull_metrics(self.dispatch(batch))

    def dispatch(self, batch: TrainBatch, *, checked: bool = False) -> dict:
        """Start one optimiser step on a host batch and return at once (JAX dispatches the
        compiled step asynchronously): the step metrics stay on the device (:func:`pull_metrics`
        waits for them), so the caller's host work overlaps the step. ``state`` already holds
        the step's outputs (reading them waits too). ``checked``: ``batch`` is already
        :meth:`check_batch`'s output (the checks are not run again).

        Raises: as :meth:`check_batch`.
        """
        if not checked:
            batch = self.check_batch(batch)
        # Host arrays go straight into the compiled step, which places them on its batch
        # sharding (batch_sharding(self.mesh)) in the same C++ call: ~0.3 ms less host time
        # a step than a jax.device_put of the 12 fields first (a Python loop over them).
        return self.dispatch_on_device(TrainBatch(*(None if x is None else np.asarray(x)
                                                    for x in batch)))

    def check_batch(self, batch: TrainBatch) -> TrainBatch:
        """The host-side checks of a step's batch; fills ``token_rewards`` with zeros
        ``[B, L]`` float32 for the group estimators, and the sequence ids
        (:func:`rlflow.learner.batch.with_sequence_ids`). (A multi-host learner runs them on host 0
        before distributing the batch, :mod:`rlflow.learner.multihost`.)

        Raises: :class:`rlflow.learner.batch.BatchError` for mismatched shapes or dtypes, or a
        row count that the micro-batches and batch-sharded devices do not divide;
        :class:`rlflow.models.decoder.TokenRangeError` for a token id outside the vocabulary
        (inside jit a gather would clamp it silently); a PPO batch without
        ``token_rewards``; more loss positions than the step's logit slots (groups x
        group size x ``sampler.max_tokens``, :mod:`rlflow.learner.loss_positions`). RuntimeError: PPO state without its value head (e.g. a
        ``TrainState`` rebuilt from a checkpoint that did not carry ``value``).
        """
        validate_batch(batch)
        if batch.token_rewards is None:
            if self.settings.gae:
                raise BatchError("token_rewards is None, but learner.advantage='gae' needs each "
                                 "sample's reward on its last response token (build_batch)")
            batch = batch._replace(token_rewards=np.zeros(np.shape(batch.advantages), np.float32))
        batch = with_sequence_ids(batch)
        batch = batch._replace(routing_ids=step_routing_ids(
            batch.routing_ids, self.routing, *np.shape(batch.tokens)))
        if self.settings.gae and self.state.value is None:
            raise RuntimeError("learner.advantage='gae' but the train state has no value head "
                               "(TrainState.value is None): a state restored from a checkpoint "
                               "must carry the value head too")
        validate_tokens(batch.tokens, self.model_config.vocab_size, where="train batch tokens")
        rows, seq = np.shape(batch.tokens)
        k, shards = self.settings.micro_batches, batch_shards(self.mesh)
        if rows % (k * shards):
            raise BatchError(f"batch of {rows} rows does not divide into learner.micro_batches x "
                             f"data x fsdp x expert = {k * shards} parts")
        cp = sequence_size(self.mesh)
        if seq % cp:
            raise BatchError(f"train batch rows of {seq} positions do not split over "
                             f"learner.mesh.sequence={cp}: training row lengths "
                             f"(learner.seq_buckets, learner.pack_length) must be multiples of it")
        if self.settings.max_loss_tokens > 0:
            capacity = capacity_for(rows // k, seq, shards, self.settings.max_loss_tokens, cp)
            try:
                check_capacity(batch.loss_mask, k, shards, capacity, cp)
            except ValueError as e:
                raise BatchError(f"train batch: {e}") from None
        return batch

    def step_on_device(self, dev: TrainBatch) -> dict[str, float]:
        """One optimiser step on a checked batch already in ``batch_sharding(self.mesh)``
        (global arrays ``[B, L]``); returns the step metrics as floats."""
        return pull_metrics(self.dispatch_on_device(dev))

    def dispatch_on_device(self, dev: TrainBatch) -> dict:
        """:meth:`step_on_device` without waiting: returns the metrics as device arrays.
        ``dev``'s fields may also be host (numpy) arrays of a checked batch: the compiled
        step places them on its batch sharding itself."""
        rows, seq = dev.tokens.shape
        fn = self.compiled_step(rows, seq)
        self.state, metrics = fn(*step_args(self.state, dev, self.ref_params, self.base))
        if self.pack_spec is not None and seq == self.pack_spec.pack_length:
            self.packed_row_counts.add(int(rows))
        return metrics

    def train_on(self, records: Sequence[Mapping]) -> dict[str, float]:
        """Build the batch from group records, take one step, merge batch and step metrics.

        Raises: :class:`rlflow.learner.batch.BatchError` for records that do not fit.
        """
        batch, info = self.build_batch(records)
        t0 = time.perf_counter()
        metrics = self.step(batch)
        metrics["learner/step_time_s"] = time.perf_counter() - t0
        metrics["learner/compile_s"] = self.last_compile_s
        return {**info, **metrics, **self.perf_metrics(
            info, metrics["learner/step_time_s"] - self.last_compile_s)}


def pull_metrics(metrics: Mapping) -> dict[str, float]:
    """Step metrics from the device (one transfer; waits for the step) as Python floats."""
    return {k: float(v) for k, v in jax.device_get(dict(metrics)).items()}


def check_lora_base(metadata, base_ref: dict, directory, step: int) -> None:
    """A LoRA checkpoint must have been trained on this base (same ``model.path`` and
    architecture hash, same ``init_seed`` for a random base).

    Raises: :class:`rlflow.checkpoint.CheckpointError` naming the checkpoint, the field and
    both values.
    """
    saved = (metadata or {}).get("lora_base")
    where = f"{directory}/{step}"
    if saved is None:
        raise ckpt_lib.CheckpointError(f"{where}: the checkpoint records no LoRA base "
                                       "(meta.lora_base); it was not saved by a LoRA learner")
    for key in ("config_sha256", "path", "init_seed"):
        if saved.get(key) != base_ref.get(key):
            raise ckpt_lib.CheckpointError(
                f"{where}: LoRA base mismatch in {key}: the checkpoint's adapters were trained "
                f"on {saved.get(key)!r}, this run's base has {base_ref.get(key)!r} "
                f"(model.path / architecture / init_seed must match to resume)")
