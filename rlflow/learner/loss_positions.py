"""Logits only where the loss reads them: gather the loss positions' hidden states into a
fixed-size buffer, project those, scatter the per-token results back.

The policy loss, the KL and the entropy metric read the logprobs only at ``loss_mask``
positions (completion tokens), a fraction of a step's positions (the prompts and the packing
padding are the rest). Projecting every position to the vocabulary and taking its
log-softmax costs ``2 E V`` FLOPs and ``O(V)`` elementwise work per position, forward and
backward; here only ``capacity`` positions per group of rows are projected.

Layout: the ``[B, T]`` batch is viewed as ``shards x seq_shards`` groups: ``shards`` groups
of ``B / shards`` consecutive rows (``shards`` = the batch-sharded devices, ``data x fsdp``),
each cut along its positions into ``seq_shards`` spans of ``T / seq_shards`` (the ``sequence``
axis of context parallelism; 1 without it), so each device gathers from its own rows and
positions and no gather crosses devices. Group ``(s, c)`` (index ``s * seq_shards + c``)
holds the positions of its rows' span ``c``, row-major; its ``j``-th loss position goes to
slot ``j`` of ``[shards * seq_shards, capacity]``; unused slots hold the out-of-range index
``P = B / shards * T / seq_shards`` (gathers clamp it, the scatter back drops it). A group
with more than ``capacity`` loss positions would lose the excess: the caller bounds
``capacity`` by what the batch can hold (:func:`capacity_for`) and the learner checks batches
on the host (:func:`check_capacity`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def capacity_for(rows: int, seq: int, shards: int, max_loss_tokens: int,
                 seq_shards: int = 1) -> int:
    """Slots per group: ``min(rows / shards * seq / seq_shards, max_loss_tokens)``, at
    least 1.

    ``max_loss_tokens``: a bound on one step's loss positions (samples x ``sampler.max_tokens``);
    0 or less: no bound (every position gets a slot).
    """
    per_group = (rows // shards) * (seq // seq_shards)
    return max(1, per_group if max_loss_tokens <= 0 else min(per_group, max_loss_tokens))


def _grouped(x, shards: int, seq_shards: int):
    """``[B, T, ...]`` -> ``[shards * seq_shards, B / shards * T / seq_shards, ...]`` (the
    module doc's groups; numpy or jax arrays)."""
    b, t = x.shape[:2]
    rest = x.shape[2:]
    x = x.reshape((shards, b // shards, seq_shards, t // seq_shards) + rest)
    x = x.transpose((0, 2, 1, 3) + tuple(range(4, x.ndim)))
    return x.reshape((shards * seq_shards, (b // shards) * (t // seq_shards)) + rest)


def _ungrouped(x, shape: tuple, shards: int, seq_shards: int):
    """Inverse of :func:`_grouped`: ``[groups, P, ...]`` -> ``shape`` ``[B, T, ...]``."""
    b, t = shape[:2]
    rest = x.shape[2:]
    x = x.reshape((shards, seq_shards, b // shards, t // seq_shards) + rest)
    x = x.transpose((0, 2, 1, 3) + tuple(range(4, x.ndim)))
    return x.reshape((b, t) + rest)


def loss_index(loss_mask: jax.Array, shards: int, capacity: int,
               seq_shards: int = 1) -> jax.Array:
    """Flat positions of the loss tokens of each group.

    Args:
      loss_mask: ``[B, T]`` bool; ``B`` divisible by ``shards``, ``T`` by ``seq_shards``.
      shards, seq_shards: row groups and position spans (see the module docstring).
      capacity: slots per group.

    Returns: int32 ``[shards * seq_shards, capacity]``: in group ``g``, slot ``j`` holds the
      flat index (into the group's ``P = B / shards * T / seq_shards`` positions) of its
      ``j``-th loss position, or ``P`` when the group has fewer than ``j + 1`` (loss positions
      past ``capacity`` get no slot).
    """
    m = _grouped(loss_mask, shards, seq_shards)
    groups, p = m.shape
    slot = jnp.cumsum(m, axis=1, dtype=jnp.int32) - 1
    slot = jnp.where(m, slot, capacity)                       # non-loss positions: dropped
    src = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), m.shape)
    rows = jnp.broadcast_to(jnp.arange(groups, dtype=jnp.int32)[:, None], m.shape)
    out = jnp.full((groups, capacity), p, jnp.int32)
    return out.at[rows, slot].set(src, mode="drop")


def gather(x: jax.Array, index: jax.Array, seq_shards: int = 1) -> jax.Array:
    """``x [B, T, ...]`` at ``index [groups, capacity]`` -> ``[groups, capacity, ...]``
    (out-of-range slots read the group's last position; their results are dropped)."""
    flat = _grouped(x, index.shape[0] // seq_shards, seq_shards)
    idx = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(flat, idx, axis=1, mode="clip")


def scatter(values: jax.Array, index: jax.Array, shape: tuple,
            seq_shards: int = 1) -> jax.Array:
    """Inverse of :func:`gather` for per-token values: ``[groups, capacity]`` -> ``shape``
    ``[B, T]``, zeros at positions without a slot."""
    groups, p = index.shape[0], int(np.prod(shape)) // index.shape[0]
    rows = jnp.broadcast_to(jnp.arange(groups, dtype=jnp.int32)[:, None], index.shape)
    out = jnp.zeros((groups, p), values.dtype).at[rows, index].set(values, mode="drop")
    return _ungrouped(out, shape, groups // seq_shards, seq_shards)


def check_capacity(loss_mask, split: int, shards: int, capacity: int,
                   seq_shards: int = 1) -> None:
    """Host check that no group of any micro-batch has more loss positions than slots.

    ``split``: micro-batches (micro-batch ``j`` holds rows ``j, j + split, ...``, as
    :func:`rlflow.learner.step.split_micro`); ``shards`` / ``seq_shards``: row groups and
    position spans per micro-batch (module doc).

    Raises: ValueError naming the micro-batch, the group, its count and the capacity.
    """
    m = np.asarray(loss_mask, bool)
    b = m.shape[0]
    for j in range(split):
        groups = _grouped(m[j::split], shards, seq_shards).sum(axis=1)
        if groups.max(initial=0) > capacity:
            g = int(np.argmax(groups))
            raise ValueError(f"micro-batch {j}, row group {g // seq_shards}"
                             + (f", position span {g % seq_shards}" if seq_shards > 1 else "")
                             + f": {int(groups[g])} loss positions, more than the {capacity} "
                             f"logit slots (samples x sampler.max_tokens); batch rows {b}")
