"""The PPO value head: a linear critic ``V(s_t)`` on the policy's final hidden states.

PPO with a learned baseline (Schulman et al. 2017, "Proximal Policy Optimization
Algorithms", eq. 9 and 11-12; GAE: Schulman et al. 2016, eq. 16) for a language model: the
state ``s_t`` is the prefix up to position ``t`` and its representation is the decoder's
final hidden state ``h_t`` (after the final RMSNorm, :meth:`rlflow.models.decoder.Decoder.
__call__` with ``return_hidden=True``), so ``V(s_t) = h_t . w + b`` shares the policy's
trunk and costs no second forward. Position ``t`` is aligned with ``targets[:, t]`` (the
token sampled in state ``s_t``), like the logprobs.

The head is the learner's own trainable state (``TrainState.value``): it is trained with the
policy but never published to the sampler, never exported, and not part of the policy
``nnx.State`` that weight transfer moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class ValueHead(nnx.Module):
    """``V = h @ kernel + bias``: ``kernel [E, 1]``, ``bias [1]``, both float32.

    Logical axes: ``kernel ("embed", None)`` (FSDP-sharded like every ``embed`` dimension of
    the policy), ``bias (None,)`` (replicated), so :func:`rlflow.mesh.param_shardings` lays it
    out with the same rules as the decoder.

    Args:
      hidden_size: ``E``, the decoder's hidden size.
      init_std: std of the normal kernel init; 0 (default) starts from ``V = 0`` everywhere,
        so the first steps' advantages are plain (discounted) returns and the value loss
        gradient does not reach the policy trunk until the head has moved.
      rngs: needed only when ``init_std > 0``.
    """

    def __init__(self, hidden_size: int, *, init_std: float = 0.0, rngs: nnx.Rngs | None = None):
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be > 0, got {hidden_size}")
        if init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {init_std}")
        if init_std > 0:
            if rngs is None:
                raise ValueError("init_std > 0 needs rngs")
            kernel = init_std * jax.random.normal(rngs.params(), (hidden_size, 1), jnp.float32)
        else:
            kernel = jnp.zeros((hidden_size, 1), jnp.float32)
        self.kernel = nnx.Param(kernel, out_sharding=("embed", None), eager_sharding=False)
        self.bias = nnx.Param(jnp.zeros((1,), jnp.float32), out_sharding=(None,),
                              eager_sharding=False)

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """``hidden [B, T, E]`` (any float dtype) -> float32 values ``[B, T]``."""
        h = hidden.astype(jnp.float32)
        return jnp.einsum("bte,eo->bto", h, self.kernel[...])[..., 0] + self.bias[...][0]


def init_value_head(hidden_size: int, *, init_std: float = 0.0, seed: int = 0):
    """``(graphdef, params)`` of a fresh :class:`ValueHead` (``nnx.split(head, nnx.Param)``)."""
    head = ValueHead(hidden_size, init_std=init_std, rngs=nnx.Rngs(seed) if init_std else None)
    return nnx.split(head, nnx.Param)
