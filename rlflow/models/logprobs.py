"""Per-token log-probabilities under a (tempered) policy: the one definition that the
sampler and the learner share, so behaviour and recomputed logprobs agree bit for bit."""

from __future__ import annotations

import math

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


def entropy_from_logits(logits) -> jax.Array:
    """Entropy ``H = logsumexp(z) - sum softmax(z) z`` of each ``[..., V]`` row, float32 ``[...]``."""
    z = jnp.asarray(logits).astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)


def tempered_entropy(logits: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
    """:func:`entropy_from_logits` of ``logits / temperature`` without gradient, float32
    ``[...]`` (the policy entropy metric of the tempered sampling distribution)."""
    return entropy_from_logits(jax.lax.stop_gradient(logits) / temperature)


def chunked_logprobs(project, hidden: jax.Array, tokens: jax.Array,
                     temperature: float | jax.Array = 1.0, chunk: int = 0, groups: int = 1
                     ) -> tuple[jax.Array, jax.Array]:
    """:func:`token_logprobs` of ``tokens`` and :func:`tempered_entropy`, from hidden states,
    ``chunk`` positions at a time, so ``[N, vocab]`` float32 logits are never held at once.

    The positions (all leading axes flattened, ``N`` of them) are viewed as ``groups``
    equal spans (``[groups, N / groups]``; the sharded groups of the learner's loss
    positions, one per device, :mod:`rlflow.learner.loss_positions`), each cut into
    ``ceil(N / groups / chunk)`` chunks (the last padded); ``lax.map`` runs one chunk of
    every group at a time through ``project`` and the log-softmax under ``jax.checkpoint``,
    so the backward recomputes a chunk's logits instead of storing them: live float32
    ``[groups, chunk, vocab]`` (x3 with the log-softmax and its gradient; ``[chunk, vocab]``
    per device when the groups are split over the devices) instead of ``[N, vocab]``, for
    one extra LM-head matmul in the backward. The same definition as the unchunked path
    (each token's logprob depends on its own row only), so values agree within float32
    rounding.

    Args:
      project: ``[..., E] -> [..., vocab]`` float32 logits (``Decoder.project``).
      hidden: ``[..., E]`` final-normed hidden states.
      tokens: ``[...]`` int32 ids (``hidden``'s leading shape).
      temperature: > 0 scalar.
      chunk: positions per chunk and group; 0 (or >= N / groups): one pass over all
        positions.
      groups: spans chunked side by side (must divide ``N``).

    Returns:
      ``(logprobs, entropy)``, float32 ``[...]`` each (entropy carries no gradient).
    """
    lead = tokens.shape
    n = math.prod(lead)
    if n % groups:
        raise ValueError(f"chunked_logprobs: {n} positions do not split into {groups} groups")
    per = n // groups
    if chunk <= 0 or chunk >= per:
        logits = project(hidden)
        return token_logprobs(logits, tokens, temperature), tempered_entropy(logits, temperature)
    chunks = -(-per // chunk)
    pad = chunks * chunk - per
    h = jnp.pad(hidden.reshape(groups, per, hidden.shape[-1]), ((0, 0), (0, pad), (0, 0)))
    t = jnp.pad(tokens.reshape(groups, per), ((0, 0), (0, pad)))

    @jax.checkpoint
    def one(xs):
        h_c, t_c = xs                        # [groups, chunk, E], [groups, chunk]
        logits = project(h_c.reshape(-1, h_c.shape[-1]))           # one 2-D matmul
        logits = logits.reshape(t_c.shape + logits.shape[-1:])
        return token_logprobs(logits, t_c, temperature), tempered_entropy(logits, temperature)

    def to_chunks(x):                        # [groups, chunks * chunk, ...] -> [chunks, groups, chunk, ...]
        x = x.reshape((groups, chunks, chunk) + x.shape[2:])
        # one group: a reshape, no transpose (a copy of the hidden states and its gradient)
        return x.reshape((chunks, 1, chunk) + x.shape[3:]) if groups == 1 else x.swapaxes(0, 1)

    def back(x):                             # [chunks, groups, chunk] -> lead
        x = x.reshape(1, -1) if groups == 1 else x.swapaxes(0, 1).reshape(groups, -1)
        return x[:, :per].reshape(lead)

    logp, ent = jax.lax.map(one, (to_chunks(h), to_chunks(t)))
    return back(logp), back(ent)
