"""The train step's metrics, grouped per feature: each group owns the names of its sums (the
numerators accumulated over micro-batches in float32, :func:`rlflow.learner.grad.make_grad_fn`)
and turns the step's totals into its metrics (:func:`rlflow.learner.step.make_train_step`).

=========  =====================================================  ==========================
group      sums (per micro-batch)                                  metrics
=========  =====================================================  ==========================
policy     loss, KL, entropy, clipped tokens, IS weights           ``learner/pg_loss``,
                                                                   ``policy/*``
mismatch   rollout-correction diagnostics per lag bucket           ``mismatch/*``,
                                                                   ``rollout_correction/*``
moe        router agreement, ``|log pi_old - log mu|``, aux loss  ``moe/*``
value      value loss, ``V_old``, returns, residuals (PPO)         ``value/*``
=========  =====================================================  ==========================

Every function is pure; sums are float32 scalars (the mismatch ones ``[K]``, one per
policy-lag bucket of :data:`rlflow.run.metrics.LAG_BUCKETS`).
"""

from __future__ import annotations

import jax.numpy as jnp

from rlflow.learner import rollout_correction as rc
from rlflow.run.metrics import LAG_BUCKETS

# the clipped surrogate's terms (rlflow.learner.losses.policy_loss) summed over loss tokens
POLICY_SUMS = ("pg_loss", "kl", "entropy", "clip_low", "clip_high", "clip_dual", "is_weight",
               "is_kept", "effective")
# the mismatch diagnostics' sums, each [len(LAG_BUCKETS)] (rlflow.learner.rollout_correction)
MISMATCH_SUMS = tuple(f"mismatch/{n}" for n in rc.DIAGNOSTIC_SUMS)
# mixture-of-experts models (batches with routing_ids): router agreement terms and the token
# sum of |log pi_old - log mu| (rlflow.learner.routing_replay); zeros for dense models
MOE_SUMS = ("moe_agree", "moe_routed", "moe_gap")
# PPO: value loss; token sums of V_old, returns R, R^2, residual R - V_old and its square
VALUE_SUMS = ("value_loss", "v_old", "ret", "ret_sq", "res", "res_sq")


def sum_names(gae: bool, moe_aux: bool) -> tuple[str, ...]:
    """The names a step accumulates: every group's, the value group's with ``gae``, and the
    MoE load-balancing loss ``moe_aux`` with ``moe_aux``."""
    return (POLICY_SUMS + MISMATCH_SUMS + MOE_SUMS + (VALUE_SUMS if gae else ())
            + (("moe_aux",) if moe_aux else ()))


def zero_sums(names: tuple[str, ...]) -> dict:
    """The accumulator at the step start: a float32 zero for each of ``names`` and for
    ``loss`` (the mismatch sums ``[len(LAG_BUCKETS)]``), and the running extremes of the IS
    log-ratio ``is_lr_max = -inf``, ``is_lr_min = +inf``."""
    return {n: jnp.zeros((), jnp.float32) for n in names + ("loss",)} | {
        n: jnp.zeros((len(LAG_BUCKETS),), jnp.float32) for n in MISMATCH_SUMS} | {
        "is_lr_max": jnp.array(-jnp.inf, jnp.float32),
        "is_lr_min": jnp.array(jnp.inf, jnp.float32)}


def policy_sums(pg, kl, entropy, terms, mask, weight) -> dict:
    """The policy group of one micro-batch.

    Args:
      pg: float32 ``[]`` the micro-batch's aggregated policy-gradient loss.
      kl, entropy: float32 ``[B, L]`` per-token KL penalty and policy entropy.
      terms: :func:`rlflow.learner.losses.policy_loss`'s result (clip indicators ``[B, L]``,
        ``kept`` and ``is_weight`` ``[B, L]``).
      mask: ``[B, L]`` bool loss mask.
      weight: float32 ``[B, L]`` the loss aggregation weight (0 off the loss mask).
    """
    m = mask.astype(jnp.float32)
    kept = terms.kept.astype(jnp.float32)
    return dict(pg_loss=pg, kl=jnp.sum(m * kl), entropy=jnp.sum(m * entropy),
                clip_low=jnp.sum(terms.clipped_low), clip_high=jnp.sum(terms.clipped_high),
                clip_dual=jnp.sum(terms.dual_clipped), is_weight=jnp.sum(kept * terms.is_weight),
                is_kept=jnp.sum(kept),
                # tokens whose policy-loss weight is not zero: loss mask x aggregation weight x
                # the correction's keep mask and weight (the step's skip test)
                effective=jnp.sum((weight * terms.is_weight) > 0))


def is_log_ratio_extremes(old_logp, behaviour_logp, mask):
    """``(max, min)`` over loss tokens of the IS log-ratio ``log pi_old - log mu``, float32
    ``[]`` each (``-inf`` / ``+inf`` without loss tokens)."""
    is_lr = old_logp - behaviour_logp
    return (jnp.max(jnp.where(mask, is_lr, -jnp.inf)),
            jnp.min(jnp.where(mask, is_lr, jnp.inf)))


