"""Sequence packing: a padded training batch -> fewer rows holding several sequences each.

An unpacked :class:`rlflow.learner.batch.TrainBatch` row holds one sample: its prompt
(left-padded to the batch's longest prompt) and completion (right-padded to the bucket), so
the step computes on every pad. Packing copies each sample's attended span (prompt +
completion, contiguous in the row) into rows of ``pack_length`` positions, first-fit in
order of decreasing length, and marks each span with its own segment id (the recorded
expert ids of rollout routing replay, ``routing_ids``, move with their tokens too)::

    tokens       [p0 p1 c0 c1 c2 | q0 c0 c1 | pad pad]
    segment_ids  [ 1  1  1  1  1 |  2  2  2 |  0   0 ]
    positions    [ 0  1  2  3  4 |  0  1  2 |  0   0 ]     RoPE restarts per segment

The decoder's attention is masked to the query's own segment (``Decoder.__call__``'s
``segment_ids``) and RoPE depends on positions only, so each segment's logprobs are those of
its sample alone; every per-token field (targets, loss mask, behaviour logprobs, advantages,
token rewards) moves with its token, and :func:`rlflow.learner.losses.loss_weights` counts
segments instead of rows for the per-sequence aggregations. Samples without loss tokens
(padding rows, dropped samples) carry no gradient and no metric and are left out.

**Shared prompts** (``learner.shared_prefix``, on by default; Prefix Grouper, Liu et al.
2025): the G samples of a GRPO group start with the same prompt. Its tokens before the
first loss position are packed once, as a segment of its own, and each sample's segment
continues it from the last prompt token (whose logit predicts the sample's first completion
token, so each sample keeps its own copy of that one token)::

    tokens       [p0 p1 | p2 a0 a1 | p2 b0 b1 b2 | pad]
    segment_ids  [ 9  9 |  1  1  1 |  2  2  2  2 |  0 ]     9: the prompt's own segment
    prefix_ids   [ 9  9 |  9  9  9 |  9  9  9  9 |  0 ]     what each position also attends
    positions    [ 0  1 |  2  3  4 |  2  3  4  5 |  0 ]

A query attends its own segment and the segment in its ``prefix_ids``
(``Decoder.__call__``), causally, so every sample sees exactly its prompt and its own
completion, at the positions it had alone: the same logprobs as unshared, computed on
``P - 1 + sum(1 + n_i)`` positions instead of ``sum(P + n_i)``. Samples share when the tokens
before their first loss position are equal; a group too long for one row is split into
several units, each with its prompt. Prompt segments carry no loss token, so the
per-sequence aggregations count the samples only.

Shapes: ``pack_length`` is fixed per run (``learner.pack_length``); the number of packed rows
is one of ``learner.pack_row_buckets`` row counts (multiples of the micro-batch x data x
fsdp split): the first step's rounded up, later steps the smallest count used before that
holds them, else the worst case (:meth:`PackSpec.rows_for`). A run has at most two packed
shapes, the worst one compiled in the background while the first steps train: a mid-run
compile would stall the learner (seconds on CPU, minutes for a large model on TPU). A sample longer than ``pack_length`` is refused at config time
(``ExperimentConfig``: ``learner.pack_length`` must hold the longest row) and again here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from rlflow.exchange.routing import NO_CHOICE
from rlflow.learner.batch import BatchError, TrainBatch, row_segment_ids

# per-token fields copied with their tokens (segment_ids and positions are rebuilt)
_MOVED = ("tokens", "attention_mask", "targets", "loss_mask", "behaviour_logprobs",
          "advantages", "token_rewards", "group_ids", "policy_lag", "routing_ids")


@dataclass(frozen=True)
class PackSpec:
    """Packed shapes of one learner.

    Attributes:
      pack_length: positions per packed row (>= the longest sample).
      row_counts: the allowed packed row counts, increasing; the largest holds any batch
        (every sample fits in ``pack_length``, and at least ``pack_length // max_row``
        samples fit per row).
      pad_id: token id of packed padding.
      shared_prefix: pack a prompt shared by several samples once (see the module
        docstring).
    """
    pack_length: int
    row_counts: tuple
    pad_id: int = 0
    shared_prefix: bool = False

    @classmethod
    def create(cls, *, num_rows: int, max_row: int, pack_length: int, buckets: int,
               split: int, pad_id: int = 0, shared_prefix: bool = False) -> "PackSpec":
        """The spec for batches of ``num_rows`` samples of at most ``max_row`` tokens.

        ``split``: packed row counts are multiples of it (micro-batches x data x fsdp);
        ``buckets``: how many row counts (shapes) to allow, evenly spaced up to the worst case.

        Raises: ValueError when ``max_row > pack_length`` (names both).
        """
        if max_row > pack_length:
            raise ValueError(f"learner.pack_length {pack_length} is shorter than the longest "
                             f"row ({max_row} tokens = longest prompt + completion)")
        worst = math.ceil(num_rows / (pack_length // max_row))
        worst = split * math.ceil(worst / split)
        step = split * math.ceil(worst / (split * max(buckets, 1)))
        counts = tuple(range(step, worst, step)) + (worst,)
        return cls(pack_length=pack_length, row_counts=counts, pad_id=pad_id,
                   shared_prefix=shared_prefix)

    def rows_for(self, n_bins: int, used: Iterable[int] = ()) -> int:
        """The row count for a step of ``n_bins`` packed rows, given the counts earlier steps
        of the run ``used``: the smallest of them that holds the rows; for the run's first
        step, the smallest allowed count >= ``n_bins``; for a step that needs more rows than
        any before, the worst case (``row_counts[-1]``). A run thus has at most two packed
        shapes, and the learner compiles the worst case in the background after the first
        (``Learner.compiled_step``): no step waits for a compile after the first one. The
        choice depends only on ``used`` (checkpointed), so a resumed run packs its steps as
        the uninterrupted one does.

        Raises: :class:`BatchError` when ``n_bins`` is above the worst case.
        """
        if n_bins > self.row_counts[-1]:
            raise BatchError(f"{n_bins} packed rows needed, more than the {self.row_counts[-1]} "
                             f"that learner.pack_length {self.pack_length} allows")
        used = [int(r) for r in used if int(r) in self.row_counts]
        fits = [r for r in used if n_bins <= r]
        if fits:
            return min(fits)
        if used:
            return self.row_counts[-1]
        return next(r for r in self.row_counts if r >= n_bins)


def first_fit(lengths, capacity: int) -> list[list[int]]:
    """First-fit decreasing bin packing (Johnson 1973): indices of ``lengths`` per bin, each
    bin's total <= ``capacity``; longer items first, ties in index order (deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def padding_fraction(attention_mask) -> float:
    """Fraction of positions that are padding (not attended): ``1 - sum(mask) / size``."""
    m = np.asarray(attention_mask, bool)
    return float(1.0 - m.sum() / max(m.size, 1))


