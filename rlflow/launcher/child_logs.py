"""What a program's log says when it died: its end, and its last exception line.

Used by the launcher's failure report (:mod:`rlflow.launcher.supervisor`): the last exception
line first (``ValueError: .../bad.jsonl:7: ...``), then the exit status and the log's end.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional, Sequence

from rlflow.system.process_limits import exit_text  # noqa: F401  (part of the failure report)

LOG_TAIL_LINES = 30
ERROR_SCAN_LINES = 400    # log lines searched for the last exception (tracebacks can be long)
TRACEBACK_HEADER = "Traceback (most recent call last):"
FATAL_PREFIX = "rlflow fatal: "   # the line a program prints last for the error that ends it


def without_repeated_fatal(lines: Sequence[str]) -> list[str]:
    """``lines`` without each :data:`FATAL_PREFIX` line that repeats the line before it
    (the traceback's own last line): a log tail shown to the user says it once."""
    out: list[str] = []
    for line in lines:
        if not (line.startswith(FATAL_PREFIX) and out
                and out[-1].strip() == line[len(FATAL_PREFIX):].strip()):
            out.append(line)
    return out


def fatal_line(error: BaseException) -> str:
    """The line a program (:mod:`rlflow.launcher.launch`) prints after the traceback of the
    exception that ends it: :data:`FATAL_PREFIX` + its exception line, as a traceback ends
    (``module.Class: message``, first line of the message). Errors printed after it (threads
    and asyncio loops torn down at interpreter exit) cannot take the failure's headline."""
    cls = type(error)
    name = (cls.__qualname__ if cls.__module__ == "builtins"
            else f"{cls.__module__}.{cls.__qualname__}")
    message = (str(error).strip().splitlines() or [""])[0]
    return f"{FATAL_PREFIX}{name}: {message}" if message else f"{FATAL_PREFIX}{name}"


def tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def last_exception_line(lines: Sequence[str]) -> Optional[str]:
    """The exception line of the last Python traceback in ``lines`` (a log's end).

    That is the first non-indented, non-empty line after the last ``Traceback (most recent
    call last):`` header, e.g. ``ValueError: /data/bad.jsonl:7: malformed JSON ...``; with
    chained exceptions, the last (outermost) one. None when there is no traceback (a
    program killed by a signal, or one that exited with a plain message). A program's own
    :func:`fatal_line` is looked up first by :func:`program_error`.
    """
    start = None
    for i, line in enumerate(lines):
        if line.rstrip().endswith(TRACEBACK_HEADER):
            start = i
    if start is None:
        return None
    for line in lines[start + 1:]:
        if line.strip() and not line[:1].isspace():
            return line.strip()
    return None


def program_error(log_path: str, start_marker: str) -> Optional[str]:
    """The error that ended the program's latest start in ``log_path``: its
    :func:`fatal_line` (searched in the whole log after the last line starting with
    ``start_marker``, as errors logged after it at interpreter exit can fill more than
    :data:`ERROR_SCAN_LINES` lines), else :func:`last_exception_line` of the log's end (that
    start's part only). None when neither is there (a program killed by a signal)."""
    marker, prefix, fatal = start_marker.encode(), FATAL_PREFIX.encode(), None
    try:
        with open(log_path, "rb") as f:
            for raw in f:
                if raw.startswith(marker):
                    fatal = None
                elif raw.startswith(prefix):
                    fatal = raw
    except OSError:
        return None
    if fatal is not None:
        return fatal.decode("utf-8", "replace")[len(FATAL_PREFIX):].strip()
    lines = tail(log_path, ERROR_SCAN_LINES).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(start_marker)]
    return last_exception_line(lines[starts[-1]:] if starts else lines)


def is_input_error(exception_line: str) -> bool:
    """True when ``exception_line`` (as :func:`last_exception_line` returns it) names an
    rlflow error about the user's input: a :class:`rlflow.data.sources.DataError` (a bad or
    missing record, an empty data set), a :class:`rlflow.config.ConfigError`, or an error of
    the user's reward function or environment (:class:`rlflow.data.rewards.NonFiniteRewardError`,
    :class:`rlflow.data.rewards.RewardFunctionError`, :class:`rlflow.envs.EnvFailureError`), a
    checkpoint damaged on disk (:class:`rlflow.checkpoint.state.DamagedCheckpointError`), or a
    model folder's file that does not match what rlflow reads
    (:class:`rlflow.models.config.ModelFormatError`: a weight file damaged after the
    pre-start checks, named with what is wrong).
    Their messages name the file, line, field or function and sample; rlflow's traceback adds
    nothing for the user."""
    name = exception_line.split(":", 1)[0].strip()
    module, _, cls_name = name.rpartition(".")
    if not module.startswith("rlflow."):
        return False
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):
        return False
    from rlflow.checkpoint.state import DamagedCheckpointError
    from rlflow.config.validation import ConfigError
    from rlflow.data.rewards import NonFiniteRewardError, RewardFunctionError
    from rlflow.data.sources import DataError
    from rlflow.envs.base import EnvFailureError
    from rlflow.models.config import ModelFormatError

    return isinstance(cls, type) and issubclass(
        cls, (DataError, ConfigError, NonFiniteRewardError, RewardFunctionError, EnvFailureError,
              DamagedCheckpointError, ModelFormatError))
