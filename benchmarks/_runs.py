"""Run ``rlflow train`` and read its steady-state steps (shared by the end-to-end
benchmarks; not a benchmark itself: bench.sh runs only files without a leading underscore)."""

from __future__ import annotations

import os


def steady_steps(cfg, warmup: int) -> tuple[list, dict, dict]:
    """Run ``cfg`` with ``rlflow.runtime.supervisor.run_train`` and return ``(steps, times,
    by_step)``: the logged steps after the first ``warmup`` (start-up and compilation
    excluded), each step's metrics-record wall time (``metrics.jsonl`` ``time``, seconds)
    and every step's metrics.

    Raises:
      RuntimeError: the run exited non-zero (names the logs folder), a metrics line is
        malformed, or fewer than 2 steps remain after ``warmup``.
    """
    from rlflow.metrics import METRICS_FILE
    from rlflow.run_folder import metrics_by_step, read_jsonl
    from rlflow.runtime.supervisor import run_train

    code = run_train(cfg)
    if code != 0:
        raise RuntimeError(f"rlflow train ({cfg.name}) exited with {code}; see "
                           f"{cfg.run_path}/logs")
    records, problems = read_jsonl(os.path.join(cfg.run_path, METRICS_FILE))
    if problems:
        raise RuntimeError(f"{cfg.name}: bad metrics lines: {problems[:3]}")
    times = {r["step"]: r["time"] for r in records if "learner/step_time_s" in r}
    steps = sorted(times)[warmup:]
    if len(steps) < 2:
        raise RuntimeError(f"{cfg.name}: only {len(times)} steps logged (need > {warmup + 1})")
    return steps, times, metrics_by_step(records)