def pack_batch(batch: TrainBatch, spec: PackSpec, used: Iterable[int] = ()
               ) -> tuple[TrainBatch, dict]:
    """Pack the samples of an unpacked ``batch`` (one sample per row) into ``[R, pack_length]``.

    Args:
      batch: numpy :class:`TrainBatch` ``[B, L]`` from :func:`rlflow.learner.batch.build_batch`
        (each row's attended tokens contiguous; ``segment_ids`` None).
      spec: :class:`PackSpec`.
      used: packed row counts earlier steps of the run used (:meth:`PackSpec.rows_for`).

    Returns:
      ``(packed, info)``: a :class:`TrainBatch` ``[R, pack_length]`` with ``R`` in
      ``spec.row_counts``, ``segment_ids`` = the sample's row in ``batch`` + 1 (0 on padding;
      a shared prompt's own segment ``B + 1 + unit``; numbered densely from 1 instead when
      those ids would pass ``R * pack_length``), positions of each sample as it had
      alone, and with ``spec.shared_prefix`` ``prefix_ids`` (the shared prompt's segment,
      else the position's own; None without ``shared_prefix``) (``token_rewards`` and
      ``policy_lag`` zeros, ``group_ids`` the sample's row + 1, when the input had None); ``info``: ``learner/padding_fraction`` (of ``batch``),
      ``learner/packed_padding_fraction`` (of the packed batch), ``batch/packed_rows``,
      ``batch/packed_samples`` (samples with loss tokens, the ones kept).

    Raises: BatchError when a row's attended tokens are not contiguous, a loss position lies
      outside them, or a row is longer than ``spec.pack_length``.
    """
    if batch.segment_ids is not None:
        raise BatchError("pack_batch: the batch is already packed (segment_ids set)")
    attn = np.asarray(batch.attention_mask, bool)
    b = attn.shape[0]
    first, n_tok, loss, keep = _row_spans(attn, batch.loss_mask, spec.pack_length)
    plain = [(-1, 0, [int(i)]) for i in keep]
    units = _shared_units(batch.tokens, first, n_tok, loss, keep, spec.pack_length) \
        if spec.shared_prefix else plain
    bins = first_fit([_unit_length(u, n_tok) for u in units], spec.pack_length)
    if len(bins) > spec.row_counts[-1]:     # sharing packed worse than the plain bound
        units = plain
        bins = first_fit([_unit_length(u, n_tok) for u in units], spec.pack_length)
    rows = spec.rows_for(max(len(bins), 1), used)
    lp = spec.pack_length
    src = batch._replace(**{name: np.zeros(attn.shape, dt) for name, dt in (
        ("token_rewards", np.float32), ("policy_lag", np.int32)) if getattr(batch, name) is None})
    if src.group_ids is None:                        # each sample its own group (its row + 1)
        src = src._replace(group_ids=row_segment_ids(attn))
    src_row, pos, seg, pre = _place(bins, units, n_tok, b, rows, lp)
    real = src_row >= 0
    rr = np.maximum(src_row, 0)
    cc = np.where(real, first[rr] + pos, 0)
    out = {}
    for name in _MOVED:
        if getattr(src, name) is None:             # routing_ids of a batch without routing
            out[name] = None
            continue
        x = np.asarray(getattr(src, name))
        fill = {"tokens": spec.pad_id, "targets": spec.pad_id, "routing_ids": NO_CHOICE}
        moved = x[rr, cc]                          # [R, lp, ...] (routing: [.., layers, k])
        at = real.reshape(real.shape + (1,) * (moved.ndim - 2))
        out[name] = np.where(at, moved, np.asarray(fill.get(name, 0), x.dtype))
    packed = TrainBatch(positions=pos, segment_ids=seg,
                        prefix_ids=pre if spec.shared_prefix else None, **out)
    info = {"learner/padding_fraction": padding_fraction(attn),
            "learner/packed_padding_fraction": padding_fraction(packed.attention_mask),
            "batch/packed_rows": rows, "batch/packed_samples": int(keep.size)}
    return packed, info


