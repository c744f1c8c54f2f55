"""The decoder's forward result: one named tuple whatever the forward reports, the parts a
forward does not compute ``None`` (its fields as HF's ``MoeCausalLMOutputWithPast`` names
them where one exists: ``logits``, ``aux_loss``).

Which forward fills which part:

================  ===============================  ======================================
field             shape, dtype                     filled by
================  ===============================  ======================================
hidden            ``[B, T, E]`` ``cfg.dtype``      ``Decoder.hidden_states``
logits            ``[B, T, V]`` float32            ``Decoder.forward_cached``
cache             ``KVCache`` / ``PagedKVCache``   ``Decoder.forward_cached``
aux_loss          ``[]`` float32                   ``hidden_states(moe_aux=True)``
router_agreement  ``[L, 2]`` float32               ``hidden_states(routing_ids=...)``
expert_ids        ``[B, T, L, k]`` int32           ``forward_cached(return_routing=True)``
================  ===============================  ======================================

``hidden``: the last layer's output after the final RMSNorm (the input of the output
projection, :meth:`rlflow.models.decoder.Decoder.project`). ``aux_loss``: the
load-balancing loss of the forward (:func:`rlflow.models.moe.balance_loss`; Fedus et al.
2021, "Switch Transformers", eq. 4-6). ``router_agreement``: per layer, the token-layers
whose own top-k expert set equals the recorded one, and those with a recorded choice
(:func:`rlflow.models.moe_replay.agreement_sums`). ``expert_ids``: the experts each layer's
router chose for each new token (what the sampler records for rollout routing replay).

A ``NamedTuple`` is a JAX pytree (``None`` parts are empty subtrees), so a jitted forward
returns it as it is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class ForwardOutput(NamedTuple):
    """A decoder forward's result (module docstring: the shape, dtype and producer of each
    field); the parts this forward did not compute are None."""
    hidden: jax.Array | None = None
    logits: jax.Array | None = None
    cache: Any = None
    aux_loss: jax.Array | None = None
    router_agreement: jax.Array | None = None
    expert_ids: jax.Array | None = None
