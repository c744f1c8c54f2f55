"""KV cache of the decoder: fixed-length (static-shape) per-row key/value buffers."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Keys and values of every layer, written per row at explicit cache positions.

    Attributes:
      k: ``L`` arrays ``[B, K, D, S]``, one per layer (a sliding-window layer's ``[B, K,
        D, R]``, a ring of its window: :mod:`rlflow.models.window_cache`): keys (RoPE
        already applied),
        dtype ``cfg.dtype``, head dim before positions. A decode step's scores
        ``sum_D q [B, K, G, D] * k -> [B, K, G, S]`` then reduce over the keys'
        second-minor axis, with vector loads along S (with ``[B, K, S, D]`` keys the same
        reduction runs along the minor axis, ~5x slower on XLA:CPU at the 4.46M
        benchmark size, and as a dot XLA:CPU copies the layer's cache every step).
      v: ``L`` arrays ``[B, K, S, D]``, values (``sum_S probs * v`` reduces over the
        second-minor axis too). One array per layer: a decode step updates and reads
        each layer's buffer in place (a stacked ``[L, ..]`` array costs a copy of the
        layer's slice per step on XLA CPU).
      mask: ``[B, S]`` bool: the entry holds a real (non-pad) token.
      linear: ``()`` for a model without linear-attention layers; else ``L`` entries, a
        :class:`rlflow.models.gdn_layer.GDNState` per linear-attention (gated DeltaNet)
        layer (its ``k`` / ``v`` entries None) and None per attention layer
        (:mod:`rlflow.models.gdn_cache`).
    """

    k: tuple
    v: tuple
    mask: jax.Array
    linear: tuple = ()

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]


def init_cache(cfg, batch: int, max_len: int) -> KVCache:
    """An empty cache: per full-attention layer zero keys ``[batch, K, D, max_len]`` and
    values ``[batch, K, max_len, D]`` in ``cfg.dtype``, per sliding-window layer a ring of
    ``R = min(window, max_len)`` entries (keys ``[batch, K, D, R]``, values ``[batch, K, R,
    D]``: :mod:`rlflow.models.window_cache`), per linear-attention layer a zero
    :class:`rlflow.models.gdn_layer.GDNState` (``linear``), mask ``[batch, max_len]`` all
    False.

    Raises:
      ValueError: ``batch`` or ``max_len`` is not positive.
    """
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_cache: batch and max_len must be > 0, got {batch}, {max_len}")
    dtype = jnp.dtype(cfg.dtype)
    linear = [kind == "linear_attention" for kind in cfg.kinds]
    lengths = [cache_length(cfg, kind, max_len) for kind in cfg.kinds]
    k_shape = lambda n: (batch, cfg.num_kv_heads, cfg.head_dim, n)  # noqa: E731
    v_shape = lambda n: (batch, cfg.num_kv_heads, n, cfg.head_dim)  # noqa: E731
    zeros = lambda shape: tuple(None if lin else jnp.zeros(shape(n), dtype)  # noqa: E731
                                for lin, n in zip(linear, lengths))
    states = ()
    if any(linear):
        from rlflow.models.blocks import gdn_spec
        from rlflow.models.gdn_layer import init_state
        states = tuple(init_state(gdn_spec(cfg), batch) if lin else None for lin in linear)
    return KVCache(k=zeros(k_shape), v=zeros(v_shape), mask=jnp.zeros((batch, max_len), bool),
                   linear=states)


def cache_length(cfg, kind: str, max_len: int) -> int:
    """Cache entries per row of a layer of ``kind`` in a cache of ``max_len`` positions:
    ``min(cfg.sliding_window, max_len)`` for ``"sliding_attention"`` (a ring of the window,
    :mod:`rlflow.models.window_cache`), else ``max_len``."""
    if kind == "sliding_attention" and cfg.sliding_window is not None:
        return min(int(cfg.sliding_window), int(max_len))
    return int(max_len)


def write_cache(cache: jax.Array, new: jax.Array, cols: jax.Array, seq_axis: int) -> jax.Array:
    """One layer's keys or values with ``T`` new entries per row written in.

    Args:
      cache: ``[B, K, D, S]`` keys (``seq_axis`` 3) or ``[B, K, S, D]`` values (2).
      new: ``[B, T, K, D]`` new keys or values (any float dtype; rounded to the cache's).
      cols: int32 ``[B, T]`` cache positions; positions ``>= S`` are dropped.

    Returns:
      The cache with ``new[b, t]`` at position ``cols[b, t]`` of row ``b``, in its dtype.

    How (same bits either way): a scatter, done in place, except for a 2-byte cache
    (bfloat16) at ``T == 1`` (the decode step), which takes a one-hot select: one pass over
    the cache. XLA:CPU upcasts a bfloat16 scatter to float32, converting the whole cache
    there and back on every step (benchmarks/sampler_throughput.py). A prefill (``T > 1``,
    once per prompt) keeps the scatter.
    """
    b, t = cols.shape
    new = new.astype(cache.dtype)
    two_byte = jnp.dtype(cache.dtype).itemsize == 2
    if two_byte and t == 1:
        shape = [b, 1, 1, 1]
        shape[seq_axis] = cache.shape[seq_axis]
        hit = jnp.arange(cache.shape[seq_axis], dtype=jnp.int32)[None, :] == cols   # [B, S]
        at = new.transpose(0, 2, 3, 1) if seq_axis == 3 else new.swapaxes(1, 2)
        return jnp.where(hit.reshape(shape), at, cache)
    # Index arrays around a slice: the indexed shape is [B, T, K, D], new's.
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    index = (rows, slice(None), slice(None), cols) if seq_axis == 3 else (rows, slice(None), cols)
    return cache.at[index].set(new, mode="drop")
