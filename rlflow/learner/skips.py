"""Degenerate steps: a step whose groups leave nothing for the loss is skipped, counted and
bounded.

A training step can end up with no loss token at all when every sample of its groups is
filtered out (:func:`rlflow.learner.batch.build_batch`):

=================  =====================================================================
reason             every sample of the step's groups ...
=================  =====================================================================
``all_bad_reward`` is in a group with a non-finite reward (``learner.on_bad_reward="drop"``)
``all_stale``      is older than ``runtime.max_staleness`` versions
                   (``runtime.stale_policy="drop"``)
``all_filtered``   is in a group with zero reward variance (``learner.dynamic_sampling``)
``all_masked``     was truncated at ``sampler.max_tokens`` (``learner.mask_truncated``)
``all_failed``     was cut by an environment or reward failure
                   (``learner.on_failed_sample="mask"``)
``mixed``          is dropped by one of the above, none of which alone covers the step
``all_rejected``   has its loss tokens rejected by ``learner.rollout_correction`` (found
                   inside the jitted step, which then leaves parameters, optimiser state
                   and version unchanged: ``learner/skipped``)
=================  =====================================================================

Such a step is **skipped**: no optimiser update, no new policy version, nothing published
or checkpointed, and its groups are given back to the admission budget (they count as
rejected, like the groups the buffer filter drops), so the samplers make replacements and
the run cannot deadlock on a budget spent on groups that trained nothing.

A skipped step does **not** count towards ``learner.num_steps``: ``num_steps`` counts
optimiser updates (= policy versions), as TRL's ``global_step`` counts optimiser steps and
verl's DAPO trainer keeps generating, without advancing its training step, until a batch
has enough groups with signal. Like verl's ``filter_groups.max_num_gen_batches`` the number
of skips is bounded: after ``learner.max_consecutive_skipped_steps`` skipped steps in a
row (or as many steps' worth of groups rejected in a row by dynamic sampling in the
buffer's filter) the run stops with :class:`DegenerateStepsError`, which names the reason
and the settings that cause it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Mapping, Optional

log = logging.getLogger("rlflow.learner")

REASONS = ("all_bad_reward", "all_stale", "all_filtered", "all_masked", "all_failed", "mixed",
           "all_rejected")


class DegenerateStepsError(RuntimeError):
    """Too many consecutive steps left nothing to train on; the message says why."""


def skip_reason(info: Mapping[str, float]) -> Optional[str]:
    """Why a batch has no loss tokens, from :func:`rlflow.learner.batch.build_batch`'s info.

    Args:
      info: the batch info (``batch/samples``, ``batch/groups``, ``batch/loss_samples``,
        ``batch/dropped_bad_reward_groups``, ``batch/dropped_stale``,
        ``batch/dropped_zero_variance_groups``, ``batch/masked_truncated``, optionally
        ``batch/failed_samples``; counts).

    Returns: None when the batch has a loss sample; otherwise the first reason of
    ``REASONS`` whose filter alone drops every sample (in the order the filters are listed),
    or ``"mixed"``.
    """
    if info["batch/loss_samples"] > 0:
        return None
    samples, groups = info["batch/samples"], info["batch/groups"]
    if info["batch/dropped_bad_reward_groups"] == groups:
        return "all_bad_reward"
    if info["batch/dropped_stale"] == samples:
        return "all_stale"
    if info["batch/dropped_zero_variance_groups"] == groups:
        return "all_filtered"
    if info["batch/masked_truncated"] == samples:
        return "all_masked"
    if info.get("batch/failed_samples", 0) == samples:
        return "all_failed"
    return "mixed"


def explain(reason: str, cfg, info: Optional[Mapping[str, float]] = None) -> str:
    """What made every sample leave the loss, naming the config fields that did it."""
    sp, rt = cfg.sampler, cfg.runtime
    if reason == "all_bad_reward":
        return ("every group had a non-finite reward and learner.on_bad_reward='drop' (check the "
                "reward functions: reward/errors/* and reward/timeouts/* count their failures)")
    if reason == "all_stale":
        return (f"every sample was more than runtime.max_staleness={rt.max_staleness} policy "
                f"versions old and runtime.stale_policy='drop'")
    if reason == "all_filtered":
        why = (f" (sampler.temperature={sp.temperature} makes every completion of a group "
               f"identical)" if sp.temperature == 0 else "")
        return ("every group had the same reward for all its samples (no reward variance) and "
                f"learner.dynamic_sampling=True{why}")
    if reason == "all_masked":
        why = (f" (with sampler.temperature={sp.temperature}, every sample repeats the same "
               "completion)" if sp.temperature == 0 else "")
        return (f"every completion was truncated at sampler.max_tokens={sp.max_tokens} and "
                f"learner.mask_truncated=True{why}")
    if reason == "all_failed":
        return ("every sample was cut by an environment error or timeout or a reward "
                "function's error or timeout, and learner.on_failed_sample='mask' (see "
                "sampler/env_errors, sampler/env_timeouts, reward/errors/*, reward/timeouts/*)")
    if reason == "all_rejected":
        c = cfg.learner.rollout_correction
        return (f"every loss token was rejected by learner.rollout_correction (reject="
                f"{c.reject!r}, reject_unit={c.reject_unit!r}, band [reject_low={c.reject_low}, "
                f"reject_high={c.reject_high}]): the learner's and the sampler's logprobs differ "
                "beyond the band (see mismatch/* and rollout_correction/masked_token_frac)")
    parts = ""
    if info is not None:
        parts = (f": {int(info['batch/dropped_bad_reward_groups'])} groups with bad rewards, "
                 f"{int(info['batch/dropped_stale'])} stale samples, "
                 f"{int(info['batch/dropped_zero_variance_groups'])} groups without reward "
                 f"variance, {int(info['batch/masked_truncated'])} truncated samples masked")
    return ("every sample was dropped by learner.on_bad_reward / runtime.stale_policy / "
            f"learner.dynamic_sampling / learner.mask_truncated together{parts}")


class SkipCounter:
    """Counts skipped steps (in total, per reason, and in a row) and enforces the bound.

    Args:
      cfg: the :class:`rlflow.config.ExperimentConfig`; reads
        ``learner.max_consecutive_skipped_steps`` (0: no bound) and the fields
        :func:`explain` names.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.limit = cfg.learner.max_consecutive_skipped_steps
        self.total: Counter = Counter()
        self.in_a_row = 0

    def skipped(self, reason: str, version: int, info: Optional[Mapping] = None) -> None:
        """Count one skipped step at policy ``version``.

        Raises: :class:`DegenerateStepsError` when this is the ``limit``-th skip in a row.
        """
        if reason not in REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; expected one of {REASONS}")
        self.total[reason] += 1
        self.in_a_row += 1
        why = explain(reason, self.cfg, info)
        log.warning("skipped a step at version %d (%s): %s; nothing trained or published "
                    "(%d in a row)", version, reason, why, self.in_a_row)
        if self.limit and self.in_a_row >= self.limit:
            raise DegenerateStepsError(
                f"{self.in_a_row} steps in a row left no sample to train on ({reason}) at "
                f"policy version {version}: {why}. Stopping (learner.max_consecutive_skipped_"
                f"steps={self.limit}).")

    def trained(self) -> None:
        """A step trained: the run of skips is over."""
        self.in_a_row = 0

    def metrics(self) -> dict[str, float]:
        """``learner/skipped_steps`` (total so far) and ``learner/skipped_steps/<reason>``."""
        out = {"learner/skipped_steps": float(sum(self.total.values()))}
        out.update({f"learner/skipped_steps/{r}": float(self.total[r]) for r in REASONS})
        return out


