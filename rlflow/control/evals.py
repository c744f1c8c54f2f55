"""The learner's schedule of held-out evaluations during training (``eval.every_steps``).

The learner owns it beside the prompt ledger; the run control (:mod:`rlflow.control.run_control`)
hands its evaluations to sampler replicas and takes their results back over the status
channel. An evaluation never enters the prompt ledger or the ring buffer::

    learner publishes version v (v % eval.every_steps == 0)  -> request(v)
    a replica's status, its weights at version u >= v, no eval assigned to it
                                                              -> assign(): it runs "eval v"
    the replica runs the held-out prompts at version u (holding newer weights back until
    they are decoded), scores them with its own reward workers and sends the prompt
    records (rlflow.eval.scoring) with a later status       -> deliver()
    the learner logs the metrics at step u                   <- take_finished()

So an evaluation runs between training prompts on one replica, at one policy version, and
the learner never waits for it (except at the end of the run, for at most
``eval.timeout_s``). A replica lost or restarted while it holds an evaluation gives it back
(:meth:`EvalSchedule.release`, called with the ledger's release): another replica (or the
restarted one) runs it again; one not finished within ``eval.timeout_s`` of its request is
given up and reported incomplete (``eval/complete`` 0).

A replica reports the version it generated at; in async mode it may be newer than the one
requested (a replica may jump over a version), never older. Each requested version yields
exactly one result.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger("rlflow.learner")


@dataclass
class _Pending:
    requested: int
    issued: float
    assignee: Optional[str] = None
    attempts: int = 0


@dataclass
class EvalResult:
    """One finished evaluation.

    Attributes:
      requested: the version the learner asked for.
      version: the version the replica generated at (>= requested); -1 when incomplete.
      records: the prompt records (:mod:`rlflow.eval.scoring`), empty when incomplete.
      complete: False when the evaluation was given up (timeout).
      replica: the replica that ran it ("" when incomplete).
      attempts: replicas it was assigned to (more than 1 after a lost replica).
      wait_s: seconds from the request to the result (or to giving up).
    """

    requested: int
    version: int = -1
    records: list = field(default_factory=list)
    complete: bool = True
    replica: str = ""
    attempts: int = 0
    wait_s: float = 0.0


class EvalSchedule:
    """Evaluations requested, assigned to replicas and finished (thread-safe).

    Args:
      every_steps: ``eval.every_steps`` (> 0): versions that are multiples of it are
        evaluated.
      num_prompts: prompt records a complete result holds (the held-out set's size).
      timeout_s: ``eval.timeout_s``.
      clock: monotonic clock in seconds.
    """

    def __init__(self, every_steps: int, num_prompts: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        if every_steps < 1 or num_prompts < 1 or timeout_s <= 0:
            raise ValueError(f"EvalSchedule: every_steps={every_steps} and num_prompts="
                             f"{num_prompts} must be >= 1, timeout_s={timeout_s} > 0")
        self.every_steps, self.num_prompts, self.timeout_s = every_steps, num_prompts, timeout_s
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._requested: set[int] = set()
        self._finished: list[EvalResult] = []

    def request(self, version: int) -> bool:
        """The learner published ``version``: schedule its evaluation when it is a multiple
        of ``every_steps`` and not requested before. Returns whether it was scheduled."""
        with self._lock:
            if version % self.every_steps or version in self._requested:
                return False
            self._requested.add(version)
            self._pending[version] = _Pending(version, self.clock())
            return True

    def assign(self, replica: str, replica_version: int) -> int:
        """The evaluation ``replica`` (holding weights of ``replica_version``) should run:
        the version requested, or -1 for none. A replica runs one at a time: while it holds
        one, the same one is named again (a replica that restarted gets it back through
        :meth:`release` and a new assignment)."""
        with self._lock:
            for p in self._pending.values():
                if p.assignee == replica:
                    return p.requested
            for p in sorted(self._pending.values(), key=lambda p: p.requested):
                if p.assignee is None and p.requested <= replica_version:
                    p.assignee, p.attempts = replica, p.attempts + 1
                    return p.requested
            return -1

    def deliver(self, replica: str, result: dict) -> bool:
        """A replica's result ``{"requested", "version", "records"}``; ignored (False) when
        that evaluation is not assigned to it any more (given back, or given up) or holds
        another number of prompt records than the held-out set."""
        with self._lock:
            requested = int(result["requested"])
            p = self._pending.get(requested)
            if p is None or p.assignee != replica or len(result["records"]) != self.num_prompts:
                return False
            del self._pending[requested]
            self._finished.append(EvalResult(
                requested=requested, version=int(result["version"]),
                records=list(result["records"]), replica=replica, attempts=p.attempts,
                wait_s=self.clock() - p.issued))
            return True

    def release(self, replica: str) -> int:
        """``replica`` was lost or restarted: its evaluation goes to the next replica that
        asks. Returns the number given back (0 or 1)."""
        with self._lock:
            n = 0
            for p in self._pending.values():
                if p.assignee == replica:
                    p.assignee, n = None, n + 1
            return n

    def take_finished(self) -> list[EvalResult]:
        """Results finished since the last call, in request order, with the evaluations
        pending for longer than ``timeout_s`` given up (``complete`` False)."""
        with self._lock:
            now = self.clock()
            for v, p in sorted(self._pending.items()):
                if now - p.issued > self.timeout_s:
                    del self._pending[v]
                    self._finished.append(EvalResult(requested=v, complete=False,
                                                     attempts=p.attempts, wait_s=now - p.issued))
            done, self._finished = sorted(self._finished, key=lambda r: r.requested), []
            return done

    @property
    def pending(self) -> int:
        """Evaluations requested and not yet finished or given up."""
        with self._lock:
            return len(self._pending)


def result_metrics(result: EvalResult) -> tuple[int, dict]:
    """``(step, metrics)`` to log for a result: a complete one at the version it was
    generated at, with :func:`rlflow.eval.scoring.aggregate`'s metrics; an incomplete one
    at the requested version with ``eval/complete`` 0 only."""
    base = {"eval/requested_version": float(result.requested), "eval/wait_s": result.wait_s,
            "eval/attempts": float(result.attempts)}
    if not result.complete:
        return result.requested, {**base, "eval/complete": 0.0}
    from rlflow.eval.scoring import aggregate

    return result.version, {**aggregate(result.records), **base, "eval/complete": 1.0,
                            "eval/version": float(result.version)}


class RunEvals:
    """The learner program's side: the schedule (handed to the run control), its requests
    at each publish, and the finished evaluations logged to the run folder (metrics at the
    version that generated them, samples to ``eval_samples.jsonl`` and, with W&B on, as a
    table).

    Args:
      schedule: the :class:`EvalSchedule`.
      writer: the run's :class:`rlflow.run.metrics.MetricsWriter`.
      eval_cfg: ``cfg.eval``.
    """

    def __init__(self, schedule: EvalSchedule, writer, eval_cfg):
        self.schedule, self.writer, self.eval_cfg = schedule, writer, eval_cfg

    @classmethod
    def for_experiment(cls, cfg, tokenizer, writer, start_step: int = 0
                       ) -> Optional["RunEvals"]:
        """None unless ``eval.every_steps > 0``; reads the held-out prompts once (a bad
        file stops the learner at start-up, naming the file and line). A run resumed from
        ``start_step`` drops the ``eval_samples.jsonl`` lines of later versions (evaluated
        again), as the metrics writer does with ``metrics.jsonl``.

        Raises:
          as :func:`rlflow.eval.scoring.load_eval_prompts`.
        """
        if not cfg.eval.enabled:
            return None
        import os

        from rlflow.eval.scoring import EVAL_SAMPLES_FILE, load_eval_prompts
        from rlflow.run.metrics import truncate_after

        truncate_after(os.path.join(writer.run_dir, EVAL_SAMPLES_FILE), start_step)
        n = len(load_eval_prompts(cfg, tokenizer))
        return cls(EvalSchedule(cfg.eval.every_steps, n, cfg.eval.timeout_s), writer, cfg.eval)

    def request(self, version: int) -> None:
        """``version`` was published (evaluated when a multiple of ``every_steps``)."""
        self.schedule.request(version)

    def log_finished(self) -> None:
        """Log the evaluations finished (or given up) since the last call."""
        from rlflow.eval.scoring import write_eval_samples

        for result in self.schedule.take_finished():
            step, metrics = result_metrics(result)
            self.writer.log(step, metrics)
            if not result.complete:
                log.warning("held-out evaluation of version %d given up after %.0f s "
                            "(eval.timeout_s): logged as incomplete", result.requested,
                            result.wait_s)
                continue
            rows = write_eval_samples(self.writer.run_dir, result.version, result.records,
                                      self.eval_cfg.num_logged_samples)
            self.writer.log_eval_samples(result.version, rows)
            log.info("eval at version %d: pass@1 %.3f reward %.3f (%s, %.1f s)",
                     result.version, metrics["eval/pass@1"], metrics["eval/reward_mean"],
                     result.replica, result.wait_s)

    def wait(self, drain: Callable[[], object]) -> None:
        """At the end of the run: log the evaluations still running as they finish (each is
        given up ``eval.timeout_s`` after its request); ``drain()`` is called between checks
        (the learner empties its buffer, so that no replica blocks on a full one)."""
        from rlflow.control import programs_common as pc

        while self.schedule.pending:
            pc.raise_if_stopped()
            self.log_finished()
            try:
                drain()
            except Exception:  # noqa: BLE001 - timeouts while draining are expected
                pass
        self.log_finished()
