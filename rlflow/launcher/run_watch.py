"""The launcher's view of a running learner: progress lines from the run folder's metrics.

The learner program logs one ``metrics.jsonl`` record per step (``step`` = policy version
after the step, 1-based). :class:`RunWatcher` tails that file (only complete lines), feeds
each new step to :class:`rlflow.launcher.progress.ProgressReporter`, and at the end writes
``summary.json`` (:mod:`rlflow.run.summary`) with the reward rise of the run, the learner
step reached (``steps_completed``), the step the invocation resumed from
(``resumed_from_step``, 0 for a fresh run) and the steps it ran (``steps_this_run``)
(:func:`rlflow.run.summary.reward_rise`), prints it and the path of the ``rlflow report``
page. When no new step arrives for ``STALL_NOTICE_S`` (then twice as long, and so on), it
prints how long, and the last line of each program's log, so a run that waits (a compile,
rollouts that never come) never waits silently.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Mapping, Optional

from rlflow.run import files
from rlflow.run.metrics import METRICS_FILE
from rlflow.run.phases import PhaseTail
from rlflow.run.folder import metrics_by_step, read_jsonl
from rlflow.run.summary import (PROMPT_COUNTS, SUMMARY_FILE, count_metrics, counts_line, health,
                                prompt_counts_line, reward_rise, throughput, write_report,
                                write_summary)

LOGS_SUBDIR = "logs"       # rlflow.launcher.supervisor's per-program logs: <role>.log
STALL_NOTICE_S = 300.0     # seconds without a new step before the first notice (then x2)


def _last_line(path: str) -> str:
    """The last non-empty line of a text file (its last 8 KiB), "" when none or unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


