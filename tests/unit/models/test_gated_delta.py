"""The gated delta rule (rlflow.models.gated_delta) and the short causal conv
(rlflow.models.causal_conv) against plain numpy oracles written from the paper's equations
(Yang, Kautz & Hatamizadeh 2024, eq. 10), in float64.

Tolerance (tests/tolerances.py's rounding model): the per-token map ``M -> M alpha (I - beta k
k^T)`` is non-expansive in the 2-norm (``||k|| <= 1`` after the L2 norm, ``beta in (0, 1)``,
``alpha <= 1``), so a rounding error made at one step is not amplified at later steps; each
step adds at most ``(d_k + 4) eps ||M||_F`` (the ``d_k``-term read ``M k``, then four
elementwise operations), the chunked form also its in-chunk sums (the triangular solve and
``A v'``, ``C`` terms each). Over ``T`` tokens a float32 output ``o_t = M_t q_t`` is within
``chain * eps * max_t ||M_t||_F * ||q||`` of the exact value with
``chain = T (d_k + 2 C + 4) + d_k`` (the last ``d_k`` the L2 norms); two float32 forms are
within twice that of each other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.models import causal_conv, gated_delta as gd
from tolerances import F32_EPS


# The forms run jitted, as the learner and the sampler run them: one compile per shape.
# Called eagerly, JAX dispatches (and compiles) every operation on its own: about 1,100
# compiles for this file.
STATIC = ("qk_l2norm", "precision")
recurrent_rule = jax.jit(gd.recurrent_gated_delta_rule, static_argnames=STATIC)
chunk_rule = jax.jit(gd.chunk_gated_delta_rule, static_argnames=("chunk_size",) + STATIC)
delta_step = jax.jit(gd.gated_delta_step, static_argnames=STATIC)
lower_inverse = jax.jit(gd.unit_lower_inverse)
conv1d = jax.jit(causal_conv.causal_conv1d)
conv1d_step = jax.jit(causal_conv.causal_conv1d_step)

def oracle(q, k, v, g, beta, s0=None, seg=None):
    """The recurrence in float64, paper orientation ``M [d_v, d_k]``; returns ``o [B, T, Hv,
    d_v]``, the final state as ``[B, Hv, d_k, d_v]`` and ``max_t ||M_t||_F``."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    rep = hv // hk
    norm = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    q, k = norm(q) / np.sqrt(dk), norm(k)
    out = np.zeros((b, t, hv, dv))
    final = np.zeros((b, hv, dk, dv))
    top = 0.0
    for r in range(b):
        for h in range(hv):
            m = np.zeros((dv, dk)) if s0 is None else np.asarray(s0, np.float64)[r, h].T.copy()
            for i in range(t):
                if seg is not None and i > 0 and seg[r, i] != seg[r, i - 1]:
                    m = np.zeros((dv, dk))
                kt, qt = k[r, i, h // rep], q[r, i, h // rep]
                a, bt = np.exp(g[r, i, h]), beta[r, i, h]
                m = m @ (a * (np.eye(dk) - bt * np.outer(kt, kt))) + bt * np.outer(v[r, i, h], kt)
                out[r, i, h] = m @ qt
                top = max(top, np.linalg.norm(m))
            final[r, h] = m.T
    return out, final, top


def inputs(seed, b=2, t=37, hk=2, hv=4, dk=8, dv=6, decay=0.3):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s).astype(np.float32)
    g = (-decay * np.abs(f(b, t, hv))).astype(np.float32)
    beta = (1 / (1 + np.exp(-f(b, t, hv)))).astype(np.float32)
    return f(b, t, hk, dk), f(b, t, hk, dk), f(b, t, hv, dv), g, beta, f(b, hv, dk, dv)


def tol(t, dk, c, top):
    """Bound on the distance of a float32 form from the exact output (module docstring);
    ``||q|| <= d_k ** -0.5`` after the L2 norm and scaling."""
    return (t * (dk + 2 * c + 4) + dk) * F32_EPS * top * dk ** -0.5


SEGMENTS = np.array([[0] * 10 + [1] * 20 + [2] * 7 + [3] * 28, [5] * 65])


