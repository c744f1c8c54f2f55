"""Paged KV cache of the decoder: a pool of fixed-size pages per layer and a page table per row.

The vLLM design (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", sec. 4.1-4.2): a row's cache positions ``0, 1, 2, ...`` are
split into pages of ``P`` tokens; logical page ``j`` of row ``b`` lives in physical page
``page_table[b, j]`` of the layer's pool. Pages are taken as a sequence grows and returned
when it ends (the host-side allocator, :mod:`rlflow.sampler.page_pool`), so memory follows
the tokens actually held, not ``rows x longest sequence``.

Layout: each layer's keys and values are ``[K, N, P, D]`` (KV heads, pages, tokens in a
page, head dim), the layout of the TPU kernel
``jax.experimental.pallas.ops.tpu.paged_attention`` (``k_pages [num_kv_heads,
total_num_pages, page_size, head_dim]``). A page-table entry ``N`` (one past the last page)
means "no page": writes through it are dropped, reads are clamped and masked.

Only full-attention layers are paged. Linear-attention (gated DeltaNet) layers hold no keys
or values: their ``k`` / ``v`` entries are None and each slot's recurrent state sits in
``linear`` (per slot, as in the contiguous cache: :mod:`rlflow.models.gdn_cache`). A
sliding-window layer holds only its window, a ring of ``R = min(W, M * P)`` entries per slot
(keys ``[B, K, D, R]``, values ``[B, K, R, D]``, as in the contiguous cache:
:mod:`rlflow.models.window_cache`; ``rings`` marks those layers), so its memory does not grow
with the sequence and no page of it ever falls out of the window. Both are per slot: a
group's samples each get a copy of the prompt's at insert, and a preempted sequence's are
recomputed by its resume (prefill + extend), as its pages' entries are.

Attention over pages (:func:`layer_attention_inputs`): on TPU the library kernel for a
decode step (one query per row); elsewhere (CPU, GPU, and every prefill) an XLA gather of
the row's pages into the contiguous ``[B, K, D, S]`` / ``[B, K, S, D]`` views that the
contiguous cache's attention reads (``S = pages_per_row x P``), so both caches share one
attention code path and give the same values up to the length of the masked tail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from rlflow.models.kv_cache import cache_length

#: Attention over pages: "gather" (XLA gather into contiguous views, any backend) or
#: "kernel" (the Pallas TPU paged-attention kernel for decode steps; TPU only).
PAGED_ATTENTION = ("auto", "gather", "kernel")


@struct.dataclass
class PagedKVCache:
    """Keys and values of every layer in pages, and each row's page table.

    Attributes:
      k: ``L`` entries, one per layer: keys ``[K, N, P, D]`` (RoPE applied), ``cfg.dtype``;
        a sliding layer's ring ``[B, K, D, R]``; None for a linear-attention layer.
      v: ``L`` entries ``[K, N, P, D]`` (a ring ``[B, K, R, D]``, or None): values.
      page_table: int32 ``[B, M]``: physical page of each row's logical page ``j``
        (position ``t`` is in logical page ``t // P``); ``N`` = no page.
      mask: ``[B, M * P]`` bool: the logical position holds a real (non-pad) token.
      attention: "gather" or "kernel" (static; see the module doc).
      linear: ``()`` for a model without linear-attention layers; else ``L`` entries, a
        :class:`rlflow.models.gdn_layer.GDNState` ``[B, ...]`` per linear-attention layer
        (each slot's conv windows and recurrent matrix) and None per attention layer.
      rings: static, per layer: its ``k`` / ``v`` are a ring per slot (a sliding-window
        layer), not pools; ``()``: none are.
    """

    k: tuple
    v: tuple
    page_table: jax.Array
    mask: jax.Array
    attention: str = struct.field(pytree_node=False, default="gather")
    linear: tuple = ()
    rings: tuple = struct.field(pytree_node=False, default=())

    def is_pool(self, layer: int) -> bool:
        """Layer ``layer``'s ``k`` / ``v`` are page pools (a full-attention layer)."""
        return self.k[layer] is not None and not (self.rings and self.rings[layer])

    def _pool(self) -> jax.Array:
        return next(self.k[i] for i in range(len(self.k)) if self.is_pool(i))

    @property
    def page_size(self) -> int:
        return self.mask.shape[1] // self.page_table.shape[1]

    @property
    def num_pages(self) -> int:
        return self._pool().shape[1]

    @property
    def max_len(self) -> int:
        """Logical positions per row: ``M * P``."""
        return self.mask.shape[1]


def resolve_attention(choice: str, backend: str) -> str:
    """The attention over pages for ``choice`` (one of :data:`PAGED_ATTENTION`) on
    ``backend``: "auto" is "kernel" on TPU, "gather" elsewhere.

    Raises:
      ValueError: an unknown choice, or "kernel" off TPU (the Pallas kernel is TPU-only).
    """
    if choice not in PAGED_ATTENTION:
        raise ValueError(f"sampler.paged_attention must be one of {list(PAGED_ATTENTION)}, "
                         f"got {choice!r}")
    if choice == "auto":
        return "kernel" if backend == "tpu" else "gather"
    if choice == "kernel" and backend != "tpu":
        raise ValueError(f"sampler.paged_attention='kernel' (the Pallas TPU paged_attention "
                         f"kernel) needs a TPU, the backend is {backend!r}; use 'gather' or "
                         f"'auto'")
    return choice


def init_paged_cache(cfg, rows: int, num_pages: int, page_size: int, pages_per_row: int,
                     attention: str = "gather") -> PagedKVCache:
    """An empty paged cache: per full-attention layer zero pools ``[K, num_pages, page_size,
    D]`` in ``cfg.dtype``, per sliding-window layer a zero ring per row (module doc), per
    linear-attention layer a zero
    :class:`rlflow.models.gdn_layer.GDNState` of ``rows`` slots (``linear``), every
    page-table entry ``num_pages`` (no page), mask all False.

    Raises:
      ValueError: a size is not positive, or the model has no full-attention layer (nothing
        to page: names ``sampler.kv_cache``).
    """
    if min(rows, num_pages, page_size, pages_per_row) <= 0:
        raise ValueError(f"init_paged_cache: rows, num_pages, page_size, pages_per_row must be "
                         f"> 0, got {rows}, {num_pages}, {page_size}, {pages_per_row}")
    kinds = cfg.kinds
    linear = [kind == "linear_attention" for kind in kinds]
    s = pages_per_row * page_size
    rings = tuple(kind == "sliding_attention" and cfg.sliding_window is not None
                  for kind in kinds)
    if all(a or b for a, b in zip(linear, rings)):
        raise ValueError("sampler.kv_cache='paged': this model has no full-attention layer "
                         "whose keys and values pages would hold; set "
                         "sampler.kv_cache='contiguous'")
    dtype = jnp.dtype(cfg.dtype)
    k, d = cfg.num_kv_heads, cfg.head_dim

    def layer(kind, lin, ring, keys):
        if lin:
            return None
        if ring:                                  # [B, K, D, R] keys, [B, K, R, D] values
            r = cache_length(cfg, kind, s)
            return jnp.zeros((rows, k, d, r) if keys else (rows, k, r, d), dtype)
        return jnp.zeros((k, num_pages, page_size, d), dtype)
    pools = lambda keys: tuple(layer(*x, keys) for x in zip(kinds, linear, rings))  # noqa: E731
    states = ()
    if any(linear):
        from rlflow.models.blocks import gdn_spec
        from rlflow.models.gdn_layer import init_state
        states = tuple(init_state(gdn_spec(cfg), rows) if lin else None for lin in linear)
    return PagedKVCache(k=pools(True), v=pools(False),
                        page_table=jnp.full((rows, pages_per_row), num_pages, jnp.int32),
                        mask=jnp.zeros((rows, s), bool),
                        attention=attention, linear=states,
                        rings=rings if any(rings) else ())


def page_slots(page_table: jax.Array, cols: jax.Array, page_size: int
               ) -> tuple[jax.Array, jax.Array]:
    """Physical (page, offset) of logical positions ``cols [B, T]`` of each row:
    ``page_table[b, cols // P]`` (``N``, dropped, past the table) and ``cols % P``."""
    m = page_table.shape[1]
    logical = cols // page_size
    page = jnp.take_along_axis(page_table, jnp.minimum(logical, m - 1), axis=1)
    n = jnp.iinfo(jnp.int32).max
    return jnp.where(logical < m, page, n), cols % page_size


def write_pages(pool: jax.Array, new: jax.Array, page: jax.Array, offset: jax.Array
                ) -> jax.Array:
    """One layer's pool with ``new [B, T, K, D]`` written at ``(page, offset)`` ``[B, T]``
    (from :func:`page_slots`); entries whose page is out of range are dropped. Rounded to
    the pool's dtype."""
    return pool.at[:, page, offset].set(new.astype(pool.dtype).transpose(2, 0, 1, 3),
                                        mode="drop")


def gather_pages(pool: jax.Array, page_table: jax.Array) -> jax.Array:
    """Each row's pages in logical order: ``[K, N, P, D]`` -> ``[B, K, M * P, D]`` (entries
    ``N`` clamp to the last page: their positions must be masked)."""
    k, _, p, d = pool.shape
    b, m = page_table.shape
    rows = jnp.take(pool, page_table, axis=1, mode="clip")                  # [K, B, M, P, D]
    return rows.transpose(1, 0, 2, 3, 4).reshape(b, k, m * p, d)


def layer_attention_inputs(cache: PagedKVCache, k_pool, v_pool, k, v, cols):
    """Write one layer's new keys / values ``[B, T, K, D]`` at logical positions ``cols
    [B, T]`` and return what its attention reads.

    Returns:
      ``(k_pool, v_pool, read)``: the updated pools and either ``(keys [B, K, D, S], values
      [B, K, S, D])`` gathered from the pages (``S = M * P``; the contiguous cache's
      layout), or, for a decode step (``T == 1``) with ``cache.attention == "kernel"``,
      a function ``q [B, 1, H, D] -> out [B, 1, H, D]`` running the Pallas TPU
      ``paged_attention`` kernel over positions ``<= cols`` (a row's positions before
      ``cols`` are all real tokens in a paged cache, so its length is ``cols + 1``).
    """
    page, offset = page_slots(cache.page_table, cols, cache.page_size)
    k_pool = write_pages(k_pool, k, page, offset)
    v_pool = write_pages(v_pool, v, page, offset)
    if cache.attention == "kernel" and cols.shape[1] == 1:
        return k_pool, v_pool, _kernel_attention(k_pool, v_pool, cache.page_table,
                                                 cols[:, 0] + 1)
    keys = gather_pages(k_pool, cache.page_table).astype(k.dtype).swapaxes(2, 3)
    values = gather_pages(v_pool, cache.page_table).astype(v.dtype)
    return k_pool, v_pool, (keys, values)


def _kernel_attention(k_pool, v_pool, page_table, lengths):
    """``q [B, 1, H, D] -> [B, 1, H, D]``: softmax(q k^T / sqrt(D)) v over each row's first
    ``lengths`` positions by ``jax.experimental.pallas.ops.tpu.paged_attention`` (which does
    not scale q itself)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    m = page_table.shape[1]
    block = max(c for c in (1, 2, 4, 8) if m % c == 0)

    def attend(q):
        d = q.shape[-1]
        out = paged_attention((q[:, 0] * (d ** -0.5)).astype(k_pool.dtype), k_pool, v_pool,
                              lengths.astype(jnp.int32), page_table,
                              pages_per_compute_block=block)
        return out[:, None].astype(q.dtype)
    return attend
