"""The jitted, sharded train step: ``(state, batch, ref_params, frozen) -> (state, metrics)``.

One optimiser step per batch. The batch ``[B, L]`` (:class:`rlflow.learner.batch.TrainBatch`)
is split into ``k`` micro-batches (micro-batch ``j`` holds rows ``j, j + k, j + 2k, ...``, so
every micro-batch stays spread over the batch-sharded devices); gradients and metric sums are
accumulated with ``lax.scan`` in float32. The aggregation weights of
:func:`rlflow.learner.losses.loss_weights` are computed on the whole batch first, so their
global normalisers (token count, sequence count) make the sum of micro-batch losses equal
the full-batch loss in every aggregation mode.

Logprobs are those of the tempered policy ``softmax(logits / T)`` with the sampler's
temperature ``T`` (1 for greedy sampling), the distribution the behaviour logprobs came from.

PPO (``settings.gae``): a :class:`rlflow.learner.value.ValueHead` on the same forward gives
``V(s_t)``; GAE advantages and returns come from the *old* values (the step-start parameters,
detached: with one optimiser step per batch they are this forward's values under
``stop_gradient``) via :func:`rlflow.learner.advantages.ppo_targets`; the loss is
``policy + value_coef * value`` (clipped value loss :func:`rlflow.learner.losses.value_loss`,
aggregated with the policy's weights). Whitening needs batch-wide statistics, so with
whitening and ``k > 1`` micro-batches a forward-only pass first computes the old values of the
whole batch (the micro-batch sums then still equal the full-batch step). The trainable tree is
the pair ``(policy params, value-head params)`` (:func:`trainable`): one optimiser, joint
gradient clipping; the head lives in ``TrainState.value``, never in ``TrainState.params``.

Layout: parameters and the optimiser state use :func:`rlflow.mesh.param_shardings` (FSDP x
tensor), the batch :func:`rlflow.mesh.batch_sharding`, metrics are replicated. The jit with
those shardings and the donated state, and the ahead-of-time compile, are
:mod:`rlflow.learner.step_jit`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rlflow.config.rollout_correction import RolloutCorrectionConfig
from rlflow.learner import advantages as adv_lib
from rlflow.learner import loss_positions, losses
from rlflow.learner import rollout_correction as rc
from rlflow.learner.batch import TrainBatch
from rlflow.learner.routing_replay import replays
from rlflow.mesh import batch_axes, batch_shards, param_shardings, replicated, sequence_size
from rlflow.models.logprobs import chunked_logprobs
from rlflow.run.metrics import LAG_BUCKETS


class TrainState(NamedTuple):
    """Everything the optimiser step changes (donated to the step).

    step: int32 ``[]`` optimiser steps taken (= the policy version of ``params``).
    params: ``nnx.State`` of the policy's master parameters (``model.param_dtype``): what
      weight transfer publishes and export writes.
    opt_state: the optax state (AdamW moments shaped like ``params``, or like the pair
      ``(params, value)`` with a value head).
    value: ``nnx.State`` of the PPO value head (float32), or None (group estimators).
    """
    step: jax.Array
    params: Any
    opt_state: Any
    value: Any = None


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


def trainable(params, value=None):
    """The tree the optimiser updates: ``params``, or ``(params, value)`` with a value head."""
    return params if value is None else (params, value)


def init_state(params, tx: optax.GradientTransformation, mesh=None, value=None) -> TrainState:
    """A fresh :class:`TrainState` (step 0) laid out in :func:`state_shardings` when ``mesh``;
    ``value``: the value head's params (PPO) or None."""
    def make(p, v):
        return TrainState(jnp.zeros((), jnp.int32), p, tx.init(trainable(p, v)), v)

    if mesh is None:
        return make(params, value)
    return jax.jit(make, out_shardings=state_shardings(params, tx, mesh, value))(params, value)


def state_shardings(params, tx: optax.GradientTransformation, mesh, value=None) -> TrainState:
    """Shardings of the state: params (and value head) per the logical-axis rules, the
    optimiser's param-shaped entries (moments) like their params, everything else replicated."""
    ps = param_shardings(params, mesh)
    vs = None if value is None else param_shardings(value, mesh)
    abstract = jax.eval_shape(tx.init, trainable(params, value))
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    opt = optax.tree_map_params(tx, lambda _, s: s, abstract, trainable(ps, vs),
                                transform_non_params=lambda _: replicated(mesh), is_leaf=is_var)
    return TrainState(replicated(mesh), ps, opt, vs)


