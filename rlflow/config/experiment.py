"""The whole-run config, the run-level cross-section checks, and config-file loading."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Tuple

from rlflow.system.ports import is_wildcard
from rlflow.config.secrets import ENV_BUFFER_TOKEN, token_source_given
from rlflow.config.validation import ConfigError, _check, _finite_floats
from rlflow.config.runtime import BufferConfig
from rlflow.config.runtime import CheckpointConfig
from rlflow.config.data import DataConfig
from rlflow.config.learner import LearnerConfig
from rlflow.config.runtime import MetricsConfig
from rlflow.config.model import ModelConfig
from rlflow.config.data import RewardConfig
from rlflow.config.runtime import RuntimeConfig
from rlflow.config.sampler import SamplerConfig
from rlflow.config.envs import EnvConfig
from rlflow.config.gateway import GatewayConfig
from rlflow.config.eval import EvalConfig
from rlflow.config.teacher import TeacherConfig


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole rlflow run.

    Attributes:
      name: run name; the run folder is ``{run_dir}/{name}``.
      run_dir: parent folder of run folders.
      seed: global seed (data order, sampling, init).
      plugins: modules every program imports first (dotted names or ``.py`` paths), e.g.
        to register reward functions (``rlflow.system.plugins``).
    """

    name: str = "demo"
    run_dir: str = "runs"
    seed: int = 0
    plugins: Tuple[str, ...] = ()
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)

    def _check_expert_axes(self) -> None:
        """``learner.mesh.expert`` / ``sampler.mesh.expert`` > 1 only for a mixture-of-experts
        model, and dividing its expert count (:mod:`rlflow.models.expert_parallel`)."""
        experts = self.model.expert_count()
        for prog in ("learner", "sampler"):
            n = getattr(self, prog).mesh.expert
            if n == 1:
                continue
            _check(experts > 0, f"{prog}.mesh.expert",
                   f"is {n}, but the model is dense (model.model_type="
                   f"{self.model.model_type!r}{', model.path ' + repr(self.model.path) if self.model.path else ''}): "
                   f"the expert axis splits a mixture-of-experts model's experts; set it to 1")
            _check(experts % n == 0, f"{prog}.mesh.expert",
                   f"must divide the model's {experts} experts (each device holds "
                   f"experts / expert of every layer), got {n}")

    def __post_init__(self):
        _finite_floats(self, "config")
        _check(bool(self.name) and "/" not in self.name, "name",
               f"must be a non-empty folder name, got {self.name!r}")
        bind = self.runtime.bind_address
        _check(bind == "localhost" or bind.startswith("127.") or bind == "::1"
               or token_source_given(self.buffer.token, self.buffer.token_file), "buffer.token",
               f"is required when runtime.bind_address={bind!r} is not loopback "
               f"(set {ENV_BUFFER_TOKEN} or buffer.token_file)")
        bport, cport = self.buffer.port, self.runtime.coordinator_port
        host = lambda a: "127.0.0.1" if a == "localhost" else a  # noqa: E731 - one name each
        _check(not (bport and bport == cport) or (
            host(self.buffer.bind_address) != host(bind)
            and not any(not a or is_wildcard(a) for a in (self.buffer.bind_address, bind))),
            "runtime.coordinator_port",
            f"must differ from buffer.port={bport} (the learner binds both on "
            f"{self.buffer.bind_address!r} / {bind!r}); 0 picks a free one")
        if self.runtime.stale_policy == "correct":
            _check(self.learner.rollout_correction.enabled, "learner.rollout_correction",
                   "must weight or reject (weight or reject not 'off') when "
                   "runtime.stale_policy='correct'")
        lr, sp = self.learner, self.sampler
        self._check_expert_axes()
        _check(not (lr.routing_replay and not self.model.path
                    and self.model.model_type != "qwen3_moe"), "learner.routing_replay",
               f"True needs a mixture-of-experts model (it replays the sampler's expert "
               f"choices), but model.model_type={self.model.model_type!r} is dense; leave it "
               f"unset (None: on for mixture-of-experts models)")
        _check(lr.advantage == "gae" or sp.group_size >= 2, "sampler.group_size",
               f"must be >= 2 with learner.advantage={lr.advantage!r} (group-relative "
               f"advantages compare the G samples of a prompt), got {sp.group_size}")
        rows = lr.groups_per_step * sp.group_size
        split = lr.micro_batches * lr.mesh.batch_shards
        _check(rows % split == 0, "learner.micro_batches",
               f"learner.groups_per_step * sampler.group_size = {rows} samples must divide into "
               f"learner.micro_batches * learner.mesh.data * learner.mesh.fsdp * "
               f"learner.mesh.expert = {split} parts")
        if lr.num_hosts > 1:        # weights leave a multi-host learner as per-host shards
            rt = self.runtime
            _check(rt.weight_transfer == "transfer", "runtime.weight_transfer",
                   f"must be 'transfer' with learner.num_hosts={lr.num_hosts} (each learner "
                   "host serves its own shards; the orbax folder fallback is one-host only)")
            _check(not self.checkpoint.keep_best_metric, "checkpoint.keep_best_metric",
                   f"is not supported with learner.num_hosts={lr.num_hosts} (the step's "
                   "metrics live on learner host 0 only; every host must save alike)")
        _check(lr.overlong_buffer <= sp.max_tokens, "learner.overlong_buffer",
               f"must be <= sampler.max_tokens={sp.max_tokens}, got {lr.overlong_buffer}")
        _check(sp.decode_lanes <= 1 or not self.env.enabled, "sampler.decode_lanes",
               f"must be 0 or 1 with multi-turn episodes (env.name={self.env.name!r}): decode "
               f"lanes run single-turn requests only, got {sp.decode_lanes}")
        _check(self.env.max_episode_tokens <= sp.max_tokens, "env.max_episode_tokens",
               f"must be <= sampler.max_tokens={sp.max_tokens} (the KV cache holds the prompt "
               f"and that many tokens), got {self.env.max_episode_tokens}")
        _check(not (self.gateway.trains_agent and self.env.enabled), "gateway.agent",
               f"training an agent through the gateway and multi-turn environments "
               f"(env.name={self.env.name!r}) are exclusive; set one")
        _check(not self.gateway.on or sp.decode_lanes <= 1, "sampler.decode_lanes",
               f"must be 0 or 1 with the gateway on (gateway calls go to one batcher), got "
               f"{sp.decode_lanes}")
        _check(not self.gateway.trains_agent or sp.journal_every_steps == 0,
               "sampler.journal_every_steps", "must be 0 when training through the gateway")
        self._check_eval()
        self._check_teacher()
        self._check_sequence_axis()
        if lr.packs and lr.pack_length:
            longest = self.longest_row
            _check(lr.pack_length >= longest, "learner.pack_length",
                   f"must hold the longest row ({longest} tokens: learner.seq_buckets[-1], or "
                   f"sampler.max_prefill_length + sampler.max_tokens), got {lr.pack_length}")

    def _check_sequence_axis(self) -> None:
        """Training rows split over ``learner.mesh.sequence`` (context parallelism): every
        row length the learner's step can see (the packed rows' ``pack_length``, else each
        padded bucket) must be a multiple of it."""
        lr, sp = self.learner, self.sampler
        n = lr.mesh.sequence
        if n == 1:
            return
        if lr.packs:
            lengths, where = (self.pack_length,), (
                "learner.pack_length" if lr.pack_length else
                "the packed row length (learner.pack_length=0 resolves to it)")
            fix = "set learner.pack_length to a multiple of it"
        elif lr.seq_buckets:
            lengths, where = lr.seq_buckets, "learner.seq_buckets"
            fix = "make every learner.seq_buckets entry a multiple of it"
        else:
            lengths, where = (sp.max_prefill_length + sp.max_tokens,), (
                "the padded row length (sampler.max_prefill_length + sampler.max_tokens; "
                "learner.seq_buckets is empty)")
            fix = "set learner.seq_buckets to multiples of it"
        bad = [t for t in lengths if t % n]
        _check(not bad, "learner.mesh.sequence",
               f"is {n}, which must divide every training row length (each row's positions "
               f"are split over the axis), but {where} has {bad}; {fix}")

    def _check_eval(self) -> None:
        """The ``eval`` section against the sampler and data sections."""
        from rlflow.config.eval import eval_data_config

        ev, sp = self.eval, self.sampler
        _check(ev.max_tokens is None or ev.max_tokens <= sp.max_tokens, "eval.max_tokens",
               f"must be <= sampler.max_tokens={sp.max_tokens} (the KV cache holds that many "
               f"new tokens), got {ev.max_tokens}")
        if not ev.enabled:
            return
        data = eval_data_config(self)
        same_file = (data.source != "builtin" and self.data.source != "builtin"
                     and os.path.realpath(data.path) == os.path.realpath(self.data.path))
        # other spellings of the same file (hard links, globs, folders) are refused by
        # rlflow.console.checks.check_held_out, which looks at the files
        _check(not same_file, "eval.path",
               f"{data.path!r} must differ from data.path={self.data.path!r}: the held-out "
               f"prompts must not be the training prompts")
        _check(not self.env.enabled, "eval.every_steps",
               f"evaluation of multi-turn episodes (env.name={self.env.name!r}) is not "
               f"supported; set eval.every_steps=0")

    def _check_teacher(self) -> None:
        """The ``teacher`` section against the learner section (on-policy distillation)."""
        te, lr = self.teacher, self.learner
        if not te.enabled:
            return
        _check(lr.advantage != "gae", "teacher.path",
               "on-policy distillation with learner.advantage='gae' is not supported (the "
               "distillation advantage is per token; GAE computes its own in the step)")
        _check(lr.num_hosts == 1, "teacher.path",
               f"a teacher needs learner.num_hosts=1 (it scores the batch on host 0), got "
               f"{lr.num_hosts}")
        _check(not (te.mode == "distill" and lr.dynamic_sampling), "learner.dynamic_sampling",
               "must be False with teacher.mode='distill' (the advantage does not come from "
               "the rewards, so a group without reward variance still carries signal)")

    @property
    def longest_row(self) -> int:
        """The most tokens (prompt + completion) one training row can hold."""
        full = self.sampler.max_prefill_length + self.sampler.max_tokens
        buckets = self.learner.seq_buckets
        return min(full, buckets[-1]) if buckets else full

    @property
    def pack_length(self) -> int:
        """Positions per packed training row: ``learner.pack_length``, else the longest row;
        with ``learner.shared_prefix``, groups of several samples and prompts at least as
        long as the completions (``max_prefill_length >= max_tokens``: sharing a prompt then
        saves at least a third of a group's positions), room for one whole group (its prompt
        once + each completion after the last prompt token, ``max_prefill_length +
        G (max_tokens + 1)``), at most twice the longest row. The attention is computed
        densely per row, so its cost per position grows with the row: with short prompts
        (little to share) longer rows cost more than sharing saves (``async_vs_sync``'s
        digits task: step 0.057 -> 0.077 s at twice the length)."""
        lr, sp = self.learner, self.sampler
        if lr.pack_length:
            return lr.pack_length
        longest = self.longest_row
        if not lr.shared_prefix or sp.group_size < 2 or sp.max_prefill_length < sp.max_tokens:
            return longest
        group = sp.max_prefill_length + sp.group_size * (sp.max_tokens + 1)
        return max(longest, min(group, 2 * longest))

    @property
    def published_dtype(self) -> str:
        """The dtype the learner publishes its model weights in (LoRA adapters stay float32):
        the sampler's compute dtype (``sampler.dtype``, else ``model.dtype``) when it is
        narrower than the learner's ``model.param_dtype``, else ``model.param_dtype``.

        Every parameter is cast to the compute dtype at use (:mod:`rlflow.models.decoder`),
        so a bf16 sampler only ever uses the bf16 rounding of a float32 version: publishing
        that rounding moves half the bytes for the same policy, and makes a delta between
        two versions small (an optimizer step at an RL learning rate changes few bf16
        values, but the low float32 mantissa bits of every element; verl syncs bf16 weights
        to its vLLM rollouts the same way). A float32 sampler beside a bf16 learner gets the
        bf16 versions (widening them at the swap is exact)."""
        narrow = {"float32": 4, "bfloat16": 2}
        compute = self.sampler.dtype or self.model.dtype
        master = self.model.param_dtype
        return compute if narrow[compute] < narrow[master] else master

    @property
    def run_path(self) -> str:
        return os.path.join(self.run_dir, self.name)


