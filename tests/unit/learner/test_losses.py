"""Losses, aggregation, KL and the corrected policy loss against plain numpy oracles
(the rollout correction's own oracles: tests/unit/learner/test_rollout_correction.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.config import RolloutCorrectionConfig
from rlflow.learner import losses as L
from rlflow.learner import rollout_correction as rc
from tolerances import sum_tol


def corrected_loss(logp, mu, adv, mask, *, off_policy, old=None, **correction):
    """policy_loss with the rollout correction of ``correction`` (token level), as the
    train step applies it."""
    old_lp = jax.lax.stop_gradient(logp) if old is None else old
    c = rc.correct(jnp.asarray(old_lp) - jnp.asarray(mu), mask,
                   RolloutCorrectionConfig(**correction),
                   apply_weight=off_policy == "decoupled")
    return L.policy_loss(logp, mu, adv, mask, off_policy=off_policy, clip_low=0.2,
                         clip_high=0.28, old_logprobs=old, is_weight=c.weight, keep=c.keep,
                         dual_clip=3.0 if off_policy == "behaviour" else 0.0)

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def np_aggregate(loss, mask, mode, norm_len=None):
    loss, mask = np.asarray(loss, np.float64), np.asarray(mask, bool)
    rows = [(loss[b][mask[b]]) for b in range(loss.shape[0]) if mask[b].any()]
    if not rows:
        return 0.0
    if mode == "token-mean":
        return float(np.concatenate(rows).mean())
    if mode == "seq-mean-token-mean":
        return float(np.mean([r.mean() for r in rows]))
    return float(np.mean([r.sum() / norm_len for r in rows]))


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_oracle_and_splits_exactly(mode):
    rng = np.random.default_rng(0)
    loss = rng.normal(size=(6, 7)).astype(np.float32)
    mask = rng.random((6, 7)) < 0.6
    mask[3] = False                                    # an empty row counts in no denominator
    loss[~mask] = np.nan                               # masked garbage must not leak
    got = float(L.aggregate(loss, mask, mode, norm_len=9))
    # float32 sums over the masked tokens (mixed signs) vs float64: n eps relative to the
    # same aggregate of |loss| (the sum of the absolute terms), plus rows for the row means
    n = int(mask.sum()) + mask.shape[0]
    tol = sum_tol(n, np_aggregate(np.abs(np.where(mask, loss, 0)), mask, mode, 9))
    np.testing.assert_allclose(got, np_aggregate(loss, mask, mode, 9), rtol=0, atol=tol)
    w = L.loss_weights(mask, mode, norm_len=9)         # global weights, split by rows
    parts = [float(jnp.sum(w[s] * np.where(mask[s], loss[s], 0))) for s in (slice(0, 2),
                                                                              slice(2, 6))]
    np.testing.assert_allclose(sum(parts), got, rtol=0, atol=2 * tol)


def test_token_mean_under_micro_batching_case():
    """A: 1 token with loss 1.0; B: 3 tokens with loss 3.0 each."""
    loss = np.array([[1.0, 0, 0], [3.0, 3.0, 3.0]], np.float32)
    mask = np.array([[1, 0, 0], [1, 1, 1]], bool)
    assert float(L.aggregate(loss, mask, "token-mean")) == pytest.approx(2.5)
    assert float(L.aggregate(loss, mask, "seq-mean-token-mean")) == pytest.approx(2.0)
    assert float(L.aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=4)) == \
        pytest.approx((1 + 9) / (2 * 4))
    w = L.loss_weights(mask, "token-mean")
    micro = [float(jnp.sum(w[i] * loss[i])) for i in range(2)]   # micro-batches A and B
    assert sum(micro) == pytest.approx(2.5)
    assert micro != [1.0, 3.0]


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_loss_is_zero_with_finite_zero_grads(mode):
    x = jnp.ones((2, 3))
    mask = np.zeros((2, 3), bool)
    val, grad = jax.value_and_grad(lambda x: L.aggregate(x * 2.0, mask, mode, norm_len=3))(x)
    assert float(val) == 0.0
    assert np.all(np.asarray(grad) == 0.0)


def test_aggregate_errors():
    with pytest.raises(ValueError, match="norm_len"):
        L.loss_weights(np.ones((1, 2)), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        L.loss_weights(np.ones((1, 2)), "sum")
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        L.loss_weights(np.ones(3), "token-mean")


# --------------------------------------------------------------------------- KL

def np_kl(logp, ref, est):
    d = np.asarray(ref, np.float64) - np.asarray(logp, np.float64)
    return {"k1": -d, "k2": d * d / 2, "k3": np.expm1(d) - d}[est]


def np_kl_tol(logp, ref, est):
    """Per-token bound on |float32 kl_penalty - float64 oracle| (tests/tolerances.py model):
    ``sum_tol(n, scale)`` with ``n`` the float32 roundings along the estimator and ``scale``
    the magnitude they are relative to. ``d = ref - logp`` rounds once (relative), which
    ``k`` carries as ``|k'(d)| |d|``: k1 ``|d|``; k2 (``d * d``: d's rounding twice, the
    product once) ``d^2 / 2``; k3 for ``|d| < 0.1`` the series (11 roundings in its constants
    and Horner steps + d's twice) ``d^2 / 2`` times ``1 + |d|``, above that ``expm1(d) - d``
    (d's rounding, expm1's, the subtraction) relative to its operands ``|expm1 d| + |d|``
    plus d's rounding through ``exp``: ``|d| e^d``."""
    d = np.asarray(ref, np.float64) - np.asarray(logp, np.float64)
    if est == "k1":
        return sum_tol(1, np.abs(d))
    if est == "k2":
        return sum_tol(3, d * d / 2)
    small = sum_tol(13, d * d / 2 * (1 + np.abs(d)))
    large = sum_tol(3, np.abs(np.expm1(d)) + np.abs(d) + np.abs(d) * np.exp(d))
    return np.where(np.abs(d) < 0.1, small, large)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_match_oracle(est):
    rng = np.random.default_rng(1)
    logp = rng.normal(size=(3, 8)).astype(np.float32) - 2
    ref = logp + rng.normal(scale=[[1e-3], [0.05], [2.0]], size=(3, 8)).astype(np.float32)
    got = L.kl_penalty(logp, ref, np.ones((3, 8), bool), est)
    err = np.abs(np.asarray(got, np.float64) - np_kl(logp, ref, est))
    tol = np_kl_tol(logp, ref, est)
    assert np.all(err <= tol), f"{est}: |err| / tol up to {np.max(err / tol):.3g}"


@pytest.mark.parametrize("d", [1e-6, -3e-6])
def test_k3_tiny_log_ratio_float32(d):
    logp = np.zeros((1, 1), np.float32)
    ref = np.full((1, 1), d, np.float32)
    kl = float(L.kl_penalty(logp, ref, np.ones((1, 1), bool), "k3")[0, 0])
    d32 = float(np.float32(d))
    assert kl >= 0
    assert abs(kl - d32 * d32 / 2) <= 0.01 * d32 * d32 / 2


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_masked_nan_gives_finite_mean_and_grads(est):
    mask = np.array([[True, False]])
    ref = jnp.array([[-1.1, -1.0]])
    want = float(np_kl([[-1.0]], [[-1.1]], est)[0, 0])

    def f(logp):
        return L.aggregate(L.kl_penalty(logp, ref, mask, est), mask, "token-mean")

    val, grad = jax.value_and_grad(f)(jnp.array([[-1.0, jnp.nan]]))
    # -1.1 rounded to float32, then a handful of float32 operations (difference, exp, one
    # division by the token count) on values of magnitude <= 1 + |ref|: each rounds by eps
    # relative to that scale
    atol = sum_tol(4, 1.0 + 1.1)
    np.testing.assert_allclose(float(val), want, rtol=0, atol=atol)
    if est == "k1":
        np.testing.assert_allclose(float(val), 0.1, rtol=0, atol=atol)
    assert np.all(np.isfinite(grad)) and float(grad[0, 1]) == 0.0


def test_kl_huge_log_ratio_is_finite():
    logp = jnp.array([[-200.0, 0.0]])
    ref = jnp.array([[0.0, -200.0]])
    val, grad = jax.value_and_grad(lambda x: jnp.sum(L.kl_penalty(x, ref, np.ones((1, 2)), "k3"))
                                   )(logp)
    assert np.isfinite(float(val)) and np.all(np.isfinite(grad))


# ---------------------------------------------------------- corrected policy loss

@pytest.mark.parametrize("mode", ["decoupled", "behaviour"])
def test_is_window_masks_huge_log_ratio(mode):
    """log-ratio [1000, 0], advantage 1, window [0.5, 5]: weights [0, 1], loss -0.5,
    gradient [0, -0.5], all finite."""
    behaviour = jnp.array([[-1001.5, -1.5]])
    mask = np.ones((1, 2), bool)

    def f(logp):
        t = corrected_loss(logp, behaviour, jnp.ones((1, 2)), mask, off_policy=mode,
                           weight_cap=10.0, reject="token", reject_low=0.5, reject_high=5.0)
        return L.aggregate(t.loss, mask, "token-mean"), t

    (val, terms), grad = jax.value_and_grad(f, has_aux=True)(jnp.array([[-1.5, -1.5]]))
    np.testing.assert_allclose(terms.is_weight, [[0.0, 1.0]])
    np.testing.assert_array_equal(terms.kept, [[False, True]])
    # ratio exp(0) = 1 and weights 0 / 1 are exact; the mean over 2 tokens rounds once
    np.testing.assert_allclose(float(val), -0.5, rtol=sum_tol(2))
    np.testing.assert_allclose(grad, [[0.0, -0.5]], rtol=sum_tol(2))
    assert np.all(np.isfinite(grad))


def np_surrogate(r, a, lo, hi, dual):
    l1, l2 = -a * r, -a * np.clip(r, 1 - lo, 1 + hi)
    loss = np.maximum(l1, l2)
    if dual:
        loss = np.where(a < 0, np.minimum(loss, -dual * a), loss)
    return loss


@pytest.mark.parametrize("dual", [0.0, 3.0])
def test_clipped_surrogate_matches_oracle(dual):
    r = np.array([0.5, 0.79, 0.81, 1.0, 1.27, 1.29, 2.0, 5.0] * 2, np.float32)
    a = np.array([1.0] * 8 + [-1.0] * 8, np.float32)
    loss, lo, hi, du = L.clipped_surrogate(r, a, clip_low=0.2, clip_high=0.28, dual_clip=dual)
    # a = +-1 and max/min/clip are exact; only the clip bounds 1 - 0.2, 1 + 0.28 round (once
    # each side, float64 -> float32 here, float32 arithmetic there)
    np.testing.assert_allclose(loss, np_surrogate(r, a, 0.2, 0.28, dual), rtol=sum_tol(2))
    np.testing.assert_array_equal(lo, (r < 0.8) & (a < 0))
    np.testing.assert_array_equal(hi, (r > 1.28) & (a > 0))
    np.testing.assert_array_equal(du, (a < 0) & (r > dual) if dual else np.zeros(16, bool))


def test_decoupled_policy_loss_matches_oracle():
    rng = np.random.default_rng(2)
    shape = (3, 5)
    logp = rng.normal(size=shape).astype(np.float32) - 1
    old = logp + rng.normal(scale=0.3, size=shape).astype(np.float32)
    mu = old + rng.normal(scale=2.0, size=shape).astype(np.float32)
    adv = np.repeat(rng.normal(size=(3, 1)), 5, 1).astype(np.float32)
    mask = rng.random(shape) < 0.8
    t = corrected_loss(logp, mu, adv, mask, off_policy="decoupled", old=old, weight_cap=2.0,
                       reject="token", reject_low=0.1, reject_high=8.0)
    r = np.exp(logp.astype(np.float64) - old)
    w_raw = np.exp(old.astype(np.float64) - mu)
    keep = mask & (w_raw >= 0.1) & (w_raw <= 8.0)
    w = np.where(keep, np.minimum(w_raw, 2.0), 0)
    want = np.where(keep, w * np_surrogate(r, adv, 0.2, 0.28, 0), 0)
    # float32 vs the float64 oracle: each log-ratio difference rounds by eps relative to
    # |a| + |b|, which exp turns into that relative error of the ratio / weight; the weight
    # times the surrogate adds a few roundings more
    scale = float(np.max(np.abs(logp) + 2 * np.abs(old) + np.abs(mu))) + 3.0
    np.testing.assert_allclose(t.loss, want, rtol=sum_tol(1, scale))
    np.testing.assert_allclose(t.is_weight, w, rtol=sum_tol(1, scale))
    assert keep.sum() < mask.sum()                     # the window really masked something
    assert np.any(keep & (w_raw > 2.0))                # and the cap really truncated something


def test_policy_gradient_sign_and_value_on_policy():
    """On-policy (old = current = behaviour): d loss / d logp_t = -A_t / N (token-mean)."""
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    adv = jnp.array([[2.0, 2.0, -1.0]])
    mask = np.array([[True, True, True]])

    def f(lp):
        t = L.policy_loss(lp, logp, adv, mask, off_policy="decoupled", clip_low=0.2,
                          clip_high=0.2, is_weight=jnp.ones((1, 3)))
        return L.aggregate(t.loss, mask, "token-mean")

    # ratios exp(0) = 1 exactly; the token mean over 3 tokens rounds a few times
    np.testing.assert_allclose(jax.grad(f)(logp), -np.asarray(adv) / 3, rtol=sum_tol(3))


def test_entropy_matches_oracle():
    z = np.random.default_rng(3).normal(size=(2, 3, 11)).astype(np.float32) * 3
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    # two float32 programs: log-sum-exp and a sum of 11 terms p * z each, every rounding
    # relative to the logits' magnitude (up to max |z|)
    np.testing.assert_allclose(L.entropy_from_logits(z), -(p * np.log(p)).sum(-1), rtol=0,
                               atol=sum_tol(2 * (11 + 2), float(np.abs(z).max())))


@pytest.mark.parametrize("clip", [0.0, 0.2])
def test_value_loss_matches_oracle(clip):
    rng = np.random.default_rng(4)
    v, vo, ret = (rng.normal(size=(2, 4)).astype(np.float32) for _ in range(3))
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    want = (v - ret) ** 2
    if clip:
        want = np.maximum(want, (vo + np.clip(v - vo, -clip, clip) - ret) ** 2)
    # a few float32 operations on each side: differences round relative to the operands'
    # magnitudes, squared (scale: the largest squared operand sum)
    scale = float(np.max((np.abs(v) + np.abs(vo) + np.abs(ret) + clip) ** 2))
    np.testing.assert_allclose(L.value_loss(v, vo, ret, mask, clip=clip),
                               np.where(mask, 0.5 * want, 0), rtol=0, atol=sum_tol(4, scale))


def test_behaviour_policy_loss_matches_oracle():
    """Ratio directly against the sampler: r = pi / mu, PPO-clipped, window on r, no weight."""
    rng = np.random.default_rng(5)
    shape = (4, 6)
    logp = rng.normal(size=shape).astype(np.float32) - 1
    mu = logp + rng.normal(scale=0.5, size=shape).astype(np.float32)
    adv = np.repeat(rng.normal(size=(4, 1)), 6, 1).astype(np.float32)
    mask = rng.random(shape) < 0.8
    t = corrected_loss(logp, mu, adv, mask, off_policy="behaviour", weight_cap=2.0,
                       reject="token", reject_low=0.5, reject_high=2.0)
    r = np.exp(logp.astype(np.float64) - mu)
    keep = mask & (r >= 0.5) & (r <= 2.0)
    want = np.where(keep, np_surrogate(r, adv, 0.2, 0.28, 3.0), 0)
    # the log-ratio difference rounds by eps relative to |logp| + |mu|, which exp turns into
    # that relative error of the ratio; the surrogate adds a few roundings (float64 oracle)
    scale = float(np.max(np.abs(logp) + np.abs(mu))) + 3.0
    np.testing.assert_allclose(t.loss, want, rtol=sum_tol(1, scale))
    np.testing.assert_array_equal(t.clipped_high, keep & (r > 1.28) & (adv > 0))
    np.testing.assert_array_equal(t.clipped_low, keep & (r < 0.8) & (adv < 0))
    assert (keep & ((r > 1.28) | (r < 0.8))).any() and keep.sum() < mask.sum()
    np.testing.assert_array_equal(t.is_weight, keep.astype(np.float32))
