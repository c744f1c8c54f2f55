"""Rollout routing replay on the learner side (issue 40 item 3): whether the step replays,
the shape of the batches' recorded expert ids, and their host-side preparation.

R3 (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers", arXiv 2510.11370): the learner's forward routes each token to the
experts the sampler chose (:mod:`rlflow.models.moe_replay`), gates from its own router, so
the behaviour and learner logprobs come from the same experts. ``learner.routing_replay``
(None: on for mixture-of-experts models) turns it on; off, the batch still carries the ids
for the router agreement metric. Step metrics of MoE models (both settings):
``moe/router_agreement`` (fraction of the token-layers with a recorded choice whose
learner top-k set equals the sampler's) and ``moe/logprob_gap`` (token mean of
``|log pi_old - log mu|`` over the loss tokens: the behaviour-vs-learner gap that replay
narrows).
"""

from __future__ import annotations

import numpy as np

from rlflow.config.validation import ConfigError
from rlflow.exchange.routing import NO_CHOICE, routing_dtype
from rlflow.learner.batch import BatchError


def replays(routing_replay: bool | None, model_config) -> bool:
    """``learner.routing_replay`` resolved for the model (a
    :class:`rlflow.models.config.DecoderConfig`): None means on for mixture-of-experts models.

    Raises:
      ConfigError: ``routing_replay=True`` for a dense model (names the field).
    """
    if routing_replay and not model_config.is_moe:
        raise ConfigError(f"learner.routing_replay: True needs a mixture-of-experts model (it "
                          f"replays the sampler's expert choices), but model_type "
                          f"{model_config.model_type!r} is dense; leave it unset (None)")
    return model_config.is_moe if routing_replay is None else bool(routing_replay)


def routing_shape(model_config) -> tuple[int, int, np.dtype] | None:
    """``(layers, k, dtype)`` of the step batches' ``routing_ids`` ``[B, T, layers, k]`` for a
    mixture-of-experts model (:func:`rlflow.exchange.routing.routing_dtype`), None for a
    dense one."""
    if not model_config.is_moe:
        return None
    return (model_config.num_layers, model_config.num_experts_per_tok,
            routing_dtype(model_config.num_experts))


def step_routing_ids(routing_ids: np.ndarray | None, shape, rows: int, seq: int
                     ) -> np.ndarray | None:
    """A step batch's ``routing_ids`` in the compiled step's layout.

    Args:
      routing_ids: the batch's ids ``[rows, seq, layers, k]`` or None (records without
        routing: all -1, the learner routes every token itself).
      shape: :func:`routing_shape` (None: a dense model, the ids are dropped).
      rows, seq: the batch's ``[B, T]``.

    Returns:
      int ``[rows, seq, layers, k]`` in ``shape``'s dtype, or None for a dense model.

    Raises:
      BatchError: ids whose ``[layers, k]`` is not the model's (another model's records).
    """
    if shape is None:
        return None
    layers, k, dtype = shape
    if routing_ids is None:
        return np.full((rows, seq, layers, k), NO_CHOICE, dtype)
    if np.shape(routing_ids) != (rows, seq, layers, k):
        raise BatchError(f"routing_ids has shape {list(np.shape(routing_ids))}, expected "
                         f"[{rows}, {seq}, {layers}, {k}] = [batch, seq, the model's "
                         f"num_layers, num_experts_per_tok]: the records were sampled by "
                         f"another model")
    return np.asarray(routing_ids).astype(dtype, copy=False)
