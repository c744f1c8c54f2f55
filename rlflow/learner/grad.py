"""The step's loss and its gradient, accumulated over micro-batches:
``(params, batch, ref_params, frozen) -> (loss, grads, sums)`` (:func:`make_grad_fn`).

The batch ``[B, L]`` (:class:`rlflow.learner.batch.TrainBatch`) is split into ``k``
micro-batches (micro-batch ``j`` holds rows ``j, j + k, j + 2k, ...``, so every micro-batch
stays spread over the batch-sharded devices: :func:`split_micro`); gradients and metric sums
(:mod:`rlflow.learner.step_sums`) are accumulated with ``lax.scan`` in float32. The aggregation
weights of :func:`rlflow.learner.losses.loss_weights` are computed on the whole batch first, so
their global normalisers (token count, sequence count) make the sum of micro-batch losses equal
the full-batch loss in every aggregation mode.

PPO (``settings.gae``): GAE advantages and returns come from the *old* values (the step-start
parameters, detached: with one optimiser step per batch they are this forward's values under
``stop_gradient``) via :func:`rlflow.learner.advantages.ppo_targets`; the loss is ``policy +
value_coef * value`` (clipped value loss :func:`rlflow.learner.losses.value_loss`, aggregated
with the policy's weights). Whitening needs batch-wide statistics, so with whitening and ``k >
1`` micro-batches a forward-only pass first computes the old values of the whole batch
(:func:`_start_pass`; the micro-batch sums then still equal the full-batch step); so does
group-level rollout rejection over several micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from rlflow.learner import advantages as adv_lib
from rlflow.learner import loss_positions, losses, step_sums
from rlflow.learner import rollout_correction as rc
from rlflow.learner.batch import TrainBatch
from rlflow.learner.forward import model_outputs, policy_logprobs
from rlflow.learner.step_settings import StepSettings
from rlflow.mesh import batch_axes, batch_shards, sequence_size


def split_micro(x: jax.Array, k: int) -> jax.Array:
    """``[B, ...] -> [k, B / k, ...]``; micro-batch ``j`` holds rows ``j, j + k, ...``."""
    return x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)


def _targets(mb: TrainBatch, v_old, logp, ref_logp, s: StepSettings):
    """Unwhitened GAE ``(advantages, returns)`` of one (micro-)batch."""
    kl_in = s.kl_in_reward and ref_logp is not None
    return adv_lib.ppo_targets(mb.token_rewards, v_old, mb.loss_mask, gamma=s.gae_gamma,
                               lam=s.gae_lambda, old_logprobs=jax.lax.stop_gradient(logp),
                               ref_logprobs=ref_logp if kl_in else None, kl_coef=s.kl_coef)


def _correct(old_logp, mb: TrainBatch, s: StepSettings, num_segments=None) -> rc.Correction:
    """The rollout correction of ``mb`` (whole sequences; whole groups with group rejection)
    from the old policy's logprobs ``old_logp`` ``[B, L]``."""
    return rc.correct(old_logp - mb.behaviour_logprobs, mb.loss_mask, s.correction,
                      segment_ids=mb.segment_ids, group_ids=mb.group_ids,
                      apply_weight=s.off_policy == "decoupled", num_segments=num_segments)


