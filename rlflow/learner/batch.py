"""Rollout group records -> one padded training batch (host side, numpy).

Layout of a row (``P`` = longest prompt in the batch, ``L`` = the sequence bucket)::

    tokens          [pad pad p0 p1 p2 | c0 c1 c2 c3 | pad ...]   prompt left-padded to P,
                                                                 completion right-padded to L
    targets[t]      = tokens[t + 1]   (last column: pad)
    loss_mask[t]    = target t is a completion token (EOS included) that counts and that the
                      policy sampled (a record's optional ``loss_mask``, multi-turn episodes:
                      environment tokens between turns are attended but never in the loss)

All per-token arrays are aligned with ``targets``: ``behaviour_logprobs[t]`` is the
sampler's logprob of ``targets[t]``. The prompt ``[Hello]`` with completion
``[, World ! <eot>]`` gives 4 loss positions (t = 0..3), all counted, EOS included.

Rows are padded to ``num_rows`` (fixed per config) and columns to the smallest of the
configured ``seq_buckets`` that fits, so the jitted step sees few distinct shapes. Padding
rows hold one attended pad token and no loss positions.

Sample selection (each counted in the returned info, never silent):
  * non-finite reward: error naming the record and sample, or (``on_bad_reward="drop"``) the
    whole group leaves the loss (its baseline would be undefined);
  * staleness ``learner_version - min(policy_versions)`` above ``max_staleness`` with
    ``stale_policy="drop"`` leaves the loss; with ``"correct"`` it stays (the truncated
    importance weight of the loss corrects it);
  * DAPO dynamic sampling: groups with zero reward variance leave the loss;
  * ``mask_truncated``: completions cut by ``max_tokens`` leave the loss (DAPO overlong filter);
  * failed samples (the record's optional ``failed``: an environment or reward error or
    timeout) with ``on_failed_sample="mask"`` leave the loss *and* their group's baseline:
    the group's advantages (and the dynamic-sampling filter) see only the other samples;
    with ``"zero_reward"`` they stay, reward 0 (counted either way: ``batch/failed_samples``).
Advantages are computed on the whole group (all G rewards but the masked failed ones, after
reward shaping) before any other sample leaves the loss. With ``estimator="gae"`` (PPO) the
batch carries no advantages (zeros): the step computes them from the value head;
``token_rewards`` holds each sample's shaped reward on its last response token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Mapping, NamedTuple, Sequence

import numpy as np

from rlflow.exchange.routing import NO_CHOICE, routing_rows
from rlflow.learner.selection import (Keep, keep_mask, sample_advantages, sample_staleness,
                                      shape_rewards, stale_keep)
from rlflow.run.metrics import staleness_histogram

# stale_keep and sample_staleness are defined in rlflow.learner.selection and imported from
# here too (the import path callers use)
__all__ = ["BatchError", "BatchSpec", "TrainBatch", "batch_metrics", "batch_routing",
           "build_batch", "host_positions", "layout_rows", "row_segment_ids",
           "sample_staleness", "seq_bucket", "stale_keep", "validate_batch",
           "with_sequence_ids"]

FIELDS_2D = ("completion_tokens", "behaviour_logprobs", "policy_versions")
FIELDS_1D = ("completion_lengths", "rewards", "truncated")


class BatchError(ValueError):
    """A rollout record does not fit the training batch; the message names record and field."""


class TrainBatch(NamedTuple):
    """Device-ready training batch, every array ``[B, L]`` (numpy on the host).

    tokens int32, attention_mask bool, positions int32 (``positions_from_mask``), targets
    int32 (``tokens`` shifted left), loss_mask bool, behaviour_logprobs float32,
    advantages float32 (per-sample advantage broadcast over its loss positions; 0 with
    ``learner.advantage="gae"``) and token_rewards float32 (the sample's shaped reward on its
    last loss position, 0 elsewhere; read by the PPO/GAE step), the last five aligned with
    ``targets``. ``token_rewards`` may be None for the group estimators (the learner then
    sends zeros).

    ``segment_ids`` int32 ``[B, L]`` (optional): which sequence each position belongs to
    (sequence packing, :mod:`rlflow.learner.packing`): a query attends only keys of its own
    segment, and the per-sequence loss aggregations count segments, not rows. Ids are unique
    over the whole batch, >= 1 on real tokens, 0 on padding. None: each row is one sequence
    (the learner fills ``row + 1`` on attended tokens).

    ``prefix_ids`` int32 ``[B, L]`` (optional, shared-prefix packing,
    :mod:`rlflow.learner.packing`): the segment a position may attend besides its own, the
    group's prompt packed once before its completions; equal to ``segment_ids`` elsewhere.
    None: ``segment_ids`` (the learner fills it).

    ``group_ids`` int32 ``[B, L]`` (optional): the prompt group (record index + 1) of the
    sample each position belongs to, 0 on padding rows (group-level rollout rejection,
    :mod:`rlflow.learner.rollout_correction`). None: each sequence its own group
    (``segment_ids``; the learner fills it).

    ``policy_lag`` int32 ``[B, L]`` (optional): the sample's staleness (learner version
    minus its oldest policy version, :func:`sample_staleness`) on its positions, 0 on
    padding (the mismatch diagnostics' lag buckets). None: 0 (the learner fills it).

    ``routing_ids`` int8 / int16 ``[B, L, layers, k]`` (optional, rollout routing replay,
    :mod:`rlflow.exchange.routing`): the experts the sampler chose for the token at each
    position in each mixture-of-experts layer, aligned with ``tokens`` (not ``targets``), -1
    where it recorded none (padding, each completion's last token, records without routing):
    the learner's forward routes those by its own top-k. None: the learner routes every token
    itself (dense models, ``learner.routing_replay=False``).
    """
    tokens: np.ndarray
    attention_mask: np.ndarray
    positions: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    advantages: np.ndarray
    token_rewards: np.ndarray | None = None
    segment_ids: np.ndarray | None = None
    prefix_ids: np.ndarray | None = None
    group_ids: np.ndarray | None = None
    policy_lag: np.ndarray | None = None
    routing_ids: np.ndarray | None = None


@dataclass(frozen=True)
class BatchSpec:
    """Everything :func:`build_batch` needs from the experiment config."""
    group_size: int
    num_rows: int
    seq_buckets: tuple
    max_tokens: int
    estimator: str = "grpo"
    scale_by_std: bool | None = None
    std_floor: float = 1e-6
    mask_truncated: bool = False
    zero_truncated_rewards: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = False
    max_staleness: int = 0
    stale_policy: Literal["drop", "correct"] = "drop"
    on_bad_reward: Literal["error", "drop"] = "error"
    on_failed_sample: Literal["mask", "zero_reward"] = "mask"
    pad_id: int = 0

    @classmethod
    def from_config(cls, cfg) -> "BatchSpec":
        """From an :class:`rlflow.config.ExperimentConfig`."""
        lr, sp, rt = cfg.learner, cfg.sampler, cfg.runtime
        return cls(group_size=sp.group_size, num_rows=lr.groups_per_step * sp.group_size,
                   seq_buckets=tuple(lr.seq_buckets) or (sp.max_prefill_length + sp.max_tokens,),
                   max_tokens=sp.max_tokens, estimator=lr.advantage,
                   scale_by_std=lr.scale_by_std, std_floor=lr.std_floor,
                   mask_truncated=lr.mask_truncated,
                   zero_truncated_rewards=lr.zero_truncated_rewards,
                   overlong_buffer=lr.overlong_buffer, overlong_penalty=lr.overlong_penalty,
                   dynamic_sampling=lr.dynamic_sampling, max_staleness=rt.max_staleness,
                   stale_policy=rt.stale_policy, on_bad_reward=lr.on_bad_reward,
                   on_failed_sample=lr.on_failed_sample)

    def replace(self, **kw) -> "BatchSpec":
        return dataclasses.replace(self, **kw)


_KINDS = dict(tokens="i", attention_mask="b", positions="i", targets="i", loss_mask="b",
              behaviour_logprobs="f", advantages="f", token_rewards="f", segment_ids="i",
              prefix_ids="i", group_ids="i", policy_lag="i", routing_ids="i")
# the optional fields (None allowed), filled by with_sequence_ids and the learner
OPTIONAL_FIELDS = ("token_rewards", "segment_ids", "prefix_ids", "group_ids", "policy_lag",
                   "routing_ids")
# fields with trailing dimensions after [B, L]: routing_ids [B, L, layers, k]
_TRAILING = {"routing_ids": 2}


def validate_batch(batch: TrainBatch) -> None:
    """Check that every field of ``batch`` is ``[B, L]`` like ``tokens`` (``routing_ids``
    ``[B, L, layers, k]``) with the right dtype kind.

    Raises: BatchError naming the field, its shape/dtype and what was expected.
    """
    shape = np.shape(batch.tokens)
    if len(shape) != 2:
        raise BatchError(f"tokens must be [batch, seq], got shape {shape}")
    for name in TrainBatch._fields:
        x = getattr(batch, name)
        if x is None and name in OPTIONAL_FIELDS:
            continue
        if np.shape(x)[:2] != shape or np.ndim(x) != 2 + _TRAILING.get(name, 0):
            want = shape + ("...",) * _TRAILING.get(name, 0)
            raise BatchError(f"{name} has shape {np.shape(x)}, expected {want} like tokens")
        kind = np.dtype(x.dtype).kind
        if kind != _KINDS[name] and not (_KINDS[name] == "i" and kind == "u"):
            raise BatchError(f"{name} has dtype {x.dtype}, expected kind {_KINDS[name]!r}")


def row_segment_ids(attention_mask: np.ndarray) -> np.ndarray:
    """Segment ids of an unpacked batch: ``row + 1`` on attended tokens, 0 on padding
    (``[B, T]`` int32; each row one sequence)."""
    mask = np.asarray(attention_mask, bool)
    rows = np.arange(1, mask.shape[0] + 1, dtype=np.int32)[:, None]
    return np.where(mask, rows, np.int32(0)).astype(np.int32)


def with_sequence_ids(batch: TrainBatch) -> TrainBatch:
    """``batch`` with its optional sequence ids filled in: ``segment_ids`` of an unpacked
    batch (:func:`row_segment_ids`), ``prefix_ids`` = ``segment_ids`` where no prompt is
    shared, ``group_ids`` = ``segment_ids`` (each sequence its own group) and ``policy_lag``
    0 when absent, so the step's inputs always have the same fields (``[B, L]`` int32)."""
    if batch.segment_ids is None:                          # one sequence per row
        batch = batch._replace(segment_ids=row_segment_ids(batch.attention_mask))
    if batch.prefix_ids is None:                           # no shared prompts
        batch = batch._replace(prefix_ids=batch.segment_ids)
    if batch.group_ids is None:
        batch = batch._replace(group_ids=batch.segment_ids)
    if batch.policy_lag is None:
        batch = batch._replace(policy_lag=np.zeros(np.shape(batch.tokens), np.int32))
    return batch


def host_positions(attention_mask: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`rlflow.models.decoder.positions_from_mask` (``[B, T]`` int32,
    ``cumsum(mask) - 1`` clipped at 0) for the host-side batch: no device dispatch."""
    pos = np.cumsum(attention_mask, axis=-1, dtype=np.int32) - 1
    return np.maximum(pos, 0, out=pos)


# --------------------------------------------------------------------------- validation

def _check_record(i: int, rec: Mapping, g_expected: int) -> None:
    where = f"record {i} (prompt_id {rec.get('prompt_id', '?')})"
    for name in ("prompt_tokens",) + FIELDS_2D + FIELDS_1D:
        if name not in rec:
            raise BatchError(f"{where}: missing field {name!r}")
    p = np.asarray(rec["prompt_tokens"])
    if p.ndim != 1 or p.shape[0] < 1:
        raise BatchError(f"{where}: prompt_tokens must be [P] with P >= 1, got shape {p.shape}")
    ct = np.asarray(rec["completion_tokens"])
    if ct.ndim != 2:
        raise BatchError(f"{where}: completion_tokens must be [G, T], got shape {ct.shape}")
    if ct.shape[0] != g_expected:
        raise BatchError(f"{where}: completion_tokens has {ct.shape[0]} samples, expected "
                         f"group_size {g_expected}")
    for name in FIELDS_2D[1:] + (("loss_mask",) if "loss_mask" in rec else ()):
        if np.shape(rec[name]) != ct.shape:
            raise BatchError(f"{where}: {name} has shape {np.shape(rec[name])}, expected "
                             f"{ct.shape} like completion_tokens")
    for name in FIELDS_1D + tuple(k for k in ("failed",) if k in rec):
        if np.shape(rec[name]) != (ct.shape[0],):
            raise BatchError(f"{where}: {name} has shape {np.shape(rec[name])}, expected "
                             f"({ct.shape[0]},)")
    n = np.asarray(rec["completion_lengths"])
    bad = np.flatnonzero((n < 1) | (n > ct.shape[1]))
    if bad.size:
        g = int(bad[0])
        raise BatchError(f"{where}, sample {g}: completion_lengths {int(n[g])} must be in "
                         f"[1, {ct.shape[1]}] (an empty response has nothing to learn from)")


# ------------------------------------------------------------------------------- build

def build_batch(records: Sequence[Mapping], spec: BatchSpec, learner_version: int
                ) -> tuple[TrainBatch, dict]:
    """Assemble one training batch from rollout group records (``docs/interfaces.md``):
    reward shaping, advantages and the keep mask (:mod:`rlflow.learner.selection`), the row
    layout (:func:`layout_rows`, module docstring) and the batch's metrics
    (:func:`batch_metrics`).

    Args:
      records: group records, each with ``G = spec.group_size`` completions.
      spec: :class:`BatchSpec`.
      learner_version: current policy version of the learner (for staleness).

    Returns:
      ``(batch, info)``: a :class:`TrainBatch` of numpy arrays ``[num_rows, L]`` and a dict of
      host-side metrics named as in :mod:`rlflow.run.metrics`: ``batch/*`` counts (samples, loss
      tokens, drops by reason, bucket length), ``reward/*`` (raw finite rewards),
      ``response/*`` and the staleness histogram of every sample in the records.

    Raises:
      BatchError: more samples than ``num_rows``, a malformed record (names record, field and
        expected shape), a non-finite reward with ``on_bad_reward="error"`` (names record
        and sample), a version problem, or no bucket long enough.
    """
    g = spec.group_size
    if len(records) * g > spec.num_rows:
        raise BatchError(f"{len(records)} groups x group_size {g} = {len(records) * g} samples "
                         f"exceed the batch of {spec.num_rows} rows")
    if not records:
        raise BatchError("no records: a training batch needs at least one group")
    for i, rec in enumerate(records):
        _check_record(i, rec, g)
    rewards = np.stack([np.asarray(r["rewards"], np.float32) for r in records])      # [N, G]
    lengths = np.stack([np.asarray(r["completion_lengths"], np.int64) for r in records])
    truncated = np.stack([np.asarray(r["truncated"], bool) for r in records])
    failed = np.stack([np.asarray(r["failed"], bool) if "failed" in r else np.zeros(g, bool)
                       for r in records])                                          # [N, G]
    _check_rewards(records, rewards, spec.on_bad_reward)
    masked_failed = failed if spec.on_failed_sample == "mask" and failed.any() else None
    shaped = shape_rewards(rewards, lengths, truncated, failed, spec)
    advantages = sample_advantages(shaped, masked_failed, spec)
    staleness = np.stack([sample_staleness(r["policy_versions"], r["completion_lengths"],
                                           learner_version, r.get("loss_mask"))
                          for r in records])
    kept = keep_mask(rewards, shaped, staleness, truncated, masked_failed, spec)
    batch, p_max = layout_rows(records, spec, lengths, kept.keep, shaped, advantages, staleness)
    info = batch_metrics(records, spec, rewards, lengths, truncated, failed, staleness, kept,
                         batch)
    routing_ids = batch_routing(records, g, spec.num_rows, p_max, batch.tokens.shape[1])
    if routing_ids is not None:
        info["batch/routed_samples"] = sum(g for r in records if "completion_routing" in r)
    return batch._replace(routing_ids=routing_ids), info


def _check_rewards(records: Sequence[Mapping], rewards: np.ndarray, on_bad_reward: str) -> None:
    """Raises BatchError naming the first non-finite reward's record and sample with
    ``on_bad_reward="error"`` (with ``"drop"`` its group leaves the loss: :func:`keep_mask`)."""
    finite = np.isfinite(rewards)
    if not finite.all() and on_bad_reward == "error":
        n_bad, s_bad = (int(x) for x in np.argwhere(~finite)[0])
        raise BatchError(f"record {n_bad} (prompt_id {records[n_bad].get('prompt_id', '?')}),"
                         f" sample {s_bad}: reward is {rewards[n_bad, s_bad]} (expected a "
                         f"finite number; learner.on_bad_reward='drop' drops such groups)")


def seq_bucket(p_max: int, t_max: int, seq_buckets) -> int:
    """The smallest of ``seq_buckets`` that holds ``p_max + t_max`` tokens.

    Raises: BatchError naming both lengths and ``learner.seq_buckets`` when none does."""
    need = p_max + t_max
    fits = [b for b in seq_buckets if b >= need]
    if not fits:
        raise BatchError(f"longest prompt ({p_max}) + completion ({t_max}) = {need} "
                         f"tokens exceed the largest seq bucket {max(seq_buckets)} "
                         f"(learner.seq_buckets)")
    return fits[0]


def _completion_rows(records: Sequence[Mapping], g: int, t_max: int):
    """The completions of every real row ``[R, t_max]`` (``R = N * G``), right-padded:
    ``(tokens int32, behaviour logprobs float32, sampled bool)``; ``sampled`` is the records'
    ``loss_mask`` (multi-turn episodes), True where they have none."""
    rows = len(records) * g
    comp = np.zeros((rows, t_max), np.int32)
    mu = np.zeros((rows, t_max), np.float32)
    sampled = np.ones((rows, t_max), bool)
    for i, rec in enumerate(records):
        t = min(t_max, np.shape(rec["completion_tokens"])[1])
        comp[i * g:(i + 1) * g, :t] = np.asarray(rec["completion_tokens"])[:, :t]
        mu[i * g:(i + 1) * g, :t] = np.asarray(rec["behaviour_logprobs"])[:, :t]
        if "loss_mask" in rec:
            sampled[i * g:(i + 1) * g, :t] = np.asarray(rec["loss_mask"], bool)[:, :t]
    return comp, mu, sampled


def layout_rows(records: Sequence[Mapping], spec: BatchSpec, lengths, keep, shaped, advantages,
                staleness) -> tuple[TrainBatch, int]:
    """The batch's rows (layout: module docstring): prompts left-padded to the longest
    ``P``, completions right-padded to the bucket ``L`` (:func:`seq_bucket`), padding rows
    with one attended pad token.

    Args:
      lengths, keep, shaped, advantages, staleness: ``[N, G]`` per sample (completion length,
        in the loss, shaped reward, advantage, staleness).

    Returns: ``(batch, P)``: a :class:`TrainBatch` ``[num_rows, L]`` without ``routing_ids``
    (and without ``segment_ids`` / ``prefix_ids``), and the longest prompt ``P``.

    Raises: BatchError when no bucket is long enough, or a behaviour logprob of a completion
    token is not finite (names record, sample and token).
    """
    g, b_rows, pad = spec.group_size, spec.num_rows, spec.pad_id
    p_max = max(int(np.asarray(r["prompt_tokens"]).shape[0]) for r in records)
    rows, t_max = len(records) * g, int(lengths.max())
    seq = seq_bucket(p_max, t_max, spec.seq_buckets)
    tokens = np.full((b_rows, seq), pad, np.int32)
    attn = np.zeros((b_rows, seq), bool)
    loss_mask = np.zeros((b_rows, seq), bool)
    behaviour = np.zeros((b_rows, seq), np.float32)
    adv_tok = np.zeros((b_rows, seq), np.float32)
    rew_tok = np.zeros((b_rows, seq), np.float32)
    attn[rows:, 0] = True                               # padding rows: one attended pad token
    for i, rec in enumerate(records):                   # prompts, left-padded to p_max
        prompt = np.asarray(rec["prompt_tokens"], np.int32)
        tokens[i * g:(i + 1) * g, p_max - prompt.shape[0]:p_max] = prompt
        attn[i * g:(i + 1) * g, p_max - prompt.shape[0]:p_max] = True
    comp, mu, sampled = _completion_rows(records, g, t_max)     # all real rows at once
    n_flat, keep_flat = lengths.reshape(-1), keep.reshape(-1)
    real_tok = np.arange(t_max)[None, :] < n_flat[:, None]                 # [R, t_max]
    tokens[:rows, p_max:p_max + t_max] = np.where(real_tok, comp, pad)
    attn[:rows, p_max:p_max + t_max] = real_tok
    # target t predicts token t+1: completion tokens sit at p_max .. p_max+n-1
    tgt = slice(p_max - 1, p_max - 1 + t_max)
    loss_mask[:rows, tgt] = real_tok & sampled & keep_flat[:, None]
    behaviour[:rows, tgt] = np.where(real_tok, mu, np.float32(0.0))
    adv_tok[:rows, tgt] = np.where(loss_mask[:rows, tgt], advantages.reshape(-1)[:, None],
                                   np.float32(0.0))
    rew_tok[np.arange(rows), p_max - 2 + n_flat] = np.where(keep_flat, shaped.reshape(-1), 0.0)
    # per sample, on its whole row: its group (record + 1) and staleness
    group_ids = np.zeros((b_rows, seq), np.int32)
    group_ids[:rows] = np.repeat(np.arange(1, len(records) + 1, dtype=np.int32), g)[:, None]
    lag = np.zeros((b_rows, seq), np.int32)
    lag[:rows] = staleness.reshape(-1, 1).astype(np.int32)
    targets = np.concatenate([tokens[:, 1:], np.full((b_rows, 1), pad, np.int32)], 1)
    if not np.isfinite(behaviour).all():
        r, t = (int(x) for x in np.argwhere(~np.isfinite(behaviour))[0])
        raise BatchError(f"record {r // g}, sample {r % g}: behaviour_logprobs at completion "
                         f"token {t - p_max + 1} is not finite")
    return TrainBatch(tokens=tokens, attention_mask=attn, positions=host_positions(attn),
                      targets=targets, loss_mask=loss_mask, behaviour_logprobs=behaviour,
                      advantages=adv_tok, token_rewards=rew_tok, group_ids=group_ids,
                      policy_lag=lag), p_max


def batch_metrics(records: Sequence[Mapping], spec: BatchSpec, rewards, lengths, truncated,
                  failed, staleness, kept: Keep, batch: TrainBatch) -> dict:
    """The host-side metrics of a built batch (names: :mod:`rlflow.run.metrics`): ``batch/*``
    counts (samples, loss tokens, drops by reason, bucket length), ``reward/*`` over the raw
    finite rewards (NaN when none is finite), ``response/*`` over the completions and the
    staleness histogram of every sample (arguments ``[N, G]`` per sample; ``kept``:
    :func:`rlflow.learner.selection.keep_mask`)."""
    real = rewards[np.isfinite(rewards)]
    return {
        "batch/samples": len(records) * spec.group_size,
        "batch/groups": len(records),
        "batch/loss_samples": int(kept.keep.sum()),
        "batch/loss_tokens": int(batch.loss_mask.sum()),
        "batch/seq_len": batch.tokens.shape[1],
        "batch/dropped_bad_reward_groups": int((~kept.good_group).sum()),
        "batch/dropped_stale": int((~kept.keep_stale).sum()),
        "batch/dropped_zero_variance_groups": int((~kept.signal).sum()),
        "batch/masked_truncated": int(truncated.sum()) if spec.mask_truncated else 0,
        "batch/failed_samples": int(failed.sum()),
        "reward/mean": float(real.mean()) if real.size else float("nan"),
        "reward/std": float(real.std()) if real.size else float("nan"),
        "reward/min": float(real.min()) if real.size else float("nan"),
        "reward/max": float(real.max()) if real.size else float("nan"),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": int(lengths.max()),
        "response/truncation_rate": float(truncated.mean()),
        **staleness_histogram(staleness.reshape(-1)),
    }


def batch_routing(records: Sequence[Mapping], group_size: int, num_rows: int, p_max: int,
                  seq: int) -> np.ndarray | None:
    """The batch's ``routing_ids`` ``[num_rows, seq, layers, k]`` from the records' routing
    fields (:func:`rlflow.exchange.routing.routing_rows`; rows of records without them and
    padding rows -1: routed by the learner itself), in the widest dtype of the records; None
    when no record has them.

    Raises:
      BatchError: two records disagree on ``[layers, k]`` (names both records).
    """
    routed = [(i, r) for i, r in enumerate(records) if "completion_routing" in r]
    if not routed:
        return None
    i0, r0 = routed[0]
    tail = np.shape(r0["completion_routing"])[2:]
    for i, r in routed[1:]:
        if np.shape(r["completion_routing"])[2:] != tail:
            raise BatchError(f"record {i} (prompt_id {r.get('prompt_id', '?')}): "
                             f"completion_routing has [layers, k] = "
                             f"{list(np.shape(r['completion_routing'])[2:])}, record {i0} "
                             f"{list(tail)}: every record of a batch comes from one model")
    dtype = np.result_type(*(r["completion_routing"].dtype for _, r in routed))
    out = np.full((num_rows, seq) + tail, NO_CHOICE, dtype)
    for i, r in routed:
        out[i * group_size:(i + 1) * group_size] = routing_rows(r, p_max, seq)
    return out
