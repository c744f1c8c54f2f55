"""Rollout routing replay on the group record: the experts the sampler's forward chose.

A mixture-of-experts layer routes each token to its top-``k`` experts. The sampler (bfloat16,
a decode step of one token) and the learner (float32, the whole sequence at once) compute
the router logits with different rounding, so a near-tie flips a choice, the two forwards
run different experts, and the behaviour and learner logprobs drift apart. Rollout routing
replay (R3; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers", arXiv 2510.11370, sec. 3) records the sampler's choice for every token
and layer and has the learner use it instead of its own top-k, its gates still computed
from its own router so gradients reach the router (the paper's eq. 5: the replayed mask,
the learner's softmax).

Two optional fields of the record (record version 3, ``docs/interfaces.md``), present
together or not at all, with one dtype (:func:`routing_dtype`, int8 when the model has at
most 127 experts, else int16):

=====================  ==============  ============  =========================================
field                  dtype           shape         meaning
=====================  ==============  ============  =========================================
prompt_routing         int8 | int16    [P, L, k]     expert ids the sampler chose for each
                                                     prompt token and layer (the prefill of
                                                     the group's first sample)
completion_routing     int8 | int16    [G, T, L, k]  the same for each completion token fed
                                                     to the model (decode steps, episode
                                                     environment tokens by their prefill)
=====================  ==============  ============  =========================================

The whole sequence the sampler saw is replayed, prompt included: the prompt's keys and
values, which every completion token attends, come from its experts too (the paper replays
every position of the rollout). :data:`NO_CHOICE` (-1) marks a token-layer without a
recorded choice: every padding entry (from ``completion_lengths`` on), and the last
sampled token of a completion, which no forward took as input. The learner routes such a
token by its own top-k. Within a token-layer the ``k`` ids are distinct, or all -1.

Bytes: ``(P + G * T) * L * k`` (one byte each below 128 experts): 8 experts of 48 layers
add 384 bytes per token, the cost of replay; without the fields a record costs nothing more.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

ROUTING_FIELDS = ("prompt_routing", "completion_routing")
ROUTING_DTYPES = ("int8", "int16")
NO_CHOICE = -1


def routing_dtype(num_experts: int) -> np.dtype:
    """The record's dtype for expert ids of a model with ``num_experts`` experts: int8 up to
    127 experts, int16 up to 32767.

    Raises:
      ValueError: ``num_experts`` outside ``[1, 32767]``.
    """
    n = int(num_experts)
    if not 1 <= n <= np.iinfo(np.int16).max:
        raise ValueError(f"routing replay records expert ids as int8 or int16: num_experts "
                         f"must be in [1, 32767], got {n}")
    return np.dtype(np.int8 if n <= np.iinfo(np.int8).max else np.int16)


def check_routing(group: Mapping[str, np.ndarray], dims: Mapping[str, int]
                  ) -> tuple[str, str, str] | None:
    """Value checks of the routing fields of a record whose shapes and dtypes passed the
    schema (:func:`rlflow.exchange.records.validate_group` calls it).

    Args:
      group: the record.
      dims: its bound dimensions (``P, G, T, L, k``).

    Returns:
      None when the fields are absent or good, else ``(field, expected, got)`` for
      :class:`rlflow.exchange.records.RecordError` (the first problem found): only
      one of the two fields, dtypes that differ, an id below -1, a padding entry other than
      -1, a token-layer with some ids -1 and others not, or repeated ids in a token-layer.
    """
    present = [f for f in ROUTING_FIELDS if f in group]
    if not present:
        return None
    if len(present) == 1:
        other = ROUTING_FIELDS[1 - ROUTING_FIELDS.index(present[0])]
        return other, f"present with {present[0]} (routing replay records both)", "missing"
    prompt, completion = (np.asarray(group[f]) for f in ROUTING_FIELDS)
    if prompt.dtype != completion.dtype:
        return ("completion_routing", f"dtype {prompt.dtype} like prompt_routing",
                f"dtype {completion.dtype}")
    real = np.arange(dims["T"])[None, :] < np.asarray(group["completion_lengths"])[:, None]
    if (completion[~real] != NO_CHOICE).any():
        return ("completion_routing", "-1 on every padding position (from "
                "completion_lengths on)", "other values")
    for name, ids in (("prompt_routing", prompt), ("completion_routing", completion)):
        if ids.size == 0:
            continue
        if ids.min() < NO_CHOICE:
            return name, "expert ids >= 0, or -1 for no recorded choice", str(int(ids.min()))
        none = ids == NO_CHOICE
        if (none.any(-1) != none.all(-1)).any():
            return name, "all k ids of a token-layer set, or all -1", "a partly -1 token-layer"
        ordered = np.sort(ids, axis=-1)
        if ((ordered[..., 1:] == ordered[..., :-1]) & ~none[..., 1:]).any():
            return name, "k distinct expert ids per token and layer", "a repeated id"
    return None


def routing_rows(record: Mapping[str, np.ndarray], p_max: int, seq: int) -> np.ndarray:
    """A record's routing laid out like the learner's unpacked batch rows
    (:func:`rlflow.learner.batch.build_batch`: prompt left-padded to ``p_max``, completion
    from column ``p_max``).

    Args:
      record: a group record with both routing fields (``P <= p_max``).
      p_max: the batch's longest prompt.
      seq: the batch's row length (``>= p_max + T`` used columns; columns past it dropped).

    Returns:
      ``[G, seq, L, k]`` in the record's dtype: row ``g``, column ``c`` holds the ids of the
      token at ``tokens[g, c]`` (the prompt's on every row), -1 on padding.
    """
    prompt = np.asarray(record["prompt_routing"])
    completion = np.asarray(record["completion_routing"])
    g, t = completion.shape[:2]
    p = prompt.shape[0]
    out = np.full((g, seq) + prompt.shape[1:], NO_CHOICE, prompt.dtype)
    out[:, p_max - p:p_max] = prompt
    n = min(t, seq - p_max)
    out[:, p_max:p_max + n] = completion[:, :n]
    return out


def synthetic_routing(rng: np.random.Generator, group: Mapping[str, np.ndarray], *,
                      num_layers: int, top_k: int, num_experts: int) -> dict[str, np.ndarray]:
    """Valid random routing fields for ``group`` (for tests and benchmarks; no model
    involved): ``k`` distinct ids per token-layer in :func:`routing_dtype`, -1 on padding
    and on each completion's last token (module doc)."""
    dt = routing_dtype(num_experts)
    p = np.shape(group["prompt_tokens"])[0]
    g, t = np.shape(group["completion_tokens"])

    def draw(*lead):
        keys = rng.random(lead + (num_layers, num_experts))
        return np.argsort(keys, axis=-1)[..., :top_k].astype(dt)

    completion = draw(g, t)
    fed = np.arange(t)[None, :] < np.asarray(group["completion_lengths"])[:, None] - 1
    completion[~fed] = NO_CHOICE
    return {"prompt_routing": draw(p), "completion_routing": completion}
