"""Reading and checking run folders written by :class:`rlflow.run.metrics.MetricsWriter`.

Readers never raise on a bad line (a crash can leave a half-written last line): they
return the problems found as ``file:line: why`` strings for the caller to show.
"""

from __future__ import annotations

import fnmatch
import json
import math
from typing import Any, Iterable, Mapping, Sequence

from rlflow.run import files
from rlflow.run.metrics import (CONFIG_FILE, METRICS_FILE, REQUIRED_METRICS, RESERVED_KEYS,
                            SAMPLES_FILE, TB_GLOB)


class RunFolderError(ValueError):
    """A run folder is missing a file or holds a bad record (message names file and line)."""


def read_jsonl(path: str) -> tuple[list[dict], list[str]]:
    """Records of a JSONL file and the problems found (``file:line: why``), never raising
    on a bad line (a crash can leave a half-written last line).

    Raises:
      RunFolderError: the file does not exist.
    """
    if not files.isfile(path):
        raise RunFolderError(f"{path}: file not found")
    records, problems = [], []
    for lineno, line in enumerate(files.read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{path}:{lineno}: not valid JSON ({e.msg})")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            problems.append(f"{path}:{lineno}: expected an object with an int 'step'")
            continue
        records.append(record)
    return records, problems


def metrics_by_step(records: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """Merge metric records by step (later values win; null -> NaN), steps ascending."""
    merged: dict[int, dict[str, float]] = {}
    for r in records:
        row = merged.setdefault(r["step"], {})
        for k, v in r.items():
            if k in RESERVED_KEYS:
                continue
            if v is None:
                row[k] = math.nan
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k] = float(v)
    return dict(sorted(merged.items()))


def validate_run_folder(run_dir: str, required: Sequence[str] = REQUIRED_METRICS,
                        *, expect_samples: bool = True) -> None:
    """Check a finished run folder: config, metrics, TensorBoard events, samples.

    Every name in ``required`` must appear in some record of ``metrics.jsonl`` and every
    logged value must be finite.

    Raises:
      RunFolderError: listing every problem found (missing files, bad lines, missing or
        non-finite metrics).
    """
    problems = []
    config = files.join(run_dir, CONFIG_FILE)
    if not files.isfile(config):
        problems.append(f"{config}: file not found")
    else:
        try:
            json.loads(files.read_text(config))
        except json.JSONDecodeError as e:
            problems.append(f"{config}: not valid JSON ({e})")
    try:
        records, bad = read_jsonl(files.join(run_dir, METRICS_FILE))
        problems += bad
        if not records:
            problems.append(f"{run_dir}/{METRICS_FILE}: no records")
        seen = set().union(*(r.keys() for r in records)) if records else set()
        missing = [n for n in required if n not in seen]
        if missing:
            problems.append(f"{run_dir}/{METRICS_FILE}: required metrics never logged: {missing}")
        for r in records:
            if r.get("non_finite"):
                problems.append(f"{run_dir}/{METRICS_FILE}: step {r['step']}: non-finite "
                                f"values {r['non_finite']}")
    except RunFolderError as e:
        problems.append(str(e))
    if not fnmatch.filter(files.listdir(run_dir) if files.isdir(run_dir) else [], TB_GLOB):
        problems.append(f"{run_dir}: no TensorBoard event file ({TB_GLOB})")
    if expect_samples:
        try:
            samples, bad = read_jsonl(files.join(run_dir, SAMPLES_FILE))
            problems += bad
            if not samples:
                problems.append(f"{run_dir}/{SAMPLES_FILE}: no sample completions")
        except RunFolderError as e:
            problems.append(str(e))
    if problems:
        raise RunFolderError(f"run folder {run_dir} failed validation:\n  " +
                             "\n  ".join(problems))
