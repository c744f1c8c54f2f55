"""Rollout correction and mismatch diagnostics: the learner's old policy against the
sampler's behaviour policy, at token, sequence and geometric-mean level (pure ``jax.numpy``).

Notation (``[B, T]`` arrays aligned to next-token targets, like :mod:`rlflow.learner.losses`):
``mask`` the loss mask (the sampled tokens that count; the environment tokens of a multi-turn
episode and padding are 0), ``log_rho = log pi_old - log mu`` on masked tokens (``pi_old``:
the learner's policy at step start, ``mu``: the behaviour policy the sampler drew with).
A *sequence* is one sample's loss tokens: the tokens of one segment id (sequence packing:
several per row; unpacked batches: one per row), a *group* the samples of one prompt
(``group_ids``). Per-sequence totals are ``jax.ops.segment_sum`` over the segment ids, which
are unique over the whole batch, so micro-batches and batch-sharded devices give the same
values as the whole batch on one device.

Levels (verl's rollout correction, ``docs/algo/rollout_corr_math.md`` sec. 3.3; Liu, Li et
al. 2025, "When Speed Kills Stability"), each a log-weight per token:

- ``"token"``: ``log rho_t``;
- ``"sequence"``: ``sum_{t in seq} log rho_t`` (the product of the token ratios);
- ``"geometric"``: ``(1 / |seq|) sum_{t in seq} log rho_t`` (their geometric mean).

A level's weight is used truncated, ``w = clip(exp(level), floor, cap)`` detached (truncated
IS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; IMPALA eq. 1), and/or as a rejection test: a token, sequence or group with a
weight outside ``[low, high]`` leaves the loss (:func:`correct`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlflow.learner.losses import kl_penalty
from rlflow.run.metrics import LAG_BUCKETS

# log-ratios are clipped to +-this before exp in the chi-square (exp(2 * 20) is finite in
# float32 and a sum of 1e20 such terms too), as kl_penalty clips its k3
MAX_LOG_RATIO = 20.0


def _f32(x):
    return jnp.asarray(x, jnp.float32)


# ----------------------------------------------------------------------------- segments

def sequence_ids(mask, segment_ids=None, num_segments: int | None = None):
    """``(ids [B, T] int32, num_segments)``: ``segment_ids`` with ``num_segments`` segments
    (default ``B * T + 1``; a micro-batch of a larger batch, whose ids run over the whole
    batch, passes the whole batch's count), or, without them, ``row + 1`` (one sequence per
    row) with ``B + 1``."""
    m = jnp.asarray(mask)
    if segment_ids is None:
        rows = jnp.arange(1, m.shape[0] + 1, dtype=jnp.int32)[:, None]
        return jnp.broadcast_to(rows, m.shape), m.shape[0] + 1
    return jnp.asarray(segment_ids, jnp.int32), num_segments or m.size + 1


def segment_total(x, ids, num_segments: int):
    """Per token, the sum of ``x`` over the tokens with its id: ``[B, T]`` float32."""
    ids = jnp.asarray(ids, jnp.int32)
    totals = jax.ops.segment_sum(_f32(x).reshape(-1), ids.reshape(-1), num_segments=num_segments)
    return totals[ids]


def level_log_weight(log_rho, mask, level: str, ids, num_segments: int):
    """The log-weight ``[B, T]`` float32 of each masked token at ``level`` ("token",
    "sequence" or "geometric", see the module docstring); 0 where ``mask`` is 0.

    Raises: ValueError for another level.
    """
    m = jnp.asarray(mask, bool)
    lr = jnp.where(m, _f32(log_rho), 0.0)
    if level == "token":
        return lr
    if level not in ("sequence", "geometric"):
        raise ValueError(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")
    total = segment_total(lr, ids, num_segments)
    if level == "geometric":
        total = total / jnp.maximum(segment_total(m, ids, num_segments), 1.0)
    return jnp.where(m, total, 0.0)


# ----------------------------------------------------------------- weights and rejection

def in_band(log_weight, low: float = 0.0, high: float = 0.0):
    """True where ``low <= exp(log_weight) <= high``, compared in log space (0 turns a side
    off); NaN is outside. Returns bool shaped like ``log_weight``."""
    lw = _f32(log_weight)
    ok = ~jnp.isnan(lw)
    if low > 0:
        ok &= lw >= math.log(low)
    if high > 0:
        ok &= lw <= math.log(high)
    return ok


def truncated_weight(log_weight, cap: float, floor: float = 0.0):
    """Truncated importance weight ``clip(exp(log_weight), floor, cap)``, detached.

    Clipped in log space before ``exp``, so a log-weight of 1000 gives ``cap`` (not inf);
    ``cap = 0``: no cap; ``floor = 0``: no floor. A non-finite log-weight gives weight 0.

    Returns: float32, shaped like ``log_weight``, no gradient.
    """
    lw = _f32(log_weight)
    finite = jnp.isfinite(lw)
    lw = jnp.where(finite, lw, 0.0)
    lo = math.log(floor) if floor > 0 else -jnp.inf
    hi = math.log(cap) if cap > 0 else 80.0  # exp(80) is finite in float32
    return jax.lax.stop_gradient(jnp.where(finite, jnp.exp(jnp.clip(lw, lo, hi)), 0.0))


class Correction(NamedTuple):
    """What :func:`correct` gives each token, all ``[B, T]``."""
    weight: jax.Array      # float32 detached weight on the loss (0 where rejected or masked)
    keep: jax.Array        # bool masked token that stays in the loss
    rejected: jax.Array    # bool masked token removed by the rejection test
    truncated: jax.Array   # bool masked token whose weight hit the cap or the floor


def correct(log_rho, mask, cfg, *, segment_ids=None, group_ids=None,
            apply_weight: bool = True, num_segments: int | None = None) -> Correction:
    """Rollout correction of one batch (or micro-batch: whole sequences; whole groups for
    ``cfg.unit == "group"``).

    Args:
      log_rho: ``[B, T]`` float ``log pi_old - log mu`` (any value where ``mask`` is 0).
      mask: ``[B, T]`` bool loss mask.
      cfg: :class:`rlflow.config.RolloutCorrectionConfig`.
      segment_ids: ``[B, T]`` int sequence ids unique over the batch (0: padding), or None
        (one sequence per row).
      group_ids: ``[B, T]`` int prompt-group ids (>= 1 on a sample's tokens, at most
        ``B * T``), or None (each sequence its own group). Groups must lie whole in the
        arrays given (the learner's step passes the whole batch for ``unit == "group"``).
      apply_weight: False gives weight 1 whatever ``cfg.weight`` (``off_policy="behaviour"``,
        whose PPO ratio already is ``pi / mu``); rejection still applies.
      num_segments: a bound on the ids (exclusive), default ``B * T + 1``: a micro-batch
        passes its whole batch's (:func:`sequence_ids`).

    Returns: :class:`Correction`. Weight: ``clip(exp(level(cfg.weight)), weight_floor,
    weight_cap)`` (1 with ``weight="off"``); a token is rejected when its ``cfg.unit``
    (itself, its sequence, its group) holds a masked token whose ``cfg.reject``-level weight
    lies outside ``[reject_low, reject_high]``.
    """
    m = jnp.asarray(mask, bool)
    ids, n_seg = sequence_ids(m, segment_ids, num_segments)
    if cfg.weight != "off" and apply_weight:
        lw = level_log_weight(log_rho, m, cfg.weight, ids, n_seg)
        w = truncated_weight(lw, cfg.weight_cap, cfg.weight_floor)
        truncated = m & ~in_band(lw, cfg.weight_floor, cfg.weight_cap)
    else:
        w, truncated = jnp.ones(m.shape, jnp.float32), jnp.zeros(m.shape, bool)
    if cfg.reject != "off":
        lw = level_log_weight(log_rho, m, cfg.reject, ids, n_seg)
        fail = m & ~in_band(lw, cfg.reject_low, cfg.reject_high)
        if cfg.unit == "sequence":
            fail = segment_total(fail, ids, n_seg) > 0
        elif cfg.unit == "group":
            gids = ids if group_ids is None else jnp.asarray(group_ids, jnp.int32)
            fail = segment_total(fail, gids, max(n_seg, m.size + 1)) > 0
        rejected = m & fail
    else:
        rejected = jnp.zeros(m.shape, bool)
    keep = m & ~rejected
    return Correction(weight=jnp.where(keep, w, 0.0), keep=keep, rejected=rejected,
                      truncated=truncated)


# --------------------------------------------------------------------------- diagnostics

# token sums, sequence sums (each [len(LAG_BUCKETS)] float32: one entry per lag bucket)
DIAGNOSTIC_SUMS = ("tokens", "kl_k1", "kl_k3", "chi2", "sequences", "log_ppl_diff",
                   "masked_tokens", "truncated_tokens", "masked_seqs", "truncated_seqs")


def lag_buckets(policy_lag, mask):
    """``[B, T, K]`` float32 one-hot of each masked token's lag bucket (``K =
    len(LAG_BUCKETS)``: lag 0, 1, ..., the last bucket everything above); 0 where masked."""
    k = len(LAG_BUCKETS)
    lag = jnp.clip(jnp.asarray(policy_lag, jnp.int32), 0, k - 1)
    return jax.nn.one_hot(lag, k, dtype=jnp.float32) * _f32(jnp.asarray(mask, bool))[..., None]


def mismatch_sums(old_logprobs, behaviour_logprobs, mask, correction: Correction, *,
                  segment_ids=None, policy_lag=None, num_segments: int | None = None) -> dict:
    """Sums of the mismatch diagnostics over one (micro-)batch, per lag bucket.

    With ``d = log pi_old - log mu`` on the masked tokens (samples drawn from ``mu``), per
    token (Schulman 2020, "Approximating KL divergence"; verl's off-policy metrics, the math
    doc's sec. 4): ``kl_k1 = -d`` and ``kl_k3 = exp(d) - 1 - d``, estimators of
    ``KL(mu || pi_old)`` (k3 unbiased and >= 0); ``chi2 = exp(2 d) - 1``, whose mean is the
    chi-square divergence ``E_mu[rho^2] - 1`` (``d`` clipped to +-:data:`MAX_LOG_RATIO`
    first); per sequence ``log_ppl_diff = mean_seq(-log pi_old) - mean_seq(-log mu) =
    -mean_seq(d)``, the log-perplexity of the learner minus the sampler's; and the tokens
    and sequences the correction rejected or truncated (a sequence counts when any of its
    tokens does). Sequence figures are token sums of ``value / |seq|``, so they split over
    micro-batches and devices like the token sums.

    Args:
      old_logprobs, behaviour_logprobs: ``[B, T]`` float ``log pi_old`` and ``log mu``.
      mask: ``[B, T]`` bool loss mask.
      correction: :func:`correct` of the same tokens.
      segment_ids: as :func:`correct`.
      policy_lag: ``[B, T]`` int the sample's staleness (learner version minus its policy
        version) on its tokens, or None (all lag 0).
      num_segments: as :func:`correct`.

    Returns: ``{name: [K] float32}`` for every name in :data:`DIAGNOSTIC_SUMS`, ``K =
    len(LAG_BUCKETS)``; turn them into means with :func:`mismatch_metrics`.
    """
    m = jnp.asarray(mask, bool)
    ids, n_seg = sequence_ids(m, segment_ids, num_segments)
    oh = lag_buckets(jnp.zeros(m.shape, jnp.int32) if policy_lag is None else policy_lag, m)
    old = jnp.where(m, _f32(jax.lax.stop_gradient(old_logprobs)), 0.0)
    mu = jnp.where(m, _f32(behaviour_logprobs), 0.0)
    d = old - mu
    dc = jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    per_seq = _f32(m) / jnp.maximum(segment_total(m, ids, n_seg), 1.0)   # 1 / |seq| per token

    def any_in_seq(x):
        return _f32(segment_total(x, ids, n_seg) > 0)

    token = dict(tokens=jnp.ones(m.shape, jnp.float32),
                 kl_k1=kl_penalty(mu, old, m, "k1"), kl_k3=kl_penalty(mu, old, m, "k3"),
                 chi2=jnp.where(m, jnp.expm1(2.0 * dc), 0.0),
                 masked_tokens=_f32(correction.rejected),
                 truncated_tokens=_f32(correction.truncated),
                 sequences=per_seq,
                 log_ppl_diff=-per_seq * level_log_weight(d, m, "geometric", ids, n_seg),
                 masked_seqs=per_seq * any_in_seq(correction.rejected),
                 truncated_seqs=per_seq * any_in_seq(correction.truncated))
    return {name: jnp.einsum("bt,btk->k", token[name], oh) for name in DIAGNOSTIC_SUMS}


def mismatch_metrics(sums: dict) -> dict:
    """Step metrics from :func:`mismatch_sums` totals: for the whole batch and per lag
    bucket (suffix ``_lag0``, ``_lag1``, ``_lag2plus``: :data:`rlflow.run.metrics.LAG_BUCKETS`)
    ``mismatch/kl_k1``, ``mismatch/kl_k3``, ``mismatch/chi2`` (token means),
    ``mismatch/log_ppl_diff`` (sequence mean), ``rollout_correction/masked_token_frac``,
    ``rollout_correction/truncated_token_frac`` (of the loss tokens),
    ``rollout_correction/masked_seq_frac``, ``rollout_correction/truncated_seq_frac`` (of the
    sequences with loss tokens). An empty bucket gives 0 (``staleness/frac_*`` tells how
    full each is). Works on jnp and numpy arrays alike."""
    out = {}
    names = (("mismatch/kl_k1", "kl_k1", "tokens"), ("mismatch/kl_k3", "kl_k3", "tokens"),
             ("mismatch/chi2", "chi2", "tokens"),
             ("mismatch/log_ppl_diff", "log_ppl_diff", "sequences"),
             ("rollout_correction/masked_token_frac", "masked_tokens", "tokens"),
             ("rollout_correction/truncated_token_frac", "truncated_tokens", "tokens"),
             ("rollout_correction/masked_seq_frac", "masked_seqs", "sequences"),
             ("rollout_correction/truncated_seq_frac", "truncated_seqs", "sequences"))
    for metric, num, den in names:
        n, d = sums[num], sums[den]
        out[metric] = _ratio(n.sum(), d.sum())
        for i, bucket in enumerate(LAG_BUCKETS):
            out[f"{metric}_{bucket}"] = _ratio(n[i], d[i])
    return out


def _ratio(num, den):
    # den counts tokens or sequences (a sum of 1 / |seq| per token: within rounding of an
    # integer), so below 1/2 it is 0
    return jnp.where(den > 0.5, num / jnp.maximum(den, 0.5), 0.0)
