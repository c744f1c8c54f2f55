"""Pure sampling functions against plain numpy oracles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.config import SamplerConfig
from rlflow.control.seeds import derive_seed
from rlflow.sampler.sampling import (SamplingError, SamplingParams, filter_logits,
                                     request_uniforms, sample_tokens)
from tolerances import F32_EPS


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_kept_probs(logits, temperature, top_k, top_p):
    """HF order: temperature, then top-k, then top-p (smallest prefix with mass >= p)."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.ones_like(x, bool)
    if top_k > 0:
        keep[:] = False
        keep[order[:top_k]] = True
    if top_p < 1:
        p = np.exp(np_log_softmax(np.where(keep, x, -np.inf)))
        mass = 0.0
        nucleus = np.zeros_like(keep)
        for i in order:
            if not keep[i]:
                continue
            nucleus[i] = True
            mass += p[i]
            if mass >= top_p:
                break
        keep = nucleus
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    return probs / probs.sum()


def draw(logits, temperature, top_k, top_p, n, seed=0):
    """n independent draws from one row of settings (one uniform per row)."""
    logits = jnp.tile(jnp.asarray(logits, jnp.float32)[None], (n, 1))
    u = jax.random.uniform(jax.random.key(seed), (n,))
    fill = lambda v, dt: jnp.full((n,), v, dt)
    return jax.jit(sample_tokens)(logits, u, fill(temperature, jnp.float32),
                                  fill(top_k, jnp.int32), fill(top_p, jnp.float32))


def test_temperature_logprob_case_from_issue():
    # logits [2, 1, 0] at T = 0.5: tokens 0 / 1 have log_softmax([4, 2, 0]) = -0.14293 / -2.14293.
    tokens, logprobs = draw([2.0, 1.0, 0.0], 0.5, 0, 1.0, n=400)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    assert {0, 1} <= set(tokens.tolist())
    np.testing.assert_allclose(logprobs[tokens == 0], -0.14293, atol=1e-5)
    np.testing.assert_allclose(logprobs[tokens == 1], -2.14293, atol=1e-5)
    oracle = np_log_softmax(np.array([2.0, 1.0, 0.0]) / 0.5)
    np.testing.assert_allclose(logprobs, oracle[tokens], atol=1e-6)
    # Neither the untempered value nor logprob / T.
    assert not np.any(np.isclose(logprobs[tokens == 0], -0.40761, atol=1e-3))
    assert not np.any(np.isclose(logprobs[tokens == 0], -0.81521, atol=1e-3))


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (0.8, 0, 0.6), (1.3, 4, 0.7)])
def test_draw_frequencies_match_numpy_oracle(temperature, top_k, top_p):
    logits = np.array([1.5, 0.2, -0.3, 2.0, 0.9, -1.0, 0.0, 1.1], np.float32)
    n = 6000
    tokens, logprobs = draw(logits, temperature, top_k, top_p, n=n, seed=1)
    tokens = np.asarray(tokens)
    expected = np_kept_probs(logits, temperature, top_k, top_p)
    freq = np.bincount(tokens, minlength=len(logits)) / n
    assert np.all(freq[expected == 0] == 0), "a token outside top-k/top-p was drawn"
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-9), (freq, expected)
    # Reported logprob: untruncated tempered one (the learner's token_logprobs).
    np.testing.assert_allclose(np.asarray(logprobs),
                               np_log_softmax(logits / temperature)[tokens], atol=1e-5)


def test_filter_logits_keeps_exactly_the_oracle_set():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 16)).astype(np.float32) * 2
    t = np.array([1.0, 0.5, 2.0, 1.0, 0.9, 1.0], np.float32)
    k = np.array([0, 5, 0, 1, 3, 16], np.int32)
    p = np.array([0.5, 1.0, 0.9, 1.0, 0.3, 0.99], np.float32)
    out = np.asarray(filter_logits(jnp.asarray(logits), jnp.asarray(t), jnp.asarray(k),
                                   jnp.asarray(p)))
    for b in range(6):
        expected = np_kept_probs(logits[b], t[b], k[b], p[b]) > 0
        np.testing.assert_array_equal(np.isfinite(out[b]), expected, err_msg=f"row {b}")
        # one float32 division each side; XLA may multiply by the reciprocal (two roundings)
        np.testing.assert_allclose(out[b][expected], logits[b][expected] / t[b],
                                   rtol=2 * F32_EPS)


