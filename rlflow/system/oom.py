"""Was a program killed by the kernel's out-of-memory killer? What the launcher can tell
without root (no ``dmesg``).

The OOM killer ends its victim with SIGKILL, which is all a parent sees in the exit status.
Two signals are readable by any process:

* the OOM-kill counter of the launcher's cgroup (the programs it starts inherit it):
  ``oom_kill`` in cgroup v2's ``memory.events`` or in cgroup v1's ``memory.oom_control``.
  It counts the processes of the cgroup (and its descendants) the OOM killer ended. It
  rising since the run started, with a program SIGKILLed, is taken as proof;
* the program's peak resident memory (``VmHWM`` of ``/proc/<pid>/status``), sampled by the
  launcher while the program lives, against this machine's memory.

:func:`killed_text` words the exit of a program: ``killed by SIGKILL: out of memory (...)``
when the counter proves it; plain ``killed by SIGKILL`` when the program's peak resident
memory was under :data:`LIKELY_VICTIM_FRACTION` of the machine's (the kernel's OOM killer
ends the process with the largest footprint: a ``kill -9`` by a person or a scheduler is
far likelier); ``killed by SIGKILL (possibly out of memory: ...)`` otherwise, with what is
known (the counter unreadable or unchanged, the peak resident memory); and the plain exit
text for any other exit.
"""

from __future__ import annotations

import os
import signal
from typing import Optional, Sequence

from rlflow.system.process_limits import exit_text

CGROUP_ROOT = "/sys/fs/cgroup"
LIKELY_VICTIM_FRACTION = 0.25
"""A SIGKILLed program whose peak resident memory was at least this fraction of the
machine's memory may have been the OOM killer's victim (when the counter cannot prove it)."""


def counter_files(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT
                  ) -> list[str]:
    """The files that may hold this process's cgroup OOM-kill counter, most specific first:
    cgroup v2 ``<root>/<path>/memory.events`` (``0::<path>`` of ``/proc/self/cgroup``),
    v1 ``<root>/memory/<path>/memory.oom_control`` (``N:memory:<path>``), and the roots'
    own files (inside a container the cgroup namespace makes its cgroup the root)."""
    out = []
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":
            out.append(os.path.join(root, path, "memory.events"))
        elif "memory" in controllers.split(","):
            out.append(os.path.join(root, "memory", path, "memory.oom_control"))
    out += [os.path.join(root, "memory.events"),
            os.path.join(root, "memory", "memory.oom_control")]
    return list(dict.fromkeys(out))


def oom_kill_count(files: Sequence[str]) -> Optional[int]:
    """The ``oom_kill N`` counter of the first readable file of ``files`` that has one, or
    None."""
    for path in files:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit():
                        return int(value)
        except OSError:
            continue
    return None


def peak_resident_bytes(pid: int) -> Optional[int]:
    """``VmHWM`` (peak resident set) of a live process, in bytes; None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_memory_bytes() -> Optional[int]:
    """This machine's physical memory in bytes (``sysconf``), or None where unknown (the
    one reading of it: the OOM note, the pre-start KV cache and memory-fit checks)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class OomWatch:
    """The OOM-kill counter at the run's start, and each program's peak resident memory.

    Args:
      files: where the counter is read (default :func:`counter_files`; tests pass a fake
        ``memory.events``).
    """

    def __init__(self, files: Optional[Sequence[str]] = None):
        self.files = list(counter_files() if files is None else files)
        self.start = oom_kill_count(self.files)
        self.peaks: dict[int, int] = {}

    def sample(self, pid: int) -> None:
        """Record the peak resident memory of live process ``pid`` (call while it runs)."""
        peak = peak_resident_bytes(pid)
        if peak is not None:
            self.peaks[pid] = max(peak, self.peaks.get(pid, 0))

    def killed_text(self, returncode, pid: Optional[int] = None) -> str:
        """:func:`exit_text` of ``returncode``, for SIGKILL with whether it was the OOM
        killer (module doc)."""
        if returncode != -signal.SIGKILL:
            return exit_text(returncode)
        now = oom_kill_count(self.files)
        peak = self.peaks.get(pid) if pid is not None else None
        total = machine_memory_bytes()
        rss = (f"its peak resident memory was {peak / 1e9:.1f} GB"
               f"{f' of this machine{chr(39)}s {total / 1e9:.1f} GB' if total else ''}"
               if peak else "")
        if self.start is not None and now is not None and now > self.start:
            return (f"killed by SIGKILL: out of memory (the kernel's OOM killer: this "
                    f"cgroup's oom_kill counter went from {self.start} to {now} during the "
                    f"run{'; ' + rss if rss else ''})")
        if peak is not None and total is not None and peak < LIKELY_VICTIM_FRACTION * total:
            return "killed by SIGKILL"
        counter = ("this cgroup's oom_kill counter did not change" if now is not None
                   else "no cgroup OOM counter is readable here")
        return (f"killed by SIGKILL (possibly out of memory: the kernel's OOM killer sends "
                f"SIGKILL; {counter}{'; ' + rss if rss else ''})")

