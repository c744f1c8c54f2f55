"""Full-sequence (learner) attention: causal, grouped-query, with padding, packed segments and
the shared-prompt prefix mask; one function, several implementations.

The mask (the one ``Decoder.__call__`` documents): query ``t`` of row ``b`` attends key ``s``
when ``s <= t``, ``attention_mask[b, s]``, and (with ``segment_ids``)
``segment_ids[b, s] in {segment_ids[b, t], prefix_ids[b, t]}``. A masked score gets the
finite logit ``MASK_VALUE``, so a query with no attendable key (a padding row) gets the
uniform average of all ``T`` values, never NaN.

Implementations (``learner.attention``):

- ``"xla"``: the reference. Materialises float32 scores ``[B, H, T, T]`` and the boolean
  mask ``[B, T, T]``; the numerics the decoder always had.
- ``"blockwise"``: plain XLA, never ``[T, T]``: queries in blocks of ``block_q`` (``lax.map``),
  each against keys in blocks of ``block_k`` (``lax.scan``) with an online softmax (Milakov &
  Gimelshein 2018, "Online normalizer calculation for softmax", alg. 3; Rabe & Staats 2021,
  "Self-attention does not need O(n^2) memory", sec. 2-3). Both loop bodies are
  ``jax.checkpoint``-ed, so the backward recomputes a query block's scores rather than
  storing them: live memory ``O(T * block)`` per head in forward and backward. Same mask
  semantics as ``"xla"`` including padding rows (same values within float32 reordering).
- ``"splash"``: the TPU Pallas splash-attention kernel of ``jax.experimental.pallas.ops.tpu``
  (causal ``CausalMask`` + ``SegmentIds``; runs in Pallas interpret mode off TPU, which the
  tests use). Cannot express the prefix mask (a query attending two segment ids).
- ``"gpu_flash"``: tokamax's GPU flash attention (Mosaic GPU or Triton; jax 0.12 dropped
  ``jax.experimental.pallas.ops.gpu.attention``) under a causal mask whose keys start at
  the query's packed segment (``k_start``); off GPU tokamax's XLA implementation of the
  same mask, which the tests use. Cannot express the prefix mask either.
- ``"auto"``: TPU ``"splash"``, GPU ``"gpu_flash"``, CPU ``"blockwise"``; a call with
  ``prefix_ids`` (shared-prompt packing) takes ``"blockwise"`` on every backend, the one
  implementation here whose mask has the prefix term (:func:`resolve`).

Attention variants (per layer kind, static; the xla and blockwise implementations, which
``"auto"`` takes whenever one is on): a sliding ``window`` ``W`` (a query at token position
``p`` sees keys at positions ``> p - W``: HF's ``sliding_window_overlay``; positions are the
RoPE positions, so packed segments and the shared-prompt prefix keep their distances),
learned attention ``sinks`` (one logit per query head joined to the softmax and dropped
after it: gpt-oss; Xiao et al. 2023, "Efficient Streaming Language Models with Attention
Sinks"), score ``softcap`` ``c tanh(s / c)`` before the mask (Gemma 2), and another score
``scale`` than ``D^-1/2``.

The kernels (splash, gpu_flash) mask padding through the segment ids: a padding position
gets its own segment id, so real queries never see it. A padding *row* then attends the
padding keys before it instead of averaging all keys: still finite, and never read (its
logits are not a loss position). ``jax.nn.dot_product_attention``'s cuDNN path is not
offered: its public arguments express padding only as right-padded lengths and packing not
at all without a materialised ``[B, T, T]`` mask, and the learner's rows are left-padded.
The splash kernel comes from ``jax.experimental.pallas.ops`` (the same one MaxText uses), the
GPU kernel from tokamax (0.0.17 imports beside typeguard 4, which tyro needs).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rlflow.config.learner import ATTENTION_IMPLEMENTATIONS

MASK_VALUE = -1e30   # masked attention logit (finite: a fully masked row stays finite)
IMPLEMENTATIONS = ATTENTION_IMPLEMENTATIONS   # ("auto", "xla", "blockwise", "splash", "gpu_flash")
BLOCK = 512          # default query / key block of "blockwise"
_KERNEL_BLOCK = 128  # the Pallas kernels' tile (their defaults); T is padded to a multiple


class SequenceMask(NamedTuple):
    """The full-sequence mask as :func:`attention` takes it (the decoder passes it to every
    layer instead of a ``[B, T, T]`` boolean array): ``attention_mask [B, T]`` bool,
    ``segment_ids`` / ``prefix_ids`` ``[B, T]`` int or None, ``impl`` (a name of
    :data:`IMPLEMENTATIONS`), ``mesh``: the learner's mesh when its ``sequence`` axis is > 1
    (context parallelism, :mod:`rlflow.models.context_parallel`), else None."""
    attention_mask: jax.Array
    segment_ids: jax.Array | None = None
    prefix_ids: jax.Array | None = None
    impl: str = "auto"
    mesh: Any = None


class Variant(NamedTuple):
    """A layer kind's attention settings (module doc), static: ``window`` (tokens) or None,
    ``softcap`` or None, ``scale`` (None: ``D^-1/2``), ``sinks``: the layer has per-head sink
    logits (passed as an array beside it)."""
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: bool = False

    @property
    def plain(self) -> bool:
        """No variant at all: what the kernels compute."""
        return self.window is None and self.softcap is None and not self.sinks


def resolve(impl: str, *, prefix: bool, backend: str | None = None, sequence: int = 1,
            plain: bool = True) -> str:
    """The implementation ``impl`` names: ``"auto"`` -> per backend (TPU ``"splash"``, GPU
    ``"gpu_flash"``, else ``"blockwise"``; ``"blockwise"`` wherever ``prefix``, the shared-
    prompt mask the kernels cannot express, or ``sequence > 1``, context parallelism, whose
    local queries start at a traced offset the kernels' static causal masks cannot take).

    Raises:
      ValueError: ``impl`` is not one of :data:`IMPLEMENTATIONS`, or a kernel is asked for a
        batch with ``prefix_ids`` or for a ``sequence`` axis > 1.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"learner.attention: expected one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        if prefix or sequence > 1 or not plain:
            return "blockwise"
        backend = backend or jax.default_backend()
        return {"tpu": "splash", "gpu": "gpu_flash"}.get(backend, "blockwise")
    if prefix and impl in ("splash", "gpu_flash"):
        raise ValueError(f"learner.attention={impl!r} cannot express the shared-prompt prefix "
                         f"mask (prefix_ids); use 'auto' or 'blockwise', or turn "
                         f"learner.shared_prefix off")
    if not plain and impl in ("splash", "gpu_flash"):
        raise ValueError(f"learner.attention={impl!r} does not express this model's sliding "
                         f"window, attention sinks or logit softcapping; use 'auto' or "
                         f"'blockwise'")
    if sequence > 1 and impl in ("splash", "gpu_flash"):
        raise ValueError(f"learner.attention={impl!r} does not run under context parallelism "
                         f"(learner.mesh.sequence={sequence}); use 'auto' or 'blockwise', or "
                         f"learner.mesh.sequence=1")
    return impl


def allowed(q_pos, k_pos, key_valid, q_seg=None, k_seg=None, q_prefix=None, *,
            window=None, q_tok=None, k_tok=None) -> jax.Array:
    """Which keys each query attends: ``[B, Tq, Tk]`` bool.

    ``window``: with it, also ``q_tok - k_tok < window`` (``[B, Tq]`` / ``[B, Tk]`` token
    positions; None: the row indices ``q_pos`` / ``k_pos``).

    Args:
      q_pos: ``[Tq]`` int row indices of the queries; k_pos ``[Tk]`` of the keys (causal:
        ``k_pos <= q_pos``).
      key_valid: ``[B, Tk]`` bool, False on padding keys.
      q_seg, k_seg: ``[B, Tq]`` / ``[B, Tk]`` int segment ids, or None (no packing).
      q_prefix: ``[B, Tq]`` int segment a query also attends, or None.
    """
    ok = (k_pos[None, :] <= q_pos[:, None])[None] & key_valid[:, None, :]
    if q_seg is not None:
        same = q_seg[:, :, None] == k_seg[:, None, :]
        if q_prefix is not None:
            same = same | (q_prefix[:, :, None] == k_seg[:, None, :])
        ok = ok & same
    if window is not None:
        if q_tok is None:
            ok = ok & (q_pos[:, None] - k_pos[None, :] < window)[None]
        else:
            ok = ok & (q_tok[:, :, None] - k_tok[:, None, :] < window)
    return ok


def softcap_scores(s: jax.Array, softcap: float | None) -> jax.Array:
    """``c tanh(s / c)`` (Gemma 2's attention logit softcapping), or ``s`` for None."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def sink_softmax(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over the last axis of float32 ``scores [B, K, G, Tq, Tk]``, with ``sinks``
    (``[K, G]`` logits, or None) joined as one more key whose probability is dropped."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None, None],
                            scores.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def _dot_operands(a, b):
    """bfloat16 batched-dot operands upcast to float32 on CPU (XLA:CPU has no BF16 x BF16 =
    F32 batched dot kernel); unchanged elsewhere."""
    if jax.default_backend() == "cpu" and jnp.dtype(a.dtype).itemsize < 4:
        return a.astype(jnp.float32), b.astype(jnp.float32)
    return a, b


def _scores(q5, k, scale):
    """``q5 [B, Tq, K, G, D]``, ``k [B, Tk, K, D]`` -> float32 ``[B, K, G, Tq, Tk]``."""
    qs, ks = _dot_operands(q5, k)
    return jnp.einsum("btkgd,bskd->bkgts", qs, ks, preferred_element_type=jnp.float32) * scale


class KeyQueryMask(NamedTuple):
    """The mask's operands split by side, so that queries and keys may be different spans of
    a row (context parallelism: a device's local queries against the whole row's keys,
    :mod:`rlflow.models.context_parallel`). ``q_pos [Tq]`` / ``k_pos [Tk]`` int: row indices
    (global positions) of the queries / keys; ``key_valid [B, Tk]`` bool; ``q_seg [B, Tq]``,
    ``k_seg [B, Tk]``, ``q_prefix [B, Tq]`` int or None (as :func:`allowed`)."""
    q_pos: jax.Array
    k_pos: jax.Array
    key_valid: jax.Array
    q_seg: jax.Array | None = None
    k_seg: jax.Array | None = None
    q_prefix: jax.Array | None = None
    q_tok: jax.Array | None = None
    k_tok: jax.Array | None = None

    @classmethod
    def whole_row(cls, attention_mask, segment_ids=None, prefix_ids=None,
                  positions=None) -> "KeyQueryMask":
        """Queries and keys both the whole row ``[B, T]`` (no context parallelism);
        ``positions [B, T]``: the token positions a sliding window measures (None: row
        indices)."""
        pos = jnp.arange(attention_mask.shape[1])
        return cls(pos, pos, attention_mask, segment_ids, segment_ids, prefix_ids,
                   positions, positions)

    def allowed(self, window=None) -> jax.Array:
        """:func:`allowed` of this mask."""
        return allowed(self.q_pos, self.k_pos, self.key_valid, self.q_seg, self.k_seg,
                       self.q_prefix, window=window, q_tok=self.q_tok, k_tok=self.k_tok)


def _xla(q, k, v, m: KeyQueryMask, scale, var: Variant = Variant(), sinks=None):
    b, t, h, d = q.shape
    q5 = q.reshape(b, t, k.shape[2], h // k.shape[2], d)
    attend = m.allowed(var.window)                                        # [B, Tq, Tk]
    scores = softcap_scores(_scores(q5, k, scale), var.softcap)
    scores = jnp.where(attend[:, None, None], scores, MASK_VALUE)
    probs = sink_softmax(scores, sinks).astype(q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)


def _blocks(x, n, blk, axis=1, fill=0):
    """``[B, T, ...]`` -> ``[n, B, blk, ...]`` (padded with ``fill`` to ``n * blk``)."""
    pad = n * blk - x.shape[axis]
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths, constant_values=fill)
    x = x.reshape(x.shape[:axis] + (n, blk) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _blockwise(q, k, v, m: KeyQueryMask, scale, block_q: int, block_k: int,
               var: Variant = Variant(), sinks=None):
    b, t, h, d = q.shape
    tk, kh = k.shape[1], k.shape[2]
    g = h // kh
    bq, bk = min(block_q, t), min(block_k, tk)
    nq, nk = -(-t // bq), -(-tk // bk)
    seg_k = jnp.zeros((b, tk), jnp.int32) if m.k_seg is None else m.k_seg
    seg_q = jnp.zeros((b, t), jnp.int32) if m.q_seg is None else m.q_seg
    prefix = seg_q if m.q_prefix is None else m.q_prefix
    tok_q = jnp.broadcast_to(m.q_pos[None], (b, t)) if m.q_tok is None else m.q_tok
    tok_k = jnp.broadcast_to(m.k_pos[None], (b, tk)) if m.k_tok is None else m.k_tok
    # keys past Tk (block padding) are out of range: -inf, not MASK_VALUE, so a padding row
    # still averages exactly the Tk real keys (block 0 always holds key 0: m stays finite)
    kv = (_blocks(k, nk, bk), _blocks(v, nk, bk), _blocks(m.k_pos[None], nk, bk)[:, 0],
          _blocks(m.key_valid, nk, bk, fill=False), _blocks(seg_k, nk, bk),
          _blocks(tok_k, nk, bk))
    in_range = _blocks(jnp.ones((1, tk), bool), nk, bk, fill=False)[:, 0]     # [nk, bk]
    qb = (_blocks(q.reshape(b, t, kh, g, d), nq, bq), _blocks(m.q_pos[None], nq, bq)[:, 0],
          _blocks(seg_q, nq, bq), _blocks(prefix, nq, bq), _blocks(tok_q, nq, bq))
    def key_step(carry, xs, q5, q_pos, q_seg, q_pre, q_tok):
        m, l, acc = carry                       # [B, K, G, bq], same, [B, K, G, bq, D] f32
        kb, vb, k_pos, k_valid, k_seg, k_tok, k_in = xs
        ok = allowed(q_pos, k_pos, k_valid, q_seg, k_seg, q_pre, window=var.window,
                     q_tok=q_tok, k_tok=k_tok)[:, None, None]
        s = jnp.where(ok, softcap_scores(_scores(q5, kb, scale), var.softcap), MASK_VALUE)
        s = jnp.where(k_in, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        ps, vs = _dot_operands(p.astype(v.dtype), vb)
        pv = jnp.einsum("bkgts,bskd->bkgtd", ps, vs, preferred_element_type=jnp.float32)
        return (m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv), None

    def query_block(xs):
        q5, q_pos, q_seg, q_pre, q_tok = xs
        step = jax.checkpoint(functools.partial(key_step, q5=q5, q_pos=q_pos, q_seg=q_seg,
                                                q_pre=q_pre, q_tok=q_tok))
        if sinks is None:
            init = (jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32),
                    jnp.zeros((b, kh, g, bq), jnp.float32))
        else:   # the sink is one more key with no value: running max at it, weight 1
            init = (jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None], (b, kh, g, bq)),
                    jnp.ones((b, kh, g, bq), jnp.float32))
        init = init + (jnp.zeros((b, kh, g, bq, d), jnp.float32),)
        (_, l, acc), _ = jax.lax.scan(step, init, kv + (in_range,))
        out = (acc / l[..., None]).astype(q.dtype)               # [B, K, G, bq, D]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, bq, h, d)

    out = jax.lax.map(jax.checkpoint(query_block), qb)           # [nq, B, bq, H, D]
    return jnp.moveaxis(out, 0, 1).reshape(b, nq * bq, h, d)[:, :t]


def _kernel_segments(t_pad, m: KeyQueryMask):
    """Segment ids for a kernel: ``[B, t_pad]`` int32, padding (and block padding) in a
    segment of its own (-1) so real queries never attend it."""
    key_valid, seg = m.key_valid, m.k_seg
    b, t = key_valid.shape
    seg = jnp.zeros((b, t), jnp.int32) if seg is None else seg.astype(jnp.int32)
    seg = jnp.where(key_valid, seg, -1)
    return jnp.pad(seg, ((0, 0), (0, t_pad - t)), constant_values=-1)


def _pad_seq(x, t_pad):
    return jnp.pad(x, ((0, 0), (0, t_pad - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def _splash(q, k, v, mask_args: KeyQueryMask, scale, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    b, t, h, d = q.shape
    t_pad = -(-t // _KERNEL_BLOCK) * _KERNEL_BLOCK
    seg = _kernel_segments(t_pad, mask_args)
    mask = sa.MultiHeadMask([sa.CausalMask((t_pad, t_pad)) for _ in range(h)])
    kernel = sa.make_splash_mha_single_device(mask, block_sizes=sa.BlockSizes.get_default(),
                                              mask_value=MASK_VALUE, interpret=interpret)
    heads = lambda x: _pad_seq(x, t_pad).swapaxes(1, 2)                # [B, N, T, D]  # noqa: E731
    out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, sa.SegmentIds(s1, s1)))(
        heads(q * jnp.asarray(scale, q.dtype)), heads(k), heads(v), seg)
    return out.swapaxes(1, 2)[:, :t].astype(q.dtype)


def _run_starts(seg):
    """``[B, T]`` index of the first position of each position's run of equal ids."""
    t = seg.shape[1]
    new_run = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)
    return jax.lax.cummax(jnp.where(new_run, jnp.arange(t, dtype=jnp.int32), 0), axis=1)


