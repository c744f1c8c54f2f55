"""Taking a step's groups from the ring buffer, the learner program's intake
(:class:`GroupIntake`, a part of :class:`rlflow.learner.program.LearnerProgram`): the buffer
filter that admits or rejects each group (staleness, reward variance), the wait for
``groups_per_step`` of them with the checks that they can still come, the prefetch of the next
step's groups while a step runs, and the return of a skipped step's groups to the admission
budget. Every group is tracked in the prompt ledger by its key
(:func:`rlflow.control.ledger.group_key`).
"""

from __future__ import annotations

import functools
import time

import numpy as np

from rlflow.learner import advantages as adv_lib
from rlflow.learner.batch import sample_staleness
from rlflow.learner.prefetch import NextGroups, build_ahead, take_waiting
from rlflow.control import programs_common as pc
from rlflow.control.ledger import group_key

WAIT_SLICE_S = 1.0    # the wait for groups is cut in slices to check the ledger and replicas


class GroupIntake:
    """The group intake of the learner program; it uses the program's ``cfg``, ``gps``
    (``learner.groups_per_step``), ``version``, ``counts`` (accepted / stale / zero-variance
    groups), ``ledger``, ``buffer``, ``coordinator``, ``learner``, ``filter_streak`` and
    ``skips``, and sets ``batch_keys`` (the ledger keys and prompt ids of the step's groups)
    and ``next_groups``."""

    next_groups: NextGroups | None = None   # taken while the step before ran (prefetch)

    def _arrived(self, group) -> bool:
        key = group_key(group)
        return key is None or self.ledger.stored(key)

    def _discarded(self, group) -> None:
        key = group_key(group)
        if key is not None:
            self.ledger.unstore(key)

    def accept(self, group, version: int | None = None) -> bool:
        """Buffer filter (runs under the ring's lock, so counts stay consistent with the
        buffer's fill): reject a group whose every sample is too stale ("drop" policy) or
        that has no reward variance (dynamic sampling). ``version``: the learner version the
        group is judged against (default: the current one; :meth:`prefetch` passes the
        version of the step in flight)."""
        rt = self.cfg.runtime
        version = self.version if version is None else version
        key = group_key(group)
        if key is not None and not self.ledger.take(key):
            return False                   # a lost replica's late group (counted there)
        if rt.stale_policy == "drop":
            stale = sample_staleness(group["policy_versions"], group["completion_lengths"],
                                     version, group.get("loss_mask"))
            if (stale > rt.max_staleness).all():
                self.counts["stale_groups"] += 1
                if key is not None:
                    self.ledger.give_back(key)     # generated again, never lost
                return False
        valid = ~group["failed"][None] if "failed" in group and \
            self.cfg.learner.on_failed_sample == "mask" else None     # failed: no baseline
        if self.cfg.learner.dynamic_sampling and \
                not adv_lib.groups_with_signal(group["rewards"][None], xp=np, valid=valid)[0]:
            self.counts["zero_variance_groups"] += 1
            if key is not None:
                self.ledger.drop(key)              # resolved: counted as dropped
            self.filter_streak.rejected(version)   # raises after too many in a row
            return False
        self.filter_streak.accepted()
        self.counts["accepted"] += 1
        return True

    def take_groups(self, taken: list = ()) -> list:
        """``groups_per_step`` accepted groups, starting with ``taken`` (groups already
        accepted, from :meth:`prefetch`); waits in slices of ``WAIT_SLICE_S``, checking
        that groups can still come (prompts left, a replica alive). Sets
        :attr:`batch_keys` (the ledger keys of the step's groups).

        Raises:
          BufferTimeoutError: no group for ``buffer.timeout_s`` seconds.
          PromptsExhaustedError / NoReplicaError: see the module docstring.
        """
        from rlflow.exchange.ring import BufferTimeoutError

        groups = list(taken)
        waited_since = time.monotonic()
        while len(groups) < self.gps:
            pc.raise_if_stopped()              # a stop whose exception a finaliser dropped
            self.ledger.check_enough((self.version + 1) * self.gps)
            self.coordinator.check_replicas()
            left = self.cfg.buffer.timeout_s - (time.monotonic() - waited_since)
            try:
                got = self.buffer.get_groups(1, timeout=max(0.01, min(WAIT_SLICE_S, left)),
                                             accept=self.accept)
            except BufferTimeoutError:
                if left <= WAIT_SLICE_S:
                    raise
                continue
            groups += got
            waited_since = time.monotonic()
        self.batch_keys = [(group_key(g), int(g["prompt_id"])) for g in groups]
        return groups

    def prefetch(self) -> None:
        """Host work for the next step while the current one runs on the device (JAX
        dispatches it asynchronously): take the next step's groups that already wait in the
        buffer (no waiting), judged against version ``v + 1``, the version the running step
        makes; with all ``groups_per_step`` there, build and check the batch too. The next
        :meth:`step` starts from :attr:`next_groups`.

        It takes the groups a take after the step would take: the buffer's oldest groups,
        filtered against the same version. Nothing is taken before the last step (the run
        ends there) or in sync mode (the samplers wait for ``v + 1``, so the buffer is
        empty). Taken groups are consumed in the prompt ledger, so a checkpoint written now
        counts them untrained (regenerated after a resume, as groups left in the buffer are).
        Errors: what taking raises is kept for the next step (:class:`NextGroups`); an error
        building or checking the batch is left for the next step to raise, which builds it
        again.
        """
        version = self.version + 1
        if version >= self.cfg.learner.num_steps:
            return
        accept = functools.partial(self.accept, version=version)
        self.next_groups = nxt = take_waiting(self.buffer, accept, self.gps, version)
        if len(nxt.groups) == self.gps and nxt.error is None:
            build_ahead(self.learner, nxt)

    def skip(self, groups, reason: str, info: dict) -> None:
        """A step without loss samples: no update, no publish; its groups go back to the
        admission budget (counted like rejected groups, so the samplers make replacements
        and the budget does not shrink with each skip; the prompt ledger counts them
        dropped). Raises :class:`rlflow.learner.skips.DegenerateStepsError` after too many
        in a row."""
        self.counts["accepted"] -= len(groups)
        for key, _ in self.batch_keys:
            if key is not None:
                self.ledger.drop(key)
        self.batch_keys = []
        self.skips.skipped(reason, self.version, info)
