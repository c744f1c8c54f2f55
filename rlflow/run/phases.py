"""Start-up phases of the programs, told to the console: what a run is doing before step 1.

A SmolLM2 run showed no status line for 5.5 minutes (loading, compiling, the first rollouts).
Each program logs its phase through the logger :data:`PHASE_LOGGER` (one line in its log,
``<time> [learner] INFO rlflow.phase: compiling the train step (first step)``, by the
programs' log format in :mod:`rlflow.control.programs_common`); :class:`PhaseTail` reads the
lines added to ``<run>/logs/*.log`` since it was made and gives them back as
``(program, phase)``, which the launcher prints until the first step is logged. Plain log
lines, not a side channel: they are in the program's log for a later reader too, and a
program started by the TPU scripts reports them the same way.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Dict, List, Tuple

#: The logger whose INFO lines are phases.
PHASE_LOGGER = "rlflow.phase"

_LINE = re.compile(r"\[(?P<role>[^\]\s]+)\] INFO " + re.escape(PHASE_LOGGER) + r": (?P<text>.+)")


def report_phase(text: str) -> None:
    """Log ``text`` (lower case, no final period: "loading the model") as this program's
    current phase."""
    logging.getLogger(PHASE_LOGGER).info("%s", text)


def parse_phase(line: str):
    """``(program, phase)`` of one log line written by :func:`report_phase`, else None."""
    m = _LINE.search(line)
    return (m.group("role"), m.group("text").strip()) if m else None


class PhaseTail:
    """The phase lines added to a folder's ``*.log`` files since this object was made (a file
    made later is read from its start). Only whole lines; a log that cannot be read is
    skipped (it is tried again on the next call).

    Args:
      logs: the folder of the programs' logs (it may not exist yet).
    """

    def __init__(self, logs: str):
        self.logs = logs
        self._offsets: Dict[str, int] = {name: _size(os.path.join(logs, name))
                                         for name in _log_names(logs)}

    def new_phases(self) -> List[Tuple[str, str]]:
        """``(program, phase)`` of each phase line written since the last call, by file
        name, then in order; the program is the log's name (``learner``, ``sampler-1``)."""
        out = []
        for name in _log_names(self.logs):
            path = os.path.join(self.logs, name)
            start = self._offsets.get(name, 0)
            if _size(path) < start:            # rewritten: from its start again
                start = 0
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            whole = data.rfind(b"\n") + 1        # a partial last line waits for the next call
            self._offsets[name] = start + whole
            for raw in data[:whole].splitlines():
                got = parse_phase(raw.decode("utf-8", "replace"))
                if got is not None:             # named by its log (sampler-1, not sampler)
                    out.append((name[:-len(".log")], got[1]))
        return out


def _log_names(logs: str) -> List[str]:
    try:
        return sorted(n for n in os.listdir(logs) if n.endswith(".log"))
    except OSError:
        return []


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
