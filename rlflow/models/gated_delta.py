"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving
Mamba2 with Delta Rule", ICLR 2025, eq. 10): the linear-attention core of Qwen3-Next's and
Qwen3.5's GatedDeltaNet layers, as pure ``jnp`` functions.

The recurrence per (row, value head), in the paper's orientation ``M_t [d_v, d_k]``::

    M_t = M_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T,      o_t = M_t q_t

with ``alpha_t = exp(g_t)`` (``g_t <= 0`` the log-decay) and ``beta_t in (0, 1)``. The state
here is stored transposed, ``S_t = M_t^T``: ``[batch, heads, d_k, d_v]``, the layout of
transformers' ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``
(``models/qwen3_5/modeling_qwen3_5.py``), whose conventions these functions follow:

- ``q, k`` are L2-normalised over ``d_k`` in float32 (``x * rsqrt(sum x^2 + 1e-6)``, the FLA
  library's ``l2norm``) when ``qk_l2norm`` (Qwen3.5 / Qwen3-Next always), then ``q`` is
  scaled by ``d_k ** -0.5``;
- grouped value heads: ``num_v_heads`` a multiple of ``num_k_heads``; value head ``h`` reads
  query/key head ``h // (num_v_heads // num_k_heads)`` (torch ``repeat_interleave``);
- all arithmetic in float32; the output is cast back to ``q.dtype``, the state stays float32.

Packed rows: ``segment_ids [B, T]`` int; the state is reset to zero before position ``t > 0``
when ``segment_ids[:, t] != segment_ids[:, t - 1]`` (segments are contiguous runs). An
``initial_state`` belongs to the first segment of its row. Padding is the caller's: the
GatedDeltaNet layer zeroes padded inputs (as transformers does), which leaves a zero state
unchanged; or give padding its own segment id.

Forms: :func:`recurrent_gated_delta_rule` (token by token, ``lax.scan``; the reference for
decode), :func:`gated_delta_step` (one decode token), :func:`chunk_gated_delta_rule` (the
chunkwise-parallel form of the paper's sec. 3.3 / the UT transform of Yang et al. 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length", eq. 6-8: within
a chunk of ``C`` tokens the updates are condensed into matmuls and one unit-lower-triangular
solve; a ``lax.scan`` carries the state across chunks). :func:`gated_delta_rule` is the seam
that picks one by name (:data:`IMPLEMENTATIONS`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

L2_EPS = 1e-6
DEFAULT_CHUNK = 64
IMPLEMENTATIONS = ("auto", "xla", "recurrent")


def resolve(impl: str, backend: str | None = None) -> str:
    """The implementation ``impl`` names. ``"xla"``: the chunked ``jnp`` form (every
    backend; the learner and prefill); ``"recurrent"``: the token-by-token scan;
    ``"auto"``: ``"xla"`` on every backend. No accelerator kernel of the gated delta rule
    ships with the installed stack: ``jax.experimental.pallas.ops`` has none, and tokamax is
    not installed (nor importable beside the CLI's typeguard 4, see
    :mod:`rlflow.models.attention`). Newer tokamax releases have a TPU Pallas op
    ``causal_conv1d_gated_delta_rule`` (conv + rule fused, forward only, over a ragged batch
    of prefill and decode tokens with a pooled state per slot: a sampler kernel, not a
    learner one); it would join here, under its own name, for the sampler's prefill.

    Raises:
      ValueError: ``impl`` is not one of :data:`IMPLEMENTATIONS`.
    """
    del backend   # one choice on every backend until a kernel exists
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"gated delta rule impl: expected one of {IMPLEMENTATIONS}, got {impl!r}")
    return "xla" if impl == "auto" else impl


def l2norm(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """``x * rsqrt(sum(x^2, -1) + eps)`` over the last axis (FLA / transformers ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def segment_runs(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
    """Run index of each position, ``[batch, length]`` int32: 0 on the first segment of a
    row, +1 at every ``t > 0`` where ``segment_ids`` changes. Two positions of a row share
    state iff their run indices are equal. ``None``: all zeros (one segment per row)."""
    if segment_ids is None:
        return jnp.zeros((batch, length), jnp.int32)
    if segment_ids.shape != (batch, length):
        raise ValueError(f"segment_ids: expected shape {(batch, length)}, got "
                         f"{segment_ids.shape}")
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.cumsum(change, axis=1)], 1)


def _prepare(q, k, v, g, beta, qk_l2norm: bool):
    """Checks shapes; float32, L2 norm, key heads repeated to the value heads, ``q`` scaled.
    Returns ``q, k [B, H, T, d_k]``, ``v [B, H, T, d_v]``, ``g, beta [B, H, T]``."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q, k: expected equal shapes [batch, seq, k_heads, d_k], got "
                         f"{q.shape} and {k.shape}")
    b, t, hk, _ = q.shape
    if v.ndim != 4 or v.shape[:2] != (b, t) or v.shape[2] % hk:
        raise ValueError(f"v: expected [batch={b}, seq={t}, v_heads (a multiple of "
                         f"k_heads={hk}), d_v], got {v.shape}")
    hv = v.shape[2]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"{name}: expected [batch, seq, v_heads] = {(b, t, hv)}, got "
                             f"{x.shape}")
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if hv != hk:
        q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
    q = q * (q.shape[-1] ** -0.5)
    return (q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
            g.transpose(0, 2, 1), beta.transpose(0, 2, 1))


