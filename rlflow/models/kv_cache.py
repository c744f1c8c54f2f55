"""KV cache of the decoder: fixed-length (static-shape) per-row key/value buffers."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Keys and values of every layer, written per row at explicit cache positions.

    Attributes:
      k: ``L`` arrays ``[B, K, D, S]``, one per layer: keys (RoPE already applied),
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
    """

    k: tuple
    v: tuple
    mask: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[3]


def init_cache(cfg, batch: int, max_len: int) -> KVCache:
    """An empty cache: per layer zero keys ``[batch, K, D, max_len]`` and values
    ``[batch, K, max_len, D]`` in ``cfg.dtype``, mask all False.

    Raises:
      ValueError: ``batch`` or ``max_len`` is not positive.
    """
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_cache: batch and max_len must be > 0, got {batch}, {max_len}")
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len)
    v_shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    zeros = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # noqa: E731
    return KVCache(k=zeros(k_shape), v=zeros(v_shape), mask=jnp.zeros((batch, max_len), bool))
