"""The mixture-of-experts extras of the decoder's full forward
(:meth:`rlflow.models.decoder.Decoder.hidden_states`): the layer scan that also carries the
load-balancing sums (:func:`rlflow.models.moe.balance_sums`; Fedus et al. 2021, "Switch
Transformers", eq. 4-6) and outputs each layer's router agreement with
recorded expert ids (rollout routing replay, :mod:`rlflow.models.moe_replay`), and the
forward result they end in (:class:`rlflow.models.forward_output.ForwardOutput`).
"""

from __future__ import annotations

import jax.numpy as jnp

from rlflow.models import moe as moe_lib
from rlflow.models.forward_output import ForwardOutput
from rlflow.models.layer_pattern import scan_pattern
from rlflow.models.layer_scan import scan_layers
from rlflow.models.moe_replay import agreement_sums


def scan_routed(layers, x, layer, remat: str, token_mask, per_layer_ids, num_experts: int,
                pattern=None):
    """The stacked ``layers`` under :func:`rlflow.models.layer_scan.scan_layers`, each
    reporting its routing: ``layer(block, h, ids) -> (h, routing)``.

    Args:
      layers: the decoder's stacked blocks (every variable ``[L, ...]``).
      x: ``[B, T, E]`` the residual stream entering layer 0 (or its folded view).
      layer: ``(block, h, ids) -> (h, routing)``, ``routing`` a
        :class:`rlflow.models.moe.Routing`; ``ids`` is the layer's slice of
        ``per_layer_ids`` (None without).
      remat: the scan's rematerialisation policy
        (:data:`rlflow.models.layer_scan.REMAT_POLICIES`).
      token_mask: ``[B, T]`` bool, the tokens of the load-balancing loss, or None: with it the
        carry holds ``sums [2, num_experts]`` float32, the layers'
        :func:`rlflow.models.moe.balance_sums` over the tokens where it is True.
      per_layer_ids: ``[L, ...tokens, k]`` recorded expert ids, scanned with the layers, or
        None: with them each layer also outputs its
        :func:`rlflow.models.moe_replay.agreement_sums`.
      num_experts: ``n``, the experts of every layer.
      pattern: the decoder's :class:`rlflow.models.layer_pattern.LayerPattern` (None: one
        stack of one kind).

    Returns:
      ``(x, sums [2, n] or None, agreement [L, 2] or None)``.
    """
    weights = None if token_mask is None else jnp.asarray(token_mask, jnp.float32).reshape(-1)

    def apply(block, carry, ids=None):
        h, sums = carry
        h, routing = layer(block, h, ids)
        if weights is not None:
            sums = sums + moe_lib.balance_sums(routing, weights)
        if per_layer_ids is None:
            return h, sums
        return (h, sums), agreement_sums(routing, ids)

    sums = None if weights is None else jnp.zeros((2, num_experts), jnp.float32)
    if pattern is None:
        out = scan_layers(layers, (x, sums), apply, remat, per_layer_ids)
    else:
        out = scan_pattern(layers, pattern, (x, sums), apply, remat, per_layer_ids)
    (x, sums), agreement = out if per_layer_ids is not None else (out, None)
    return x, sums, agreement


def finish_routed(scanned, attention_mask, moe_aux: bool, finish,
                  num_layers: int) -> ForwardOutput:
    """The :class:`rlflow.models.forward_output.ForwardOutput` of the triple of
    :func:`scan_routed`: ``hidden = finish(x)``; with ``moe_aux`` the load-balancing loss
    ``aux_loss`` (float32 ``[]``, :func:`rlflow.models.moe.balance_loss` over ``num_layers``
    times the tokens where ``attention_mask [B, T]`` is True); ``router_agreement`` ``[L, 2]``
    when recorded ids were given (else None)."""
    x, sums, agreement = scanned
    aux = None
    if moe_aux:
        rows = num_layers * jnp.sum(jnp.asarray(attention_mask, jnp.float32))
        aux = moe_lib.balance_loss(sums, rows)
    return ForwardOutput(hidden=finish(x), aux_loss=aux, router_agreement=agreement)
