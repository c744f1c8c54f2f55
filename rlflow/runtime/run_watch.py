"""The launcher's view of a running learner: progress lines from the run folder's metrics.

The learner program logs one ``metrics.jsonl`` record per step (``step`` = policy version
after the step, 1-based). :class:`RunWatcher` tails that file (only complete lines), feeds
each new step to :class:`rlflow.console.progress.ProgressReporter`, and at the end writes
``summary.json`` with the reward rise of the run, the learner step reached
(``steps_completed``), the step the invocation resumed from (``resumed_from_step``, 0 for a
fresh run) and the steps it ran (``steps_this_run``) (:func:`reward_rise`), prints it and the
path of the ``rlflow report`` page. When no new step arrives for ``STALL_NOTICE_S`` (then
twice as long, and so on), it prints how long, and the last line of each program's log, so a
run that waits (a compile, rollouts that never come) never waits silently.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Mapping, Optional

from rlflow.run import files
from rlflow.run.metrics import METRICS_FILE
from rlflow.run.phases import PhaseTail
from rlflow.run.folder import metrics_by_step, read_jsonl

SUMMARY_FILE = "summary.json"
LOGS_SUBDIR = "logs"       # rlflow.runtime.supervisor's per-program logs: <role>.log
STALL_NOTICE_S = 300.0     # seconds without a new step before the first notice (then x2)
CHECKPOINTS_SUBDIR = "checkpoints"  # rlflow.checkpoint.checkpoint_dir(run) (not imported: JAX)


def latest_checkpoint_step(run_path: str) -> Optional[int]:
    """Step of the newest complete checkpoint of a local run folder, or None.

    Reads only folder names under ``<run_path>/checkpoints``: orbax commits a checkpoint by
    renaming ``<step>.orbax-checkpoint-tmp-*`` to ``<step>`` (:mod:`rlflow.checkpoint`), so
    the all-digit names are the complete ones (what ``Checkpointer.latest_step()`` returns,
    without importing JAX / orbax in the launcher).
    """
    directory = files.join(run_path, CHECKPOINTS_SUBDIR)
    try:
        names = files.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = [int(n) for n in names
             if n.isdigit() and files.isdir(files.join(directory, n))]
    return max(steps) if steps else None


def discard_records_after(run_path: str, step: int) -> dict[str, int]:
    """Remove the records of steps > ``step`` from the run folder's ``metrics.jsonl`` and
    ``samples.jsonl`` (:func:`rlflow.run.metrics.truncate_after`, an atomic rewrite).

    The launcher calls it before it starts the programs of an invocation that resumes from
    checkpoint ``step`` (0: no checkpoint): records an interrupted invocation wrote after
    that checkpoint belong to steps the learner recomputes, so neither the console, the
    summary nor the report may read them (the learner's own truncation at start-up stays as
    a second guard). Returns ``{file name: records removed}`` for the files that had some.
    """
    from rlflow.run.metrics import SAMPLES_FILE, truncate_after

    removed = {}
    for name in (METRICS_FILE, SAMPLES_FILE):
        n = truncate_after(files.join(run_path, name), step)
        if n:
            removed[name] = n
    return removed


def reward_rise(rewards_by_step: Mapping[int, float], frac: float = 0.1) -> dict:
    """Mean reward of the first and last ``frac`` of steps (at least one step each).

    Args:
      rewards_by_step: step -> mean reward of that step (NaN entries are skipped).
      frac: fraction of steps in each window, in (0, 0.5].

    Returns:
      ``{"steps", "window", "reward_first", "reward_last", "reward_rise"}`` (NaN figures
      when there are no finite rewards).
    """
    if not 0 < frac <= 0.5:
        raise ValueError(f"frac must be in (0, 0.5], got {frac}")
    steps = [s for s in sorted(rewards_by_step) if math.isfinite(rewards_by_step[s])]
    if not steps:
        return {"steps": 0, "window": 0, "reward_first": math.nan, "reward_last": math.nan,
                "reward_rise": math.nan}
    k = max(1, int(round(frac * len(steps))))
    first = sum(rewards_by_step[s] for s in steps[:k]) / k
    last = sum(rewards_by_step[s] for s in steps[-k:]) / k
    return {"steps": len(steps), "window": k, "reward_first": first, "reward_last": last,
            "reward_rise": last - first}


def throughput(by_step: Mapping[int, Mapping], after_step: int, wall_s: float) -> dict:
    """Rates of one invocation over its whole run, for ``summary.json``.

    Args:
      by_step: step -> merged ``metrics.jsonl`` record.
      after_step: the step the invocation resumed from (its own steps are the later ones).
      wall_s: the invocation's wall-clock seconds (start-up and compilation included).

    Returns:
      ``learner_steps_per_s`` and ``learner_tokens_per_s`` (steps and trained tokens,
      ``learner/tokens``, per wall-clock second), ``sampler_tokens`` and
      ``sampler_tokens_per_s`` (tokens decoded, per second since the learner started:
      :class:`rlflow.runtime.metrics.StepRates`, from the last step's record); NaN where the
      records hold no figure (written as ``null``).
    """
    steps = sorted(s for s in by_step if s > after_step)
    last = by_step[steps[-1]] if steps else {}
    wall = wall_s if wall_s > 0 else math.nan
    trained = sum(float(by_step[s].get("learner/tokens", 0.0)) for s in steps)
    return {"learner_steps_per_s": len(steps) / wall,
            "learner_tokens_per_s": trained / wall if steps else math.nan,
            "sampler_tokens": float(last.get("sampler/tokens_total", math.nan)),
            "sampler_tokens_per_s": float(last.get("sampler/tokens_per_s_run", math.nan))}


#: Share of a reward function's (or the environment's) calls that may fail before a run
#: that finished is still called healthy.
UNHEALTHY_FAILURE_FRAC = 0.01


def health(success: bool, counts: Mapping[str, float], last: Mapping,
           group_size: int) -> list[str]:
    """Why a run is not healthy (empty: healthy), for ``summary.json``.

    Args:
      success: whether the invocation finished its steps.
      counts: the run's count metrics (:func:`count_metrics`, newest values).
      last: the last step's merged ``metrics.jsonl`` record (``sampler/groups_delivered``,
        ``sampler/env_steps``).
      group_size: ``sampler.group_size`` (reward calls per delivered group).

    Returns:
      One line per reason: the run did not finish; a reward function or the environment
      failed (errors and timeouts) on more than :data:`UNHEALTHY_FAILURE_FRAC` of its calls
      (or on some with none known to succeed); groups were dropped for a NaN/inf reward.
    """
    reasons = [] if success else ["the run did not finish (see the lines above and logs/)"]
    delivered = float(last.get("sampler/groups_delivered", 0.0))
    dropped = float(counts.get("sampler/dropped_bad_reward_groups", 0.0))
    calls = (delivered + dropped) * group_size
    for fn in sorted({k.split("/", 2)[2] for k in counts if k.startswith(COUNT_PREFIXES)}):
        errors = float(counts.get(f"reward/errors/{fn}", 0.0))
        timeouts = float(counts.get(f"reward/timeouts/{fn}", 0.0))
        failed = errors + timeouts
        if failed and (not calls or failed > UNHEALTHY_FAILURE_FRAC * calls):
            reasons.append(f"reward function {fn!r} failed on {int(failed)} of about "
                           f"{int(calls)} calls ({int(errors)} errors, {int(timeouts)} "
                           f"timeouts; scored 0)")
    steps = float(last.get("sampler/env_steps", 0.0))
    failed = float(counts.get("sampler/env_errors", 0.0)) + \
        float(counts.get("sampler/env_timeouts", 0.0))
    if failed and (not steps or failed > UNHEALTHY_FAILURE_FRAC * steps):
        reasons.append(f"the environment failed on {int(failed)} of {int(steps)} steps "
                       f"(sampler/env_errors, sampler/env_timeouts; reward 0)")
    if dropped:
        reasons.append(f"{int(dropped)} group(s) dropped for a NaN/inf reward")
    return reasons


def _write_summary(path: str, summary: Mapping) -> None:
    """Write ``summary`` to ``path`` atomically (a temporary file, then ``os.replace``), as
    strict JSON: a figure with no value (NaN, inf) is ``null``."""
    files.write_atomic(path, json.dumps(_finite_or_none(summary), indent=2, allow_nan=False))


def _write_report(run_path: str, stream) -> Optional[str]:
    """Write the run's report page and print its path to ``stream``; returns the path, or
    None after printing why it could not be made (a report problem never fails a run)."""
    try:
        from rlflow.run.report import make_report

        page = make_report(run_path)
    except Exception as e:  # noqa: BLE001 - see above
        print(f"rlflow train: could not write the report ({e})", file=stream, flush=True)
        return None
    print(f"rlflow train: report {page}", file=stream, flush=True)
    return page


def _finite_or_none(obj):
    """``obj`` with every NaN or infinite float replaced by None (JSON ``null``), so that
    ``summary.json`` is strict JSON (``NaN`` is not) for every reader, ``jq`` included."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