def split_micro(x: jax.Array, k: int) -> jax.Array:
    """``[B, ...] -> [k, B / k, ...]``; micro-batch ``j`` holds rows ``j, j + k, ...``."""
    return x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)


def model_outputs(graphdef, params, batch: TrainBatch, temperature: float = 1.0,
                  value_graphdef=None, frozen=None, loss_slots: tuple[int, ...] | None = None,
                  attention: str = "auto", logprob_chunk: int = 0, remat: str = "none",
                  mesh=None, moe_aux: bool = False, routing_replay: bool = False):
    """One forward: tempered logprobs of ``batch.targets``, entropy and values.

    Args:
      params: the policy's ``nnx.State``, or ``(policy, value head)`` with ``value_graphdef``.
      frozen: parameters merged into the model but not trained (LoRA: the base, with
        ``params`` the adapters), or None.
      loss_slots: ``(shards, capacity)`` or ``(shards, capacity, seq_shards)``: logits only
        at ``batch.loss_mask`` positions (:func:`rlflow.learner.loss_positions.loss_index`;
        the caller guarantees at most ``capacity`` per group), logprobs and entropy 0
        elsewhere; None: every position.
      attention: the decoder's attention implementation (``learner.attention``).
      logprob_chunk: positions projected to the vocabulary at a time (``learner.logprob_chunk``;
        0: all at once), :func:`rlflow.models.logprobs.chunked_logprobs`.
      remat: the layers' rematerialisation policy (:mod:`rlflow.models.layer_scan`; what a
        backward pass through this forward keeps, never the values).
      mesh: the learner's mesh, for context parallelism (a ``sequence`` axis > 1:
        :meth:`rlflow.models.decoder.Decoder.hidden_states`), or None.
      moe_aux: also return the mixture-of-experts load-balancing loss of this forward
        (:meth:`rlflow.models.decoder.Decoder.hidden_states`; MoE models only).
      routing_replay: route the tokens of ``batch.routing_ids`` (a mixture-of-experts
        model's recorded expert ids; rollout routing replay) to those experts; without,
        they are only compared with the model's own choice.

    Returns: ``(logprobs, entropy, values)``, float32 ``[B, L]`` each (entropy carries no
    gradient); ``values`` ``V(s_t)`` (aligned with ``targets``) is None without a value head;
    with ``moe_aux`` one more element, the float32 ``[]`` load-balancing loss; then, when
    ``batch`` has ``routing_ids``, the router agreement float32 ``[2]`` (token-layers whose
    own top-k set equals the recorded one, token-layers with a recorded choice:
    :func:`rlflow.models.moe_replay.agreement_sums` over the layers; no gradient).
    """
    policy, vparams = (params, None) if value_graphdef is None else params
    model = nnx.merge(graphdef, policy) if frozen is None else nnx.merge(graphdef, policy, frozen)
    routed = {} if batch.routing_ids is None else dict(routing_ids=batch.routing_ids,
                                                        replay_routing=routing_replay)
    out = model.hidden_states(batch.tokens, batch.positions, batch.attention_mask,
                              segment_ids=batch.segment_ids, prefix_ids=batch.prefix_ids,
                              attention_impl=attention, remat=remat, mesh=mesh,
                              moe_aux=moe_aux, **routed)
    hidden, extra = (out[0], list(out[1:])) if (moe_aux or routed) else (out, [])
    if routed:                                      # summed over the layers
        extra[-1] = jax.lax.stop_gradient(jnp.sum(extra[-1], axis=0))
    extra = tuple(extra)
    values = None if value_graphdef is None else nnx.merge(value_graphdef, vparams)(hidden)
    if loss_slots is None:
        logp, ent = chunked_logprobs(model.project, hidden, batch.targets, temperature,
                                     logprob_chunk)
        return (logp, ent, values) + extra
    shards, capacity, seq_shards = (tuple(loss_slots) + (1,))[:3]
    index = loss_positions.loss_index(batch.loss_mask, shards, capacity, seq_shards)
    hidden = loss_positions.gather(hidden, index, seq_shards)
    targets = loss_positions.gather(batch.targets, index, seq_shards)
    # one chunk of every group at a time: the groups are the devices' own loss positions
    logp, ent = chunked_logprobs(model.project, hidden, targets, temperature, logprob_chunk,
                                 groups=index.shape[0])
    shape = batch.loss_mask.shape
    return (loss_positions.scatter(logp, index, shape, seq_shards),
            loss_positions.scatter(ent, index, shape, seq_shards), values) + extra