class FilterStreak:
    """Groups rejected in a row by the buffer's dynamic-sampling filter.

    With ``learner.dynamic_sampling`` the learner's buffer filter drops groups without
    reward variance before they reach a batch, and the samplers make replacements; if no
    group ever has variance (e.g. ``sampler.temperature=0``) that would go on forever.
    ``limit_steps * groups_per_step`` rejections in a row (no accepted group in between)
    stop the run like as many skipped steps would. Stale rejections are not counted: their
    replacements are made with newer weights, so they cannot recur forever.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.limit = cfg.learner.max_consecutive_skipped_steps * cfg.learner.groups_per_step
        self.in_a_row = 0

    def rejected(self, version: int) -> None:
        """Raises :class:`DegenerateStepsError` at the ``limit``-th rejection in a row."""
        self.in_a_row += 1
        if self.limit and self.in_a_row >= self.limit:
            raise DegenerateStepsError(
                f"{self.in_a_row} groups in a row (learner.max_consecutive_skipped_steps="
                f"{self.cfg.learner.max_consecutive_skipped_steps} steps of "
                f"learner.groups_per_step={self.cfg.learner.groups_per_step}) were dropped at "
                f"policy version {version}: {explain('all_filtered', self.cfg)}. Stopping.")

    def accepted(self) -> None:
        self.in_a_row = 0
