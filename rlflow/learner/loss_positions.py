"""Logits only where the loss reads them: gather the loss positions' hidden states into a
fixed-size buffer, project those, scatter the per-token results back.

The policy loss, the KL and the entropy metric read the logprobs only at ``loss_mask``
positions (completion tokens), a fraction of a step's positions (the prompts and the packing
padding are the rest). Projecting every position to the vocabulary and taking its
log-softmax costs ``2 E V`` FLOPs and ``O(V)`` elementwise work per position, forward and
backward; here only ``capacity`` positions per group of rows are projected.

Layout: the ``[B, T]`` batch is viewed as ``shards`` groups of ``B / shards`` consecutive rows
(``shards`` = the batch-sharded devices, ``data x fsdp``, so each device gathers from its own
rows and no gather crosses devices). In group ``s`` the ``j``-th loss position (row-major
order) goes to slot ``j`` of ``[shards, capacity]``; unused slots hold the out-of-range index
``P = B / shards * T`` (gathers clamp it, the scatter back drops it). A group with more than
``capacity`` loss positions would lose the excess: the caller bounds ``capacity`` by what the
batch can hold (:func:`capacity_for`) and the learner checks batches on the host
(:func:`check_capacity`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def capacity_for(rows: int, seq: int, shards: int, max_loss_tokens: int) -> int:
    """Slots per group: ``min(rows / shards * seq, max_loss_tokens)``, at least 1.

    ``max_loss_tokens``: a bound on one step's loss positions (samples x ``sampler.max_tokens``);
    0 or less: no bound (every position gets a slot).
    """
    per_group = (rows // shards) * seq
    return max(1, per_group if max_loss_tokens <= 0 else min(per_group, max_loss_tokens))


def loss_index(loss_mask: jax.Array, shards: int, capacity: int) -> jax.Array:
    """Flat positions of the loss tokens of each row group.

    Args:
      loss_mask: ``[B, T]`` bool; ``B`` divisible by ``shards``.
      shards: row groups (see the module docstring).
      capacity: slots per group.

    Returns: int32 ``[shards, capacity]``: in group ``s``, slot ``j`` holds the flat index
      (into the group's ``B / shards * T`` positions) of its ``j``-th loss position, or
      ``B / shards * T`` when the group has fewer than ``j + 1`` (loss positions past
      ``capacity`` get no slot).
    """
    b, t = loss_mask.shape
    m = loss_mask.reshape(shards, (b // shards) * t)
    p = m.shape[1]
    slot = jnp.cumsum(m, axis=1, dtype=jnp.int32) - 1
    slot = jnp.where(m, slot, capacity)                       # non-loss positions: dropped
    src = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), m.shape)
    rows = jnp.broadcast_to(jnp.arange(shards, dtype=jnp.int32)[:, None], m.shape)
    out = jnp.full((shards, capacity), p, jnp.int32)
    return out.at[rows, slot].set(src, mode="drop")


def gather(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x [B, T, ...]`` at ``index [shards, capacity]`` -> ``[shards, capacity, ...]``
    (out-of-range slots read the group's last position; their results are dropped)."""
    shards = index.shape[0]
    b, t = x.shape[:2]
    flat = x.reshape((shards, (b // shards) * t) + x.shape[2:])
    idx = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(flat, idx, axis=1, mode="clip")


def scatter(values: jax.Array, index: jax.Array, shape: tuple) -> jax.Array:
    """Inverse of :func:`gather` for per-token values: ``[shards, capacity]`` -> ``shape``
    ``[B, T]``, zeros at positions without a slot."""
    shards, p = index.shape[0], int(np.prod(shape)) // index.shape[0]
    rows = jnp.broadcast_to(jnp.arange(shards, dtype=jnp.int32)[:, None], index.shape)
    out = jnp.zeros((shards, p), values.dtype).at[rows, index].set(values, mode="drop")
    return out.reshape(shape)


def check_capacity(loss_mask, split: int, shards: int, capacity: int) -> None:
    """Host check that no row group of any micro-batch has more loss positions than slots.

    ``split``: micro-batches (micro-batch ``j`` holds rows ``j, j + split, ...``, as
    :func:`rlflow.learner.step.split_micro`); ``shards``: row groups per micro-batch.

    Raises: ValueError naming the micro-batch, the group, its count and the capacity.
    """
    m = np.asarray(loss_mask, bool)
    b = m.shape[0]
    for j in range(split):
        groups = m[j::split].reshape(shards, -1).sum(axis=1)
        if groups.max(initial=0) > capacity:
            g = int(np.argmax(groups))
            raise ValueError(f"micro-batch {j}, row group {g}: {int(groups[g])} loss positions, "
                             f"more than the {capacity} logit slots (samples x "
                             f"sampler.max_tokens); batch rows {b}")
