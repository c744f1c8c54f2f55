"""Live progress of a run: a rich progress bar on a terminal, plain lines elsewhere.

On a TTY (``metrics.progress`` "auto" or "bar") a :mod:`rich` bar shows steps done, elapsed
time, ETA and a compact status (step, reward, KL, tokens/s, staleness, buffer fill,
truncation rate). The bar appears at the first finished step (no "0/N" frame during
start-up), and :meth:`ProgressReporter.message` prints lines above it. The ETA is the pace
of the steps after the first one (which includes start-up and compilation) times the steps
left, shown as ``-:--:--`` until :data:`ETA_MIN_TIMED_STEPS` steps are timed. When
the stream is not a TTY (CI logs, pipes, files) or ``metrics.progress == "plain"``, each
update is one plain line with no control characters (no ANSI escapes, no carriage
returns), e.g.::

    step 12/100 (12%) elapsed 0:01:05 eta 0:07:58 | reward 0.412 | kl 1.2e-03 | tok/s 1520 ...

Metric names are those of :mod:`rlflow.run.metrics`.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from typing import Callable, Mapping, Optional, TextIO

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)
from rich.text import Text

# (label, metric name, format) of the status line, in order.
STATUS_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward", "reward/mean", "{:.3f}"),
    ("kl", "policy/kl", "{:.2e}"),
    ("tok/s", "sampler/tokens_per_s", "{:.0f}"),
    ("mfu", "perf/mfu", "{:.1%}"),
    ("stale", "staleness/mean", "{:.2f}"),
    ("buf", "buffer/fill", "{:.0%}"),
    ("trunc", "response/truncation_rate", "{:.0%}"),
)
# Steps timed before the ETA is shown: the first step (start-up, compilation) is never
# timed, and the pace is the mean over the steps after it.
ETA_MIN_TIMED_STEPS = 2

_ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def plain_text(text: str) -> str:
    """``text`` without ANSI escape sequences; other control characters (``\\r``, tab,
    ...) become spaces. Newlines are kept."""
    return _CONTROL.sub(" ", _ANSI.sub("", text))


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``-:--:--`` when unknown, i.e. NaN, inf or negative)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# (label, metric name or prefix summed over functions) of the reward failure counts shown
# on the status line when non-zero (run-wide counts, newest record wins).
REWARD_FAILURE_FIELDS: tuple[tuple[str, str], ...] = (
    ("reward errors", "reward/errors/"),
    ("reward timeouts", "reward/timeouts/"),
    ("bad-reward groups dropped", "sampler/dropped_bad_reward_groups"),
)


def format_status(metrics: Mapping[str, float]) -> str:
    """Compact status of the fields in :data:`STATUS_FIELDS` present in ``metrics``
    (a missing field is left out; a NaN shows as ``nan``), then the non-zero reward failure
    counts of :data:`REWARD_FAILURE_FIELDS` (errors and timeouts summed over functions)."""
    parts = []
    for label, name, fmt in STATUS_FIELDS:
        if name in metrics and metrics[name] is not None:
            value = float(metrics[name])
            parts.append(f"{label} {fmt.format(value) if math.isfinite(value) else value}")
    for label, name in REWARD_FAILURE_FIELDS:
        total = sum(float(v) for k, v in metrics.items()
                    if (k.startswith(name) if name.endswith("/") else k == name)
                    and isinstance(v, (int, float)) and math.isfinite(v))
        if total:
            parts.append(f"{label} {int(total)}")
    return " | ".join(parts)


def plain_line(step: int, total: int, elapsed_s: float, eta_s: float,
               metrics: Mapping[str, float]) -> str:
    """One plain progress line: step, percentage, elapsed, ETA and the status fields."""
    pct = f" ({100 * step / total:.0f}%)" if total > 0 else ""
    line = (f"step {step}/{total}{pct} elapsed {format_duration(elapsed_s)} "
            f"eta {format_duration(eta_s)}")
    status = format_status(metrics)
    return plain_text(f"{line} | {status}" if status else line)


def use_bar(mode: str, stream: TextIO) -> bool:
    """Whether ``mode`` ("auto" | "bar" | "plain") means a rich bar on ``stream``.

    "auto" picks the bar only when ``stream`` is a TTY and ``TERM`` is not "dumb".

    Raises:
      ValueError: an unknown mode.
    """
    if mode not in ("auto", "bar", "plain"):
        raise ValueError(f"metrics.progress must be 'auto', 'bar' or 'plain', got {mode!r}")
    if mode != "auto":
        return mode == "bar"
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM", "") != "dumb"


class _BarWithStatus(Progress):
    """A rich Progress whose status line sits under the bar (fits an 80-column terminal)."""

    status = ""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        yield Text(self.status, no_wrap=True, overflow="ellipsis")


class ProgressReporter:
    """Progress of a run of ``total_steps`` learner steps.

    Args:
      total_steps: steps of the whole run (``learner.num_steps``), > 0.
      mode: "auto", "bar" or "plain" (``metrics.progress``).
      stream: where to write (default ``sys.stderr``).
      start_step: step the run starts from (> 0 on resume); the ETA counts only the steps
        done by this process.
      plain_every: in plain mode, print every N-th step (and always the last one).
      clock: monotonic clock in seconds (tests pass a fake one).

    Raises:
      ValueError: bad ``total_steps``, ``start_step``, ``plain_every`` or ``mode``.
    """

    def __init__(self, total_steps: int, *, mode: str = "auto", stream: Optional[TextIO] = None,
                 start_step: int = 0, plain_every: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        if total_steps <= 0 or not 0 <= start_step <= total_steps or plain_every <= 0:
            raise ValueError(f"need total_steps > 0, 0 <= start_step <= total_steps and "
                             f"plain_every > 0; got {total_steps}, {start_step}, {plain_every}")
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.start_step, self.plain_every = total_steps, start_step, plain_every
        self._clock = clock
        self._t0 = clock()
        self._step = start_step
        self._first: Optional[tuple[int, float]] = None   # (step, time) of the first update
        self._last: Optional[tuple[int, float]] = None
        self._bar = None
        self._use_bar = use_bar(mode, self.stream)
        self._console = Console(file=self.stream, force_terminal=True) if self._use_bar else None

    def _start_bar(self) -> None:
        self._bar = _BarWithStatus(TextColumn("step"), BarColumn(), MofNCompleteColumn(),
                                   TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"),
                                   console=self._console, redirect_stdout=False,
                                   redirect_stderr=False)
        self._task = self._bar.add_task("run", total=self.total, completed=self._step,
                                        eta=format_duration(self.eta_s()))
        self._bar.start()

    @property
    def is_bar(self) -> bool:
        return self._use_bar

    def eta_s(self) -> float:
        """Seconds left: the mean time per step of the steps after the first one reported
        (the first includes start-up and compilation) times the steps left; NaN until
        :data:`ETA_MIN_TIMED_STEPS` steps are timed."""
        if self._first is None or self._last is None:
            return math.nan
        timed = self._last[0] - self._first[0]
        if timed < ETA_MIN_TIMED_STEPS:
            return math.nan
        return (self._last[1] - self._first[1]) / timed * (self.total - self._last[0])

    def update(self, step: int, metrics: Optional[Mapping[str, float]] = None,
               at: Optional[float] = None) -> None:
        """Report that ``step`` (1-based count of finished steps) is done, with its metrics.

        ``at``: when the step finished, in the clock's seconds (default: now). The launcher
        reads steps from a file in bursts, so it passes each record's own time.
        """
        metrics = metrics or {}
        now = self._clock() if at is None else at
        if self._first is None:
            self._first = (step, now)
        self._last = (step, now)
        self._step = step
        if self._use_bar:
            if self._bar is None:
                self._start_bar()
            self._bar.status = format_status(metrics)
            self._bar.update(self._task, completed=step, eta=format_duration(self.eta_s()))
        elif step % self.plain_every == 0 or step >= self.total:
            line = plain_line(step, self.total, self._clock() - self._t0, self.eta_s(), metrics)
            self.stream.write(line + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """Print a line of text (above the bar; plain, with control characters removed,
        otherwise)."""
        if self._console is not None:       # above the bar when it is live
            self._console.print(Text(text))
        else:
            self.stream.write(plain_text(text) + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Stop the bar (leaving its last state on screen); idempotent."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self._use_bar = False

    def __enter__(self) -> "ProgressReporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