# Run-wide counts a user needs on the console (cumulative in the records: newest wins).
# "{s}" in a label is the plural ending: "" for a count of 1, "s" otherwise.
PROMPT_COUNTS = {"sampler/prompts_kept": "kept",
                 "sampler/prompts_too_long": "longer than data.max_prompt_tokens (filtered)",
                 "sampler/prompts_bad": "bad record{s} (skipped)"}
DROP_COUNTS = {"learner/stale_groups_dropped": "stale group{s} dropped",
               "learner/zero_variance_groups_dropped": "zero-variance group{s} dropped",
               "buffer/dropped_full": "group{s} dropped by a full buffer",
               "sampler/dropped_bad_reward_groups": "group{s} dropped for a NaN/inf reward",
               "learner/skipped_steps": "learner step{s} skipped (no sample for the loss)",
               "sampler/env_reset_errors": "prompt{s} dropped (environment could not start)",
               "sampler/env_errors": "environment step error{s} (episode marked failed)",
               "sampler/env_timeouts": "environment step timeout{s} (episode marked failed)",
               "sampler/replicas_lost": "time{s} a sampler replica was declared lost "
                                        "(no heartbeat for runtime.replica_timeout_s)"}
COUNT_PREFIXES = ("reward/errors/", "reward/timeouts/")
# The held-out evaluations' reward failures (rlflow.sampler.eval_runner), counted apart:
# summary.json's "counts" and the counts line, not the run's health.
EVAL_COUNT_PREFIXES = {"eval/reward_errors/": "held-out evaluation reward error{s}",
                       "eval/reward_timeouts/": "held-out evaluation reward timeout{s}"}


