"""Per-token log-probabilities under a (tempered) policy: the one definition that the
sampler and the learner share, so behaviour and recomputed logprobs agree bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float | jax.Array = 1.0
                   ) -> jax.Array:
    """log pi(token) under softmax(logits / temperature).

    Args:
      logits: ``[..., vocab]`` float; computed in float32.
      tokens: ``[...]`` int32 token ids, same leading shape as ``logits``.
      temperature: > 0 scalar (or broadcastable to ``[...]``). The sampler draws from
        softmax(logits / T), so the logprob it reports is that of the tempered
        distribution (logits [2, 1, 0] at T = 0.5: token 0 has log_softmax([4, 2, 0])[0]
        = -0.14293, not -0.40761 untempered nor -0.40761 / 0.5).

    Returns:
      ``[...]`` float32 log-probabilities.
    """
    logits = logits.astype(jnp.float32)
    t = jnp.asarray(temperature, jnp.float32)
    scaled = logits / t[..., None] if t.ndim else logits / t
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
