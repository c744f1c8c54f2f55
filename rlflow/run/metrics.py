"""The run folder: resolved config, per-step metrics (JSONL + TensorBoard), sample completions.

Layout of ``runs/<name>/`` (``ExperimentConfig.run_path``)::

    config.json              the resolved ExperimentConfig (``dataclasses.asdict``)
    metrics.jsonl            one JSON object per ``MetricsWriter.log`` call:
                             {"step": int, "time": unix seconds, "<metric>": float | null, ...,
                              "non_finite": [names]}   (last key only when a value was NaN/inf)
    samples.jsonl            one JSON object per sample completion:
                             {"step", "prompt", "completion", "reward", "version", ...extras}
    events.out.tfevents.*    TensorBoard scalars/histograms/text (tensorboardX SummaryWriter)
    report/                  written by ``rlflow report`` (rlflow/run/report.py)
    wandb/, wandb_run_id     with ``metrics.wandb.mode`` on: W&B's files and run id
                             (rlflow/run/wandb_sink.py)

One writer per run: the process that owns the run folder (the launcher or the learner)
logs both programs' metrics; the sampler's figures travel to it with the rollouts.
Metric names are ``section/name``; :data:`REQUIRED_METRICS` (:mod:`rlflow.run.metric_names`,
the catalogue of names, units and meanings) lists those every ``rlflow train`` step must log (the runtime's end-to-end test checks them with
:func:`rlflow.run.folder.validate_run_folder`). Any other name may be logged as well.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from rlflow.run import files
from rlflow.run.metric_names import (LAG_BUCKETS, METRIC_SPECS, REQUIRED_METRICS,
                                     STALENESS_BUCKETS, STALENESS_HIST, staleness_histogram)

# the catalogue of names stays importable from here (its importers predate metric_names)
__all__ = ["MetricsWriter", "NonFiniteMetricError", "truncate_after", "completion_text",
           "CONFIG_FILE", "METRICS_FILE", "SAMPLES_FILE", "TB_GLOB", "RESERVED_KEYS",
           "LAG_BUCKETS", "METRIC_SPECS", "REQUIRED_METRICS", "STALENESS_BUCKETS",
           "STALENESS_HIST", "staleness_histogram"]

logger = logging.getLogger("rlflow.run.metrics")

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TB_GLOB = "events.out.tfevents.*"
RESERVED_KEYS = ("step", "time", "non_finite")

class NonFiniteMetricError(ValueError):
    """A metric value is NaN or inf and ``on_non_finite == "error"``."""


def _scalar(where: str, value: Any) -> float:
    arr = np.asarray(value)
    if arr.size != 1 or arr.dtype.kind not in "biuf":
        raise TypeError(f"{where} must be a real scalar, got "
                        f"{type(value).__name__} with shape {arr.shape} and dtype {arr.dtype} "
                        "(log arrays with MetricsWriter.histogram)")
    return float(arr.reshape(()))


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def summary_writer_class():
    """tensorboardX's ``SummaryWriter`` class, imported with torch hidden.

    tensorboardX's writer module imports torch whenever it is installed, only to accept
    ``torch.Tensor`` values (``tensorboardX/writer.py``); rlflow logs Python floats. On a host
    that has torch (GPU machines, our test environment) that import cost each learner start
    about 1.3 CPU seconds and a few hundred MB of resident memory. With ``sys.modules["torch"]``
    set to None for the import, ``import torch`` raises ImportError there and tensorboardX
    takes its no-torch path. A process that has already imported torch keeps it: the import
    is then free and nothing is hidden.
    """
    import sys

    if "tensorboardX.writer" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None             # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter

class MetricsWriter:
    """Writes one run folder: config, metrics (JSONL + TensorBoard) and sample completions.

    Thread-safe (a lock around each write); the JSONL files are flushed after every record
    so a crash loses nothing already logged. Use as a context manager or call :meth:`close`.

    Args:
      run_dir: the run folder (created if missing).
      samples_every: :meth:`log_samples` writes on steps divisible by this (0: never).
      num_samples: most completions written per sampled step.
      on_non_finite: "error" raises :class:`NonFiniteMetricError`; "flag" writes the value
        as null, lists it under the record's "non_finite" key and logs a warning.
      start_step: the step the run (re)starts from: the checkpoint's step on resume, 0 on
        a fresh start. Records of later steps, written by an interrupted invocation after
        that checkpoint, are removed from ``metrics.jsonl`` and ``samples.jsonl`` (an
        atomic rewrite, :func:`truncate_after`) and hidden in TensorBoard
        (``purge_step=start_step + 1``), so each step is recorded once.
      tensorboard: also write TensorBoard event files.
      wandb: a :class:`rlflow.run.wandb_sink.WandbSink` that receives the same metrics and
        samples (and logs the report's plots on :meth:`close`), or None.
    """

    def __init__(self, run_dir: str, *, samples_every: int = 5, num_samples: int = 4,
                 on_non_finite: str = "flag", start_step: int = 0, tensorboard: bool = True,
                 wandb=None):
        if on_non_finite not in ("error", "flag"):
            raise ValueError(f"on_non_finite must be 'error' or 'flag', got {on_non_finite!r}")
        if samples_every < 0 or num_samples < 0:
            raise ValueError(f"samples_every and num_samples must be >= 0, got "
                             f"{samples_every}, {num_samples}")
        self.run_dir = os.fspath(run_dir)
        files.makedirs(self.run_dir)
        self.samples_every, self.num_samples = samples_every, num_samples
        self.on_non_finite = on_non_finite
        self.non_finite_count = 0
        self._lock = threading.Lock()
        self._closed = False
        self.wandb = wandb
        for name in (METRICS_FILE, SAMPLES_FILE):
            removed = truncate_after(files.join(self.run_dir, name), start_step)
            if removed:
                logger.info("%s: removed %d record(s) of steps after %d (written after the "
                            "checkpoint this run resumes from)", name, removed, start_step)
        self._metrics = files.AppendFile(files.join(self.run_dir, METRICS_FILE))
        self._samples = files.AppendFile(files.join(self.run_dir, SAMPLES_FILE))
        self._tb = None
        # TensorBoard writes its event files with local file calls: for an object-store run
        # folder it writes them in the run's local side and flush() copies them over.
        self._tb_dir = (self.run_dir if not files.is_url(self.run_dir)
                        else os.path.join(files.local_side(self.run_dir), "tensorboard"))
        if tensorboard:
            SummaryWriter = summary_writer_class()
            # The suffix keeps two writers opened in the same second (a quick resume) from
            # sharing tensorboardX's per-second file name, which would truncate the first.
            self._tb = SummaryWriter(logdir=self._tb_dir, flush_secs=10,
                                     purge_step=start_step + 1,
                                     filename_suffix=f".{time.time_ns()}")

    @classmethod
    def for_experiment(cls, cfg, *, start_step: int = 0,
                       report_plots=None) -> "MetricsWriter":
        """Writer for ``cfg.run_path`` with ``cfg.metrics`` settings; writes ``config.json``.
        With ``metrics.wandb.mode`` not "off" it also opens (or, on resume, continues) the
        run's W&B run with the redacted config (:mod:`rlflow.run.wandb_sink`), which logs
        the plots that ``report_plots`` (e.g. :func:`rlflow.run.report.make_report`) renders
        when the writer closes (None: no plots).

        Raises:
          ImportError: W&B logging is on and ``wandb`` is not installed.
        """
        m = cfg.metrics
        sink = None
        if m.wandb.mode != "off":
            from rlflow.config.secrets import redact_config
            from rlflow.run.wandb_sink import WandbSink

            config = json.loads(json.dumps(redact_config(dataclasses.asdict(cfg)),
                                           default=_jsonable))
            sink = WandbSink(cfg.run_path, m.wandb, config, default_name=cfg.name,
                             report_plots=report_plots)
        writer = cls(cfg.run_path, samples_every=m.samples_every, num_samples=m.num_samples,
                     on_non_finite=m.on_non_finite, start_step=start_step, wandb=sink)
        writer.write_config(cfg)
        return writer

    # -- config --------------------------------------------------------------------------
    def write_config(self, cfg: Any) -> str:
        """Write the resolved config (a dataclass or a mapping) to ``config.json``, secrets
        redacted (:func:`rlflow.config.secrets.redact_config`).

        Replaces the file atomically; also shown as text in TensorBoard. Returns its path.
        """
        from rlflow.config.secrets import redact_config

        data = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
        data = redact_config(data)                  # secrets never reach the run folder
        text = json.dumps(data, indent=2, default=_jsonable)
        path = files.join(self.run_dir, CONFIG_FILE)
        with self._lock:
            self._check_open()
            files.write_atomic(path, text + "\n")
            if self._tb is not None:
                self._tb.add_text("config", "```\n" + text + "\n```", 0)
        return path

    # -- scalars -------------------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Record scalar metrics of one step (JSONL line + TensorBoard scalars).

        Args:
          step: learner step (= policy version), int >= 0. Several calls may share a step
            (e.g. sampler and learner figures); readers merge them, later values winning.
          metrics: name -> real scalar (Python/numpy number or 0-d array, JAX included).

        Returns:
          The JSON record written.

        Raises:
          TypeError: a name is not a non-empty string, or a value is not a real scalar.
          ValueError: bad step, or a reserved name ("step", "time", "non_finite").
          NonFiniteMetricError: a NaN/inf value and ``on_non_finite == "error"`` (nothing
            of that call is written).
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        step = int(step)
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"metric names must be non-empty strings, got {name!r} "
                                f"at step {step}")
            if name in RESERVED_KEYS:
                raise ValueError(f"metric name {name!r} is reserved ({RESERVED_KEYS})")
            values[name] = _scalar(f"metric {name!r} at step {step}", value)
        bad = [n for n, v in values.items() if not math.isfinite(v)]
        if bad:
            detail = ", ".join(f"{n}={values[n]}" for n in bad)
            if self.on_non_finite == "error":
                raise NonFiniteMetricError(
                    f"step {step}: non-finite metric values: {detail} "
                    "(metrics.on_non_finite='flag' records them as null and continues)")
            logger.warning("step %d: non-finite metric values recorded as null: %s", step, detail)
        record: dict[str, Any] = {"step": step, "time": time.time()}
        record.update({n: (None if n in bad else v) for n, v in values.items()})
        if bad:
            record["non_finite"] = bad
        line = json.dumps(record, allow_nan=False)
        with self._lock:
            self._check_open()
            self.non_finite_count += len(bad)
            self._metrics.write(line + "\n")
            self._metrics.flush()
            if self._tb is not None:
                # One TensorBoard event holding every scalar of the call (one queue hand-off
                # instead of one per metric: ~100 per learner step), its values built as
                # protos directly (tensorboardX's ``summary.scalar`` per value cost ~4 ms a
                # step; metric names are valid tags as they are).
                from tensorboardX.proto.summary_pb2 import Summary

                summary = Summary(value=[Summary.Value(tag=n, simple_value=v)
                                         for n, v in values.items() if n not in bad])
                self._tb.file_writer.add_summary(summary, step, record["time"])
            if self.wandb is not None:
                self.wandb.log(step, {n: v for n, v in values.items() if n not in bad})
        return record

    def histogram(self, step: int, name: str, values: Sequence[float] | np.ndarray) -> None:
        """TensorBoard histogram of ``values`` (any shape, flattened) at ``step``.

        Raises:
          ValueError: empty or non-finite values (histogram bins would be meaningless).
        """
        arr = np.asarray(values, dtype=np.float64).ravel()
        if arr.size == 0 or not np.isfinite(arr).all():
            raise ValueError(f"histogram {name!r} at step {step}: needs a non-empty array of "
                             f"finite values, got {arr.size} values "
                             f"({int((~np.isfinite(arr)).sum())} non-finite)")
        with self._lock:
            self._check_open()
            if self._tb is not None:
                self._tb.add_histogram(name, arr, step)

    # -- samples -------------------------------------------------------------------------
    def samples_due(self, step: int) -> bool:
        """Whether :meth:`log_samples` writes at ``step`` (detokenize only then)."""
        return self.samples_every > 0 and self.num_samples > 0 and step % self.samples_every == 0

    def log_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> int:
        """Write up to ``num_samples`` completions when :meth:`samples_due` (else nothing).

        Args:
          samples: mappings with ``prompt`` (str), ``completion`` (str), ``reward`` (real
            scalar) and ``version`` (int, the policy version that sampled it); optional
            ``turns`` (multi-turn episodes: a list of ``{"role": str, "text": str, ...}``,
            shown instead of ``completion`` in TensorBoard and ``rlflow report``); extra
            JSON-serialisable keys (e.g. ``answer``, ``truncated``, ``completion_ids``) are
            kept.

        Returns:
          The number of samples written.

        Raises:
          ValueError / TypeError: a sample misses a key or has a value of the wrong type
            (message names the sample's index and the key).
        """
        if not self.samples_due(step):
            return 0
        lines = []
        for i, sample in enumerate(samples):
            if i >= self.num_samples:
                break
            where = f"sample {i} at step {step}"
            for key in ("prompt", "completion", "reward", "version"):
                if key not in sample:
                    raise ValueError(f"{where}: missing key {key!r} (has {sorted(sample)})")
            for key in ("prompt", "completion"):
                if not isinstance(sample[key], str):
                    raise TypeError(f"{where}: {key!r} must be str, got "
                                    f"{type(sample[key]).__name__}")
            turns = sample.get("turns")
            if turns is not None and not (isinstance(turns, list) and all(
                    isinstance(t, Mapping) and isinstance(t.get("role"), str)
                    and isinstance(t.get("text"), str) for t in turns)):
                raise TypeError(f"{where}: 'turns' must be a list of {{'role': str, 'text': "
                                f"str}} dicts, got {turns!r:.200}")
            version = sample["version"]
            if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
                raise TypeError(f"{where}: 'version' must be int, got {version!r}")
            reward = _scalar(f"{where}: 'reward'", sample["reward"])
            record = {"step": int(step), **sample, "version": int(version),
                      "reward": reward if math.isfinite(reward) else None}
            if not math.isfinite(reward):
                if self.on_non_finite == "error":
                    raise NonFiniteMetricError(f"{where}: reward is {reward}")
                logger.warning("%s: non-finite reward %s recorded as null", where, reward)
                record["non_finite"] = ["reward"]
            try:
                lines.append(json.dumps(record, default=_jsonable, allow_nan=False))
            except ValueError as e:
                raise ValueError(f"{where}: an extra key holds a value JSON cannot store "
                                 f"({e})") from None
        with self._lock:
            self._check_open()
            for line in lines:
                self._samples.write(line + "\n")
            self._samples.flush()
            if self._tb is not None and lines:
                self._tb.add_text("samples", _samples_markdown(lines), step)
            if self.wandb is not None and lines:
                self.wandb.log_samples(step, [json.loads(line) for line in lines])
        return len(lines)

    def log_eval_samples(self, version: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """One held-out evaluation's logged samples (the rows
        :func:`rlflow.eval.scoring.write_eval_samples` wrote to ``eval_samples.jsonl``:
        ``prompt``, ``completion``, ``answer``, ``reward``, ``correct``) to W&B as a table
        (:meth:`rlflow.run.wandb_sink.WandbSink.log_eval_samples`); nothing without W&B or
        rows. ``version``: the policy version that generated them."""
        with self._lock:
            self._check_open()
            if self.wandb is not None and rows:
                self.wandb.log_eval_samples(int(version), rows)

    # -- lifetime ------------------------------------------------------------------------
    def flush(self) -> None:
        with self._lock:
            if not self._closed and self._tb is not None:
                self._tb.flush()
                self._copy_tensorboard()

    def close(self) -> None:
        """Flush and close every file (idempotent); later writes raise RuntimeError. A W&B
        run gets the report's plots, then finishes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._metrics.close()
            self._samples.close()
            if self._tb is not None:
                self._tb.close()
                self._copy_tensorboard()
        if self.wandb is not None:
            self.wandb.finish()

    def _copy_tensorboard(self) -> None:
        """Object-store run folder: put the local TensorBoard event files in it (whole)."""
        if self._tb_dir == self.run_dir or not os.path.isdir(self._tb_dir):
            return
        for name in os.listdir(self._tb_dir):
            with open(os.path.join(self._tb_dir, name), "rb") as f:
                files.write_atomic(files.join(self.run_dir, name), f.read())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MetricsWriter for {self.run_dir} is closed")

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_after(path: str, step: int) -> int:
    """Remove the records of steps > ``step`` from a JSONL file (atomic rewrite).

    Lines that are not a JSON object with an int ``step`` are kept, except a last line
    without its newline (a write cut by a crash; appending after it would glue two
    records). Returns the number of lines removed (0, and the file untouched, when none).
    """
    try:
        data = files.read_bytes(path)
    except FileNotFoundError:
        return 0
    lines = data.split(b"\n")
    tail = lines.pop()                      # b"" when the file ends with a newline
    keep, removed = [], 1 if tail.strip() else 0
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            keep.append(line)
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
            removed += 1
        else:
            keep.append(line)
    if removed:
        files.write_atomic(path, b"".join(line + b"\n" for line in keep))
    return removed


def completion_text(sample: Mapping[str, Any]) -> str:
    """What a report shows of a sample's completion: its ``turns`` one per line as
    ``[role] text`` (multi-turn episodes, :func:`rlflow.exchange.records.completion_samples`),
    else ``completion``. A malformed ``turns`` falls back to ``completion``."""
    turns = sample.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, dict) for t in turns):
        return "\n".join(f"[{t.get('role', '?')}] {t.get('text', '')}" for t in turns)
    return str(sample.get("completion", ""))


def _samples_markdown(lines: Sequence[str]) -> str:
    rows = ["| version | reward | prompt | completion |", "|---|---|---|---|"]
    for line in lines:
        r = json.loads(line)
        cells = [str(r["version"]), str(r["reward"]), r["prompt"][:200],
                 completion_text(r)[:400]]
        rows.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells)
                    + " |")
    return "\n".join(rows)
