"""The KV cache of a sliding-window layer holds only the window: a ring buffer per slot.

A layer of window ``W`` (a query at cache position ``p`` attends keys at ``p - W < s <= p``:
Gemma 3's local layers, gpt-oss's sliding ones; Beltagy et al. 2020, "Longformer", sec. 3.1)
never reads a key more than ``W - 1`` positions back, so its cache keeps ``R = min(W, S)``
entries per row (:func:`rlflow.models.kv_cache.cache_length`; ``S`` the cache's positions),
position ``p`` in entry ``p % R`` (as HF's ``StaticSlidingWindowLayer``, of
``min(max_cache_len, sliding_window)`` entries, and Mistral's rolling buffer cache, Jiang et
al. 2023, "Mistral 7B", sec. 2). Keys ``[B, K, D, R]`` and values ``[B, K, R, D]``, in the
contiguous :class:`rlflow.models.kv_cache.KVCache` and in the paged
:class:`rlflow.models.paged_kv_cache.PagedKVCache` alike (a ring per slot there, beside the
full-attention layers' pages: its memory is ``R`` positions per slot whatever the sequence's
length).

A forward over ``T`` new tokens (:func:`ring_update`, :func:`ring_mask`) attends the ring as
it was (the positions before ``cache_index``) joined with the ``T`` new keys, ``R + T``
keys, and then writes the new real tokens into the ring: only the last ``R`` of them (a
prefill longer than the ring keeps its end; written positions never collide), never a
padding token (a right-padded prefill's pads would overwrite the prompt's end).

Which position an entry holds is not stored: a row's cached tokens are contiguous and
written in order (the sampler's prefill, decode and extend; a left-padded batch's pads are
never written), so before a call starting at ``c = cache_index`` entry ``j`` holds
``p_j = c - 1 - ((c - 1 - j) mod R)``, the latest position below ``c`` of its residue, which
is valid when ``p_j >= 0`` and the cache's ``[B, S]`` mask (kept for every position) marks
it real. A slot's decode step writes nothing while it is inactive (its token mask is False),
so a parked episode's ring stays as its last turn left it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlflow.models.kv_cache import write_cache


def ring_mask(r: int, cols: jax.Array, token_mask: jax.Array, old_mask: jax.Array,
              window: int) -> jax.Array:
    """Which of the ``R + T`` keys :func:`ring_update` returns each new token attends:
    ``[B, T, R + T]`` bool (the old ring's entries first, module doc, then the new tokens,
    causal), all within ``window``.

    Args:
      r: ``R``, the ring's entries.
      cols: int32 ``[B, T]`` the new tokens' cache positions (consecutive; ``cols[:, 0]``
        the row's ``cache_index``).
      token_mask: ``[B, T]`` bool, False on padding.
      old_mask: ``[B, S]`` bool, the cache's mask before this call (real positions).
      window: ``W``.
    """
    start = cols[:, :1]                                                       # [B, 1]
    j = jnp.arange(r, dtype=jnp.int32)[None, :]
    held = start - 1 - jnp.mod(start - 1 - j, r)                             # [B, R]
    safe = jnp.clip(held, 0, old_mask.shape[1] - 1)
    real = (held >= 0) & jnp.take_along_axis(old_mask, safe, axis=1)
    old = real[:, None, :] & (cols[:, :, None] - held[:, None, :] < window)  # [B, T, R]
    t = cols.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    new = token_mask[:, None, :] & causal & (cols[:, :, None] - cols[:, None, :] < window)
    return jnp.concatenate([old, new], axis=2)


def ring_update(k_ring: jax.Array, v_ring: jax.Array, k: jax.Array, v: jax.Array,
                cols: jax.Array, token_mask: jax.Array):
    """One sliding layer's ring after ``T`` new tokens, and what its attention reads.

    Args:
      k_ring / v_ring: the ring's keys ``[B, K, D, R]`` / values ``[B, K, R, D]``.
      k, v: the new keys / values ``[B, T, K, D]`` (RoPE applied).
      cols, token_mask: as :func:`ring_mask`.

    Returns:
      ``(k_ring, v_ring, (keys [B, K, D, R + T], values [B, K, R + T, D]))``: the ring with
      the new real tokens written (the last ``R`` of them; in its dtype) and the old ring
      joined with the new tokens (in ``k``'s dtype), the keys :func:`ring_mask` masks.
    """
    r = k_ring.shape[3]
    keys = jnp.concatenate([k_ring.astype(k.dtype), k.transpose(0, 2, 3, 1)], axis=3)
    values = jnp.concatenate([v_ring.astype(v.dtype), v.transpose(0, 2, 1, 3)], axis=2)
    last = jnp.max(jnp.where(token_mask, cols, -1), axis=1, keepdims=True)   # [B, 1]
    write = token_mask & (cols > last - r)
    dst = jnp.where(write, jnp.mod(cols, r), r)                               # r: dropped
    return (write_cache(k_ring, k, dst, seq_axis=3), write_cache(v_ring, v, dst, seq_axis=2),
            (keys, values))


def insert_ring(ring: jax.Array, prefix_ring: jax.Array, rows: jax.Array, slots: jax.Array,
                seq_axis: int) -> jax.Array:
    """A prefill's rings copied into slots: ``prefix_ring`` row ``rows[j]`` (``[n, K, D,
    R']`` keys, ``seq_axis`` 3, or ``[n, K, R', D]`` values, 2) into the first ``R'`` entries
    of slot ``slots[j]`` of ``ring`` (``R >= R'``: ``R' = min(W, bucket)``, so the entry of
    each prompt position is the same in both); slots ``>= B`` are dropped."""
    r = prefix_ring.shape[seq_axis]
    at = (slots,) + tuple(slice(0, r) if a == seq_axis else slice(None) for a in (1, 2, 3))
    return ring.at[at].set(prefix_ring[rows].astype(ring.dtype), mode="drop")
