"""Rollout routing replay in the decoder's forward: recorded expert ids in, per-layer router
agreement out (pure functions; the record side is :mod:`rlflow.exchange.routing`).

R3 (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers", arXiv 2510.11370, sec. 3): the learner's forward routes each token to
the experts the sampler chose (:func:`rlflow.models.moe.route` with ``replay_ids``), gates
from its own router. Whether or not it replays, the learner's *own* top-k is compared with
the sampler's choice: the router agreement, the fraction of token-layers whose top-k *sets*
are equal (the paper's "routing consistency" diagnostic, sec. 2.2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlflow.models.moe import Routing


def layer_major(routing_ids: jax.Array) -> jax.Array:
    """``[B, T, L, k]`` recorded ids (the batch's layout) -> ``[L, B, T, k]`` (one slice per
    scanned layer)."""
    return jnp.moveaxis(routing_ids, 2, 0)


def agreement_sums(routing: Routing, recorded: jax.Array) -> jax.Array:
    """One layer's router agreement terms: float32 ``[2]``, ``(token-layers whose own top-k
    set equals the recorded set, token-layers with a recorded choice)``.

    Args:
      routing: the layer's :class:`rlflow.models.moe.Routing` of ``N`` tokens (its
        ``probs [N, n]`` give this router's own top-k, whatever ids it ran).
      recorded: ``[..., k]`` int ids the sampler chose for the same ``N`` tokens, -1 where
        none was recorded (not counted).

    The sets are compared sorted, so the top-k order (which equal probabilities may swap)
    does not count; ties inside the top-k are as ``jax.lax.top_k`` breaks them.
    """
    k = routing.expert_ids.shape[-1]
    rec = recorded.reshape(-1, k).astype(jnp.int32)
    own = jax.lax.top_k(routing.probs, k)[1]
    same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(rec, axis=-1), axis=-1)
    counted = jnp.all(rec >= 0, axis=-1)
    return jnp.stack([jnp.sum(same & counted), jnp.sum(counted)]).astype(jnp.float32)
