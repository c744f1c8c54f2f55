"""KV cache of the decoder: fixed-length (static-shape) per-row key/value buffers."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Keys and values of every layer, written per row at explicit cache positions.

    Attributes:
      k: ``L`` arrays ``[B, K, S, D]``, one per layer: keys (RoPE already applied),
        dtype ``cfg.dtype``. One array per layer, heads before positions: a decode step
        updates and reads each layer's buffer in place (a stacked ``[L, ..]`` array
        costs a copy of the layer's slice per step on XLA CPU, and a ``[.., S, K, D]``
        layout a transpose).
      v: ``L`` arrays ``[B, K, S, D]``, values.
      mask: ``[B, S]`` bool: the entry holds a real (non-pad) token.
    """

    k: tuple
    v: tuple
    mask: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def init_cache(cfg, batch: int, max_len: int) -> KVCache:
    """An empty cache: per layer zero keys/values ``[batch, K, max_len, D]`` in ``cfg.dtype``,
    mask all False.

    Raises:
      ValueError: ``batch`` or ``max_len`` is not positive.
    """
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_cache: batch and max_len must be > 0, got {batch}, {max_len}")
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # noqa: E731
    return KVCache(k=zeros(), v=zeros(), mask=jnp.zeros((batch, max_len), bool))