def policy_logprobs(graphdef, params, batch: TrainBatch, temperature: float = 1.0, frozen=None,
                    loss_slots: tuple[int, ...] | None = None, attention: str = "auto",
                    logprob_chunk: int = 0, mesh=None, routing_replay: bool = False):
    """Tempered logprobs of ``batch.targets`` and the policy entropy at each position
    (``loss_slots``, ``attention``, ``logprob_chunk``, ``mesh``, ``routing_replay``: as
    :func:`model_outputs`).

    Returns: ``(logprobs, entropy)``, both float32 ``[B, L]`` (entropy carries no gradient).
    """
    return model_outputs(graphdef, params, batch, temperature, frozen=frozen,
                         loss_slots=loss_slots, attention=attention,
                         logprob_chunk=logprob_chunk, mesh=mesh,
                         routing_replay=routing_replay)[:2]


_SUMS = ("pg_loss", "kl", "entropy", "clip_low", "clip_high", "clip_dual", "is_weight",
         "is_kept", "effective")
# the mismatch diagnostics' sums, each [len(LAG_BUCKETS)] (rlflow.learner.rollout_correction)
_MISMATCH_SUMS = tuple(f"mismatch/{n}" for n in rc.DIAGNOSTIC_SUMS)
# mixture-of-experts models (batches with routing_ids): router agreement terms and the token
# sum of |log pi_old - log mu| (rlflow.learner.routing_replay); zeros for dense models
_MOE_SUMS = ("moe_agree", "moe_routed", "moe_gap")
# PPO: value loss; token sums of V_old, returns R, R^2, residual R - V_old and its square
_VALUE_SUMS = ("value_loss", "v_old", "ret", "ret_sq", "res", "res_sq")


def _targets(mb: TrainBatch, v_old, logp, ref_logp, s: StepSettings):
    """Unwhitened GAE ``(advantages, returns)`` of one (micro-)batch."""
    kl_in = s.kl_in_reward and ref_logp is not None
    return adv_lib.ppo_targets(mb.token_rewards, v_old, mb.loss_mask, gamma=s.gae_gamma,
                               lam=s.gae_lambda, old_logprobs=jax.lax.stop_gradient(logp),
                               ref_logprobs=ref_logp if kl_in else None, kl_coef=s.kl_coef)