def _initial(initial_state, b, h, dk, dv) -> jax.Array:
    if initial_state is None:
        return jnp.zeros((b, h, dk, dv), jnp.float32)
    if initial_state.shape != (b, h, dk, dv):
        raise ValueError(f"initial_state: expected [batch, v_heads, d_k, d_v] = "
                         f"{(b, h, dk, dv)}, got {initial_state.shape}")
    return initial_state.astype(jnp.float32)


def _update(s, q_t, k_t, v_t, g_t, b_t, precision):
    """One token: ``s [B, H, dk, dv]``, ``q_t, k_t [B, H, dk]``, ``v_t [B, H, dv]``,
    ``g_t, b_t [B, H]`` (prepared). Returns the new state and ``o_t [B, H, dv]``."""
    s = s * jnp.exp(g_t)[..., None, None]
    delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=precision)) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=precision)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, segment_ids=None,
                               qk_l2norm: bool = True, precision=None
                               ) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (``lax.scan`` over the sequence).

    Args:
      q, k: ``[B, T, Hk, d_k]``; v: ``[B, T, Hv, d_v]`` (``Hv`` a multiple of ``Hk``).
      g: ``[B, T, Hv]`` log-decay (``<= 0``); beta: ``[B, T, Hv]`` in ``(0, 1)``.
      initial_state: ``[B, Hv, d_k, d_v]`` or None (zeros).
      segment_ids: ``[B, T]`` int or None; the state resets where it changes.
      qk_l2norm: L2-normalise ``q`` and ``k`` first.
      precision: ``jax.lax.Precision`` of the float32 contractions (None: the backend's
        default; TPU's default multiplies float32 in one bfloat16 pass, ``HIGHEST`` does not).

    Returns:
      ``(o [B, T, Hv, d_v] in q.dtype, final state [B, Hv, d_k, d_v] float32)``.

    Raises:
      ValueError: shapes disagree (names the argument and the expected shape).
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, qk_l2norm)
    b, h, t, dk = k.shape
    s0 = _initial(initial_state, b, h, dk, v.shape[-1])
    runs = segment_runs(segment_ids, b, t)
    reset = jnp.concatenate([jnp.zeros((b, 1), bool), runs[:, 1:] != runs[:, :-1]], axis=1)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t, r_t = xs
        s = jnp.where(r_t[:, None, None, None], 0.0, s)
        return _update(s, q_t, k_t, v_t, g_t, b_t, precision)

    xs = (q.transpose(2, 0, 1, 3), k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3),
          g.transpose(2, 0, 1), beta.transpose(2, 0, 1), reset.T)
    s, o = jax.lax.scan(step, s0, xs)
    return o.transpose(1, 0, 2, 3).astype(out_dtype), s