def _micro_loss(params, graphdef, mb: TrainBatch, w, ref_logp, s: StepSettings,
                value_graphdef=None, old=None, frozen=None, loss_slots=None, pre=None,
                num_segments=None, mesh=None):
    """Loss of one micro-batch. PPO: ``old = (advantages, returns, V_old)`` from the
    old-values pass, or None (computed here from this forward's detached values).
    ``pre``: ``(correction, old logprobs)`` of this micro-batch from the start pass
    (group-level rejection over several micro-batches), or None (computed here from this
    forward's detached logprobs). ``loss_slots``, ``mesh``: as :func:`model_outputs`.
    ``num_segments``: the whole batch's bound on segment ids (``B * L + 1``).

    Returns: ``(loss, (sums, is_lr_max, is_lr_min))``: the sums of every metric group
    (:mod:`rlflow.learner.step_sums`), float32."""
    out = model_outputs(graphdef, params, mb, s.temperature, value_graphdef, frozen, loss_slots,
                        s.attention, s.logprob_chunk, s.remat, mesh, moe_aux=s.moe_aux,
                        routing_replay=s.routing_replay)
    logp, values = out.logprobs, out.values
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
    sums = step_sums.policy_sums(pg, kl, out.entropy, t, mask, w)
    sums |= step_sums.mismatch_sums(old_logp, mb, corr, num_segments)
    sums |= step_sums.moe_sums(out.router_agreement if mb.routing_ids is not None else None,
                               out.aux_loss if s.moe_aux else None, old_logp,
                               mb.behaviour_logprobs, mask, s.micro_batches)
    if s.gae:
        vl = jnp.sum(w * losses.value_loss(values, v_old, returns, mask, clip=s.value_clip))
        loss = loss + s.value_coef * vl
        sums |= step_sums.value_sums(vl, v_old, returns, mask)
    if s.moe_aux and s.moe_aux_coef > 0:   # MoE: the load-balancing loss, weighted 1 / k
        loss = loss + s.moe_aux_coef * sums["moe_aux"]
    sums = {k: v.astype(jnp.float32) for k, v in sums.items()}
    return loss, (sums, *step_sums.is_log_ratio_extremes(old_logp, mb.behaviour_logprobs, mask))


def _constrain(x, lead: int, mesh, seq_shards: int):
    """``x [..., B, L]`` (``lead`` axes before the batch) in the batch sharding: batch over
    ``data`` x ``fsdp`` x ``expert``, positions over ``sequence`` when it is > 1 (no-op
    without ``mesh``)."""
    if mesh is None:
        return x
    seq = ("sequence",) if seq_shards > 1 and x.ndim > lead + 1 else ()
    spec = P(*((None,) * lead), batch_axes(mesh), *seq,
             *((None,) * (x.ndim - lead - 1 - len(seq))))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _loss_slots(mb: TrainBatch, s: StepSettings, shards: int, seq_shards: int):
    """``(shards, capacity, seq_shards)`` of a micro-batch's loss positions, or None (every
    position: ``s.max_loss_tokens <= 0``)."""
    if s.max_loss_tokens <= 0:
        return None
    rows, seq = mb.tokens.shape
    return shards, loss_positions.capacity_for(rows, seq, shards, s.max_loss_tokens,
                                               seq_shards), seq_shards


def _ref_logprobs(graphdef, s: StepSettings, mesh, ref_params, mb, frozen, loss_slots=None):
    """The reference policy's logprobs ``[B, L]`` of ``mb`` (detached), or None without
    ``ref_params``."""
    return None if ref_params is None else jax.lax.stop_gradient(
        policy_logprobs(graphdef, ref_params, mb, s.temperature, frozen, loss_slots,
                        s.attention, s.logprob_chunk, mesh, s.routing_replay)[0])


def _start_pass(graphdef, value_graphdef, s: StepSettings, mesh, params, micro: TrainBatch,
                ref_params, frozen):
    """Forward only, at the step-start params, over every micro-batch ``micro`` (leaves ``[k,
    B/k, L]``): GAE targets whitened over the whole batch (PPO with whitening) and the rollout
    correction of the whole batch (group-level rejection). Returns ``(gae, pre)``:
    ``(advantages, returns, V_old)`` and ``(correction, old logprobs)``, each leaf ``[k, B/k,
    L]``, or None."""
    seq_shards = sequence_size(mesh)
    old_values_pass = s.gae and s.whiten and s.micro_batches > 1
    group_pass = (s.correction.reject != "off" and s.correction.unit == "group"
                  and s.micro_batches > 1)

    def body(_, mb):
        mb = jax.tree.map(lambda x: _constrain(x, 0, mesh, seq_shards), mb)
        out = model_outputs(graphdef, params, mb, s.temperature, value_graphdef, frozen,
                            attention=s.attention, logprob_chunk=s.logprob_chunk, mesh=mesh,
                            routing_replay=s.routing_replay)
        logp = jax.lax.stop_gradient(out.logprobs)
        if not old_values_pass:
            return None, (logp, None)
        ref = (_ref_logprobs(graphdef, s, mesh, ref_params, mb, frozen) if s.kl_in_reward
               else None)
        v_old = jax.lax.stop_gradient(out.values)
        return None, (logp, (*_targets(mb, v_old, logp, ref, s), v_old))

    _, (logp, gae) = jax.lax.scan(body, None, micro)
    if gae is not None:
        adv, ret, v_old = gae
        adv = _constrain(adv_lib.masked_whiten(adv, micro.loss_mask), 1, mesh, seq_shards)
        gae = jax.lax.stop_gradient((adv, ret, v_old))
    pre = None
    if group_pass:        # the micro-batches' rows side by side: ids are batch-wide
        whole = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), micro)
        corr = _correct(logp.reshape(whole.loss_mask.shape), whole, s)
        pre = (jax.tree.map(lambda x: _constrain(x.reshape(logp.shape), 1, mesh, seq_shards),
                            corr), logp)
    return gae, pre