def replace(cfg, **changes):
    """``dataclasses.replace`` that re-runs validation (frozen dataclasses)."""
    return dataclasses.replace(cfg, **changes)


def config_module(path: str):
    """The Python config file ``path`` run as a fresh module (its ``config()`` and helpers),
    e.g. a config built on another one: ``config_module(os.path.join(HERE, "demo.py"))``.

    Raises:
      FileNotFoundError: ``path`` does not exist (names it).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"rlflow_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_config_file(path: str) -> ExperimentConfig:
    """Load ``configs/<name>.py``, which defines ``config() -> ExperimentConfig``.

    Raises:
      FileNotFoundError: the file does not exist.
      ConfigError: the path is a folder or not a ``.py`` file; the file has no ``config``
        function or it returns something else.
    """
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a folder; --config takes a Python file such as "
                          "configs/demo.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    if not path.endswith(".py"):
        raise ConfigError(f"{path}: not a Python file; --config takes a .py file that defines "
                          "`config() -> ExperimentConfig` (e.g. configs/demo.py)")
    module = config_module(path)
    fn = getattr(module, "config", None)
    _check(callable(fn), path, "must define a function `config() -> ExperimentConfig`")
    cfg = fn()
    _check(isinstance(cfg, ExperimentConfig), path,
           f"config() must return ExperimentConfig, got {type(cfg).__name__}")
    return cfg