def _gpu_flash(q, k, v, mask_args: KeyQueryMask, scale, interpret: bool):
    """tokamax's GPU flash attention (Mosaic GPU on Hopper and later, else Triton) under
    ``Mask(k_start, is_causal)``: a query attends the keys from the start of its run of
    equal segment ids (padding a run of its own) up to itself, the segment mask of
    contiguous packed segments. ``interpret``: tokamax's XLA implementation under the same
    mask (CPU tests)."""
    from tokamax._src.ops.attention import api as tk_api
    from tokamax._src.ops.attention import base as tk_base
    b, t, h, d = q.shape
    starts = _run_starts(_kernel_segments(t, mask_args))               # [B, T]
    mask = tk_base.Mask(k_start=starts[:, None, :], is_causal=True)
    names = ("xla",) if interpret else tuple(
        n for n in ("mosaic_gpu", "triton") if n in tk_api.IMPLEMENTATIONS)
    errors = []
    for name in names:
        try:
            out = tk_api.IMPLEMENTATIONS[name](q, k, v, mask=mask, logits_scale=scale)
            return out.astype(q.dtype)
        except NotImplementedError as e:     # e.g. Mosaic GPU on a pre-Hopper card
            errors.append(e)
    raise NotImplementedError(f"learner.attention='gpu_flash': no tokamax GPU attention "
                              f"kernel runs here ({names}): {errors}")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, attention_mask: jax.Array,
              segment_ids: jax.Array | None = None, prefix_ids: jax.Array | None = None,
              impl: str = "auto", block_size: int | None = None,
              interpret: bool | None = None, positions: jax.Array | None = None,
              variant: Variant = Variant(), sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention of a whole sequence, ``softmax(q k^T / sqrt(D)) v``
    (Vaswani et al. 2017, eq. 1; GQA: Ainslie et al. 2023) under the mask of the module
    docstring.

    Args:
      q: ``[B, T, H, D]`` queries (RoPE applied), in the compute dtype.
      k, v: ``[B, T, K, D]`` keys / values, ``H % K == 0`` (query head ``i`` uses K/V head
        ``i // (H / K)``).
      attention_mask: ``[B, T]`` bool, False on padding (left or right).
      segment_ids: ``[B, T]`` int or None: packed sequences; a query attends its segment.
      prefix_ids: ``[B, T]`` int or None (with ``segment_ids``): the segment a query also
        attends (shared prompt, :mod:`rlflow.learner.packing`).
      impl: one of :data:`IMPLEMENTATIONS` (see :func:`resolve`).
      block_size: query and key block of ``"blockwise"`` (tokens); None: :data:`BLOCK`.
      interpret: run the Pallas kernels in interpret mode; None: when the backend is not the
        kernel's own (TPU for splash, GPU for gpu_flash), e.g. CPU tests.
      positions: ``[B, T]`` int token positions a sliding window measures (None: row
        indices).
      variant: the layer kind's :class:`Variant` (module doc).
      sinks: ``[H]`` float sink logits when ``variant.sinks`` (query head ``i``'s).

    Returns:
      ``[B, T, H, D]`` in ``q.dtype``; scores and softmax in float32.

    Raises:
      ValueError: unknown ``impl``, ``prefix_ids`` without ``segment_ids``, a kernel asked
        for the prefix mask, or mismatched shapes.
    """
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"attention: q {q.shape} with k {k.shape} / v {v.shape}: expected "
                         f"k, v [B, T, K, D] with H % K == 0")
    if prefix_ids is not None and segment_ids is None:
        raise ValueError("attention: prefix_ids needs segment_ids")
    name = resolve(impl, prefix=prefix_ids is not None, plain=variant.plain)
    mask = KeyQueryMask.whole_row(jnp.asarray(attention_mask, bool),
                                  None if segment_ids is None else jnp.asarray(segment_ids),
                                  None if prefix_ids is None else jnp.asarray(prefix_ids),
                                  None if positions is None else jnp.asarray(positions))
    return attend(q, k, v, mask, name, block_size=block_size, interpret=interpret,
                  variant=variant, sinks=sinks)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: KeyQueryMask, name: str, *,
           block_size: int | None = None, interpret: bool | None = None,
           variant: Variant = Variant(), sinks: jax.Array | None = None) -> jax.Array:
    """:func:`attention` of queries ``q [B, Tq, H, D]`` against keys / values
    ``[B, Tk, K, D]`` under ``mask`` (:class:`KeyQueryMask`), by the resolved implementation
    ``name`` (not "auto"). The kernels need ``Tq == Tk`` and the mask of the whole row.

    Raises:
      ValueError: ``block_size <= 0``.
    """
    block_size = BLOCK if block_size is None else block_size
    if block_size <= 0:
        raise ValueError(f"attention: block_size must be > 0, got {block_size}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if variant.scale is None else variant.scale
    kh = k.shape[2]
    sinks = None if sinks is None else sinks.reshape(kh, q.shape[2] // kh)      # [K, G]
    if name == "xla":
        return _xla(q, k, v, mask, scale, variant, sinks)
    if name == "blockwise":
        return _blockwise(q, k, v, mask, scale, block_size, block_size, variant, sinks)
    if not variant.plain:
        raise ValueError(f"attention: {name!r} does not express {variant}")
    own = "tpu" if name == "splash" else "gpu"
    interp = (jax.default_backend() != own) if interpret is None else interpret
    return (_splash if name == "splash" else _gpu_flash)(q, k, v, mask, scale, interp)