def count_metrics(record: Mapping) -> dict[str, float]:
    """The count metrics of one ``metrics.jsonl`` record (prompt filter counts, dropped
    groups, reward function errors / timeouts, in training and in held-out evaluations)."""
    return {k: float(v) for k, v in record.items()
            if (k in PROMPT_COUNTS or k in DROP_COUNTS or k.startswith(COUNT_PREFIXES)
                or k.startswith(tuple(EVAL_COUNT_PREFIXES)))
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


def prompt_counts_line(counts: Mapping[str, float], max_prompt_tokens: int) -> str:
    """``prompts: 7473 kept, 12 longer than data.max_prompt_tokens=256 (filtered), ...``"""
    parts = []
    for key, label in PROMPT_COUNTS.items():
        if key in counts:
            label = label.replace("max_prompt_tokens", f"max_prompt_tokens={max_prompt_tokens}")
            parts.append(_counted(counts[key], label))
    return "prompts: " + ", ".join(parts)


def _counted(n: float, label: str) -> str:
    """``"1 bad record (skipped)"`` / ``"3 bad records (skipped)"``: ``label``'s ``{s}``
    filled for the count ``n``."""
    return f"{int(n)} " + label.replace("{s}", "" if int(n) == 1 else "s")


def counts_line(counts: Mapping[str, float]) -> str:
    """The non-zero drop and failure counts of a run as one line ("" when all are zero)."""
    parts = [_counted(counts[k], label) for k, label in DROP_COUNTS.items() if counts.get(k)]
    parts += [_counted(v, f"reward {k.split('/')[1][:-1]}{{s}} in {k.split('/', 2)[2]}")
              for k, v in sorted(counts.items()) if k.startswith(COUNT_PREFIXES) and v]
    parts += [_counted(v, f"{label} in {k[len(prefix):]}")
              for prefix, label in EVAL_COUNT_PREFIXES.items()
              for k, v in sorted(counts.items()) if k.startswith(prefix) and v]
    return ("counts: " + ", ".join(parts)) if parts else ""


def mark_complete(run_path: str, step: int, stream=None) -> Optional[str]:
    """Record a run as finished whose last invocation stopped after the final checkpoint was
    committed (e.g. SIGTERM during the exit checkpoint's last moments): its ``summary.json``
    says ``"success": false`` and it has no report. Called when a re-run finds the run
    complete (checkpoint ``step >= learner.num_steps``).

    Sets ``success`` to true and ``steps_completed`` to at least ``step``, writes the report
    and prints its path to ``stream`` (default stdout). A summary that is missing, unreadable
    or not marked failed is left as it is.

    Returns:
      The report page's path, or None when nothing was changed or no report could be made.
    """
    stream = stream if stream is not None else sys.stdout
    path = files.join(run_path, SUMMARY_FILE)
    try:
        summary = json.loads(files.read_text(path))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("success") is not False:
        return None
    summary["success"] = True
    summary["steps_completed"] = max(int(summary.get("steps_completed") or 0), int(step))
    _write_summary(path, summary)
    print(f"rlflow train: {path}: the last invocation stopped after its final checkpoint "
          f"(step {step}) was committed; marked successful", file=stream, flush=True)
    return _write_report(run_path, stream)


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
        from rlflow.console.progress import ProgressReporter

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
        """Keep the newest value of each count of :func:`count_metrics`; print the prompt
        filter counts once, when they first arrive (they are fixed for the run)."""
        new = count_metrics(rec)
        self._note_lost_replicas(rec)
        self.counts.update(new)
        if not self._prompts_shown and any(k in new for k in PROMPT_COUNTS):
            self._prompts_shown = True
            self.progress.message("rlflow train: " + prompt_counts_line(
                self.counts, self.cfg.data.max_prompt_tokens))

    def _note_lost_replicas(self, rec: Mapping) -> None:
        """One console line each time the learner declares a sampler replica lost for
        silence (``replica/<i>/lost`` rises, :func:`rlflow.runtime.metrics.replica_metrics`):
        a hung or unreachable replica, whose process the launcher still sees running (one
        whose death the launcher already printed, ``reported_dead``, is not told again)."""
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
        (:func:`throughput`), and ``healthy`` with ``unhealthy_reasons`` (:func:`health`)."""
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
        _write_summary(path, summary)
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
            _write_report(self.run_path, self.stream)
        return summary
