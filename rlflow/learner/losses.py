"""Policy-gradient losses: clipped ratio, KL, aggregation (importance weights and rejection
of off-policy tokens: :mod:`rlflow.learner.rollout_correction`).

Pure ``jax.numpy`` functions on ``[B, T]`` arrays aligned to next-token targets, with a
response ``mask [B, T]`` (1 where the target is a response token that counts). Every function
replaces masked entries by a neutral value *before* any nonlinearity (the double-``where``
pattern), so NaN/inf in masked positions, or a log-ratio of 1000 on a rejected token, give
finite values and finite gradients.

Sign convention: functions return per-token *losses* (to minimise).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from rlflow.models.logprobs import entropy_from_logits  # noqa: F401  (re-exported)

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
OffPolicy = Literal["decoupled", "behaviour"]


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _masked(x, mask, fill=0.0):
    """``x`` where mask else ``fill``; non-finite masked entries never reach later math."""
    return jnp.where(jnp.asarray(mask, bool), _f32(x), fill)


# ----------------------------------------------------------------------------- aggregation

def loss_weights(mask, mode: AggMode, *, norm_len: int | None = None,
                 segment_ids=None) -> jax.Array:
    """Per-token weights ``w [B, T]`` so that the aggregated loss is ``sum(w * loss)``.

    Computed once on the whole batch, then sliced with it into micro-batches: the global
    normalisers (token count, sequence count) live inside ``w``, so summing micro-batch
    losses gives exactly the full-batch loss in every mode. With ``n_b = sum_t m_bt``,
    ``N = sum_b n_b`` and ``S = #{b : n_b > 0}``:

    - ``"token-mean"`` (DAPO token-level loss, Yu et al. 2025, sec. 3.3): ``sum_bt m l / N``.
    - ``"seq-mean-token-mean"`` (GRPO, Shao et al. 2024, eq. 3): ``(1/S) sum_b (1/n_b) sum_t m l``.
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO objective, Liu et al. 2025):
      ``(1/S) sum_b (1/L) sum_t m l`` with the constant ``L = norm_len`` (the generation budget).

    Empty denominators count as 1, so an all-zero mask gives loss 0 and zero gradients.

    With ``segment_ids`` (sequence packing, several sequences per row) the sequences ``b``
    above are the segments, not the rows: ``n_b`` counts the loss tokens of segment ``b``
    and ``S`` the segments with any.

    Args:
      mask: ``[B, T]`` bool/0-1 loss mask.
      segment_ids: ``[B, T]`` int, ids unique over the batch in ``[0, B * T]`` (0: padding,
        which holds no loss token), or None (one sequence per row).
      mode: one of the three modes above.
      norm_len: ``L`` for "seq-mean-token-sum-norm" (required there, > 0).

    Returns: ``[B, T]`` float32 weights (0 where mask is 0).

    Raises: ValueError for an unknown mode or a missing/invalid ``norm_len``.
    """
    m = _f32(jnp.asarray(mask, bool))
    if m.ndim != 2:
        raise ValueError(f"mask must be [batch, seq], got shape {m.shape}")
    if segment_ids is None:
        n_b = jnp.sum(m, axis=1, keepdims=True)
        n_seq = jnp.maximum(jnp.sum(n_b > 0), 1).astype(jnp.float32)
    else:
        seg = jnp.asarray(segment_ids, jnp.int32)
        counts = jax.ops.segment_sum(m.reshape(-1), seg.reshape(-1),
                                     num_segments=m.size + 1)          # [B * T + 1]
        n_b = counts[seg]                                              # per token: its segment's
        n_seq = jnp.maximum(jnp.sum(counts > 0), 1).astype(jnp.float32)
    if mode == "token-mean":
        return m / jnp.maximum(jnp.sum(m), 1.0)
    if mode == "seq-mean-token-mean":
        return m / (jnp.maximum(n_b, 1.0) * n_seq)
    if mode == "seq-mean-token-sum-norm":
        if not norm_len or norm_len <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs norm_len > 0, got {norm_len!r}")
        return m / (float(norm_len) * n_seq)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected token-mean, "
                     f"seq-mean-token-mean or seq-mean-token-sum-norm")


def aggregate(per_token, mask, mode: AggMode, *, norm_len: int | None = None,
              segment_ids=None) -> jax.Array:
    """Scalar loss ``sum(loss_weights(mask, mode) * per_token)`` (NaN-safe where mask is 0)."""
    w = loss_weights(mask, mode, norm_len=norm_len, segment_ids=segment_ids)
    return jnp.sum(w * _masked(per_token, mask))


# ---------------------------------------------------------------------------- policy loss

class PolicyTerms(NamedTuple):
    """Per-token outputs of :func:`policy_loss`, all ``[B, T]``."""
    loss: jax.Array          # float32 per-token loss (0 where masked or rejected)
    ratio: jax.Array         # float32 PPO ratio pi / pi_old (1 where not kept)
    is_weight: jax.Array     # float32 importance weight applied (0 where not kept)
    kept: jax.Array          # bool token in the loss (mask and not rejected)
    clipped_low: jax.Array   # bool ratio < 1 - clip_low with A < 0 (clip active)
    clipped_high: jax.Array  # bool ratio > 1 + clip_high with A > 0 (clip active)
    dual_clipped: jax.Array  # bool dual clip active (A < 0, ratio > dual_clip)


def clipped_surrogate(ratio, advantages, *, clip_low: float, clip_high: float,
                      dual_clip: float = 0.0):
    """PPO clipped surrogate loss per token (Schulman et al. 2017, eq. 7), as a loss.

    ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` (DAPO clip-higher: separate
    low/high ranges, Yu et al. 2025 sec. 3.1); with dual clip ``c > 1`` (Ye et al. 2020, dual-clip PPO),
    ``l = min(l, -c A)`` where ``A < 0``.

    Returns: ``(loss, clipped_low, clipped_high, dual_clipped)`` all shaped like ``ratio``.
    """
    r, a = _f32(ratio), _f32(advantages)
    l1 = -a * r
    l2 = -a * jnp.clip(r, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(l1, l2)
    dual = jnp.zeros(r.shape, bool)
    if dual_clip > 0:
        dual = (a < 0) & (loss > -dual_clip * a)
        loss = jnp.where(a < 0, jnp.minimum(loss, -dual_clip * a), loss)
    return loss, (r < 1.0 - clip_low) & (a < 0), (r > 1.0 + clip_high) & (a > 0), dual


def policy_loss(logprobs, behaviour_logprobs, advantages, mask, *, off_policy: OffPolicy,
                clip_low: float, clip_high: float, dual_clip: float = 0.0,
                old_logprobs=None, is_weight=None, keep=None) -> PolicyTerms:
    """Per-token clipped policy loss with off-policy correction against the sampler.

    ``"decoupled"`` (Fu et al. 2025, AReaL, "decoupled PPO objective"; Hilton et al. 2021):
    the PPO ratio is against the proximal/old policy ``r = pi / pi_old`` and each token is
    weighted by the detached importance weight ``w`` of the old policy against the behaviour
    policy ``mu`` (the sampler), :func:`rlflow.learner.rollout_correction.correct`::

        l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1-eps_low, 1+eps_high))

    ``old_logprobs`` defaults to ``stop_gradient(logprobs)``: with one optimiser step per
    batch the old policy is the current parameters at step start (r = 1, gradient of r =
    gradient of log pi).

    ``"behaviour"``: the ratio is taken directly against the behaviour policy,
    ``r = pi / mu`` (PPO with the sampler as the old policy); ``is_weight`` is not applied.

    In both modes a token outside ``keep`` (rejected by the rollout correction) has loss 0
    and gradient 0, but stays in the aggregation denominator (the weights of
    :func:`loss_weights`).

    Args:
      logprobs: ``[B, T]`` float32 current-policy logprobs of the targets (differentiated).
      behaviour_logprobs: ``[B, T]`` float32 logprobs the sampler drew the targets with.
      advantages: ``[B, T]`` float32 (per-sample advantages broadcast over tokens).
      mask: ``[B, T]`` response/loss mask.
      off_policy: "decoupled" or "behaviour".
      clip_low, clip_high, dual_clip: see :func:`clipped_surrogate`.
      old_logprobs: ``[B, T]`` proximal policy logprobs (decoupled only).
      is_weight: ``[B, T]`` float32 detached weight (decoupled only), or None (1).
      keep: ``[B, T]`` bool tokens not rejected, or None (all of ``mask``).

    Returns: :class:`PolicyTerms`.

    Raises: ValueError for an unknown ``off_policy``.
    """
    m = jnp.asarray(mask, bool)
    keep = m if keep is None else m & jnp.asarray(keep, bool)
    logp = _masked(logprobs, m)
    adv = _masked(advantages, m)
    if off_policy == "decoupled":
        old = jax.lax.stop_gradient(logp if old_logprobs is None else _masked(old_logprobs, m))
    elif off_policy == "behaviour":
        old = _masked(behaviour_logprobs, m)
    else:
        raise ValueError(f"off_policy must be 'decoupled' or 'behaviour', got {off_policy!r}")
    log_ratio = jnp.where(keep, logp - old, 0.0)
    ratio = jnp.exp(log_ratio)
    loss, lo, hi, dual = clipped_surrogate(ratio, adv, clip_low=clip_low, clip_high=clip_high,
                                           dual_clip=dual_clip)
    if off_policy == "decoupled" and is_weight is not None:
        w = jax.lax.stop_gradient(_masked(is_weight, keep))
    else:
        w = _f32(keep)
    return PolicyTerms(loss=w * jnp.where(keep, loss, 0.0), ratio=ratio, is_weight=w,
                       kept=keep, clipped_low=lo & keep, clipped_high=hi & keep,
                       dual_clipped=dual & keep)


# ---------------------------------------------------------------------------------- KL

def kl_penalty(logprobs, ref_logprobs, mask, estimator: KLEstimator = "k3",
               max_log_ratio: float = 20.0) -> jax.Array:
    """Per-token KL(pi || pi_ref) estimators of Schulman (2020), "Approximating KL divergence".

    With ``d = log pi_ref - log pi`` on the sampled token:
    ``k1 = -d``; ``k2 = d^2 / 2``; ``k3 = exp(d) - 1 - d = expm1(d) - d`` (unbiased, >= 0; GRPO
    eq. 4). k3 uses the series ``d^2/2 + d^3/6 + d^4/24 + d^5/120 + d^6/720`` for ``|d| < 0.1``
    (float32 ``expm1(d) - d`` cancels catastrophically: at ``d = 1e-6`` it is off by ~10%) and
    clips ``d`` to ``+-max_log_ratio`` before ``exp`` (zero gradient beyond).

    Args:
      logprobs: ``[B, T]`` float current-policy logprobs (differentiated).
      ref_logprobs: ``[B, T]`` float reference-policy logprobs (treated as constants).
      mask: ``[B, T]`` bool; masked entries give 0 (NaN there is harmless, gradients finite).
      estimator: "k1", "k2" or "k3".

    Returns: ``[B, T]`` float32 per-token KL (0 where masked).
    """
    m = jnp.asarray(mask, bool)
    d = _masked(jax.lax.stop_gradient(_f32(ref_logprobs)), m) - _masked(logprobs, m)
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    elif estimator == "k3":
        small = jnp.abs(d) < 0.1
        ds = jnp.where(small, d, 0.0)
        series = ds * ds * (0.5 + ds * (1 / 6 + ds * (1 / 24 + ds * (1 / 120 + ds / 720))))
        dl = jnp.clip(jnp.where(small, 1.0, d), -max_log_ratio, max_log_ratio)
        kl = jnp.where(small, series, jnp.expm1(dl) - dl)
    else:
        raise ValueError(f"kl estimator must be k1, k2 or k3, got {estimator!r}")
    return jnp.where(m, kl, 0.0)


# ---------------------------------------------------------------------------- entropy

def value_loss(values, old_values, returns, mask, *, clip: float = 0.0) -> jax.Array:
    """Per-token PPO value loss (Schulman et al. 2017, sec. 5; clipped form as in OpenAI
    baselines): ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``; ``c = 0``: plain
    ``0.5 (V - R)^2``. All ``[B, T]``; returns float32 ``[B, T]`` (0 where masked)."""
    m = jnp.asarray(mask, bool)
    v, r = _masked(values, m), _masked(returns, m)
    loss = (v - r) ** 2
    if clip > 0:
        vo = _masked(jax.lax.stop_gradient(_f32(old_values)), m)
        loss = jnp.maximum(loss, (vo + jnp.clip(v - vo, -clip, clip) - r) ** 2)
    return jnp.where(m, 0.5 * loss, 0.0)
