"""The learner program's sections: optimisation, losses and LoRA adapters."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace as replace_section
from typing import Literal, Optional, Tuple

from rlflow.config.validation import (DTYPES, ConfigError, _check, _finite_floats, _one_of,
                                      _positive)
from rlflow.config.model import MeshConfig
from rlflow.config.rollout_correction import RolloutCorrectionConfig


# learner.attention's names (rlflow.models.attention: kept here so the config imports no jax)
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "blockwise", "splash", "gpu_flash")
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
      train_embeddings: also train the token embedding ``embed [V, E]`` and an untied
        ``lm_head [E, V]`` (PEFT ``modules_to_save=["embed_tokens", "lm_head"]``; with tied
        embeddings ``["embed_tokens"]`` and ``ensure_weight_tying``, so the output projection
        follows): published, checkpointed and exported with the adapters, ``V x E`` floats
        per matrix per version (Qwen2.5-7B: 545M each, far more than rank-64 adapters; the
        demo's 15-token vocabulary: 960). For new or re-purposed tokens, or a base whose
        output layer cannot express the task: the demo's random base caps the answer
        token's probability near 0.2 through its small frozen tied embedding, which
        adapters cannot lift (configs/demo.py).
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
    train_embeddings: bool = False
    swap: Literal["forward", "merged"] = "merged"

    def __post_init__(self):
        _finite_floats(self, "learner.lora")
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
      moe_aux_loss_coef: weight of a mixture-of-experts model's load-balancing loss in the
        learner's loss (Switch Transformer, Fedus et al. 2021, eq. 4-6; HF
        ``load_balancing_loss_func``, :mod:`rlflow.models.moe`); None: the model's
        ``router_aux_loss_coef`` (config.json, or ``model.router_aux_loss_coef``); 0: off.
        Reported as ``moe/aux_loss`` for MoE models; set on a dense model, ``rlflow train``
        refuses it before the run starts (:func:`rlflow.console.checks.check_runnable`).
      rollout_correction: importance weights and rejection of tokens, samples or groups
        between the learner's old policy and the sampler's behaviour policy
        (:class:`RolloutCorrectionConfig`; default: token-level truncation at 2, which is
        also what corrects an int8 sampler, ``sampler.quantization="int8"``: it stays on
        unless set off here).
      is_cap: deprecated alias: ``rollout_correction.weight="token"`` with
        ``weight_cap=is_cap`` (0: ``weight="off"``); None: not used.
      mask_truncated: drop completions cut by max_tokens from the loss (DAPO).
      dynamic_sampling: drop groups with zero reward variance (DAPO).
      max_consecutive_skipped_steps: a step whose groups leave no sample for the loss (all
        truncated and masked, all stale, all without reward variance, all with bad rewards,
        every loss token rejected by ``rollout_correction``) is skipped: no update, no new version, not counted in ``num_steps``, its groups
        given back to the admission budget. This many skips in a row (or this many steps'
        worth of groups dropped in a row by ``dynamic_sampling``) stop the run with an error
        naming the reason (``rlflow.learner.skips``); 0: never stop.
      num_devices / mesh: devices and mesh of the learner program (over all its hosts).
        ``mesh.sequence > 1`` splits every training row's positions over that many devices
        (context parallelism for rows longer than one chip holds,
        :mod:`rlflow.models.context_parallel`); row lengths must be multiples of it.
      num_hosts: hosts (processes) of the learner program, joined by ``jax.distributed``:
        one global mesh of ``num_devices`` devices, ``num_devices / num_hosts`` per host, the
        same jitted step on every host; host 0 serves the ring buffer and the coordinator
        and builds each step's batch (``rlflow.learner.hosts``). ``rlflow train`` starts
        them on this machine (fake CPU devices, gloo collectives); on a TPU pod it is the
        learner slice's host count (``docs/tpu.md``).
      compute_dtype: activations dtype in the train step; params stay ``model.param_dtype``.
      seed: PRNG seed of the learner (dropout-free; used for any sampled quantity).
      scale_by_std: divide advantages by the group std (None: only "grpo" does).
      off_policy: "decoupled" (AReaL decoupled PPO: ratio against the old policy times
        the detached ``rollout_correction`` weight of pi_old / pi_behaviour) or "behaviour"
        (ratio directly against the sampler's behaviour logprobs; no weight).
      is_floor: deprecated alias of ``rollout_correction.weight_floor``; None: not used.
      is_window_low / is_window_high: deprecated aliases: token-level rejection,
        ``rollout_correction.reject="token"`` with ``reject_low`` / ``reject_high``; None
        (or 0): not used.
      overlong_buffer / overlong_penalty: DAPO soft overlong punishment over the last
        ``overlong_buffer`` tokens of ``sampler.max_tokens`` (0 off), scaled by the penalty.
      zero_truncated_rewards: reward 0 for completions cut by ``max_tokens``.
      on_bad_reward: a NaN/inf reward "error"s (naming the sample) or is "drop"ped (counted).
      on_failed_sample: a sample the record marks ``failed`` (cut by an environment error or
        timeout, or a reward function's error or timeout: an infrastructure failure, not the
        policy's) leaves the loss and its group's baseline ("mask": the group's advantages
        are those of the other samples alone) or trains as a reward-0 sample
        ("zero_reward", as before failure marks existed). Counted: ``batch/failed_samples``.
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
      packing: sequence packing (:mod:`rlflow.learner.packing`): the step's samples are
        packed into rows of ``pack_length`` tokens with segment ids and per-segment
        positions instead of one padded row each (same loss, logprobs and KL, less padding
        computed). None: on, except with ``advantage="gae"`` (GAE runs along rows), where
        ``true`` is refused.
      pack_length: positions per packed row; 0: the longest row (``seq_buckets[-1]``, or
        ``sampler.max_prefill_length + sampler.max_tokens`` without buckets), so a packed
        step never computes more positions or longer attention rows than the padded one;
        with ``shared_prefix``, ``sampler.group_size > 1`` and ``max_prefill_length >=
        max_tokens``, room for one whole group (``max_prefill_length + group_size *
        (max_tokens + 1)``) up to twice the longest row (``ExperimentConfig.pack_length``).
        Must hold the longest row.
      pack_row_buckets: how many packed row counts the first step may round up to, evenly
        spaced up to the count that holds any batch (with 16 rows of the longest row, 8
        buckets round 13 packed rows to 14, 4 would round them to 16). Later steps reuse
        that count when their rows fit, else the worst case, compiled in the background
        after the first step (``PackSpec.rows_for``): at most two compiled shapes a run.
      shared_prefix: with packing, a prompt shared by a group's samples is packed once and
        each sample's completion attends it (shared-prefix attention, Prefix Grouper, Liu
        et al. 2025; :mod:`rlflow.learner.packing`): the same logprobs, loss and gradients
        on fewer positions (``P - 1 + sum(1 + n_i)`` instead of ``sum(P + n_i)`` per
        group). Off: each sample packed with its own prompt copy.
      attention: the learner's full-sequence attention (:mod:`rlflow.models.attention`):
        "auto" (TPU: Pallas splash attention; GPU: Pallas flash attention; CPU: "blockwise";
        with shared-prompt packing, whose prefix mask the kernels cannot express, or with
        ``mesh.sequence > 1``: "blockwise" on every backend), "xla" (materialised ``[B, H, T, T]`` float32 scores:
        the reference, quadratic memory), "blockwise" (online softmax over key blocks in
        plain XLA, never ``[T, T]``), "splash", "gpu_flash" (the kernels by name; refused
        with shared-prompt packing).
      logprob_chunk: positions projected to the vocabulary at a time when the step computes
        logprobs and entropy (:func:`rlflow.models.logprobs.chunked_logprobs`; each chunk
        rematerialised in the backward); 0: all at once. 1024: a chunk's float32 logits at a
        151,936-token vocabulary (Qwen2.5) are 0.58 GiB (about 1.7 GiB with the log-softmax
        and its gradient) instead of 9.3 GiB per 16K-token row; 1024 rows keep the LM-head
        matmul a multiple of the TPU MXU's 256, and a micro-batch with fewer loss positions
        takes one pass (today's program).
      remat: what the backward pass keeps of the decoder layers' forward (the layers run
        under one scan; ``jax.checkpoint`` policies, :mod:`rlflow.models.layer_scan`):
        "none" (everything, attention scores included), "full" (only each layer's input
        ``[B, T, E]``; the backward recomputes the layer: ~1/3 more FLOPs), "dots" (also
        the projections' matmul outputs) or "offload" (those outputs moved to host memory;
        needs a ``pinned_host`` memory space: TPU, GPU, and jax's CPU client). The values
        never change, only memory and time. Default "full", as MaxText's, for long
        rollouts; measured on CPU (2 cores) it also cost no step time at the small sizes:
        compiled temporaries / step time of the GSM8K 4.46M model at 16 x 192 tokens
        none 648 MiB / 2.9 s, full 194 MiB / 1.5 s, dots 278 MiB / 1.2 s; the demo model
        at 64 x 12: 14.5 / 5.9 / 7.6 MiB, 12 / 8 / 7 ms (``benchmarks/long_context.py``
        for the long-row figures).
      routing_replay: rollout routing replay for mixture-of-experts models (R3, Ma et al.
        2025, arXiv 2510.11370; :mod:`rlflow.learner.routing_replay`): the learner's forward
        routes each token to the experts the sampler chose for it (recorded in the group
        record, ``docs/interfaces.md`` version 3), gates from its own router, so that the
        behaviour and learner logprobs come from the same experts. None (default): on for
        mixture-of-experts models; true for a dense model is an error; false: the learner
        routes by its own top-k (``moe/router_agreement`` and ``moe/logprob_gap`` are logged
        either way).
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
    moe_aux_loss_coef: Optional[float] = None
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    is_cap: Optional[float] = None
    mask_truncated: bool = False
    dynamic_sampling: bool = False
    max_consecutive_skipped_steps: int = 10
    num_devices: int = 1
    mesh: MeshConfig = field(default_factory=MeshConfig)
    num_hosts: int = 1
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    scale_by_std: Optional[bool] = None
    off_policy: Literal["decoupled", "behaviour"] = "decoupled"
    is_floor: Optional[float] = None
    is_window_low: Optional[float] = None
    is_window_high: Optional[float] = None
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    zero_truncated_rewards: bool = False
    on_bad_reward: Literal["error", "drop"] = "error"
    on_failed_sample: Literal["mask", "zero_reward"] = "mask"
    seq_buckets: Tuple[int, ...] = ()
    gae_lambda: float = 0.95
    gae_gamma: float = 1.0
    value_coef: float = 0.1
    value_clip: float = 0.2
    gae_whiten: bool = True
    gae_kl_in_reward: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    packing: Optional[bool] = None
    pack_length: int = 0
    pack_row_buckets: int = 8
    shared_prefix: bool = True
    attention: Literal["auto", "xla", "blockwise", "splash", "gpu_flash"] = "auto"
    logprob_chunk: int = 1024
    remat: Literal["none", "full", "dots", "offload"] = "full"
    routing_replay: Optional[bool] = None

    @property
    def packs(self) -> bool:
        """Whether the step packs sequences (``packing``, resolved)."""
        return self.advantage != "gae" if self.packing is None else self.packing

    def __post_init__(self):
        _finite_floats(self, "learner")
        for name in ("num_steps", "groups_per_step", "micro_batches", "lr", "num_devices",
                     "num_hosts"):
            _positive(getattr(self, name), f"learner.{name}")
        _check(self.warmup_steps >= 0, "learner.warmup_steps", "must be >= 0")
        _check(self.max_consecutive_skipped_steps >= 0, "learner.max_consecutive_skipped_steps",
               f"must be >= 0 (0: never stop), got {self.max_consecutive_skipped_steps}")
        _one_of(self.schedule, ("constant", "cosine"), "learner.schedule")
        _one_of(self.attention, ATTENTION_IMPLEMENTATIONS, "learner.attention")
        _check(self.logprob_chunk >= 0, "learner.logprob_chunk",
               f"must be >= 0 (0: all positions at once), got {self.logprob_chunk}")
        _check(not (self.attention in ("splash", "gpu_flash") and self.shared_prefix
                    and self.packs), "learner.attention",
               f"{self.attention!r} cannot express the shared-prompt prefix mask; use 'auto' "
               f"or 'blockwise', or set learner.shared_prefix=False")
        _check(not (self.attention in ("splash", "gpu_flash") and self.mesh.sequence > 1),
               "learner.attention",
               f"{self.attention!r} does not run under context parallelism "
               f"(learner.mesh.sequence={self.mesh.sequence}: the kernels' causal masks are "
               f"static, the local queries' offset is not); use 'auto' or 'blockwise'")
        _one_of(self.advantage, ("grpo", "drgrpo", "rloo", "gae"), "learner.advantage")
        _one_of(self.loss_agg, ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
                "learner.loss_agg")
        _one_of(self.kl_estimator, ("k1", "k2", "k3"), "learner.kl_estimator")
        _one_of(self.compute_dtype, DTYPES, "learner.compute_dtype")
        _one_of(self.remat, ("none", "full", "dots", "offload"), "learner.remat")
        _check(0 <= self.clip_low < 1, "learner.clip_low", f"must be in [0, 1), got {self.clip_low}")
        _check(self.clip_high >= 0, "learner.clip_high", f"must be >= 0, got {self.clip_high}")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "learner.dual_clip",
               f"must be 0 (off) or > 1, got {self.dual_clip}")
        _check(self.kl_coef >= 0, "learner.kl_coef", "must be >= 0")
        _check(self.moe_aux_loss_coef is None or self.moe_aux_loss_coef >= 0,
               "learner.moe_aux_loss_coef",
               f"must be None (the model's router_aux_loss_coef) or >= 0, got "
               f"{self.moe_aux_loss_coef}")
        self._map_deprecated_correction()
        _check(self.max_grad_norm >= 0, "learner.max_grad_norm", "must be >= 0 (0 turns it off)")
        _check(self.weight_decay >= 0, "learner.weight_decay",
               f"must be >= 0, got {self.weight_decay}")
        for name in ("b1", "b2"):
            v = getattr(self, name)
            _check(0 <= v < 1, f"learner.{name}", f"must be in [0, 1) (Adam), got {v}")
        _check(self.std_floor >= 0, "learner.std_floor", f"must be >= 0, got {self.std_floor}")
        _check(self.mesh.num_devices == self.num_devices, "learner.mesh",
               f"has {self.mesh.num_devices} devices but learner.num_devices={self.num_devices}")
        _check(self.num_devices % self.num_hosts == 0, "learner.num_hosts",
               f"must divide learner.num_devices={self.num_devices} (the devices of all hosts "
               f"together), got {self.num_hosts}; e.g. --learner.num-hosts {self.num_hosts} "
               f"--learner.num-devices {self.num_hosts} --learner.mesh.fsdp {self.num_hosts}")
        _check(not (self.advantage == "drgrpo" and self.scale_by_std), "learner.scale_by_std",
               "must not be True with learner.advantage='drgrpo' (Dr. GRPO has no std scaling)")
        _one_of(self.off_policy, ("decoupled", "behaviour"), "learner.off_policy")
        _one_of(self.on_bad_reward, ("error", "drop"), "learner.on_bad_reward")
        _one_of(self.on_failed_sample, ("mask", "zero_reward"), "learner.on_failed_sample")
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
        _check(not (self.packing and gae), "learner.packing",
               "must be None or False with learner.advantage='gae' (GAE runs along each row, "
               "so a packed row would carry one sample's advantages into the next)")
        _check(self.pack_length >= 0, "learner.pack_length",
               f"must be >= 0 (0: the longest row), got {self.pack_length}")
        _check(self.pack_row_buckets >= 1, "learner.pack_row_buckets",
               f"must be >= 1, got {self.pack_row_buckets}")
        _check(not (self.lora.enabled and gae), "learner.lora",
               "LoRA with learner.advantage='gae' (a value head) is not supported")

    def _map_deprecated_correction(self) -> None:
        """Fold the deprecated ``is_cap`` / ``is_floor`` / ``is_window_low|high`` into
        ``rollout_correction`` (token-level truncation and rejection, their old meaning).
        A section field they map to that was also set to another value is refused."""
        old = dict(is_cap=self.is_cap, is_floor=self.is_floor,
                   is_window_low=self.is_window_low, is_window_high=self.is_window_high)
        if all(v is None for v in old.values()):
            return
        want = {}
        if self.is_cap is not None:
            _check(self.is_cap >= 0, "learner.is_cap", f"must be >= 0 (0 off), got {self.is_cap}")
            want["weight"] = "token" if self.is_cap > 0 else "off"
            if self.is_cap > 0:
                want["weight_cap"] = self.is_cap
        if self.is_floor is not None:
            want["weight_floor"] = self.is_floor
        if self.is_window_low or self.is_window_high:          # 0 / None: no window
            want["reject"] = "token"
            want["reject_low"] = self.is_window_low or 0.0
            want["reject_high"] = self.is_window_high or 0.0
        rc, default = self.rollout_correction, RolloutCorrectionConfig()
        names = ", ".join(f"learner.{k}" for k, v in old.items() if v is not None)
        for name, value in want.items():
            _check(getattr(rc, name) in (value, getattr(default, name)),
                   f"learner.rollout_correction.{name}",
                   f"is {getattr(rc, name)!r} but the deprecated {names} asks for {value!r}; "
                   f"set only learner.rollout_correction")
        try:
            mapped = replace_section(rc, **want)
        except ConfigError as e:
            raise ConfigError(f"{e} (from the deprecated {names})") from None
        object.__setattr__(self, "rollout_correction", mapped)
