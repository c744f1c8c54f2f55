"""Which samples of a batch's groups train, and with what reward and advantage (host side,
numpy, pure): the sample selection of :func:`rlflow.learner.batch.build_batch`.

Per group record ``n`` and sample ``g`` (arrays ``[N, G]``):
  * reward shaping (:func:`shape_rewards`): non-finite rewards 0 (their group leaves the
    loss), DAPO's soft overlong punishment (Yu et al. 2025, sec. 3.4) and truncated rewards
    zeroed when configured, a failed sample's reward 0;
  * advantages (:func:`sample_advantages`) over the whole group, masked failed samples
    excluded from the baseline (:func:`rlflow.learner.advantages.group_advantages`), or zeros
    for PPO (the step computes GAE);
  * the keep mask (:func:`keep_mask`): finite-reward groups, samples within the staleness
    bound (:func:`stale_keep`), groups with reward variance under DAPO dynamic sampling,
    minus masked failed samples and (``mask_truncated``) truncated ones.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rlflow.learner import advantages as adv_lib


def sample_staleness(policy_versions, lengths, learner_version: int,
                     sampled=None) -> np.ndarray:
    """Per-sample staleness ``learner_version - min_t policy_versions[g, t]`` over the sampled
    tokens.

    Args:
      policy_versions: ``[G, T]`` int versions that produced each token (-1 on padding and on
        the environment tokens of multi-turn episodes).
      lengths: ``[G]`` real tokens per completion (>= 1).
      learner_version: the learner's current policy version.
      sampled: optional bool ``[G, T]``, the record's ``loss_mask`` (1 on sampled tokens);
        ``None``: every real token was sampled. A sample without any sampled token has
        staleness 0.

    Returns: ``[G]`` int64 staleness (>= 0).

    Raises:
      ValueError: a real token has version < 0, or a version newer than the learner's.
    """
    v = np.asarray(policy_versions).astype(np.int64)
    n = np.asarray(lengths)
    real = np.arange(v.shape[1])[None, :] < n[:, None]
    if sampled is not None:
        real = real & np.asarray(sampled, bool)
    if np.any(real & (v < 0)):
        g = int(np.argwhere(real & (v < 0))[0, 0])
        raise ValueError(f"sample {g}: policy_versions has -1 on a sampled token "
                         f"(length {n[g]})")
    oldest = np.where(real, v, np.iinfo(np.int64).max).min(axis=1)
    oldest = np.where(real.any(axis=1), oldest, learner_version)
    stale = learner_version - oldest.astype(np.int64)
    if np.any(stale < 0):
        g = int(np.argmin(stale))
        raise ValueError(f"sample {g}: policy version {oldest[g]} is newer than the learner's "
                         f"{learner_version}")
    return stale


def stale_keep(staleness, max_staleness: int, stale_policy: str) -> np.ndarray:
    """Which samples stay in the loss: all with ``"correct"``, ``staleness <= max`` with ``"drop"``.

    Returns: bool array shaped like ``staleness``.
    """
    s = np.asarray(staleness)
    if stale_policy == "correct":
        return np.ones(s.shape, bool)
    if stale_policy == "drop":
        return s <= max_staleness
    raise ValueError(f"stale_policy must be 'drop' or 'correct', got {stale_policy!r}")


# ------------------------------------------------------------------- rewards and keep mask

def shape_rewards(rewards, lengths, truncated, failed, spec) -> np.ndarray:
    """The shaped rewards ``[N, G]`` float32 the advantages and ``token_rewards`` use.

    Args:
      rewards: ``[N, G]`` float32 raw rewards (non-finite ones become 0).
      lengths: ``[N, G]`` int completion lengths; truncated, failed: ``[N, G]`` bool.
      spec: a :class:`rlflow.learner.batch.BatchSpec` (``overlong_buffer``,
        ``overlong_penalty``, ``max_tokens``, ``zero_truncated_rewards``).

    The host path (``xp=np``) of the tested jnp references in :mod:`rlflow.learner.advantages`:
    no device dispatch per step.
    """
    shaped = np.where(np.isfinite(rewards), rewards, np.float32(0.0))
    if spec.overlong_buffer > 0:
        shaped = shaped + adv_lib.overlong_penalty(
            lengths, max_tokens=spec.max_tokens, buffer=spec.overlong_buffer,
            factor=spec.overlong_penalty, xp=np)
    if spec.zero_truncated_rewards:
        shaped = adv_lib.zero_truncated_rewards(shaped, truncated, xp=np)
    return np.where(failed, np.float32(0.0), shaped)   # a failure's reward is no grade


def sample_advantages(shaped, masked_failed, spec) -> np.ndarray:
    """Per-sample advantages ``[N, G]`` float32 from the shaped rewards: the group estimator
    ``spec.estimator`` (:func:`rlflow.learner.advantages.group_advantages`) with the samples of
    ``masked_failed`` (``[N, G]`` bool, or None) out of the baseline; zeros for ``"gae"``
    (PPO: the step computes advantages from the value head)."""
    if spec.estimator == "gae":
        return np.zeros_like(shaped)
    return adv_lib.group_advantages(
        shaped, estimator=spec.estimator, scale_by_std=spec.scale_by_std,
        std_floor=spec.std_floor, xp=np,
        valid=None if masked_failed is None else ~masked_failed)


class Keep(NamedTuple):
    """Which samples stay in the loss (:func:`keep_mask`), and why others left.

    keep: ``[N, G]`` bool, the samples in the loss.
    good_group: ``[N]`` bool, groups whose rewards are all finite.
    keep_stale: ``[N, G]`` bool, samples within the staleness bound.
    signal: ``[N]`` bool, groups with reward variance (all True without dynamic sampling).
    """
    keep: np.ndarray
    good_group: np.ndarray
    keep_stale: np.ndarray
    signal: np.ndarray


def keep_mask(rewards, shaped, staleness, truncated, masked_failed, spec) -> Keep:
    """The keep mask of the batch's samples (module docstring: the rules, in order).

    Args:
      rewards: ``[N, G]`` raw rewards; shaped: ``[N, G]`` shaped rewards; staleness: ``[N,
        G]`` int (:func:`sample_staleness`); truncated: ``[N, G]`` bool; masked_failed: ``[N,
        G]`` bool failed samples that leave the loss, or None.
      spec: a :class:`rlflow.learner.batch.BatchSpec` (``max_staleness``, ``stale_policy``,
        ``dynamic_sampling``, ``mask_truncated``).
    """
    good_group = np.isfinite(rewards).all(axis=1)
    keep_stale = stale_keep(staleness, spec.max_staleness, spec.stale_policy)
    signal = adv_lib.groups_with_signal(
        shaped, xp=np, valid=None if masked_failed is None else ~masked_failed) \
        if spec.dynamic_sampling else np.ones(len(rewards), bool)
    keep = good_group[:, None] & keep_stale & signal[:, None]
    if masked_failed is not None:
        keep &= ~masked_failed
    if spec.mask_truncated:
        keep &= ~truncated
    return Keep(keep, good_group, keep_stale, signal)