def test_greedy_rows_and_mixed_batch():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 32)).astype(np.float32)
    temps = jnp.array([0.0, 1.0, 0.0, 0.7], jnp.float32)
    u = jax.random.uniform(jax.random.key(3), (4,))
    tok, lp = sample_tokens(jnp.asarray(logits), u, temps, jnp.array([0, 1, 5, 0]),
                            jnp.ones(4))
    tok, lp = np.asarray(tok), np.asarray(lp)
    assert tok[0] == logits[0].argmax() and tok[2] == logits[2].argmax()
    assert tok[1] == logits[1].argmax()          # top_k = 1 is greedy too
    ref = [np_log_softmax(logits[b] / (1.0 if t == 0 else t))[tok[b]]
           for b, t in enumerate(np.asarray(temps))]
    np.testing.assert_allclose(lp, ref, atol=1e-6)
    # Each row is independent of its neighbours: row 3 alone gives the same draw.
    tok3, _ = sample_tokens(jnp.asarray(logits[3:]), u[3:], temps[3:], jnp.array([0]),
                            jnp.ones(1))
    assert int(tok3[0]) == tok[3]


def test_per_request_uniforms_are_reproducible_and_distinct():
    u_a, u_b = np.asarray(request_uniforms(7, 0, 64)), np.asarray(request_uniforms(7, 1, 64))
    np.testing.assert_array_equal(u_a, np.asarray(request_uniforms(7, 0, 64)))
    assert u_a.dtype == np.float32 and ((0 <= u_a) & (u_a < 1)).all()
    assert len(np.unique(u_a)) == 64 and not np.isin(u_a, u_b).any()
    assert not np.isin(u_a, np.asarray(request_uniforms(8, 0, 64))).any()
    # Uniform in [0, 1): a KS-style check on 64 x 200 draws.
    u = np.sort(np.concatenate([np.asarray(request_uniforms(s, 0, 64)) for s in range(200)]))
    assert np.abs(u - (np.arange(u.size) + 0.5) / u.size).max() < 0.02
    logits = jnp.zeros((3, 1000))
    u = jnp.array([u_a[0], u_a[0], u_b[0]])
    tok, _ = sample_tokens(logits, u, jnp.ones(3), jnp.zeros(3, jnp.int32), jnp.ones(3))
    assert tok[0] == tok[1] and tok[0] != tok[2]


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.1, "sampling.temperature"),
    ("top_p", 0.0, "sampling.top_p"),
    ("top_p", 1.5, "sampling.top_p"),
    ("top_k", -1, "sampling.top_k"),
    ("max_tokens", 0, "sampling.max_tokens"),
    ("max_tokens", -3, "sampling.max_tokens"),
    ("stop_token_ids", (-1,), "sampling.stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(field, value, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**{field: value})


def test_params_from_config():
    cfg = SamplerConfig(temperature=0.7, top_k=5, top_p=0.9, max_tokens=12, seed=3)
    sp = SamplingParams.from_config(cfg, seed=11)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens, sp.seed) == (0.7, 5, 0.9, 12, 11)


def test_derive_seed_is_deterministic_32_bit_and_separates_keys():
    seeds = [derive_seed(0, 0, i) for i in range(200)] + [derive_seed(0, 1, i) for i in range(200)]
    assert all(0 <= s < 2**32 for s in seeds) and len(set(seeds)) == 400
    assert derive_seed(0, 0, 5) == derive_seed(0, 0, 5) != derive_seed(1, 0, 5)
    # Unrelated streams: first uniforms of consecutive positions are not close to each other.
    u = np.array([float(request_uniforms(s, 0, 1)[0]) for s in seeds[:200]])
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.2
