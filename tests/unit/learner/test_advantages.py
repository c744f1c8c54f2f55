"""Advantages and reward shaping against plain numpy oracles (float64) on small exact inputs."""

import numpy as np
import pytest

from rlflow.learner import advantages as A
from tolerances import F32_EPS, sum_tol


def np_grpo(r, floor=1e-6):
    r = np.asarray(r, np.float64)
    d = r - r.mean(1, keepdims=True)
    return d / (r.std(1, ddof=1, keepdims=True) + floor)


def np_rloo(r):
    r = np.asarray(r, np.float64)
    n, g = r.shape
    out = np.zeros_like(r)
    for i in range(n):
        for j in range(g):
            others = [r[i, k] for k in range(g) if k != j]
            out[i, j] = r[i, j] - sum(others) / len(others)
    return out


@pytest.fixture
def rewards():
    return np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)


def test_grpo_matches_oracle(rewards):
    np.testing.assert_allclose(A.group_advantages(rewards, estimator="grpo"), np_grpo(rewards),
                               rtol=1e-5, atol=1e-6)


def test_drgrpo_matches_oracle(rewards):
    want = rewards - rewards.astype(np.float64).mean(1, keepdims=True)
    np.testing.assert_allclose(A.group_advantages(rewards, estimator="drgrpo"), want, atol=1e-6)