class RunWatcher:
    """Tails ``<run>/metrics.jsonl`` and reports progress (a thin shell, no JAX).

    Args:
      cfg: the :class:`rlflow.config.ExperimentConfig` of the run.
      run_path: the run folder.
      stream: where progress goes (default stderr).
      resumed_from: learner step of the checkpoint this invocation resumes from (0: fresh).
      stall_notice_s: seconds without a new step before a notice (doubling after each;
        0: never).
      clock: monotonic seconds (a test's fake clock).

    Raises:
      ValueError: ``resumed_from`` outside ``[0, learner.num_steps]``.
    """

    def __init__(self, cfg, run_path: str, stream=None, resumed_from: int = 0,
                 stall_notice_s: float = STALL_NOTICE_S, clock=time.monotonic):
        from rlflow.launcher.progress import ProgressReporter

        self.cfg = cfg
        self.run_path = run_path
        self.stream = stream if stream is not None else sys.stderr
        self.path = files.join(run_path, METRICS_FILE)
        self.logs = os.path.join(files.local_side(run_path), LOGS_SUBDIR)
        # the programs' start-up phases (loading, compiling, waiting for rollouts), printed
        # until the first step: lines they add to their logs from now on
        self._phases = PhaseTail(self.logs)
        # From the start: the learner may rewrite the file shorter on resume (records after
        # its checkpoint removed); steps <= resumed_from are skipped below.
        self._offset = 0
        self._partial = b""
        self._clock = clock
        self._t0 = clock()
        self._stall_after = self._stall_first = float(stall_notice_s)
        self._last_new_step_t = self._t0
        if not 0 <= resumed_from <= cfg.learner.num_steps:
            raise ValueError(f"resumed_from must be in [0, learner.num_steps="
                             f"{cfg.learner.num_steps}], got {resumed_from}")
        self.resumed_from = resumed_from
        self.last_step = resumed_from
        self.counts: dict[str, float] = {}
        self._lost: dict[str, float] = {}       # replica/<i>/lost seen so far
        self.reported_dead: set[str] = set()    # replicas whose death the launcher printed
        self._prompts_shown = False
        self.progress = ProgressReporter(cfg.learner.num_steps, mode=cfg.metrics.progress,
                                         stream=self.stream, start_step=resumed_from)

    def poll(self) -> int:
        """Read new complete records; one progress update per new step; before the first
        step, a line per start-up phase a program reports (:mod:`rlflow.run.phases`).
        Returns the newest step seen (``resumed_from`` before the first)."""
        if self.last_step <= self.resumed_from:     # phases first: they came before step 1
            for role, text in self._phases.new_phases():
                self.progress.message(f"rlflow train: [{role}] {text}")
        self._read_records()
        return self.last_step

    def _read_records(self) -> None:
        try:
            if files.is_url(self.path):    # an object: read whole, keep what is new
                data = files.read_bytes(self.path)
                if len(data) < self._offset:
                    self._offset, self._partial = 0, b""
                chunk = data[self._offset:]
            else:
                if os.path.getsize(self.path) < self._offset:    # rewritten (resume)
                    self._offset, self._partial = 0, b""
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    chunk = f.read()
        except OSError:                    # no metrics yet
            self._stall_notice()
            return
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            step = rec.get("step")
            if isinstance(step, int) and step > self.last_step and "learner/step_time_s" in rec:
                self.last_step = step
                self._last_new_step_t, self._stall_after = self._clock(), self._stall_first
                self._note_counts(rec)
                at = rec.get("time")
                # run-wide counts (newest seen) too: not every record carries them
                self.progress.update(min(step, self.cfg.learner.num_steps), {
                    **self.counts, **{k: v for k, v in rec.items()
                                      if isinstance(v, (int, float))}},
                    at=at if isinstance(at, (int, float)) else None)
        self._stall_notice()

    def _stall_notice(self) -> None:
        """After ``stall_notice_s`` (then 2x, 4x ...) without a new step: how long, and the
        last line of each program's log (``<run>/logs/*.log``)."""
        waited = self._clock() - self._last_new_step_t
        if not self._stall_after or waited < self._stall_after:
            return
        self._stall_after *= 2
        since = (f"since step {self.last_step} of {self.cfg.learner.num_steps}"
                 if self.last_step > self.resumed_from else "since the start")
        took = f"{waited:.0f} s" if waited < 120 else f"{waited / 60:.0f} min"
        lines = [f"rlflow train: no learner step for {took} {since} (a compile, or the "
                 f"learner waiting for rollouts); the last line of each log:"]
        logs = self.logs
        try:
            names = sorted(n for n in os.listdir(logs) if n.endswith(".log"))
        except OSError:
            names = []
        for name in names:
            last = _last_line(os.path.join(logs, name))
            lines.append(f"  [{name[:-4]}] {last[:300]}" if last else f"  [{name[:-4]}] (empty)")
        self.progress.message("\n".join(lines))

    def _note_counts(self, rec: Mapping) -> None:
        """Keep the newest value of each count of :func:`rlflow.run.summary.count_metrics`;
        print the prompt filter counts once, when they first arrive (they are fixed for the
        run)."""
        new = count_metrics(rec)
        self._note_lost_replicas(rec)
        self.counts.update(new)
        if not self._prompts_shown and any(k in new for k in PROMPT_COUNTS):
            self._prompts_shown = True
            self.progress.message("rlflow train: " + prompt_counts_line(
                self.counts, self.cfg.data.max_prompt_tokens))

    def _note_lost_replicas(self, rec: Mapping) -> None:
        """One console line each time the learner declares a sampler replica lost for
        silence (``replica/<i>/lost`` rises,
        :func:`rlflow.control.replica_metrics.replica_metrics`): a hung or unreachable
        replica, whose process the launcher still sees running (one whose death the launcher
        already printed, ``reported_dead``, is not told again)."""
        for key, value in sorted(rec.items()):
            if not (key.startswith("replica/") and key.endswith("/lost")
                    and isinstance(value, (int, float)) and value > self._lost.get(key, 0)):
                continue
            self._lost[key] = value
            name = f"sampler-{key.split('/')[1]}"
            if name in self.reported_dead:
                continue
            last = _last_line(os.path.join(self.logs, f"{name}.log"))
            self.progress.message(
                f"rlflow train: the learner declared {name} lost (no heartbeat for over "
                f"runtime.replica_timeout_s={self.cfg.runtime.replica_timeout_s:g} s: hung, "
                f"stopped or unreachable); its leased prompts go to the other replicas"
                + (f"; the last line of its log: {last[:300]}" if last else ""))

    def summary(self, success: bool) -> dict:
        """Reward rise over the run's whole ``metrics.jsonl`` (``reward/mean`` per step), wall
        time of this invocation, outcome, ``steps_completed`` (learner step reached),
        ``resumed_from_step``, ``steps_this_run``, this invocation's ``throughput``
        (:func:`rlflow.run.summary.throughput`), and ``healthy`` with ``unhealthy_reasons``
        (:func:`rlflow.run.summary.health`)."""
        try:
            records, _ = read_jsonl(self.path)
        except ValueError:
            records = []
        by_step = metrics_by_step(records)
        rewards = {s: m["reward/mean"] for s, m in by_step.items() if "reward/mean" in m}
        out = reward_rise(rewards)
        out.update(counts=dict(self.counts))
        out.update(success=bool(success), steps_completed=self.last_step,
                   resumed_from_step=self.resumed_from,
                   steps_this_run=self.last_step - self.resumed_from,
                   wall_s=self._clock() - self._t0)
        out["throughput"] = throughput(by_step, self.resumed_from, out["wall_s"])
        last = by_step[max(by_step)] if by_step else {}
        reasons = health(success, out["counts"], last, self.cfg.sampler.group_size)
        out.update(healthy=not reasons, unhealthy_reasons=reasons)
        return out

    def close(self, success: bool, report: bool = True) -> Optional[dict]:
        """Stop the progress display; write ``summary.json``, print the reward rise and
        (on success, when ``report``) the report page path."""
        self.progress.close()
        summary = self.summary(success)
        path = files.join(self.run_path, SUMMARY_FILE)
        write_summary(path, summary)
        if summary["steps"]:
            resumed = (f" (resumed from step {self.resumed_from}, now at step "
                       f"{summary['steps_completed']})" if self.resumed_from else "")
            ended = "" if success else " before the run stopped (see the lines above)"
            first, last = (f"{summary[k]:.3f}" for k in ("reward_first", "reward_last"))
            # the rise of the figures shown (summary.json keeps the exact one): never
            # "0.073 -> 0.073 (rise -0.001)"
            rise = float(last) - float(first) + 0.0       # + 0.0: no "-0.000"
            print(f"rlflow train: {summary['steps_this_run']} steps in "
                  f"{summary['wall_s']:.0f} s{resumed}{ended}; mean reward first "
                  f"{summary['window']} step(s) {first} -> last "
                  f"{summary['window']} step(s) {last} (rise "
                  f"{rise:+.3f}); written to {path}", file=self.stream, flush=True)
        counts = counts_line(summary["counts"])
        if counts:
            print(f"rlflow train: {counts}", file=self.stream, flush=True)
        if success and not summary["healthy"]:
            print("rlflow train: finished, but not healthy: "
                  + "; ".join(summary["unhealthy_reasons"]), file=self.stream, flush=True)
        if success and report:
            write_report(self.run_path, self.stream)
        return summary
