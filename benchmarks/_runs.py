"""Run ``rlflow train`` and read its steady-state steps (shared by the end-to-end
benchmarks; not a benchmark itself: bench.sh runs only files without a leading underscore)."""

from __future__ import annotations

import os


def run_records(cfg) -> list[dict]:
    """Run ``cfg`` with ``rlflow.launcher.supervisor.run_train``; its ``metrics.jsonl``
    records.

    Raises:
      RuntimeError: the run exited non-zero (names the logs folder) or a metrics line is
        malformed.
    """
    from rlflow.run.folder import read_jsonl
    from rlflow.run.metrics import METRICS_FILE
    from rlflow.launcher.supervisor import run_train

    code = run_train(cfg)
    if code != 0:
        raise RuntimeError(f"rlflow train ({cfg.name}) exited with {code}; see "
                           f"{cfg.run_path}/logs")
    records, problems = read_jsonl(os.path.join(cfg.run_path, METRICS_FILE))
    if problems:
        raise RuntimeError(f"{cfg.name}: bad metrics lines: {problems[:3]}")
    return records


def steady_steps(cfg, warmup: int) -> tuple[list, dict, dict]:
    """Run ``cfg`` with ``rlflow.launcher.supervisor.run_train`` and return ``(steps, times,
    by_step)``: the logged steps after the first ``warmup`` (start-up and compilation
    excluded), each step's metrics-record wall time (``metrics.jsonl`` ``time``, seconds)
    and every step's metrics.

    Raises:
      RuntimeError: the run exited non-zero (names the logs folder), a metrics line is
        malformed, or fewer than 2 steps remain after ``warmup``.
    """
    from rlflow.run.folder import metrics_by_step

    records = run_records(cfg)
    times = {r["step"]: r["time"] for r in records if "learner/step_time_s" in r}
    steps = sorted(times)[warmup:]
    if len(steps) < 2:
        raise RuntimeError(f"{cfg.name}: only {len(times)} steps logged (need > {warmup + 1})")
    return steps, times, metrics_by_step(records)


def steady_wall(steps: list, times: dict, by_step: dict) -> tuple[float, float]:
    """``(wall, compile_s)``: seconds between the metrics records of ``steps[0]`` and
    ``steps[-1]`` less the time steps inside it spent compiling or waiting for a background
    compile (``learner/compile_s``: a packed run's second shape, compiled while the first
    steps train, may not be ready when a step first needs it), and that compile time."""
    compile_s = sum(by_step[s].get("learner/compile_s", 0.0) for s in steps[1:])
    return times[steps[-1]] - times[steps[0]] - compile_s, compile_s


def mean_train_s(steps: list, by_step: dict) -> float:
    """Mean seconds of the train step over ``steps``, compile time (``learner/compile_s``)
    left out."""
    return sum(by_step[s]["learner/step_time_s"] - by_step[s].get("learner/compile_s", 0.0)
               for s in steps) / len(steps)
