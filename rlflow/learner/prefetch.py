"""The learner's next-step prefetch: while step N runs on the device (JAX dispatches it
asynchronously), take step N+1's groups that already wait in the buffer and, when all are
there, build and check their batch (:meth:`rlflow.learner.program.LearnerProgram.prefetch`).

The pure part lives here: :func:`take_waiting` takes without waiting and keeps what taking
raised for the next step; :func:`build_ahead` builds the batch, leaving a failure for the next
step to meet again in order.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rlflow.learner.skips import skip_reason


@dataclasses.dataclass
class NextGroups:
    """The next step's groups, taken while the current step ran.

    Attributes:
      groups: group records taken from the buffer (at most ``groups_per_step``), each
        accepted against ``version``.
      version: the policy version the current step makes (``v + 1``).
      built: ``(batch, info)`` built at ``version`` when every group was there; the batch
        has passed ``Learner.check_batch`` unless ``info`` makes the step a skip.
      error: what taking from the buffer raised (a producer's failure, a closed buffer, the
        dynamic-sampling streak limit); the next step raises it before anything else, as a
        take after the step would have.
    """

    groups: list
    version: int
    built: tuple | None = None
    error: BaseException | None = None


def take_waiting(buffer, accept: Callable[[dict], bool], count: int, version: int) -> NextGroups:
    """Up to ``count`` accepted groups that are in ``buffer`` now (never waits).

    Args:
      buffer: a ``BufferServer`` (``get_groups(n, timeout=, accept=)``).
      accept: the learner's filter, judging a group against ``version``.
      count: groups wanted (``learner.groups_per_step``).
      version: the policy version the groups are judged against.

    Returns:
      :class:`NextGroups` with the groups taken; an exception from the buffer or from
      ``accept`` other than the empty buffer's timeout is kept in ``error``, not raised.
    """
    from rlflow.exchange.ring import BufferTimeoutError

    nxt = NextGroups([], version)
    try:
        while len(nxt.groups) < count:
            nxt.groups += buffer.get_groups(1, timeout=0.0, accept=accept)
    except BufferTimeoutError:
        pass                                      # the rest is taken after the step
    except Exception as e:  # noqa: BLE001 - raised by the next step, in order
        nxt.error = e
    return nxt


def build_ahead(learner, nxt: NextGroups) -> None:
    """Build and check the batch of ``nxt``'s groups at ``nxt.version`` into ``nxt.built``.

    ``learner``: a :class:`rlflow.learner.trainer.Learner`. A batch whose ``info`` makes
    the step a skip is kept unchecked (the step skips it). Any error leaves ``nxt.built``
    None: the next step builds the batch again and raises it there.
    """
    try:
        batch, info = learner.build_batch(nxt.groups, version=nxt.version)
        if skip_reason(info) is None:
            batch = learner.check_batch(batch)
    except Exception:  # noqa: BLE001 - the next step builds it again and raises
        return
    nxt.built = (batch, info)
