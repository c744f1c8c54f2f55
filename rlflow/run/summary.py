"""The run summary: ``summary.json`` of an invocation of ``rlflow train`` and the counts it
prints, from the run folder's ``metrics.jsonl`` (no JAX; the launcher's
:class:`rlflow.launcher.run_watch.RunWatcher` writes it at the end of a run).

The summary holds the reward rise of the run (:func:`reward_rise`), the learner step reached
(``steps_completed``), the step the invocation resumed from (``resumed_from_step``, 0 for a
fresh run), the steps it ran (``steps_this_run``), its throughput (:func:`throughput`), the
run-wide counts (:func:`count_metrics`) and whether it is healthy (:func:`health`).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Mapping, Optional

from rlflow.run import files
from rlflow.run.metrics import METRICS_FILE

SUMMARY_FILE = "summary.json"
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
      :class:`rlflow.control.replica_metrics.StepRates`, from the last step's record); NaN where the
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


def write_summary(path: str, summary: Mapping) -> None:
    """Write ``summary`` to ``path`` atomically (a temporary file, then ``os.replace``), as
    strict JSON: a figure with no value (NaN, inf) is ``null``."""
    files.write_atomic(path, json.dumps(_finite_or_none(summary), indent=2, allow_nan=False))


def write_report(run_path: str, stream) -> Optional[str]:
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
    write_summary(path, summary)
    print(f"rlflow train: {path}: the last invocation stopped after its final checkpoint "
          f"(step {step}) was committed; marked successful", file=stream, flush=True)
    return write_report(run_path, stream)