@pytest.mark.parametrize("t,chunk", [(1, 1), (7, 4), (37, 5), (64, 16), (65, 64)])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_and_recurrent_equal_the_oracle(t, chunk, packed):
    q, k, v, g, beta, s0 = inputs(0, t=t)
    seg = SEGMENTS[:, :t] if packed else None
    want, want_s, top = oracle(q, k, v, g, beta, s0, seg)
    bound = tol(t, q.shape[-1], chunk, top)
    rec, rec_s = recurrent_rule(q, k, v, g, beta, initial_state=s0,
                                               segment_ids=seg)
    chk, chk_s = chunk_rule(q, k, v, g, beta, initial_state=s0,
                                           segment_ids=seg, chunk_size=chunk)
    for name, o, s in (("recurrent", rec, rec_s), ("chunked", chk, chk_s)):
        assert o.shape == want.shape and o.dtype == jnp.float32, name
        np.testing.assert_allclose(np.asarray(o), want, rtol=0, atol=bound, err_msg=name)
        np.testing.assert_allclose(np.asarray(s), want_s, rtol=0, atol=bound * q.shape[-1]**0.5,
                                   err_msg=name)


def test_packed_row_equals_its_segments_run_alone():
    q, k, v, g, beta, _ = inputs(1)
    seg = SEGMENTS[:1, :37]
    packed, _ = chunk_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], segment_ids=seg,
                                          chunk_size=8)
    for lo, hi in ((0, 10), (10, 30), (30, 37)):
        alone, _ = chunk_rule(*(x[:1, lo:hi] for x in (q, k, v, g, beta)),
                                             chunk_size=8)
        _, _, top = oracle(*(x[:1, lo:hi] for x in (q, k, v, g, beta)))
        np.testing.assert_allclose(np.asarray(packed[:, lo:hi]), np.asarray(alone), rtol=0,
                                   atol=2 * tol(hi - lo, 8, 8, top))


def test_decode_steps_after_prefill_equal_the_full_sequence():
    q, k, v, g, beta, s0 = inputs(2, t=20)
    full, full_s = recurrent_rule(q, k, v, g, beta, initial_state=s0)
    _, _, top = oracle(q, k, v, g, beta, s0)
    out, s = chunk_rule(*(x[:, :13] for x in (q, k, v, g, beta)),
                                       initial_state=s0, chunk_size=4)
    outs = [out]
    for i in range(13, 20):
        o, s = delta_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s)
        assert o.shape == (2, 4, 6) and s.shape == (2, 4, 8, 6)
        outs.append(o[:, None])
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), rtol=0,
                               atol=2 * tol(20, 8, 4, top))
    np.testing.assert_allclose(np.asarray(s), np.asarray(full_s), rtol=0,
                               atol=2 * tol(20, 8, 4, top) * 8 ** 0.5)


def test_chunked_gradients_equal_recurrent_and_stay_finite_under_strong_decay():
    """The learner differentiates the chunked form: its gradients equal the recurrent
    form's, also where in-chunk decays underflow (``g = -60`` on some tokens: ``exp`` of
    masked positive differences must not reach the backward)."""
    q, k, v, g, beta, s0 = inputs(3, t=19)
    g[:, 5] = -60.0
    seg = SEGMENTS[:, :19]
    w = np.random.default_rng(4).normal(size=(2, 19, 4, 6)).astype(np.float32)

    def loss(fn, *xs):
        o, s = fn(*xs)
        return jnp.sum(o * w) + jnp.sum(s)

    chunked = lambda *xs: chunk_rule(*xs, initial_state=s0, segment_ids=seg,
                                                    chunk_size=8)
    recurrent = lambda *xs: recurrent_rule(*xs, initial_state=s0, segment_ids=seg)
    args = (q, k, v, g, beta)
    ga = jax.jit(jax.grad(lambda *xs: loss(chunked, *xs), argnums=range(5)))(*args)
    gb = jax.jit(jax.grad(lambda *xs: loss(recurrent, *xs), argnums=range(5)))(*args)
    _, _, top = oracle(q, k, v, g, beta, s0, seg)
    # The backward is the transposed recurrence, as non-expansive, carrying the cotangent
    # state dS (||dS|| <= sum_t ||w_t|| ||q_t|| + ||ones [d_k, d_v]||); every input's
    # gradient is a product of dS with S, k, v or q, so scale = max ||dS|| * max(||S||, |v|, 1)
    # and the chain is the forward's.
    d_s = float(np.linalg.norm(w, axis=-1).sum(1).max()) * 8 ** -0.5 + (8 * 6) ** 0.5
    scale = d_s * max(top, float(np.abs(v).max()), 1.0)
    bound = 2 * (19 * (8 + 2 * 8 + 4) + 8) * F32_EPS * scale
    for name, a, b in zip("q k v g beta".split(), ga, gb):
        assert np.isfinite(np.asarray(a)).all(), name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=bound,
                                   err_msg=name)


