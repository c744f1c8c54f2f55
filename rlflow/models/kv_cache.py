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
    """An empty cache: per attention layer zero keys ``[batch, K, D, max_len]`` and values
    ``[batch, K, max_len, D]`` in ``cfg.dtype``, per linear-attention layer a zero
    :class:`rlflow.models.gdn_layer.GDNState` (``linear``), mask all False.

    Raises:
      ValueError: ``batch`` or ``max_len`` is not positive.
    """
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_cache: batch and max_len must be > 0, got {batch}, {max_len}")
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len)
    v_shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    linear = [kind == "linear_attention" for kind in cfg.kinds]
    zeros = lambda shape: tuple(None if lin else jnp.zeros(shape, dtype)  # noqa: E731
                                for lin in linear)
    states = ()
    if any(linear):
        from rlflow.models.blocks import gdn_spec
        from rlflow.models.gdn_layer import init_state
        states = tuple(init_state(gdn_spec(cfg), batch) if lin else None for lin in linear)
    return KVCache(k=zeros(k_shape), v=zeros(v_shape), mask=jnp.zeros((batch, max_len), bool),
                   linear=states)
