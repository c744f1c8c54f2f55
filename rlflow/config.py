"""Experiment configuration: frozen, typed dataclasses validated at construction.

One :class:`ExperimentConfig` describes a whole run. It is built by a Python file in
``configs/`` (a function ``config() -> ExperimentConfig``) and overridden from the
command line with tyro (``rlflow train --config configs/x.py --learner.lr 1e-6``).

Every dataclass checks itself in ``__post_init__``; a bad value raises
:class:`ConfigError` whose message names the field (``learner.lr``) and what was
expected. Nested sections are checked when they are built, so a bad combination fails
before any device work starts (the pattern of Tunix's typed configs).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Tuple

from rlflow.secrets import ENV_BUFFER_TOKEN, token_source_given


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""


def _check(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {msg}")


def _positive(value, where: str) -> None:
    _check(value > 0, where, f"must be > 0, got {value!r}")


def _one_of(value, allowed, where: str) -> None:
    _check(value in allowed, where, f"must be one of {sorted(allowed)}, got {value!r}")


DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """The policy model.

    Attributes:
      path: local Hugging Face folder (config.json + safetensors). Empty: build a random
        model from the architecture fields below (used by the built-in demo and tests).
      model_type: architecture family when ``path`` is empty: "llama", "qwen2" or "qwen3".
      vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim:
        architecture of the random model (ignored when ``path`` is set).
      rope_theta: RoPE base frequency of the random model.
      tie_word_embeddings: share input embedding and output projection (random model).
      dtype: activation/compute dtype.
      param_dtype: dtype of stored (master) parameters.
      init_seed: PRNG seed for a random model's initial parameters.
    """

    path: str = ""
    model_type: Literal["llama", "qwen2", "qwen3"] = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    init_seed: int = 0

    def __post_init__(self):
        _one_of(self.model_type, ("llama", "qwen2", "qwen3"), "model.model_type")
        _one_of(self.dtype, DTYPES, "model.dtype")
        _one_of(self.param_dtype, DTYPES, "model.param_dtype")
        if self.path:
            _check(os.path.isdir(self.path), "model.path",
                   f"must be an existing Hugging Face folder, got {self.path!r}")
            _check(os.path.isfile(os.path.join(self.path, "config.json")), "model.path",
                   f"{self.path!r} has no config.json (expected a Hugging Face model folder "
                   "with config.json and *.safetensors)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            _positive(getattr(self, name), f"model.{name}")
        _check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
               f"must divide model.num_heads={self.num_heads}, got {self.num_kv_heads}")
        _positive(self.rope_theta, "model.rope_theta")


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh of one program: sizes of the ``data``, ``fsdp`` and ``tensor`` axes.

    The product must equal the number of devices the program sees.

    Attributes:
      data: data-parallel axis size (batch split, parameters replicated).
      fsdp: fully-sharded data-parallel axis size (batch and parameters split).
      tensor: tensor-parallel axis size (heads and MLP columns split).
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in ("data", "fsdp", "tensor"):
            _positive(getattr(self, name), f"mesh.{name}")

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.tensor


@dataclass(frozen=True)
class DataConfig:
    """Prompt dataset (a grain pipeline).

    Attributes:
      source: "builtin" for a procedural task, or "jsonl" / "parquet" / "arrayrecord".
      path: file (or glob) for non-builtin sources.
      task: name of the built-in task when ``source == "builtin"``.
      prompt_field / answer_field: record fields holding the prompt and the reference answer.
      chat_template: "hf" (the tokenizer's chat template), "plain" (``plain_template``) or "none".
      plain_template: Python format string with ``{prompt}``: the whole prompt text for
        "plain", the user message inside the chat template for "hf"; unused for "none".
      max_prompt_tokens: prompts longer than this (in tokens) are filtered out and counted.
      shuffle_seed: seed of the deterministic shuffle.
      num_epochs: passes over the dataset (0: unlimited).
      on_bad_record: "error" stops with file and line; "skip" skips and counts.
    """

    source: Literal["builtin", "jsonl", "parquet", "arrayrecord"] = "builtin"
    path: str = ""
    task: str = "digits"
    prompt_field: str = "question"
    answer_field: str = "answer"
    chat_template: Literal["hf", "plain", "none"] = "none"
    plain_template: str = "{prompt}"
    max_prompt_tokens: int = 256
    shuffle_seed: int = 0
    num_epochs: int = 0
    on_bad_record: Literal["error", "skip"] = "error"

    def __post_init__(self):
        _one_of(self.source, ("builtin", "jsonl", "parquet", "arrayrecord"), "data.source")
        _one_of(self.chat_template, ("hf", "plain", "none"), "data.chat_template")
        _one_of(self.on_bad_record, ("error", "skip"), "data.on_bad_record")
        if self.source != "builtin":
            _check(bool(self.path), "data.path", f"is required when data.source={self.source!r}")
        _positive(self.max_prompt_tokens, "data.max_prompt_tokens")
        _check(self.num_epochs >= 0, "data.num_epochs", f"must be >= 0, got {self.num_epochs}")
        _check("{prompt}" in self.plain_template, "data.plain_template",
               "must contain '{prompt}'")


@dataclass(frozen=True)
class RewardConfig:
    """Reward functions (names from the registry in ``rlflow.data.rewards``) and weights.

    Each call runs in a reward worker process; one that raises, runs longer than
    ``timeout_s`` seconds (its worker is killed and replaced) or past ``memory_limit_mb``
    gives reward 0 for that sample; the failure is counted and logged with the sample id.

    Attributes:
      functions: reward function names: registered names (``rlflow.data.rewards``, or
        registered by a module in ``plugins``) or ``"package.module:function"`` /
        ``"path/file.py:function"`` references; unknown names are refused when the config
        is resolved.
      weights: one weight per function; the reward is the weighted sum.
      timeout_s: seconds one reward call may take before it scores 0 (counted).
      num_workers: reward worker processes of the sampler (scoring overlaps decoding).
        0 calls the functions in the sampler process on a thread: for debugging only
        (a call that holds the GIL or allocates without bound is then not stopped).
      memory_limit_mb: memory one reward call may allocate, MiB: each reward worker's
        address space (RLIMIT_AS) is capped at what it maps after loading the functions plus
        this; a call past it scores 0 (counted as an error). 0: no limit.
    """

    functions: Tuple[str, ...] = ("digits_match",)
    weights: Tuple[float, ...] = (1.0,)
    timeout_s: float = 5.0
    num_workers: int = 2
    memory_limit_mb: int = 4096

    def __post_init__(self):
        _check(len(self.functions) > 0, "reward.functions", "needs at least one reward function")
        _check(len(self.functions) == len(self.weights), "reward.weights",
               f"must have one weight per function ({len(self.functions)}), got {len(self.weights)}")
        _positive(self.timeout_s, "reward.timeout_s")
        _check(self.num_workers >= 0, "reward.num_workers", f"must be >= 0, got {self.num_workers}")
        _check(self.memory_limit_mb >= 0, "reward.memory_limit_mb",
               f"must be >= 0 (0: no limit), got {self.memory_limit_mb}")


@dataclass(frozen=True)
class SamplerConfig:
    """The sampler program: JetStream engine, continuous batching, sampling settings.

    Attributes:
      num_slots: decode slots (the decode batch size).
      max_prefill_length: longest prompt, in tokens.
      prefill_buckets: padded prefill lengths, increasing; the largest equals
        max_prefill_length (one compiled prefill per bucket).
      max_tokens: most new tokens per completion.
      group_size: completions per prompt (G).
      temperature / top_k / top_p: sampling settings (temperature 0 is greedy; top_k 0 off).
      on_long_prompt: "error" or "truncate" (keep the last max_prefill_length tokens, counted).
      num_devices: devices of the sampler program (fake CPU devices on a laptop).
      mesh: the sampler's mesh (tensor parallel axis at least).
      seed: base PRNG seed; the sampler program derives each request's seed from it and
        the request's position in the prompt stream (sampling.derive_seed).
      decode_steps_per_call: decode steps per jitted decode call (k >= 1, one host copy per
        call); weight swaps and slot refills happen between calls, so with k > 1 a slot
        that finishes mid-call idles for the rest of it. Default 1: every free slot is
        refilled before every step; benchmarks/sampler_throughput.py reports k = 4 too
        (more tokens/s on a small model, some slot steps idle).
      max_prefill_batch: most prompts prefilled in one call (C >= 1). A refill prefills
        its new prompts in calls of up to C rows, padded to a power of two, so prefill and
        insert compile at most log2(C) + 1 times per bucket (each compile stalls every
        slot); 1 is JetStream's one prompt per prefill.
      num_replicas: sampler replicas (N >= 1), each an independent sampler program with
        its own process, devices and engine, all leasing prompts from the learner's prompt
        ledger. ``rlflow train`` starts N processes of ``num_devices`` devices each; on
        Cloud TPU each sampler host is one replica (``scripts/tpu --sampler-slices``).
    """

    num_slots: int = 16
    max_prefill_length: int = 64
    prefill_buckets: Tuple[int, ...] = (16, 32, 64)
    max_tokens: int = 16
    group_size: int = 4
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    on_long_prompt: Literal["error", "truncate"] = "error"
    num_devices: int = 1
    mesh: MeshConfig = field(default_factory=MeshConfig)
    seed: int = 0
    decode_steps_per_call: int = 1
    max_prefill_batch: int = 4
    num_replicas: int = 1

    def __post_init__(self):
        for name in ("num_slots", "max_prefill_length", "max_tokens", "group_size", "num_devices",
                     "decode_steps_per_call", "max_prefill_batch", "num_replicas"):
            _positive(getattr(self, name), f"sampler.{name}")
        _check(len(self.prefill_buckets) > 0, "sampler.prefill_buckets", "must not be empty")
        _check(list(self.prefill_buckets) == sorted(self.prefill_buckets),
               "sampler.prefill_buckets", f"must be increasing, got {self.prefill_buckets}")
        _check(max(self.prefill_buckets) == self.max_prefill_length, "sampler.prefill_buckets",
               f"largest bucket must equal sampler.max_prefill_length={self.max_prefill_length}")
        _check(self.temperature >= 0, "sampler.temperature",
               f"must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, "sampler.top_k", f"must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, "sampler.top_p", f"must be in (0, 1], got {self.top_p}")
        _one_of(self.on_long_prompt, ("error", "truncate"), "sampler.on_long_prompt")
        _check(self.mesh.num_devices == self.num_devices, "sampler.mesh",
               f"has {self.mesh.num_devices} devices but sampler.num_devices={self.num_devices}")


LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the decoder's projections (Hu et al. 2021, "LoRA", eq. 3):
    ``W' = W + (alpha / rank) * A @ B`` with ``A [in, rank]``, ``B [rank, out]``; the base
    weights ``W`` stay frozen (no gradient, no optimiser state), and only the adapters are
    published to the samplers and checkpointed.

    Attributes:
      rank: adapter rank r (0: LoRA off, the whole policy is trained).
      alpha: scale numerator; the adapter term is multiplied by ``alpha / rank``.
      dropout: dropout on the adapter input; only 0 is supported (the sampler's behaviour
        logprobs come from the deterministic policy, so dropout in the learner's forward
        would bias the importance ratios).
      targets: regular expressions matched (``re.fullmatch``) against the Hugging Face
        projection names ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``; each
        must match at least one.
      lr: learning rate of the adapters; None: ``learner.lr``.
      train_final_norm: also train the final RMSNorm scale (``E`` floats; PEFT's
        ``modules_to_save=["model.norm"]``): published, checkpointed and exported with the
        adapters. Adapters alone cannot raise the logit range (the final RMSNorm fixes the
        hidden state's norm and the embedding is frozen), which a random base needs.
      swap: how a sampler applies a new adapter version: "merged" (``W + delta`` written
        into a working copy of the touched matrices at swap time, the unmerged base kept
        beside it so that swaps never accumulate; decode runs at the plain model's speed) or
        "forward" (a low-rank term in every projection's forward; the base is held once, no
        second copy of the touched matrices, but every decode step pays for the term:
        ``benchmarks/lora_sync.py``).
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: Tuple[str, ...] = LORA_PROJECTIONS
    lr: Optional[float] = None
    train_final_norm: bool = False
    swap: Literal["forward", "merged"] = "merged"

    def __post_init__(self):
        _check(self.rank >= 0, "learner.lora.rank", f"must be >= 0 (0 off), got {self.rank}")
        _check(math.isfinite(self.alpha) and self.alpha > 0, "learner.lora.alpha",
               f"must be finite and > 0, got {self.alpha}")
        _check(self.dropout == 0.0, "learner.lora.dropout",
               f"only 0.0 is supported (dropout would make the learner's logprobs differ from "
               f"the sampler's behaviour logprobs), got {self.dropout}")
        _check(self.lr is None or (math.isfinite(self.lr) and self.lr > 0), "learner.lora.lr",
               f"must be None (learner.lr) or finite and > 0, got {self.lr}")
        _one_of(self.swap, ("forward", "merged"), "learner.lora.swap")
        _check(len(self.targets) > 0, "learner.lora.targets", "must name at least one projection")
        for pat in self.targets:
            try:
                rx = re.compile(pat)
            except re.error as e:
                raise ConfigError(f"learner.lora.targets: {pat!r} is not a regular expression "
                                  f"({e})") from None
            _check(any(rx.fullmatch(p) for p in LORA_PROJECTIONS), "learner.lora.targets",
                   f"{pat!r} matches none of {', '.join(LORA_PROJECTIONS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def projections(self) -> Tuple[str, ...]:
        """The projection names the targets select, in ``LORA_PROJECTIONS`` order."""
        return tuple(p for p in LORA_PROJECTIONS
                     if any(re.fullmatch(pat, p) for pat in self.targets))


@dataclass(frozen=True)
class LearnerConfig:
    """The learner program: losses, optimiser and the jitted train step.

    Attributes:
      num_steps: optimiser steps (= policy versions published) in the run.
      groups_per_step: prompt groups (each ``sampler.group_size`` samples) per step.
      micro_batches: gradient-accumulation micro-batches per step.
      lr, warmup_steps, schedule, weight_decay, max_grad_norm, b1, b2: optax AdamW.
      advantage: "grpo" (z-score, Shao et al. 2024), "drgrpo" (no std, Liu et al. 2025),
        "rloo" (leave-one-out, Ahmadian et al. 2024), "gae" (PPO with a value head on the
        policy's final hidden states and GAE, Schulman et al. 2016 / 2017).
      std_floor: floor added to the group std in GRPO.
      loss_agg: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm" (Dr. GRPO).
      clip_low / clip_high: PPO ratio clip range [1-clip_low, 1+clip_high] (DAPO clip-higher).
      dual_clip: dual-clip constant c > 1 for negative advantages (Ye et al. 2020), or 0 off.
      kl_coef / kl_estimator: KL penalty to the frozen reference policy (k1, k2, k3).
      is_cap: truncated importance-weight cap C for off-policy tokens (0 off).
      mask_truncated: drop completions cut by max_tokens from the loss (DAPO).
      dynamic_sampling: drop groups with zero reward variance (DAPO).
      max_consecutive_skipped_steps: a step whose groups leave no sample for the loss (all
        truncated and masked, all stale, all without reward variance, all with bad rewards)
        is skipped: no update, no new version, not counted in ``num_steps``, its groups
        given back to the admission budget. This many skips in a row (or this many steps'
        worth of groups dropped in a row by ``dynamic_sampling``) stop the run with an error
        naming the reason (``rlflow.learner.skips``); 0: never stop.
      num_devices / mesh: devices and mesh of the learner program.
      compute_dtype: activations dtype in the train step; params stay ``model.param_dtype``.
      seed: PRNG seed of the learner (dropout-free; used for any sampled quantity).
      scale_by_std: divide advantages by the group std (None: only "grpo" does).
      off_policy: "decoupled" (AReaL decoupled PPO: ratio against the old policy times a
        detached truncated weight pi_old / pi_behaviour) or "behaviour" (ratio directly
        against the sampler's behaviour logprobs).
      is_floor: lower clamp of the truncated importance weight (0 off).
      is_window_low / is_window_high: tokens whose importance ratio lies outside this window
        are masked out of the loss (0 turns a side off).
      overlong_buffer / overlong_penalty: DAPO soft overlong punishment over the last
        ``overlong_buffer`` tokens of ``sampler.max_tokens`` (0 off), scaled by the penalty.
      zero_truncated_rewards: reward 0 for completions cut by ``max_tokens``.
      on_bad_reward: a NaN/inf reward "error"s (naming the sample) or is "drop"ped (counted).
      seq_buckets: padded training lengths (prompt + completion); the step compiles once per
        bucket used. Empty: one bucket of ``sampler.max_prefill_length + sampler.max_tokens``.
      gae_lambda / gae_gamma: GAE lambda and discount over response tokens, in [0, 1]
        (``advantage="gae"`` only).
      value_coef: weight of the value loss in the total loss (``advantage="gae"``).
      value_clip: PPO2 value clip range around the old values (0 off; ``advantage="gae"``).
      gae_whiten: whiten GAE advantages over the batch's response tokens (zero mean, unit
        variance).
      gae_kl_in_reward: move the KL penalty (``kl_coef``, k1 of the old policy against the
        reference) from the loss into the per-token rewards (``advantage="gae"``; needs
        ``kl_coef > 0``).
      lora: LoRA adapters (:class:`LoraConfig`; ``rank`` 0: off). With LoRA the KL reference
        is the base model (the adapter term switched off), never a second copy of it.
    """

    num_steps: int = 20
    groups_per_step: int = 4
    micro_batches: int = 1
    lr: float = 1e-3
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.99
    advantage: Literal["grpo", "drgrpo", "rloo", "gae"] = "grpo"
    std_floor: float = 1e-6
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    is_cap: float = 2.0
    mask_truncated: bool = False
    dynamic_sampling: bool = False
    max_consecutive_skipped_steps: int = 10
    num_devices: int = 1
    mesh: MeshConfig = field(default_factory=MeshConfig)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    scale_by_std: Optional[bool] = None
    off_policy: Literal["decoupled", "behaviour"] = "decoupled"
    is_floor: float = 0.0
    is_window_low: float = 0.0
    is_window_high: float = 0.0
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    zero_truncated_rewards: bool = False
    on_bad_reward: Literal["error", "drop"] = "error"
    seq_buckets: Tuple[int, ...] = ()
    gae_lambda: float = 0.95
    gae_gamma: float = 1.0
    value_coef: float = 0.1
    value_clip: float = 0.2
    gae_whiten: bool = True
    gae_kl_in_reward: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        for name in ("num_steps", "groups_per_step", "micro_batches", "lr", "num_devices"):
            _positive(getattr(self, name), f"learner.{name}")
        _check(self.warmup_steps >= 0, "learner.warmup_steps", "must be >= 0")
        _check(self.max_consecutive_skipped_steps >= 0, "learner.max_consecutive_skipped_steps",
               f"must be >= 0 (0: never stop), got {self.max_consecutive_skipped_steps}")
        _one_of(self.schedule, ("constant", "cosine"), "learner.schedule")
        _one_of(self.advantage, ("grpo", "drgrpo", "rloo", "gae"), "learner.advantage")
        _one_of(self.loss_agg, ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
                "learner.loss_agg")
        _one_of(self.kl_estimator, ("k1", "k2", "k3"), "learner.kl_estimator")
        _one_of(self.compute_dtype, DTYPES, "learner.compute_dtype")
        _check(0 <= self.clip_low < 1, "learner.clip_low", f"must be in [0, 1), got {self.clip_low}")
        _check(self.clip_high >= 0, "learner.clip_high", f"must be >= 0, got {self.clip_high}")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "learner.dual_clip",
               f"must be 0 (off) or > 1, got {self.dual_clip}")
        _check(self.kl_coef >= 0, "learner.kl_coef", "must be >= 0")
        _check(self.is_cap >= 0, "learner.is_cap", "must be >= 0 (0 turns it off)")
        _check(self.max_grad_norm >= 0, "learner.max_grad_norm", "must be >= 0 (0 turns it off)")
        _check(math.isfinite(self.lr), "learner.lr", "must be finite")
        _check(self.mesh.num_devices == self.num_devices, "learner.mesh",
               f"has {self.mesh.num_devices} devices but learner.num_devices={self.num_devices}")
        _check(not (self.advantage == "drgrpo" and self.scale_by_std), "learner.scale_by_std",
               "must not be True with learner.advantage='drgrpo' (Dr. GRPO has no std scaling)")
        _one_of(self.off_policy, ("decoupled", "behaviour"), "learner.off_policy")
        _one_of(self.on_bad_reward, ("error", "drop"), "learner.on_bad_reward")
        _check(self.is_floor >= 0 and (self.is_cap == 0 or self.is_floor <= self.is_cap),
               "learner.is_floor", f"must be in [0, learner.is_cap], got {self.is_floor}")
        _check(0 <= self.is_window_low <= 1, "learner.is_window_low",
               f"must be in [0, 1] (0 off), got {self.is_window_low}")
        _check(self.is_window_high == 0 or self.is_window_high >= 1, "learner.is_window_high",
               f"must be 0 (off) or >= 1, got {self.is_window_high}")
        _check(self.overlong_buffer >= 0, "learner.overlong_buffer", "must be >= 0 (0 off)")
        _check(self.overlong_penalty >= 0, "learner.overlong_penalty", "must be >= 0")
        _check(all(b > 0 for b in self.seq_buckets) and
               list(self.seq_buckets) == sorted(set(self.seq_buckets)), "learner.seq_buckets",
               f"must be positive and strictly increasing, got {self.seq_buckets}")
        for name in ("gae_lambda", "gae_gamma"):
            v = getattr(self, name)
            _check(0 <= v <= 1, f"learner.{name}", f"must be in [0, 1], got {v}")
        _check(self.value_coef > 0 and math.isfinite(self.value_coef), "learner.value_coef",
               f"must be finite and > 0, got {self.value_coef}")
        _check(self.value_clip >= 0, "learner.value_clip",
               f"must be >= 0 (0 off), got {self.value_clip}")
        gae = self.advantage == "gae"
        _check(not gae or self.scale_by_std is None, "learner.scale_by_std",
               "must be None with learner.advantage='gae' (GAE has no group std; see "
               "learner.gae_whiten)")
        _check(not self.gae_kl_in_reward or (gae and self.kl_coef > 0),
               "learner.gae_kl_in_reward", f"needs learner.advantage='gae' and "
               f"learner.kl_coef > 0, got advantage={self.advantage!r}, kl_coef={self.kl_coef}")
        _check(not (self.lora.enabled and gae), "learner.lora",
               "LoRA with learner.advantage='gae' (a value head) is not supported")


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
        logs and checkpoints show it as ``<redacted>`` (``rlflow/secrets.py``).
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
        _positive(self.capacity, "buffer.capacity")
        _one_of(self.when_full, ("block", "drop_oldest"), "buffer.when_full")
        _positive(self.timeout_s, "buffer.timeout_s")
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
    """

    mode: Literal["async", "sync"] = "async"
    max_staleness: int = 2
    stale_policy: Literal["drop", "correct"] = "drop"
    weight_transfer: Literal["transfer", "orbax"] = "transfer"
    publish_every: int = 1
    transfer_timeout_s: float = 120.0
    transfer_retries: int = 2
    transfer_layout: Literal["native", "single_device"] = "native"
    bind_address: str = "127.0.0.1"
    coordinator_port: int = 0
    weights_keep_last: int = 2
    restart_sampler: bool = False
    relay_fanout: int = 2
    replica_timeout_s: float = 60.0
    sampler_sleep: bool = False
    pin_cpus: bool = False

    def __post_init__(self):
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
        _positive(self.transfer_timeout_s, "runtime.transfer_timeout_s")
        _check(self.transfer_retries >= 0, "runtime.transfer_retries", "must be >= 0")
        _one_of(self.transfer_layout, ("native", "single_device"), "runtime.transfer_layout")
        _check(bool(self.bind_address), "runtime.bind_address", "must not be empty")
        _check(0 <= self.coordinator_port < 65536, "runtime.coordinator_port",
               f"must be in [0, 65535], got {self.coordinator_port}")
        _positive(self.weights_keep_last, "runtime.weights_keep_last")
        _positive(self.replica_timeout_s, "runtime.replica_timeout_s")
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
        ``overwrite`` (a run folder belongs to one run: ``rlflow/run_identity.py``).
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
        _check(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0")
        _positive(self.keep_last, "checkpoint.keep_last")
        _one_of(self.resume, ("auto", "never"), "checkpoint.resume")
        _one_of(self.keep_best_mode, ("max", "min"), "checkpoint.keep_best_mode")


@dataclass(frozen=True)
class MetricsConfig:
    """Run-folder outputs: JSONL + TensorBoard metrics and sample completions.

    Attributes:
      samples_every: write sample completions every N steps (0 off).
      num_samples: completions written each time.
      progress: "auto" (bar on a TTY, plain lines otherwise), "bar" or "plain".
      on_non_finite: a NaN/inf metric value "error"s (raises, naming step and metric) or is
        "flag"ged (written as null, listed under the record's "non_finite" key, warned).
    """

    samples_every: int = 5
    num_samples: int = 4
    progress: Literal["auto", "bar", "plain"] = "auto"
    on_non_finite: Literal["error", "flag"] = "flag"

    def __post_init__(self):
        _check(self.samples_every >= 0, "metrics.samples_every", "must be >= 0")
        _check(self.num_samples >= 0, "metrics.num_samples", "must be >= 0")
        _one_of(self.progress, ("auto", "bar", "plain"), "metrics.progress")
        _one_of(self.on_non_finite, ("error", "flag"), "metrics.on_non_finite")


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole rlflow run.

    Attributes:
      name: run name; the run folder is ``{run_dir}/{name}``.
      run_dir: parent folder of run folders.
      seed: global seed (data order, sampling, init).
      plugins: modules every program imports first (dotted names or ``.py`` paths), e.g.
        to register reward functions (``rlflow.plugins``).
    """

    name: str = "demo"
    run_dir: str = "runs"
    seed: int = 0
    plugins: Tuple[str, ...] = ()
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self):
        _check(bool(self.name) and "/" not in self.name, "name",
               f"must be a non-empty folder name, got {self.name!r}")
        bind = self.runtime.bind_address
        _check(bind == "localhost" or bind.startswith("127.") or bind == "::1"
               or token_source_given(self.buffer.token, self.buffer.token_file), "buffer.token",
               f"is required when runtime.bind_address={bind!r} is not loopback "
               f"(set {ENV_BUFFER_TOKEN} or buffer.token_file)")
        if self.runtime.stale_policy == "correct":
            _check(self.learner.is_cap > 0, "learner.is_cap",
                   "must be > 0 when runtime.stale_policy='correct'")
        lr, sp = self.learner, self.sampler
        _check(lr.advantage == "gae" or sp.group_size >= 2, "sampler.group_size",
               f"must be >= 2 with learner.advantage={lr.advantage!r} (group-relative "
               f"advantages compare the G samples of a prompt), got {sp.group_size}")
        rows = lr.groups_per_step * sp.group_size
        split = lr.micro_batches * lr.mesh.data * lr.mesh.fsdp
        _check(rows % split == 0, "learner.micro_batches",
               f"learner.groups_per_step * sampler.group_size = {rows} samples must divide into "
               f"learner.micro_batches * learner.mesh.data * learner.mesh.fsdp = {split} parts")
        _check(lr.overlong_buffer <= sp.max_tokens, "learner.overlong_buffer",
               f"must be <= sampler.max_tokens={sp.max_tokens}, got {lr.overlong_buffer}")

    @property
    def run_path(self) -> str:
        return os.path.join(self.run_dir, self.name)


def replace(cfg, **changes):
    """``dataclasses.replace`` that re-runs validation (frozen dataclasses)."""
    return dataclasses.replace(cfg, **changes)


def load_config_file(path: str) -> ExperimentConfig:
    """Load ``configs/<name>.py``, which defines ``config() -> ExperimentConfig``.

    Raises:
      FileNotFoundError: the file does not exist.
      ConfigError: the file has no ``config`` function or it returns something else.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"rlflow_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, "config", None)
    _check(callable(fn), path, "must define a function `config() -> ExperimentConfig`")
    cfg = fn()
    _check(isinstance(cfg, ExperimentConfig), path,
           f"config() must return ExperimentConfig, got {type(cfg).__name__}")
    return cfg
