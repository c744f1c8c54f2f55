"""KV cache of the decoder: fixed-length (static-shape) per-row key/value buffers."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Keys and values of every layer, written per row at explicit cache positions.

    Attributes:
      k: ``[L, B, S, K, D]`` keys (RoPE already applied), dtype ``cfg.dtype``.
      v: ``[L, B, S, K, D]`` values.
      mask: ``[B, S]`` bool: the entry holds a real (non-pad) token.
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(cfg, batch: int, max_len: int) -> KVCache:
    """An empty cache: zero keys/values ``[L, batch, max_len, K, D]`` in ``cfg.dtype``,
    mask all False.

    Raises:
      ValueError: ``batch`` or ``max_len`` is not positive.
    """
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_cache: batch and max_len must be > 0, got {batch}, {max_len}")
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   mask=jnp.zeros((batch, max_len), bool))