def policy_metrics(acc: dict, n_tok) -> dict:
    """``learner/pg_loss``; ``policy/kl``, ``policy/entropy`` (token means),
    ``policy/clip_frac_low|high|dual`` (fractions of loss tokens), ``policy/is_weight_mean``
    (applied weight over kept tokens), ``policy/is_weight_min|max`` (untruncated token ratio
    over loss tokens, 1 without loss tokens) from the step's totals ``acc`` and its loss-token
    count ``n_tok`` (float32 ``[]``)."""
    per_tok = 1.0 / jnp.maximum(n_tok, 1.0)
    any_tok = n_tok > 0
    return {
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
    }


def mismatch_sums(old_logp, mb, corr: rc.Correction, num_segments=None) -> dict:
    """The mismatch group of one micro-batch ``mb`` (a :class:`rlflow.learner.batch.TrainBatch`)
    under its rollout correction ``corr``: :func:`rlflow.learner.rollout_correction.mismatch_sums`
    with each name prefixed ``mismatch/``, ``[len(LAG_BUCKETS)]`` each."""
    diag = rc.mismatch_sums(old_logp, mb.behaviour_logprobs, mb.loss_mask, corr,
                            segment_ids=mb.segment_ids, policy_lag=mb.policy_lag,
                            num_segments=num_segments)
    return {f"mismatch/{n}": v for n, v in diag.items()}


def mismatch_metrics(acc: dict) -> dict:
    """``mismatch/*`` and ``rollout_correction/*`` for the batch and per lag bucket
    (:func:`rlflow.learner.rollout_correction.mismatch_metrics`)."""
    return rc.mismatch_metrics({n: acc[f"mismatch/{n}"] for n in rc.DIAGNOSTIC_SUMS})


def moe_sums(agreement, aux, old_logp, behaviour_logp, mask, micro_batches: int) -> dict:
    """The mixture-of-experts group of one micro-batch.

    Args:
      agreement: float32 ``[2]`` (agreeing token-layers, token-layers with a recorded choice;
        :class:`rlflow.learner.forward.PolicyOutputs`), or None (dense model: zeros).
      aux: float32 ``[]`` the forward's load-balancing loss, or None (not computed: no
        ``moe_aux`` entry); weighted ``1 / micro_batches`` so the step's sum is the mean.
      old_logp, behaviour_logp: float32 ``[B, L]``; mask ``[B, L]`` bool.
    """
    zero = jnp.zeros((), jnp.float32)
    m = mask.astype(jnp.float32)
    sums = dict(moe_agree=zero, moe_routed=zero, moe_gap=zero) if agreement is None else dict(
        moe_agree=agreement[0], moe_routed=agreement[1],
        moe_gap=jnp.sum(m * jnp.abs(old_logp - behaviour_logp)))
    if aux is not None:
        sums["moe_aux"] = aux / micro_batches
    return sums


def moe_metrics(acc: dict, n_tok, *, aux: bool, routed: bool) -> dict:
    """``moe/aux_loss`` (with ``aux``: the load-balancing loss, mean over micro-batches);
    with ``routed`` (the batch had ``routing_ids``) ``moe/router_agreement`` (fraction of the
    token-layers with a recorded expert choice whose own top-k set equals it) and
    ``moe/logprob_gap`` (token mean of ``|log pi_old - log mu|``)."""
    out = {"moe/aux_loss": acc["moe_aux"]} if aux else {}
    if routed:
        out |= {"moe/router_agreement": acc["moe_agree"] / jnp.maximum(acc["moe_routed"], 1.0),
                "moe/logprob_gap": acc["moe_gap"] * (1.0 / jnp.maximum(n_tok, 1.0))}
    return out


def value_sums(value_loss, v_old, returns, mask) -> dict:
    """The PPO value group of one micro-batch: ``value_loss`` (float32 ``[]``, aggregated like
    the policy loss) and token sums of ``V_old``, ``R``, ``R^2``, ``R - V_old`` and its square
    (``v_old``, ``returns`` float32 ``[B, L]``; ``mask`` ``[B, L]`` bool)."""
    m = mask.astype(jnp.float32)
    res = returns - v_old
    return dict(value_loss=value_loss, v_old=jnp.sum(m * v_old), ret=jnp.sum(m * returns),
                ret_sq=jnp.sum(m * returns ** 2), res=jnp.sum(m * res),
                res_sq=jnp.sum(m * res ** 2))


def value_metrics(acc: dict, n_tok) -> dict:
    """``value/loss``, ``value/mean`` and ``value/return_mean`` (token means of ``V_old`` and
    of the returns), ``value/explained_variance`` ``1 - Var(R - V_old) / Var(R)`` over
    response tokens (0 when the returns have no variance)."""
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