def test_rloo_matches_oracle(rewards):
    np.testing.assert_allclose(A.group_advantages(rewards, estimator="rloo"), np_rloo(rewards),
                               atol=1e-6)
    scaled = np_rloo(rewards) / (rewards.astype(np.float64).std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(A.group_advantages(rewards, estimator="rloo", scale_by_std=True),
                               scaled, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("group", [[1.0, 1.0, 1.0, 1.0], [0.35] * 7])
def test_equal_rewards_give_exact_zero(estimator, group):
    r = np.asarray([group, np.arange(len(group))], np.float32)
    adv = np.asarray(A.group_advantages(r, estimator=estimator))
    assert np.all(adv[0] == 0.0), adv[0]
    assert np.all(np.isfinite(adv))
    assert np.any(adv[1] != 0.0)


def test_rloo_lone_zero_among_equal_rewards():
    r = np.asarray([[0.35] * 7 + [0.0]], np.float32)
    raw = np.asarray(A.group_advantages(r, estimator="rloo"))[0]
    np.testing.assert_allclose(raw[-1], -0.35, atol=1e-6)
    np.testing.assert_allclose(raw[:-1], 0.35 - 0.30, atol=1e-6)
    scaled = np.asarray(A.group_advantages(r, estimator="rloo", scale_by_std=True))[0]
    assert np.all(np.isfinite(scaled)) and np.max(np.abs(scaled)) <= 3.0, scaled
    np.testing.assert_allclose(scaled, np_rloo(r)[0] / (r.astype(np.float64).std(ddof=1) + 1e-6),
                               rtol=1e-5)


def test_flat_groups_and_group_size_errors():
    r = np.arange(8, dtype=np.float32)
    np.testing.assert_allclose(A.flat_group_advantages(r, 4, estimator="drgrpo"),
                               [-1.5, -0.5, 0.5, 1.5] * 2, atol=1e-6)
    with pytest.raises(ValueError, match="group_size 3 does not divide the batch of 8"):
        A.flat_group_advantages(r, 3)
    with pytest.raises(ValueError, match="needs group_size >= 2"):
        A.group_advantages(np.ones((2, 1)), estimator="grpo")
    with pytest.raises(ValueError, match="drgrpo means no std"):
        A.group_advantages(np.ones((2, 2)), estimator="drgrpo", scale_by_std=True)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_reward_names_the_sample(bad):
    r = np.zeros((3, 4), np.float32)
    r[1, 2] = bad
    with pytest.raises(ValueError, match="group 1, sample 2"):
        A.group_advantages(r)


def test_zero_truncated_rewards_touches_only_truncated():
    out = A.zero_truncated_rewards([1.0, 0.0, 1.0, 1.0], [False, False, True, False])
    np.testing.assert_array_equal(out, [1.0, 0.0, 0.0, 1.0])


def test_overlong_penalty_piecewise():
    lengths = np.array([3, 6, 7, 8, 10, 12])
    L, cache = 10, 4

    def oracle(n):
        if n <= L - cache:
            return 0.0
        if n <= L:
            return ((L - cache) - n) / cache
        return -1.0

    want = [0.5 * oracle(n) for n in lengths]
    # float32 against the float64 oracle: (start - n) is exact (small integers), then at most
    # 4 roundings of eps/2 each (the division, or reciprocal and product if XLA rewrites it;
    # float32(factor); the product) on a result of magnitude <= factor (tests/tolerances.py)
    np.testing.assert_allclose(A.overlong_penalty(lengths, max_tokens=L, buffer=cache, factor=0.5),
                               want, rtol=0, atol=sum_tol(4, 0.5, F32_EPS / 2))
    np.testing.assert_allclose(want, [0, 0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="overlong buffer"):
        A.overlong_penalty(lengths, max_tokens=4, buffer=5)


def test_dynamic_sampling_filter():
    r = np.array([[1, 1, 1], [0, 1, 0], [0.35, 0.35, 0.35], [0, 0, 1e-3]], np.float32)
    np.testing.assert_array_equal(A.groups_with_signal(r), [False, True, False, True])


def np_gae_contiguous(r, v, gamma, lam):
    """Textbook GAE on one episode (Schulman et al. 2016, eq. 16): 1-D, every token valid."""
    adv, last = np.zeros(len(r)), 0.0
    for t in reversed(range(len(r))):
        v_next = v[t + 1] if t + 1 < len(r) else 0.0
        last = r[t] + gamma * v_next - v[t] + gamma * lam * last
        adv[t] = last
    return adv


def np_gae(r, v, m, gamma, lam):
    """GAE over the sampled tokens: each row compressed to its valid tokens, the textbook
    recursion on that sequence, the result scattered back (0 elsewhere)."""
    r, v = np.asarray(r, np.float64), np.asarray(v, np.float64)
    adv = np.zeros(r.shape)
    for i in range(r.shape[0]):
        idx = np.flatnonzero(m[i])
        adv[i, idx] = np_gae_contiguous(r[i, idx], v[i, idx], gamma, lam)
    return adv, (adv + v) * m


def test_gae_matches_oracle():
    rng = np.random.default_rng(1)
    m = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    r = rng.normal(size=m.shape).astype(np.float32)
    v = rng.normal(size=m.shape).astype(np.float32)
    adv, ret = A.gae(r, v, m, gamma=0.9, lam=0.8)
    want_adv, want_ret = np_gae(r, v * m, m, 0.9, 0.8)
    np.testing.assert_allclose(adv, want_adv, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, atol=1e-5)


def test_gae_skips_environment_tokens_issue_44_example():
    """One multi-turn row: mask 1 1 1 0 0 0 1 1 (three environment tokens between the turns),
    reward 1 on the last token, gamma 1, lambda 0.95 (issue 44)."""
    m = np.array([[1, 1, 1, 0, 0, 0, 1, 1]], bool)
    v = np.array([[0.3, -0.2, 0.5, 7.0, -3.0, 2.0, 0.1, 0.4]], np.float32)   # env: ignored
    r = A.terminal_rewards(np.array([1.0]), m)
    adv, ret = A.gae(r, v, m, gamma=1.0, lam=0.95)
    want_adv, want_ret = np_gae(np.asarray(r), v, m, 1.0, 0.95)
    tol = sum_tol(8, scale=4.0)     # >= sum of |r| + |V| along the row
    np.testing.assert_allclose(adv, want_adv, atol=tol)
    np.testing.assert_allclose(ret, want_ret, atol=tol)
    np.testing.assert_allclose(np.asarray(adv)[0, :3], [0.550, 1.105, 0.427], atol=5e-4)
    np.testing.assert_allclose(np.asarray(adv)[0, 6:], [0.87, 0.6], atol=5e-4)
    np.testing.assert_array_equal(np.asarray(adv)[0, 3:6], 0.0)
    # the old recursion (episode ends at the first gap) gave [-0.286, 0.225, -0.5] here
    assert not np.allclose(np.asarray(adv)[0, :3], [-0.286, 0.225, -0.5], atol=1e-2)


def test_gae_over_random_gapped_masks_matches_the_compressed_oracle_under_jit():
    import jax

    rng = np.random.default_rng(3)
    m = rng.random((6, 24)) < 0.6
    m[0] = False                                   # a row without sampled tokens
    m[1] = np.arange(24) < 10                      # contiguous (single-turn)
    r = rng.normal(size=m.shape).astype(np.float32)
    v = rng.normal(size=m.shape).astype(np.float32)
    adv, ret = jax.jit(lambda r, v, m: A.gae(r, v, m, gamma=0.9, lam=0.8))(r, v, m)
    want_adv, want_ret = np_gae(r, np.where(m, v, 0.0), m, 0.9, 0.8)
    tol = sum_tol(24, scale=float(np.abs(r).max() + 2 * np.abs(v).max()))
    np.testing.assert_allclose(adv, want_adv, atol=tol)
    np.testing.assert_allclose(ret, want_ret, atol=tol)
    np.testing.assert_array_equal(np.asarray(adv)[~m], 0.0)


def test_gae_terminal_reward_monte_carlo():
    """gamma = lam = 1 with the reward on the last token: A_t = R - V_t."""
    m = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    r = A.terminal_rewards(np.array([2.0, -1.0]), m)
    np.testing.assert_array_equal(r, [[0, 0, 2, 0], [-1, 0, 0, 0]])
    v = np.array([[0.5, 1.0, 1.5, 9.0], [0.25, 9.0, 9.0, 9.0]], np.float32)
    adv, ret = A.gae(r, v, m, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [[1.5, 1.0, 0.5, 0], [-1.25, 0, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(ret, [[2, 2, 2, 0], [-1, 0, 0, 0]], atol=1e-6)


# ----------------------------------------------------------------------------- failed samples

def np_group_advantages_over(r, valid, estimator):
    """Oracle: each group's formula run on its valid samples alone (the failed ones removed
    from the group, advantage 0)."""
    r = np.asarray(r, np.float64)
    out = np.zeros_like(r)
    for n in range(r.shape[0]):
        idx = np.flatnonzero(valid[n])
        if not idx.size:
            continue
        sub = r[n, idx][None]
        if estimator == "grpo":
            out[n, idx] = np_grpo(sub)[0] if idx.size >= 2 else 0.0
        elif estimator == "rloo":
            out[n, idx] = np_rloo(sub)[0] if idx.size >= 2 else 0.0
        else:
            out[n, idx] = sub[0] - sub[0].mean()
    return out


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("xp", ["jnp", "np"])
def test_failed_samples_have_no_weight_in_the_group_baseline(estimator, xp):
    rng = np.random.default_rng(5)
    r = rng.normal(size=(5, 4)).astype(np.float32)
    valid = np.ones((5, 4), bool)
    valid[0, 1] = False                         # one environment crash
    valid[1, [0, 3]] = False                    # two
    valid[2, 1:] = False                        # a lone survivor: no baseline, 0
    valid[3, :] = False                         # every sample failed
    r[~valid] = rng.normal(size=(~valid).sum()) * 100.0   # must not leak into the others
    kw = dict(estimator=estimator, valid=valid)
    got = A.group_advantages(r, **kw) if xp == "jnp" else A.group_advantages(r, xp=np, **kw)
    want = np_group_advantages_over(r, valid, estimator)
    np.testing.assert_allclose(got, want, atol=sum_tol(4, scale=4 * float(np.abs(r[valid]).max())))
    assert (np.asarray(got)[~valid] == 0).all()
    # all valid: the same advantages as without the argument
    all_valid = A.group_advantages(r, estimator=estimator, valid=np.ones_like(valid))
    np.testing.assert_allclose(all_valid, A.group_advantages(r, estimator=estimator),
                               atol=sum_tol(4, 10.0))


def test_equal_valid_rewards_give_exactly_zero_and_signal_ignores_failed():
    r = np.array([[0.35, 0.0, 0.35, 0.35], [1.0, 0.0, 1.0, 1.0]], np.float32)
    valid = np.array([[True, False, True, True], [True, True, True, True]])
    adv = np.asarray(A.group_advantages(r, valid=valid))
    assert (adv[0] == 0).all() and (adv[1] != 0).all()
    np.testing.assert_array_equal(A.groups_with_signal(r, xp=np, valid=valid), [False, True])
    np.testing.assert_array_equal(A.groups_with_signal(r, valid=valid), [False, True])
    np.testing.assert_array_equal(A.groups_with_signal(r, xp=np), [True, True])
