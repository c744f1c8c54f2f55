"""The static settings of the loss and the train step (:class:`StepSettings`, hashable: a jit
static argument), read from the experiment config, and the two MoE settings resolved for the
policy's model (:func:`routing_replay`, :func:`moe_aux_coef`).
"""

from __future__ import annotations

import dataclasses

from rlflow.config.rollout_correction import RolloutCorrectionConfig
from rlflow.learner.routing_replay import replays


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Static settings of the loss and the step (hashable; see ``LearnerConfig``).

    ``gae`` turns on PPO with the value head (``learner.advantage == "gae"``); ``whiten`` and
    ``kl_in_reward`` are ``learner.gae_whiten`` / ``learner.gae_kl_in_reward``.
    ``max_loss_tokens``: a bound on a step's loss positions (samples x ``sampler.max_tokens``):
    > 0 projects to the vocabulary only at loss positions, in that many slots per micro-batch
    and batch shard at most (:mod:`rlflow.learner.loss_positions`); 0 projects every position.
    ``attention``: ``learner.attention`` (:func:`rlflow.models.attention.resolve`);
    ``logprob_chunk``: ``learner.logprob_chunk`` (:func:`rlflow.models.logprobs.chunked_logprobs`).
    ``remat``: the decoder layers' rematerialisation policy in the differentiated forward
    (``learner.remat``, :mod:`rlflow.models.layer_scan`). ``correction``:
    ``learner.rollout_correction`` (:mod:`rlflow.learner.rollout_correction`).
    ``moe_aux``: the policy is a mixture of experts: its load-balancing loss
    (:func:`rlflow.models.moe.balance_loss`) is computed in every differentiated forward and
    reported; ``moe_aux_coef`` weighs it in the loss (:func:`moe_aux_coef`; 0: reported only).
    ``routing_replay``: ``learner.routing_replay`` resolved for the model
    (:func:`rlflow.learner.routing_replay.replays`): a batch's ``routing_ids`` are replayed,
    not only compared.
    """
    loss_agg: str = "token-mean"
    norm_len: int = 1
    off_policy: str = "decoupled"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0
    correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    micro_batches: int = 1
    temperature: float = 1.0
    gae: bool = False
    gae_lambda: float = 0.95
    gae_gamma: float = 1.0
    value_coef: float = 0.1
    value_clip: float = 0.2
    whiten: bool = True
    kl_in_reward: bool = False
    max_loss_tokens: int = 0
    attention: str = "auto"
    logprob_chunk: int = 0
    remat: str = "none"
    moe_aux: bool = False
    moe_aux_coef: float = 0.0
    routing_replay: bool = False

    @classmethod
    def from_config(cls, cfg, decoder_cfg=None) -> "StepSettings":
        """From an :class:`rlflow.config.ExperimentConfig` (``norm_len`` = ``sampler.max_tokens``)
        and the policy's :class:`rlflow.models.config.DecoderConfig` (its
        ``router_aux_loss_coef``; None: the one of ``cfg.model``'s random model)."""
        lr = cfg.learner
        return cls(loss_agg=lr.loss_agg, norm_len=cfg.sampler.max_tokens,
                   off_policy=lr.off_policy, clip_low=lr.clip_low, clip_high=lr.clip_high,
                   dual_clip=lr.dual_clip, correction=lr.rollout_correction,
                   kl_coef=lr.kl_coef, kl_estimator=lr.kl_estimator,
                   micro_batches=lr.micro_batches,
                   temperature=cfg.sampler.temperature or 1.0,
                   gae=lr.advantage == "gae", gae_lambda=lr.gae_lambda, gae_gamma=lr.gae_gamma,
                   value_coef=lr.value_coef, value_clip=lr.value_clip, whiten=lr.gae_whiten,
                   kl_in_reward=lr.gae_kl_in_reward,
                   max_loss_tokens=lr.groups_per_step * cfg.sampler.group_size
                   * cfg.sampler.max_tokens,
                   attention=lr.attention, logprob_chunk=lr.logprob_chunk, remat=lr.remat,
                   moe_aux=(decoder_cfg.is_moe if decoder_cfg is not None
                            else not cfg.model.path and cfg.model.model_type == "qwen3_moe"),
                   moe_aux_coef=moe_aux_coef(cfg, decoder_cfg),
                   routing_replay=routing_replay(cfg, decoder_cfg))


def routing_replay(cfg, decoder_cfg=None) -> bool:
    """``learner.routing_replay`` resolved (:func:`rlflow.learner.routing_replay.replays`) for
    ``decoder_cfg``, else for ``cfg.model``'s random model (None: on for MoE models).

    Raises:
      ConfigError: ``learner.routing_replay=True`` for a dense model.
    """
    if decoder_cfg is not None:
        return replays(cfg.learner.routing_replay, decoder_cfg)
    moe = not cfg.model.path and cfg.model.model_type == "qwen3_moe"
    return moe if cfg.learner.routing_replay is None else bool(cfg.learner.routing_replay)


def moe_aux_coef(cfg, decoder_cfg=None) -> float:
    """``learner.moe_aux_loss_coef``, or when it is None the model's ``router_aux_loss_coef``
    (HF config.json; ``decoder_cfg``, else ``cfg.model``'s random model); 0 for a dense model."""
    if cfg.learner.moe_aux_loss_coef is not None:
        return float(cfg.learner.moe_aux_loss_coef)
    if decoder_cfg is not None:
        return float(decoder_cfg.router_aux_loss_coef) if decoder_cfg.is_moe else 0.0
    m = cfg.model
    return float(m.router_aux_loss_coef) if not m.path and m.model_type == "qwen3_moe" else 0.0