def _micro_loss(params, graphdef, mb: TrainBatch, w, ref_logp, s: StepSettings,
                value_graphdef=None, old=None, frozen=None, loss_slots=None, pre=None,
                num_segments=None, mesh=None):
    """Loss of one micro-batch. PPO: ``old = (advantages, returns, V_old)`` from the
    old-values pass, or None (computed here from this forward's detached values).
    ``pre``: ``(correction, old logprobs)`` of this micro-batch from the start pass
    (group-level rejection over several micro-batches), or None (computed here from this
    forward's detached logprobs). ``loss_slots``, ``mesh``: as :func:`model_outputs`.
    ``num_segments``: the whole batch's bound on segment ids (``B * L + 1``)."""
    logp, ent, values, *extra = model_outputs(
        graphdef, params, mb, s.temperature, value_graphdef, frozen, loss_slots, s.attention,
        s.logprob_chunk, s.remat, mesh, moe_aux=s.moe_aux, routing_replay=s.routing_replay)
    aux = extra[:1] if s.moe_aux else []
    agreement = extra[-1] if mb.routing_ids is not None else None
    mask = mb.loss_mask
    advantages = mb.advantages
    if s.gae:
        if old is None:
            v_old = jax.lax.stop_gradient(values)
            advantages, returns = _targets(mb, v_old, logp, ref_logp, s)
            if s.whiten:              # here this micro-batch is the whole batch (make_grad_fn)
                advantages = adv_lib.masked_whiten(advantages, mask)
        else:
            advantages, returns, v_old = old
    if pre is None:
        old_logp = jax.lax.stop_gradient(logp)
        corr = _correct(old_logp, mb, s, num_segments)
    else:
        corr, old_logp = pre
    t = losses.policy_loss(logp, mb.behaviour_logprobs, advantages, mask,
                           off_policy=s.off_policy, clip_low=s.clip_low, clip_high=s.clip_high,
                           dual_clip=s.dual_clip, is_weight=corr.weight, keep=corr.keep)
    pg = jnp.sum(w * t.loss)
    loss = pg
    kl = jnp.zeros_like(logp)
    if ref_logp is not None:
        kl = losses.kl_penalty(logp, ref_logp, mask, s.kl_estimator)
        if not (s.gae and s.kl_in_reward):
            loss = loss + s.kl_coef * jnp.sum(w * kl)
    m = mask.astype(jnp.float32)
    kept = t.kept.astype(jnp.float32)
    sums = dict(pg_loss=pg, kl=jnp.sum(m * kl), entropy=jnp.sum(m * ent),
                clip_low=jnp.sum(t.clipped_low), clip_high=jnp.sum(t.clipped_high),
                clip_dual=jnp.sum(t.dual_clipped), is_weight=jnp.sum(kept * t.is_weight),
                is_kept=jnp.sum(kept),
                # tokens whose policy-loss weight is not zero: loss mask x aggregation weight x
                # the correction's keep mask and weight (the step's skip test)
                effective=jnp.sum((w * t.is_weight) > 0))
    diag = rc.mismatch_sums(old_logp, mb.behaviour_logprobs, mask, corr,
                            segment_ids=mb.segment_ids, policy_lag=mb.policy_lag,
                            num_segments=num_segments)
    sums |= {f"mismatch/{n}": v for n, v in diag.items()}
    zero = jnp.zeros((), jnp.float32)
    sums |= dict(moe_agree=zero, moe_routed=zero, moe_gap=zero) if agreement is None else dict(
        moe_agree=agreement[0], moe_routed=agreement[1],
        moe_gap=jnp.sum(m * jnp.abs(old_logp - mb.behaviour_logprobs)))
    if s.gae:
        vl = jnp.sum(w * losses.value_loss(values, v_old, returns, mask, clip=s.value_clip))
        loss = loss + s.value_coef * vl
        res = returns - v_old
        sums |= dict(value_loss=vl, v_old=jnp.sum(m * v_old), ret=jnp.sum(m * returns),
                     ret_sq=jnp.sum(m * returns ** 2), res=jnp.sum(m * res),
                     res_sq=jnp.sum(m * res ** 2))
    if aux:       # MoE: the load-balancing loss, each micro-batch's weighted 1 / k
        sums["moe_aux"] = aux[0] / s.micro_batches
        if s.moe_aux_coef > 0:
            loss = loss + s.moe_aux_coef * sums["moe_aux"]
    sums = {k: v.astype(jnp.float32) for k, v in sums.items()}
    is_lr = old_logp - mb.behaviour_logprobs
    lr_big = jnp.where(mask, is_lr, -jnp.inf)
    lr_small = jnp.where(mask, is_lr, jnp.inf)
    return loss, (sums, jnp.max(lr_big), jnp.min(lr_small))


def _correct(old_logp, mb: TrainBatch, s: StepSettings, num_segments=None) -> rc.Correction:
    """The rollout correction of ``mb`` (whole sequences; whole groups with group rejection)
    from the old policy's logprobs ``old_logp`` ``[B, L]``."""
    return rc.correct(old_logp - mb.behaviour_logprobs, mb.loss_mask, s.correction,
                      segment_ids=mb.segment_ids, group_ids=mb.group_ids,
                      apply_weight=s.off_policy == "decoupled", num_segments=num_segments)


