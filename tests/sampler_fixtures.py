"""Weights for sampler tests whose greedy tokens are known: the output head's columns of two
tokens exchanged, so the KV cache (and every other logit) stays the same."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PROMPT = [1, 20, 33, 47]


def logits_of(forward, state, seq):
    seq = jnp.asarray([seq], jnp.int32)
    n = seq.shape[1]
    return forward(state, seq, jnp.arange(n)[None], jnp.ones((1, n), bool))[0]


def with_lm_head_swapped(state, a, b):
    """Params whose output columns of tokens a and b are exchanged (KV unaffected)."""
    pure = jax.tree_util.tree_map(lambda x: x, state.to_pure_dict())
    head = np.array(pure["lm_head"])
    head[:, [a, b]] = head[:, [b, a]]
    pure["lm_head"] = jnp.asarray(head)
    new = jax.tree_util.tree_map(lambda x: x, state)
    nnx.replace_by_pure_dict(new, pure)
    return new


def first_token_weights(forward, state):
    """(W0, W1): PROMPT's greedy first token is 5 under W0 and 7 under W1 (output head
    columns exchanged, so the KV cache is the same under both)."""
    a = int(jnp.argmax(logits_of(forward, state, PROMPT)[-1]))
    w0 = with_lm_head_swapped(state, a, 5) if a != 5 else state
    return w0, with_lm_head_swapped(w0, 5, 7)