def make_grad_fn(graphdef, settings: StepSettings, mesh=None, value_graphdef=None):
    """``(params, batch, ref_params, frozen=None) -> (loss, grads, stats)`` accumulated over
    micro-batches. ``frozen``: parameters of the model that get no gradient (LoRA: the base,
    ``params`` and ``ref_params`` then being adapter trees; zero adapters as ``ref_params``
    make the KL reference the base model).

    ``params`` is the policy's ``nnx.State``, or with ``settings.gae`` the pair
    ``(policy, value head)`` (:func:`rlflow.learner.step.trainable`; ``value_graphdef`` is the
    head's graphdef). ``grads`` is shaped like ``params`` (float32 accumulation, cast back to
    the params' dtype); ``stats`` holds the summed metric numerators of every metric group
    (:mod:`rlflow.learner.step_sums`) and the extreme IS log-ratios ``is_lr_max`` /
    ``is_lr_min`` over loss tokens.

    Raises: ValueError when ``settings.gae`` and ``value_graphdef`` disagree, or (when traced)
    a PPO batch without ``token_rewards``.
    """
    s, k = settings, settings.micro_batches
    if s.gae != (value_graphdef is not None):
        raise ValueError(f"settings.gae={s.gae} needs a value head graphdef exactly when True, "
                         f"got value_graphdef={value_graphdef!r}")
    sums_names = step_sums.sum_names(s.gae, s.moe_aux)
    shards = batch_shards(mesh)
    seq_shards = sequence_size(mesh)
    # a prompt group spans micro-batches: group rejection needs the whole batch's logprobs
    start_pass = ((s.gae and s.whiten and k > 1)
                  or (s.correction.reject != "off" and s.correction.unit == "group" and k > 1))

    def constrain(x, lead):
        return _constrain(x, lead, mesh, seq_shards)

    def grad_fn(params, batch: TrainBatch, ref_params, frozen=None):
        b = batch.tokens.shape[0]
        if b % k:
            raise ValueError(f"batch of {b} rows does not split into {k} micro-batches")
        if s.gae and batch.token_rewards is None:
            raise ValueError("PPO (settings.gae) needs batch.token_rewards")
        w = losses.loss_weights(batch.loss_mask, s.loss_agg, norm_len=s.norm_len,
                                segment_ids=batch.segment_ids)
        micro = jax.tree.map(lambda x: constrain(split_micro(x, k), 1), (batch, w))
        old, pre = (_start_pass(graphdef, value_graphdef, s, mesh, params, micro[0],
                                ref_params, frozen) if start_pass else (None, None))
        value_and_grad = jax.value_and_grad(_micro_loss, has_aux=True)

        def body(carry, xs):
            (mb, w_mb), old_mb, pre_mb = jax.tree.map(lambda x: constrain(x, 0), xs)
            mb_slots = _loss_slots(mb, s, shards, seq_shards)
            ref_logp = _ref_logprobs(graphdef, s, mesh, ref_params, mb, frozen, mb_slots)
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
        (grads, acc), _ = jax.lax.scan(body, (zeros, step_sums.zero_sums(sums_names)),
                                       (micro, old, pre))
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return acc.pop("loss"), grads, acc

    return grad_fn
