"""The decode state of linear-attention (gated DeltaNet) layers in the sampler's cached
forward: per slot the layer's :class:`rlflow.models.gdn_layer.GDNState` (conv windows and
the recurrent matrix), carried in :class:`rlflow.models.kv_cache.KVCache`'s ``linear`` field
instead of keys and values, and the layer run from it over ``T`` new tokens per row.

Padding among the new tokens (``attention_mask`` False) leaves a row's state as it was: a
padded position decays nothing and writes nothing (``g = 0``, ``beta = 0`` there, so the
rule's ``S <- exp(g) S (I - beta k k^T) + beta v k^T`` is the identity), and the new conv
window holds the last ``K - 1`` inputs up to the row's last real token. Exact when a row's
real tokens are contiguous (the sampler's right-padded prefill and extend, a decode step
with inactive rows) and for left padding before a fresh (zero) state (HF-style batches);
an interior gap is treated as absent tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlflow.models import gated_delta
from rlflow.models.gdn_layer import GatedDeltaNet, GDNState


def _window(state: jax.Array, x: jax.Array, end: jax.Array) -> jax.Array:
    """The conv window after a row's last real token: ``K - 1`` inputs of ``concat(state
    [B, K - 1, H, d], x [B, T, H, d])`` ending at input ``end[b] - 1`` of ``x`` (``end``
    0: the old window)."""
    both = jnp.concatenate([state, x.astype(state.dtype)], axis=1)
    idx = end[:, None] + jnp.arange(state.shape[1], dtype=jnp.int32)[None, :]   # [B, K - 1]
    return jnp.take_along_axis(both, idx[:, :, None, None], axis=1)


def run_cached(layer: GatedDeltaNet, x: jax.Array, attention_mask: jax.Array,
               state: GDNState) -> tuple[jax.Array, GDNState]:
    """The layer over ``x [B, T, E]`` from the slots' ``state`` (module doc for padding).

    Args:
      layer: the :class:`rlflow.models.gdn_layer.GatedDeltaNet`.
      x: ``[B, T, E]`` normed hidden states of the new tokens.
      attention_mask: ``[B, T]`` bool, False on padding.
      state: each row's :class:`GDNState` before the new tokens.

    Returns:
      ``(y [B, T, E], new state)``; ``y`` at padded positions is meaningless.
    """
    mask = jnp.asarray(attention_mask, bool)
    x = x.astype(layer.dtype) * mask[..., None].astype(layer.dtype)
    parts, z, beta, g = layer._project(x)
    beta = jnp.where(mask[..., None], beta, 0.0)
    g = jnp.where(mask[..., None], g, 0.0)
    if x.shape[1] == 1:                                   # decode: one token per row
        (q, k, v), convs = layer._convs([p[:, 0] for p in parts], state[:3])
        o, rec = gated_delta.gated_delta_step(q, k, v, g[:, 0], beta[:, 0], state.recurrent,
                                              precision=layer._precision())
        keep = mask[:, 0]
        new = GDNState(*convs, rec)
        new = jax.tree.map(lambda n, o_: jnp.where(
            keep.reshape((-1,) + (1,) * (n.ndim - 1)), n, o_), new, state)
        return layer._out(o, z[:, 0])[:, None], new
    (q, k, v), _ = layer._convs(parts, state[:3])
    o, rec = gated_delta.gated_delta_rule(
        q, k, v, g, beta, impl=layer.spec.impl, chunk_size=layer.spec.chunk_size,
        initial_state=state.recurrent, precision=layer._precision())
    t = x.shape[1]
    end = jnp.max(jnp.where(mask, jnp.arange(1, t + 1, dtype=jnp.int32)[None, :], 0), axis=1)
    convs = [_window(s, p, end) for s, p in zip(state[:3], parts)]
    return layer._out(o, z), GDNState(*convs, rec)
