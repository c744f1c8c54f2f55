"""Logprobs and entropy without full logits (rlflow/models/logprobs.py chunked_logprobs):
equal to a float64 numpy oracle and to the one-pass path, values and gradients, for chunk
sizes that do and do not divide the positions; and the compiled program holds no
``[N, vocab]`` buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlflow.models.logprobs import chunked_logprobs, token_logprobs
from tolerances import F32_EPS

N_ROWS, L, E, V, TEMP = 3, 7, 16, 50, 0.7


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(N_ROWS, L, E)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, V)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, size=(N_ROWS, L)), jnp.int32)
    return hidden, w, tokens


def numpy_oracle(hidden, w, tokens):
    z = np.asarray(hidden, np.float64) @ np.asarray(w, np.float64) / TEMP
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    p = np.exp(logp)
    return (np.take_along_axis(logp, np.asarray(tokens)[..., None], -1)[..., 0],
            -(p * logp).sum(-1))


@pytest.mark.parametrize("chunk", [0, 4, 7, 21, 64])
def test_chunked_logprobs_equal_numpy_oracle_and_one_pass(data, chunk):
    """21 positions in chunks of 4 (a partial last chunk), 7, 21 (one chunk) or 64 (> N: one
    pass), 0 (off): logprobs and entropy equal the float64 oracle; gradients w.r.t. hidden
    states and the LM head equal the one-pass program's."""
    hidden, w, tokens = data
    project = lambda h: h @ w  # noqa: E731
    logp, ent = chunked_logprobs(project, hidden, tokens, TEMP, chunk)
    want_lp, want_ent = numpy_oracle(hidden, w, tokens)
    scale = float(np.abs(np.asarray(hidden) @ np.asarray(w)).max()) / TEMP
    atol = 2 * (E + V) * F32_EPS * scale          # the matmul (E) and the log-softmax (V)
    np.testing.assert_allclose(np.asarray(logp), want_lp, rtol=0, atol=atol)
    np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=0, atol=atol)

    def loss(h, w_, c):
        lp, en = chunked_logprobs(lambda x: x @ w_, h, tokens, TEMP, c)
        return jnp.sum(lp * jnp.cos(jnp.arange(L))) + jnp.sum(en)   # entropy: no gradient
    g = jax.grad(loss, argnums=(0, 1))(hidden, w, chunk)
    g0 = jax.grad(loss, argnums=(0, 1))(hidden, w, 0)
    g_only_lp = jax.grad(lambda h, w_: jnp.sum(token_logprobs(h @ w_, tokens, TEMP)
                                               * jnp.cos(jnp.arange(L))), argnums=(0, 1))(hidden, w)
    for a, b, c in zip(g, g0, g_only_lp):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                   atol=2 * (E + V + N_ROWS * L) * F32_EPS * float(jnp.abs(b).max()))
        np.testing.assert_allclose(np.asarray(b), np.asarray(c), rtol=0,
                                   atol=2 * (E + V) * F32_EPS * float(jnp.abs(c).max()))


def test_chunked_program_holds_no_full_logits():
    """Forward + backward of 8192 positions at a 4096-token vocabulary in chunks of 256:
    compiled temporaries far below one float32 ``[N, V]`` logits buffer (128 MiB, which the
    one-pass program holds)."""
    n, e, v, chunk = 8192, 32, 4096, 256
    h = jax.ShapeDtypeStruct((n, e), jnp.float32)
    w = jax.ShapeDtypeStruct((e, v), jnp.float32)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)

    def temp_bytes(c):
        f = lambda h_, w_, t_: jnp.sum(chunked_logprobs(lambda x: x @ w_, h_, t_, 1.0, c)[0])  # noqa: E731
        return jax.jit(jax.grad(f, argnums=(0, 1))).lower(h, w, t).compile() \
            .memory_analysis().temp_size_in_bytes

    full = n * v * 4
    assert temp_bytes(0) >= full
    # chunked: at most three [chunk, V] float32 buffers (logits, log-softmax, its gradient)
    # plus the [N, E] hidden-state gradient and [E, V] weight gradient (two copies each)
    bound = 4 * (3 * chunk * v + 2 * n * e + 2 * e * v)
    assert temp_bytes(chunk) <= bound < full / 8