def gated_delta_step(q, k, v, g, beta, state, *, qk_l2norm: bool = True, precision=None
                     ) -> tuple[jax.Array, jax.Array]:
    """One decode token: ``q, k [B, Hk, d_k]``, ``v [B, Hv, d_v]``, ``g, beta [B, Hv]``,
    ``state [B, Hv, d_k, d_v]`` (a slot starting a new sequence passes zeros). Returns
    ``(o [B, Hv, d_v] in q.dtype, new state float32)``; same arithmetic as one step of
    :func:`recurrent_gated_delta_rule`."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                qk_l2norm)
    b, h, _, dk = k.shape
    s = _initial(state, b, h, dk, v.shape[-1])
    s, o = _update(s, q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], precision)
    return o.astype(out_dtype), s


def _forward_substitution(a):
    """``(I + a)^{-1}`` for strictly lower triangular ``a [..., C, C]``, row by row
    (transformers' export path of ``torch_chunk_gated_delta_rule``): ``t = -a``; for
    ``i = 1 .. C-1``: ``t[i, :i] += t[i, :i] @ t[:i, :i]``; then ``+ I``."""
    c = a.shape[-1]
    cols = jnp.arange(c)

    def body(i, t):
        row = jnp.where(cols < i, t[..., i, :], 0.0)
        new = jnp.where(cols < i, row + jnp.einsum("...j,...jk->...k", row, t,
                                                   precision=jax.lax.Precision.HIGHEST), 0.0)
        return t.at[..., i, :].set(new)

    return jax.lax.fori_loop(1, c, body, -a) + jnp.eye(c, dtype=a.dtype)


@jax.custom_vjp
def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + a)^{-1}`` of a strictly lower triangular ``a [..., C, C]`` (the entries on and
    above the diagonal are ignored), by forward substitution. The UT transform's solve:
    ``C - 1`` row updates of ``O(C^2)``, cheaper on XLA:CPU than its ``TriangularSolve``
    (5-25x at ``C = 64``), the same arithmetic on every backend. Its VJP is the inverse's,
    ``-X^T G X^T`` restricted to the strict lower triangle, two matmuls (a loop's VJP
    would keep ``C`` copies of the ``[C, C]`` matrix per chunk)."""
    c = a.shape[-1]
    return _forward_substitution(jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), a, 0.0))


def _inverse_fwd(a):
    x = unit_lower_inverse(a)
    return x, x


def _inverse_bwd(x, g):
    c = x.shape[-1]
    xt = jnp.swapaxes(x, -1, -2)
    hi = jax.lax.Precision.HIGHEST
    da = -jnp.einsum("...ij,...jk,...kl->...il", xt, g, xt, precision=hi)
    return (jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), da, 0.0),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def _chunks(x, n, c):
    """``[B, H, N*C, ...] -> [B, H, N, C, ...]``."""
    return x.reshape(x.shape[:2] + (n, c) + x.shape[3:])


def _intra_chunk(q, k, v, g, beta, runs, c_in, c_last, precision):
    """The chunk-local quantities, all chunks at once (shapes ``[B, H, N, C, ...]``; ``runs
    [B, N, C]``, ``c_in`` / ``c_last [B, N]`` the run of the state entering / leaving each
    chunk). ``D[i, j] = exp(G_i - G_j)`` where ``j <= i`` in one run, else 0 (``G`` the
    in-chunk cumulative log-decay); the incoming state reaches position ``i`` with
    ``exp(G_i)`` iff ``i`` is in the incoming run."""
    big_g = jnp.cumsum(g, axis=-1)
    c = big_g.shape[-1]
    causal = jnp.tril(jnp.ones((c, c), bool))
    mask = (causal & (runs[..., :, None] == runs[..., None, :]))[:, None]       # [B,1,N,C,C]
    diff = big_g[..., :, None] - big_g[..., None, :]
    decay = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
    from_in = (runs == c_in[..., None])[:, None]                                   # [B,1,N,C]
    to_last = (runs == c_last[..., None])[:, None]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    lower = jnp.where(strict, jnp.einsum("...id,...jd->...ij", k_beta, k,
                                             precision=precision) * decay, 0.0)
    rhs = jnp.concatenate([v_beta, k_beta * (jnp.exp(big_g) * from_in)[..., None]], axis=-1)
    solved = jnp.einsum("...ij,...jd->...id", unit_lower_inverse(lower), rhs,
                        precision=precision)
    dv = v.shape[-1]
    new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]
    attn = jnp.einsum("...id,...jd->...ij", q, k, precision=precision) * decay
    q_in = q * (jnp.exp(big_g) * from_in)[..., None]
    g_last = big_g[..., -1:]
    k_out = k * (jnp.exp(g_last - big_g) * to_last)[..., None]
    chunk_decay = jnp.exp(g_last[..., 0]) * (c_last == c_in)[:, None]             # [B,H,N]
    return new_values, k_cumdecay, attn, q_in, k_out, chunk_decay


