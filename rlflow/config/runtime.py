"""Ring buffer, runtime supervision, checkpoint and metrics sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Tuple

from rlflow.config.secrets import ENV_BUFFER_TOKEN, token_source_given
from rlflow.config.validation import _check, _positive, _one_of, _timeout, _finite_floats

#: The default of ``runtime.delta_full_every`` (a value away from it needs delta sync).
_DELTA_FULL_EVERY = 10


@dataclass(frozen=True)
class BufferConfig:
    """Host-side ring buffer of completed groups (sampler -> learner).

    Attributes:
      capacity: most groups held.
      when_full: "block" the producer, or "drop_oldest" group (counted).
      timeout_s: seconds a producer or consumer waits before raising a named error.
      bind_address: address the buffer server binds; non-loopback requires a token.
      port: TCP port (0: pick a free one).
      token: shared secret clients must present (required off loopback). Prefer the
        ``RLFLOW_BUFFER_TOKEN`` environment variable or ``token_file``: ``rlflow train``
        refuses ``--buffer.token`` on the command line (visible in ``ps``); run folders,
        logs and checkpoints show it as ``<redacted>`` (``rlflow/config/secrets.py``).
      token_file: file holding the token, readable by its owner only (mode 0600; another
        mode is refused). Used when ``token`` and ``RLFLOW_BUFFER_TOKEN`` are unset.
    """

    capacity: int = 64
    when_full: Literal["block", "drop_oldest"] = "block"
    timeout_s: float = 300.0
    bind_address: str = "127.0.0.1"
    port: int = 0
    token: str = ""
    token_file: str = ""

    def __post_init__(self):
        _finite_floats(self, "buffer")
        _positive(self.capacity, "buffer.capacity")
        _one_of(self.when_full, ("block", "drop_oldest"), "buffer.when_full")
        _timeout(self.timeout_s, "buffer.timeout_s")
        _check(0 <= self.port < 65536, "buffer.port", f"must be in [0, 65535], got {self.port}")
        loopback = self.bind_address in ("127.0.0.1", "localhost", "::1") or \
            self.bind_address.startswith("127.")
        _check(loopback or token_source_given(self.token, self.token_file), "buffer.token",
               f"is required when buffer.bind_address={self.bind_address!r} is not loopback "
               f"(set {ENV_BUFFER_TOKEN} or buffer.token_file)")


@dataclass(frozen=True)
class RuntimeConfig:
    """How the two programs run together.

    Attributes:
      mode: "async" (sampler and learner overlap) or "sync" (on-policy baseline: the
        sampler waits for each new version; requires max_staleness == 0).
      max_staleness: most policy versions a consumed sample may lag the learner.
      stale_policy: "drop" samples older than max_staleness (counted) or "correct" them with
        truncated importance weights.
      weight_transfer: "transfer" (jax.experimental.transfer) or "orbax" (folder fallback).
      publish_every: publish weights every k learner steps.
      transfer_timeout_s: watchdog for one weight pull, seconds.
      transfer_retries: extra pull attempts (each with a fresh uuid) after a failed pull.
      transfer_layout: "native" (pull in the learner's shard layout; the sampler needs at
        least as many devices) or "single_device" (published gathered on one device).
      weight_sync: "full" (every pull moves the whole version) or "delta" (a replica that
        holds the previous version pulls, per published leaf, the zstd-compressed XOR of the
        two versions' bit patterns with a hash of the result, ``rlflow.exchange.delta``; a
        replica that missed a version or whose rebuilt tensor fails the hash pulls the whole
        version). The learner and each replica then keep a host copy of the last version.
        Needs ``weight_transfer="transfer"``.
      delta_full_every: with ``weight_sync="delta"``, every this many-th published version
        goes whole (no delta), bounding the chain of deltas a replica applies (1: never a
        delta). Refused away from its default with ``weight_sync="full"``.
      bind_address: host the weight coordinator and the transfer server bind; off loopback
        requires ``buffer.token`` (the run's shared secret).
      coordinator_port: TCP port of the weight coordinator (0: pick a free one).
      weights_keep_last: versions kept in ``<run>/weights`` by the orbax fallback.
      restart_sampler: restart a dead sampler replica (up to 3 times each); it pulls the
        newest weights before it generates a token. Without it a dead replica stays dead
        and the run goes on with the others (it stops when none is left).
      relay_fanout: with several sampler replicas and ``weight_transfer="transfer"``, the
        learner and every replica that holds a version serve it to this many replicas (a
        relay tree, ``rlflow.exchange.relay``): the learner sends ~fanout x the model's
        bytes per version whatever the replica count. 0: every replica pulls from the
        learner (a star).
      replica_timeout_s: a sampler replica not heard from (heartbeats every second) for
        this many seconds is dropped: its leased prompts go to the other replicas. The
        learner stops with ``NoReplicaError`` when no replica has been alive for this long
        (the first heartbeat of a run may take up to 600 s).
      sampler_sleep: the sampler frees its KV cache whenever it waits (for a new version or
        for admission budget) and allocates a fresh one when it resumes; it keeps generating
        with the last synced weights.
      pin_cpus: on one machine (``rlflow train``), run the learner on the first half of the
        CPUs this process may use and the sampler on the rest (``sched_setaffinity``): the
        CPU stand-in for two accelerator slices. Ignored with fewer than 2 CPUs.
      keep_freed_host_memory: start the learner program(s) with glibc malloc set to keep
        freed memory for reuse (one arena, no ``mmap``, no trimming;
        ``rlflow.system.host_memory``): on the CPU backend the train step's temporaries are
        then not page-faulted in again on every step (~20% of the GSM8K-size step). Its
        resident memory stays at its peak. Not the sampler: one arena slowed its decode
        lanes. Nothing is added where the environment sets any ``MALLOC_*`` variable or
        ``GLIBC_TUNABLES`` (the learner's log says so). ``rlflow train`` on one machine only:
        scripts/tpu and scripts/xpk start their programs without it (on an accelerator the
        step's temporaries are device memory).
      check_memory: before any program starts, refuse a run whose learner (parameters,
        optimizer state, gradients, one micro-batch's activations) or sampler replica
        (weights, KV cache) does not fit its devices' memory by the memory model
        (``rlflow.console.fit``: a chip's HBM on a TPU, this machine's memory on the CPU
        backend), naming the setting to change. ``false`` skips the check (the activations
        are an estimate, within 1.5% of XLA's compiled figure on CPU in
        ``benchmarks/long_context.py``).
    """

    mode: Literal["async", "sync"] = "async"
    max_staleness: int = 2
    stale_policy: Literal["drop", "correct"] = "drop"
    weight_transfer: Literal["transfer", "orbax"] = "transfer"
    publish_every: int = 1
    transfer_timeout_s: float = 120.0
    transfer_retries: int = 2
    transfer_layout: Literal["native", "single_device"] = "native"
    weight_sync: Literal["full", "delta"] = "full"
    delta_full_every: int = _DELTA_FULL_EVERY
    bind_address: str = "127.0.0.1"
    coordinator_port: int = 0
    weights_keep_last: int = 2
    restart_sampler: bool = False
    relay_fanout: int = 2
    replica_timeout_s: float = 60.0
    sampler_sleep: bool = False
    pin_cpus: bool = False
    keep_freed_host_memory: bool = True
    check_memory: bool = True

    def __post_init__(self):
        _finite_floats(self, "runtime")
        _one_of(self.mode, ("async", "sync"), "runtime.mode")
        _one_of(self.stale_policy, ("drop", "correct"), "runtime.stale_policy")
        _one_of(self.weight_transfer, ("transfer", "orbax"), "runtime.weight_transfer")
        _check(self.max_staleness >= 0, "runtime.max_staleness", "must be >= 0")
        _check(self.mode == "async" or self.max_staleness == 0, "runtime.max_staleness",
               f"must be 0 in sync mode, got {self.max_staleness}")
        _positive(self.publish_every, "runtime.publish_every")
        # Between two publishes the sampler keeps the last published version, so samples
        # consumed there lag by up to publish_every - 1 versions by construction.
        _check(self.max_staleness >= self.publish_every - 1, "runtime.publish_every",
               f"must be <= runtime.max_staleness + 1 = {self.max_staleness + 1} (samples "
               f"between publishes are publish_every - 1 versions old), got {self.publish_every}")
        _timeout(self.transfer_timeout_s, "runtime.transfer_timeout_s")
        _check(self.transfer_retries >= 0, "runtime.transfer_retries", "must be >= 0")
        _one_of(self.transfer_layout, ("native", "single_device"), "runtime.transfer_layout")
        _one_of(self.weight_sync, ("full", "delta"), "runtime.weight_sync")
        _check(self.weight_sync == "full" or self.weight_transfer == "transfer",
               "runtime.weight_sync", "'delta' needs runtime.weight_transfer='transfer', got "
               f"{self.weight_transfer!r}")
        _positive(self.delta_full_every, "runtime.delta_full_every")
        _check(self.weight_sync == "delta" or self.delta_full_every == _DELTA_FULL_EVERY,
               "runtime.delta_full_every", f"only applies with runtime.weight_sync='delta', and "
               f"weight_sync is {self.weight_sync!r}, so {self.delta_full_every} would be "
               f"ignored; add --runtime.weight-sync delta, or leave it at {_DELTA_FULL_EVERY}")
        _check(bool(self.bind_address), "runtime.bind_address", "must not be empty")
        _check(0 <= self.coordinator_port < 65536, "runtime.coordinator_port",
               f"must be in [0, 65535], got {self.coordinator_port}")
        _positive(self.weights_keep_last, "runtime.weights_keep_last")
        _timeout(self.replica_timeout_s, "runtime.replica_timeout_s")
        _check(self.relay_fanout >= 0, "runtime.relay_fanout",
               f"must be >= 0, got {self.relay_fanout}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing of the learner state.

    Attributes:
      every_steps: save every N learner steps (0: only at exit).
      keep_last: keep the newest K checkpoints.
      keep_best_metric: also keep the best checkpoint by this metric ("" off).
      keep_best_mode: "max" (higher is better, e.g. a reward) or "min" (e.g. a loss).
      resume: "auto" resumes when the run folder has checkpoints (refused when the folder's
        config.json differs in model, data or reward: another run); "never" starts fresh
        and is refused on a folder holding an earlier run's checkpoints or records, unless
        ``overwrite`` (a run folder belongs to one run: ``rlflow/run/identity.py``).
      overwrite: with ``resume="never"``, move an earlier run's folder aside to
        ``<run>.replaced-<UTC time>`` and start clean instead of refusing.
    """

    every_steps: int = 0
    keep_last: int = 2
    keep_best_metric: str = ""
    keep_best_mode: Literal["max", "min"] = "max"
    resume: Literal["auto", "never"] = "auto"
    overwrite: bool = False

    def __post_init__(self):
        _finite_floats(self, "checkpoint")
        _check(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0")
        _positive(self.keep_last, "checkpoint.keep_last")
        _one_of(self.resume, ("auto", "never"), "checkpoint.resume")
        _one_of(self.keep_best_mode, ("max", "min"), "checkpoint.keep_best_mode")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging (``rlflow.run.wandb_sink``; off by default; needs the
    ``wandb`` package). The run's W&B files live in ``<run folder>/wandb``; its id is kept in
    ``<run folder>/wandb_run_id`` so a resumed run continues the same W&B run.

    Attributes:
      mode: "off", "online" (sync to the server; needs ``wandb login`` or
        ``WANDB_API_KEY``) or "offline" (files only; upload later with ``wandb sync``).
      project: W&B project.
      entity: W&B team or user ("" for the default of the logged-in user).
      run_name: display name of the run ("" for the experiment's ``name``).
      tags: run tags.
    """

    mode: Literal["off", "online", "offline"] = "off"
    project: str = "rlflow"
    entity: str = ""
    run_name: str = ""
    tags: Tuple[str, ...] = ()

    def __post_init__(self):
        _one_of(self.mode, ("off", "online", "offline"), "metrics.wandb.mode")
        _check(self.mode == "off" or bool(self.project), "metrics.wandb.project",
               "must be set when metrics.wandb.mode is not 'off'")


@dataclass(frozen=True)
class MetricsConfig:
    """Run-folder outputs: JSONL + TensorBoard metrics and sample completions.

    Attributes:
      samples_every: write sample completions every N steps (0 off).
      num_samples: completions written each time.
      progress: "auto" (bar on a TTY, plain lines otherwise), "bar" or "plain".
      on_non_finite: a NaN/inf metric value "error"s (raises, naming step and metric) or is
        "flag"ged (written as null, listed under the record's "non_finite" key, warned).
      wandb: Weights & Biases logging of the same metrics, config and samples (off by
        default; :class:`WandbConfig`).
      report: at the end of a successful ``rlflow train``, write the run's report
        (``report/report.html``, ``report.md`` and the PNG plots of
        :mod:`rlflow.run.report`: about 4 CPU seconds of plotting). Off, the run ends without
        it and ``rlflow report RUN_DIR`` writes the same report later (the tests' runs turn
        it off).
    """

    samples_every: int = 5
    num_samples: int = 4
    progress: Literal["auto", "bar", "plain"] = "auto"
    on_non_finite: Literal["error", "flag"] = "flag"
    wandb: WandbConfig = field(default_factory=WandbConfig)
    report: bool = True

    def __post_init__(self):
        _finite_floats(self, "metrics")
        _check(self.samples_every >= 0, "metrics.samples_every", "must be >= 0")
        _check(self.num_samples >= 0, "metrics.num_samples", "must be >= 0")
        _one_of(self.progress, ("auto", "bar", "plain"), "metrics.progress")
        _one_of(self.on_non_finite, ("error", "flag"), "metrics.on_non_finite")