def test_unit_lower_inverse_ignores_the_upper_triangle_and_inverts():
    rng = np.random.default_rng(8)
    a = rng.normal(size=(3, 16, 16)).astype(np.float32) * 0.3
    x = np.asarray(lower_inverse(a), np.float64)
    m = np.eye(16) + np.tril(a.astype(np.float64), -1)
    # a triangular inverse by substitution: |X M - I| <= c_n u |X| |M| with c_n ~ n
    # (Higham 2002, sec. 14.2, first order); 2 n eps here
    scale = float((np.abs(x) @ np.abs(m)).max())
    np.testing.assert_allclose(x @ m, np.eye(16)[None].repeat(3, 0), rtol=0,
                               atol=2 * 16 * F32_EPS * scale)
    assert (np.triu(x, 1) == 0).all()


def test_seam_and_errors():
    assert gd.resolve("auto") == "xla" and gd.resolve("recurrent") == "recurrent"
    with pytest.raises(ValueError, match="expected one of"):
        gd.resolve("pallas")
    q, k, v, g, beta, s0 = inputs(5, t=6)
    a, _ = gd.gated_delta_rule(q, k, v, g, beta, impl="recurrent")
    b, _ = gd.gated_delta_rule(q, k, v, g, beta, impl="auto", chunk_size=4,
                               precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="v: expected"):
        gd.chunk_gated_delta_rule(q, k, v[:, :, :3], g, beta)
    with pytest.raises(ValueError, match="beta: expected"):
        gd.chunk_gated_delta_rule(q, k, v, g, beta[:, :5])
    with pytest.raises(ValueError, match="initial_state: expected"):
        gd.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0[:, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        gd.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="segment_ids"):
        gd.chunk_gated_delta_rule(q, k, v, g, beta, segment_ids=np.zeros((2, 5), np.int32))


def conv_oracle(x, w, hist, seg):
    """``y[t] = silu(sum_j w[j] x[t - K + 1 + j])`` in float64 with ``x`` before the row =
    ``hist``, inputs of another segment zero; and the last ``K - 1`` inputs of the last
    segment (zeros before it)."""
    b, t, c = x.shape
    kern = w.shape[0]
    ext = np.concatenate([hist, x], 1).astype(np.float64)
    run = np.zeros((b, t + kern - 1), int)
    for r in range(b):
        for i in range(1, t):
            run[r, kern - 1 + i] = run[r, kern - 2 + i] + (seg[r, i] != seg[r, i - 1])
    y = np.zeros((b, t, c))
    for r in range(b):
        for i in range(t):
            for j in range(kern):
                p = i + j
                if run[r, p] == run[r, kern - 1 + i]:
                    y[r, i] += w[j] * ext[r, p]
    y = y / (1 + np.exp(-y))
    tail = ext[:, -(kern - 1):] * (run[:, -(kern - 1):] == run[:, -1:])[..., None]
    return y, tail


def conv_bound(w, x):
    """Two float32 evaluations of a ``K``-term sum of ``|w x| <= sum_j |w_j| max |x|``
    (``2 K eps`` of it), through SiLU (slope <= 1.1) and its own few roundings (``4 eps``)."""
    scale = float(np.abs(w).sum(0).max() * np.abs(x).max())
    return (2 * w.shape[0] + 4) * F32_EPS * 1.1 * scale


@pytest.mark.parametrize("t", [1, 2, 9])
def test_causal_conv_equals_the_oracle_and_its_decode_steps(t):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, t + 5, 12)).astype(np.float32)
    w = rng.normal(size=(4, 12)).astype(np.float32)
    hist = rng.normal(size=(2, 3, 12)).astype(np.float32)
    seg = np.array([[3] * (t // 2) + [4] * (t - t // 2) + [4] * 5, [1] * (t + 5)])
    y, state = conv1d(x[:, :t], w, state=hist, segment_ids=seg[:, :t])
    want, want_state = conv_oracle(x[:, :t], w, hist, seg[:, :t])
    bound = conv_bound(w, x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=bound)
    np.testing.assert_array_equal(np.asarray(state), want_state.astype(np.float32))
    # decode: the remaining 5 tokens one at a time equal the whole row run at once
    full, _ = conv1d(x, w, state=hist, segment_ids=seg)
    for i in range(t, t + 5):
        yi, state = conv1d_step(x[:, i], w, state)
        np.testing.assert_allclose(np.asarray(yi), np.asarray(full[:, i]), rtol=0, atol=bound)


def test_causal_conv_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 11, 10)).astype(np.float32)
    w = rng.normal(size=(4, 10)).astype(np.float32)
    ref = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w.T.copy()),
                              None, activation="silu").transpose(1, 2).numpy()
    y, _ = conv1d(x, w)
    bound = conv_bound(w, x)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=bound)
    with pytest.raises(ValueError, match="conv state: expected"):
        causal_conv.causal_conv1d(x, w, state=np.zeros((2, 4, 10), np.float32))