def chunk_gated_delta_rule(q, k, v, g, beta, *, chunk_size: int = DEFAULT_CHUNK,
                           initial_state=None, segment_ids=None, qk_l2norm: bool = True,
                           precision=None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks of ``chunk_size`` tokens (the learner and prefill).

    Same arguments and results as :func:`recurrent_gated_delta_rule`, plus ``chunk_size``
    (``>= 1``; ``T`` need not be a multiple: the tail is padded with ``k = v = beta = g = 0``,
    which leaves the state unchanged, and cut from the output). Live memory per chunk
    ``[B, H, C, C]``; all chunks' local terms are built at once, then a ``lax.scan`` over
    the ``ceil(T / C)`` chunks carries the state (per chunk: ``v' = U - W S``,
    ``o = Q_in S + A v'``, ``S <- decay * S + K_out^T v'``).

    Raises:
      ValueError: shapes disagree, or ``chunk_size < 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, qk_l2norm)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    s0 = _initial(initial_state, b, h, dk, dv)
    runs = segment_runs(segment_ids, b, t)
    pad = (-t) % chunk_size
    n = (t + pad) // chunk_size
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
        runs = jnp.pad(runs, ((0, 0), (0, pad)), mode="edge")
    runs = runs.reshape(b, n, chunk_size)
    c_last = runs[:, :, -1]
    c_in = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), c_last[:, :-1]], axis=1)
    q, k, v = (_chunks(x, n, chunk_size) for x in (q, k, v))
    g, beta = (_chunks(x, n, chunk_size) for x in (g, beta))
    new_values, k_cumdecay, attn, q_in, k_out, chunk_decay = _intra_chunk(
        q, k, v, g, beta, runs, c_in, c_last, precision)

    ein = functools.partial(jnp.einsum, precision=precision)

    def step(s, xs):
        u, w, a, qi, ko, dec = xs
        v_new = u - ein("bhck,bhkv->bhcv", w, s)
        o = ein("bhck,bhkv->bhcv", qi, s) + ein("bhij,bhjv->bhiv", a, v_new)
        s = s * dec[..., None, None] + ein("bhck,bhcv->bhkv", ko, v_new)
        return s, o

    to_scan = lambda x: jnp.moveaxis(x, 2, 0)   # chunks first
    xs = tuple(map(to_scan, (new_values, k_cumdecay, attn, q_in, k_out, chunk_decay)))
    s, o = jax.lax.scan(step, s0, xs)
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * chunk_size, dv)[:, :, :t]
    return o.transpose(0, 2, 1, 3).astype(out_dtype), s


def gated_delta_rule(q, k, v, g, beta, *, impl: str = "auto", chunk_size: int = DEFAULT_CHUNK,
                     initial_state=None, segment_ids=None, qk_l2norm: bool = True,
                     precision=None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a sequence by the implementation ``impl`` names
    (:func:`resolve`): :func:`chunk_gated_delta_rule` for ``"xla"``,
    :func:`recurrent_gated_delta_rule` for ``"recurrent"``. Arguments and results as theirs.

    Raises:
      ValueError: an unknown ``impl``, or what the chosen form raises.
    """
    if resolve(impl) == "recurrent":
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                          segment_ids=segment_ids, qk_l2norm=qk_l2norm,
                                          precision=precision)
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size,
                                  initial_state=initial_state, segment_ids=segment_ids,
                                  qk_l2norm=qk_l2norm, precision=precision)