def _row_spans(attn, loss_mask, pack_length: int):
    """Each row's attended span of an unpacked batch (``attn`` ``[B, L]`` bool): ``(first
    attended column [B], attended tokens [B], loss mask [B, L] bool, rows with loss tokens
    [K])``.

    Raises: BatchError when a row's attended tokens are not contiguous, a loss position lies
    outside them, or a row with loss tokens is longer than ``pack_length``."""
    l = attn.shape[1]
    first = np.argmax(attn, axis=1)
    n_tok = attn.sum(axis=1)
    last = l - np.argmax(attn[:, ::-1], axis=1)
    if np.any(last - first != n_tok):
        r = int(np.flatnonzero(last - first != n_tok)[0])
        raise BatchError(f"pack_batch: row {r} has non-contiguous attended tokens")
    loss = np.asarray(loss_mask, bool)
    if np.any(loss & ~attn):
        r = int(np.argwhere(loss & ~attn)[0, 0])
        raise BatchError(f"pack_batch: row {r} has a loss position outside its attended tokens")
    keep = np.flatnonzero(loss.any(axis=1))
    too_long = keep[n_tok[keep] > pack_length]
    if too_long.size:
        r = int(too_long[0])
        raise BatchError(f"row {r} has {int(n_tok[r])} tokens, more than learner.pack_length "
                         f"{pack_length}")
    return first, n_tok, loss, keep