def make_grad_fn(graphdef, settings: StepSettings, mesh=None, value_graphdef=None):
    """``(params, batch, ref_params, frozen=None) -> (loss, grads, stats)`` accumulated over
    micro-batches. ``frozen``: parameters of the model that get no gradient (LoRA: the base,
    ``params`` and ``ref_params`` then being adapter trees; zero adapters as ``ref_params``
    make the KL reference the base model).

    ``params`` is the policy's ``nnx.State``, or with ``settings.gae`` the pair
    ``(policy, value head)`` (:func:`trainable`; ``value_graphdef`` is the head's graphdef).
    ``grads`` is shaped like ``params`` (float32 accumulation, cast back to the params'
    dtype); ``stats`` holds the summed metric numerators (see :func:`make_train_step`) and
    the extreme IS log-ratios ``is_lr_max`` / ``is_lr_min`` over loss tokens.

    Raises: ValueError when ``settings.gae`` and ``value_graphdef`` disagree, or (when traced)
    a PPO batch without ``token_rewards``.
    """
    s, k = settings, settings.micro_batches
    if s.gae != (value_graphdef is not None):
        raise ValueError(f"settings.gae={s.gae} needs a value head graphdef exactly when True, "
                         f"got value_graphdef={value_graphdef!r}")
    sums_names = (_SUMS + _MISMATCH_SUMS + _MOE_SUMS + (_VALUE_SUMS if s.gae else ())
                  + (("moe_aux",) if s.moe_aux else ()))
    shards = batch_shards(mesh)
    seq_shards = sequence_size(mesh)
    old_values_pass = s.gae and s.whiten and k > 1
    # a prompt group spans micro-batches: group rejection needs the whole batch's logprobs
    group_pass = s.correction.reject != "off" and s.correction.unit == "group" and k > 1

    def constrain(x, lead):
        """``x [..., B, L]`` (``lead`` axes before the batch) in the batch sharding:
        batch over ``data`` x ``fsdp`` x ``expert``, positions over ``sequence`` when it is
        > 1."""
        if mesh is None:
            return x
        seq = ("sequence",) if seq_shards > 1 and x.ndim > lead + 1 else ()
        spec = P(*((None,) * lead), batch_axes(mesh), *seq,
                 *((None,) * (x.ndim - lead - 1 - len(seq))))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def slots(mb: TrainBatch):
        """``(shards, capacity, seq_shards)`` of a micro-batch's loss positions, or None
        (every position)."""
        if s.max_loss_tokens <= 0:
            return None
        rows, seq = mb.tokens.shape
        return shards, loss_positions.capacity_for(rows, seq, shards, s.max_loss_tokens,
                                                   seq_shards), seq_shards

    def ref_logprobs(ref_params, mb, frozen, loss_slots=None):
        return None if ref_params is None else jax.lax.stop_gradient(
            policy_logprobs(graphdef, ref_params, mb, s.temperature, frozen, loss_slots,
                            s.attention, s.logprob_chunk, mesh, s.routing_replay)[0])

    def start_pass(params, micro: TrainBatch, ref_params, frozen):
        """Forward only, at the step-start params, over every micro-batch: GAE targets
        whitened over the whole batch (``old_values_pass``) and the rollout correction of the
        whole batch (``group_pass``). Returns ``(gae, pre)``: ``(advantages, returns, V_old)``
        and ``(correction, old logprobs)``, each leaf ``[k, B/k, L]``, or None."""
        def body(_, mb):
            mb = jax.tree.map(lambda x: constrain(x, 0), mb)
            logp, _, values, *_ = model_outputs(
                graphdef, params, mb, s.temperature, value_graphdef, frozen,
                attention=s.attention, logprob_chunk=s.logprob_chunk, mesh=mesh,
                routing_replay=s.routing_replay)
            logp = jax.lax.stop_gradient(logp)
            if not old_values_pass:
                return None, (logp, None)
            ref = ref_logprobs(ref_params, mb, frozen) if s.kl_in_reward else None
            v_old = jax.lax.stop_gradient(values)
            return None, (logp, (*_targets(mb, v_old, logp, ref, s), v_old))

        _, (logp, gae) = jax.lax.scan(body, None, micro)
        if gae is not None:
            adv, ret, v_old = gae
            adv = constrain(adv_lib.masked_whiten(adv, micro.loss_mask), 1)
            gae = jax.lax.stop_gradient((adv, ret, v_old))
        pre = None
        if group_pass:        # the micro-batches' rows side by side: ids are batch-wide
            whole = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), micro)
            corr = _correct(logp.reshape(whole.loss_mask.shape), whole, s)
            pre = (jax.tree.map(lambda x: constrain(x.reshape(logp.shape), 1), corr), logp)
        return gae, pre

    def grad_fn(params, batch: TrainBatch, ref_params, frozen=None):
        b = batch.tokens.shape[0]
        if b % k:
            raise ValueError(f"batch of {b} rows does not split into {k} micro-batches")
        if s.gae and batch.token_rewards is None:
            raise ValueError("PPO (settings.gae) needs batch.token_rewards")
        w = losses.loss_weights(batch.loss_mask, s.loss_agg, norm_len=s.norm_len,
                                segment_ids=batch.segment_ids)
        micro = jax.tree.map(lambda x: constrain(split_micro(x, k), 1), (batch, w))
        old, pre = (start_pass(params, micro[0], ref_params, frozen)
                    if old_values_pass or group_pass else (None, None))
        value_and_grad = jax.value_and_grad(_micro_loss, has_aux=True)

        def body(carry, xs):
            (mb, w_mb), old_mb, pre_mb = jax.tree.map(lambda x: constrain(x, 0), xs)
            mb_slots = slots(mb)
            ref_logp = ref_logprobs(ref_params, mb, frozen, mb_slots)
            (loss, (sums, hi, lo)), g = value_and_grad(params, graphdef, mb, w_mb, ref_logp, s,
                                                       value_graphdef, old_mb, frozen, mb_slots,
                                                       pre_mb, batch.tokens.size + 1, mesh)
            grads, acc = carry
            grads = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), grads, g)
            acc = {n: acc[n] + sums[n] for n in sums_names} | {
                "loss": acc["loss"] + loss, "is_lr_max": jnp.maximum(acc["is_lr_max"], hi),
                "is_lr_min": jnp.minimum(acc["is_lr_min"], lo)}
            return (grads, acc), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        acc0 = {n: jnp.zeros((), jnp.float32) for n in sums_names + ("loss",)} | {
            n: jnp.zeros((len(LAG_BUCKETS),), jnp.float32) for n in _MISMATCH_SUMS} | {
            "is_lr_max": jnp.array(-jnp.inf, jnp.float32),
            "is_lr_min": jnp.array(jnp.inf, jnp.float32)}
        (grads, acc), _ = jax.lax.scan(body, (zeros, acc0), (micro, old, pre))
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return acc.pop("loss"), grads, acc

    return grad_fn


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    settings: StepSettings, mesh=None, value_graphdef=None):
    """The pure train step ``(state, batch, ref_params, frozen=None) -> (state, metrics)``.

    Args:
      graphdef: the model's ``nnx.GraphDef`` (from ``nnx.split(model, nnx.Param)``).
      tx, schedule: from :func:`rlflow.learner.optimizer.make_optimizer`.
      settings: :class:`StepSettings`.
      mesh: when given, micro-batches are constrained to :func:`rlflow.mesh.batch_sharding`.
      value_graphdef: the value head's graphdef with ``settings.gae`` (``state.value`` holds
        its params), else None.

    The step's ``batch`` is a :class:`TrainBatch` of ``[B, L]`` arrays with ``B`` divisible by
    ``settings.micro_batches``; ``ref_params`` are the frozen reference parameters (or None:
    no KL term). ``frozen``: parameters of the model outside the train state, never updated
    (LoRA: the base model; ``state.params`` are then the adapters). Metrics (float32 scalars): ``learner/loss``, ``learner/pg_loss``,
    ``policy/kl``, ``policy/entropy`` (token means), ``policy/clip_frac_low|high|dual``
    (fractions of loss tokens), ``policy/is_weight_mean`` (applied weight over kept tokens),
    ``policy/is_weight_min|max`` (untruncated token ratio over loss tokens), the mismatch
    diagnostics and the rollout correction's masked / truncated fractions, each for the
    whole batch and per policy-lag bucket (``mismatch/kl_k1``, ``mismatch/kl_k3``,
    ``mismatch/chi2``, ``mismatch/log_ppl_diff``, ``rollout_correction/masked_token_frac``,
    ``.../masked_seq_frac``, ``.../truncated_token_frac``, ``.../truncated_seq_frac``, and
    the same with ``_lag0``, ``_lag1``, ``_lag2plus``:
    :func:`rlflow.learner.rollout_correction.mismatch_metrics`), ``learner/grad_norm`` (before clipping), ``learner/tokens``, ``learner/lr``,
    ``learner/kept_tokens`` (loss tokens with a non-zero policy-loss weight: not rejected by
    the rollout correction), ``learner/skipped`` (1 when ``learner/kept_tokens`` is 0, i.e.
    no loss token or every one rejected: parameters, optimiser state and step are then left
    unchanged, bit for bit; the KL and value terms of such a step are not applied either). PPO adds ``value/loss`` (aggregated like the policy loss),
    ``value/mean`` and ``value/return_mean`` (token means of ``V_old`` and of the returns) and
    ``value/explained_variance`` ``1 - Var(R - V_old) / Var(R)`` over response tokens (0 when
    the returns have no variance); ``learner/grad_norm`` is then the joint norm of policy and
    value-head gradients. A mixture-of-experts policy (``settings.moe_aux``) adds
    ``moe/aux_loss``, the load-balancing loss (mean over micro-batches; ``learner/loss``
    holds it times ``settings.moe_aux_coef``). A mixture-of-experts model's batches (with
    ``routing_ids``) add ``moe/router_agreement`` (fraction of the token-layers with a
    recorded expert choice whose own top-k set equals it) and ``moe/logprob_gap`` (token mean
    of ``|log pi_old - log mu|``), with or without ``settings.routing_replay``
    (:mod:`rlflow.learner.routing_replay`).
    """
    grad_fn = make_grad_fn(graphdef, settings, mesh, value_graphdef)

    def step(state: TrainState, batch: TrainBatch, ref_params, frozen=None):
        current = trainable(state.params, state.value)
        loss, grads, acc = grad_fn(current, batch, ref_params, frozen)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, current)
        new = optax.apply_updates(current, updates)
        n_tok = jnp.sum(batch.loss_mask).astype(jnp.float32)
        # a batch whose every token has policy-loss weight 0 (no loss token, or every one
        # rejected by the rollout correction) carries no signal: an AdamW update on it would
        # still move every parameter by about lr (the first moment, weight decay), so keep
        # params, moments and version (verl PR #3915, NeMo-RL PR #4001 fixed the same)
        skip = acc["effective"] == 0
        new, opt_state = jax.tree.map(lambda old, new: jnp.where(skip, old, new),
                                      (current, state.opt_state), (new, opt_state))
        params, value = (new, None) if state.value is None else new
        per_tok = 1.0 / jnp.maximum(n_tok, 1.0)
        any_tok = n_tok > 0
        metrics = {
            "learner/loss": loss,
            "learner/pg_loss": acc["pg_loss"],
            "policy/kl": acc["kl"] * per_tok,
            "policy/entropy": acc["entropy"] * per_tok,
            "policy/clip_frac_low": acc["clip_low"] * per_tok,
            "policy/clip_frac_high": acc["clip_high"] * per_tok,
            "policy/clip_frac_dual": acc["clip_dual"] * per_tok,
            "policy/is_weight_mean": acc["is_weight"] / jnp.maximum(acc["is_kept"], 1.0),
            "policy/is_weight_max": jnp.where(any_tok, jnp.exp(jnp.minimum(acc["is_lr_max"], 80.0)),
                                              1.0),
            "policy/is_weight_min": jnp.where(any_tok,
                                              jnp.exp(jnp.maximum(acc["is_lr_min"], -80.0)), 1.0),
            "learner/grad_norm": grad_norm,
            "learner/tokens": n_tok,
            "learner/kept_tokens": acc["effective"],
            "learner/lr": jnp.asarray(schedule(state.step), jnp.float32),
            "learner/skipped": skip.astype(jnp.float32),
        }
        metrics |= rc.mismatch_metrics({n: acc[f"mismatch/{n}"] for n in rc.DIAGNOSTIC_SUMS})
        if settings.gae:
            metrics |= _value_metrics(acc, n_tok)
        if settings.moe_aux:
            metrics["moe/aux_loss"] = acc["moe_aux"]
        if batch.routing_ids is not None:               # a mixture-of-experts model's batch
            metrics |= {"moe/router_agreement": acc["moe_agree"] / jnp.maximum(
                            acc["moe_routed"], 1.0),
                        "moe/logprob_gap": acc["moe_gap"] * per_tok}
        return TrainState(state.step + 1 - skip.astype(jnp.int32), params, opt_state,
                          value), metrics

    return step


def _value_metrics(acc, n_tok) -> dict:
    n = jnp.maximum(n_tok, 1.0)
    ret_mean, res_mean = acc["ret"] / n, acc["res"] / n
    var_ret = jnp.maximum(acc["ret_sq"] / n - ret_mean ** 2, 0.0)
    var_res = jnp.maximum(acc["res_sq"] / n - res_mean ** 2, 0.0)
    # float32 sums: a variance below ~1e-6 of the mean square is rounding, not signal
    has_var = var_ret > 1e-6 * acc["ret_sq"] / n + 1e-12
    return {"value/loss": acc["value_loss"], "value/mean": acc["v_old"] / n,
            "value/return_mean": ret_mean,
            "value/explained_variance": jnp.where(
                has_var, 1.0 - var_res / jnp.where(has_var, var_ret, 1.0), 0.0)}
