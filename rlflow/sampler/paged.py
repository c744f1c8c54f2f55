"""The engine's device side of a paged KV cache (``sampler.kv_cache = "paged"``).

The decode state's cache is a :class:`rlflow.models.paged_kv_cache.PagedKVCache` of
``sampler.pool_pages`` pages (``N``) of ``sampler.page_size`` tokens (``P``) per layer and
a page table ``[slots, M]`` (``M = sampler.pages_per_slot``). Prefill is unchanged (a
:class:`rlflow.sampler.decode_state.Prefix` holds contiguous ``[n, K, D, bucket]`` keys);
:func:`insert_prefix` writes a prefix row's entries into the pages of the slot it is
inserted into, and a linear-attention (gated DeltaNet) layer's state at the prompt's end
from the prefix row into each slot's own state (a group's samples each get a copy). The
host (:class:`rlflow.sampler.paged_batching.PagedSlots`) owns the page table: it takes
pages for a slot before any device call writes there, and uploads the table
(:meth:`rlflow.sampler.engine.RlflowEngine.set_page_table`) when it changed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlflow.models.kv_cache import KVCache
from rlflow.models.paged_kv_cache import (PagedKVCache, init_paged_cache, page_slots,
                                          resolve_attention, write_pages)
from rlflow.models.window_cache import insert_ring


def paged_settings(sampler_cfg, backend: str) -> dict:
    """``init_paged_cache`` keyword sizes of a sampler config (pages, page size, pages per
    slot, attention resolved for ``backend``)."""
    return dict(num_pages=sampler_cfg.pool_pages, page_size=sampler_cfg.page_size,
                pages_per_row=sampler_cfg.pages_per_slot,
                attention=resolve_attention(sampler_cfg.paged_attention, backend))


def init_state_cache(cfg, slots: int, settings: dict) -> PagedKVCache:
    """The decode state's empty paged cache (``settings``: :func:`paged_settings`)."""
    return init_paged_cache(cfg, slots, **settings)


def insert_prefix(cache: PagedKVCache, prefix: KVCache, rows: jax.Array, slots: jax.Array,
                  keep: jax.Array) -> PagedKVCache:
    """Write prefix rows into the pages of slots.

    Args:
      cache: the decode state's paged cache (its page table already holds the slots' pages).
      prefix: a prefill's contiguous cache, keys ``[n, K, D, W]``, values ``[n, K, W, D]``.
      rows / slots: int32 ``[m]``: prefix row ``rows[j]`` goes to slot ``slots[j]``; a slot
        ``>= B`` is padding (nothing written).
      keep: bool ``[m, W]``: the prefix entries that hold prompt tokens (the rest are not
        written, so no page outside the slot's table is touched).

    Returns:
      The cache with the entries in the slots' pages, each slot's mask row reset to
      ``keep`` (its positions past ``W`` False) and each slot's linear-attention states
      those of its prefix row. Samples of one group share their full prompt pages: each
      writes the same values there.
    """
    b, n_pages = cache.page_table.shape[0], cache.num_pages
    m, w = keep.shape
    valid = slots < b
    table = jnp.where(valid[:, None], cache.page_table[jnp.minimum(slots, b - 1)], n_pages)
    cols = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (m, w))
    page, offset = page_slots(table, cols, cache.page_size)
    page = jnp.where(keep, page, n_pages)
    def layer(i, pools, news, seq_axis, order):
        if pools[i] is None:                           # a linear-attention layer
            return None
        if not cache.is_pool(i):                       # a sliding layer's ring per slot
            return insert_ring(pools[i], news[i], rows, slots, seq_axis)
        return write_pages(pools[i], news[i][rows].transpose(order), page, offset)
    n = len(cache.k)
    ks = tuple(layer(i, cache.k, prefix.k, 3, (0, 3, 1, 2)) for i in range(n))
    vs = tuple(layer(i, cache.v, prefix.v, 2, (0, 2, 1, 3)) for i in range(n))
    row_mask = jnp.zeros((m, cache.max_len), bool).at[:, :w].set(keep)
    linear = jax.tree.map(lambda d, s: d.at[slots].set(s[rows].astype(d.dtype), mode="drop"),
                          cache.linear, prefix.linear)
    return cache.replace(k=ks, v=vs, mask=cache.mask.at[slots].set(row_mask, mode="drop"),
                         linear=linear)


def slot_rows(cache, slots: jax.Array):
    """The cache seen by ``m`` slots (padding slots ``>= B`` see no page, so a forward over
    them writes nothing): a paged cache with those rows of the page table, mask, sliding
    layers' rings and linear-attention states (pools shared), or a contiguous cache's
    rows."""
    b = cache.mask.shape[0]
    safe = jnp.minimum(slots, b - 1)
    rows = lambda t: jax.tree.map(lambda a: a[safe], t)   # noqa: E731 (None: a GDN layer)
    if isinstance(cache, PagedKVCache):
        table = jnp.where((slots < b)[:, None], cache.page_table[safe], cache.num_pages)
        own = lambda t: tuple(a if cache.is_pool(i) else rows(a)  # noqa: E731 (rings)
                              for i, a in enumerate(t))
        return cache.replace(k=own(cache.k), v=own(cache.v), page_table=table,
                             mask=cache.mask[safe], linear=rows(cache.linear))
    return KVCache(k=rows(cache.k), v=rows(cache.v), mask=cache.mask[safe],
                   linear=rows(cache.linear))


def set_slot_rows(cache, sub, slots: jax.Array):
    """Inverse of :func:`slot_rows` after a forward over ``sub``: its rows put back into
    ``cache`` (padding slots dropped); a paged cache takes ``sub``'s pools whole."""
    def put(dst, src):
        return dst.at[slots].set(src.astype(dst.dtype), mode="drop")
    if isinstance(cache, PagedKVCache):
        back = lambda t, s: tuple(b if cache.is_pool(i) or a is None else put(a, b)  # noqa: E731
                                  for i, (a, b) in enumerate(zip(t, s)))
        return cache.replace(k=back(cache.k, sub.k), v=back(cache.v, sub.v),
                             mask=put(cache.mask, sub.mask),
                             linear=jax.tree.map(put, cache.linear, sub.linear))
    return KVCache(k=jax.tree.map(put, cache.k, sub.k), v=jax.tree.map(put, cache.v, sub.v),
                   mask=put(cache.mask, sub.mask), linear=jax.tree.map(put, cache.linear,
                                                                       sub.linear))