def _place(bins, units, n_tok, b: int, rows: int, lp: int):
    """Where each packed position ``[rows, lp]`` comes from: ``(source row int64, -1 on
    padding; position in its sequence int32; segment id int32; prefix id int32)``, the
    ``units`` (``(head row or -1, shared prompt length, sample rows)``) laid out bin by bin
    (``bins``: unit indices per packed row) from a batch of ``b`` rows."""
    src_row = np.full((rows, lp), -1, np.int64)
    pos = np.zeros((rows, lp), np.int32)
    seg = np.zeros((rows, lp), np.int32)
    pre = np.zeros((rows, lp), np.int32)
    for r, members in enumerate(bins):
        at = 0
        for u in members:
            head, q, samples = units[u]
            if head >= 0:
                # the prompt's own segment: ids after every sample's (row + 1 <= b); it holds
                # no loss token, so no aggregation counts it
                sid = b + 1 + u
                src_row[r, at:at + q] = head
                pos[r, at:at + q] = np.arange(q, dtype=np.int32)
                seg[r, at:at + q] = pre[r, at:at + q] = sid
                at += q
            for i in samples:
                n = int(n_tok[i]) - q
                src_row[r, at:at + n] = i
                pos[r, at:at + n] = np.arange(q, q + n, dtype=np.int32)
                seg[r, at:at + n] = i + 1
                pre[r, at:at + n] = sid if head >= 0 else i + 1
                at += n
    if seg.max(initial=0) > rows * lp:
        # ids must stay <= the packed positions (loss_weights sums per id over that many
        # slots): only when most samples were left out; number the segments densely then
        _, dense = np.unique(np.concatenate([[0], seg.ravel(), pre.ravel()]),
                             return_inverse=True)
        seg = dense[1:seg.size + 1].reshape(seg.shape).astype(np.int32)
        pre = dense[seg.size + 1:].reshape(pre.shape).astype(np.int32)
    return src_row, pos, seg, pre


def _unit_length(unit, n_tok) -> int:
    head, q, samples = unit
    return q + sum(int(n_tok[i]) - q for i in samples)


def _shared_units(tokens, first, n_tok, loss, keep, pack_length: int) -> list:
    """``[(head row or -1, prefix length q, [sample rows])]``: samples whose tokens before
    their first loss position are equal share those ``q`` tokens (taken from ``head``);
    a unit holds as many of them as fit in ``pack_length``; a sample alone is ``(-1, 0,
    [row])``. Order: first appearance (deterministic)."""
    tokens = np.asarray(tokens)
    groups: dict = {}
    for i in keep:
        i = int(i)
        q = int(np.argmax(loss[i])) - int(first[i])      # tokens before the first loss position
        key = (q, tokens[i, first[i]:first[i] + q].tobytes())
        groups.setdefault(key, []).append(i)
    units = []

    def close(members, q):                  # one sample alone shares nothing: a plain unit
        units.append((members[0], q, members) if len(members) > 1 else (-1, 0, members))

    for (q, _), rows in groups.items():
        if q == 0:
            units.extend((-1, 0, [i]) for i in rows)
            continue
        current: list = []
        length = q
        for i in rows:
            n = int(n_tok[i]) - q
            if current and length + n > pack_length:
                close(current, q)
                current, length = [], q
            current.append(i)
            length += n
        close(current, q)
    return units


def pack_spec_from_config(cfg) -> PackSpec | None:
    """The :class:`PackSpec` of an :class:`rlflow.config.ExperimentConfig`, or None when
    ``learner.packing`` resolves off (see ``LearnerConfig.packs``)."""
    lr = cfg.learner
    if not lr.packs:
        return None
    longest = cfg.longest_row
    split = lr.micro_batches * lr.mesh.batch_shards
    return PackSpec.create(num_rows=lr.groups_per_step * cfg.sampler.group_size,
                           max_row=longest, pack_length=cfg.pack_length,
                           buckets=lr.pack_row_buckets, split=split,
                           shared_prefix=lr.shared_prefix)
