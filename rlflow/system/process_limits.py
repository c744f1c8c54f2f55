"""Limits and kills for worker processes that run user code (reward workers, the Python tool).

Standard library only and no rlflow imports: the Python tool's sandbox child
(:mod:`rlflow.envs.sandbox_child`) runs in an isolated interpreter (``python -I``) and loads
this file by path.
"""

from __future__ import annotations

import contextlib
import os
import signal


def address_space_bytes() -> int:
    """This process's virtual memory size (``VmSize`` of /proc/self/status), in bytes; 0 if
    unknown (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def set_memory_limit(memory_limit_mb: int) -> None:
    """RLIMIT_AS (soft) = what this process maps now plus ``memory_limit_mb`` MiB: the code
    run next may allocate that much, whatever the interpreter and its imports mapped. An
    allocation past it fails (``MemoryError`` in Python). 0 or less: no limit. Never raises
    the hard limit."""
    if memory_limit_mb <= 0:
        return
    import resource

    limit = address_space_bytes() + int(memory_limit_mb) * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def kill_process_group(pid) -> None:
    """SIGKILL the process group led by ``pid`` (a process started with ``os.setpgrp()`` /
    ``start_new_session=True``: it and every process it started). No error when the group
    is gone or ``pid`` is None."""
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def exit_text(code) -> str:
    """``"killed by SIGKILL"`` for a negative return code (signal), else ``"exit code N"``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def process_cpu_s(pid) -> "float | None":
    """CPU seconds process ``pid`` has used: user + system time of the process (all its
    threads) and of the children it has waited for (``utime + stime + cutime + cstime`` of
    ``/proc/<pid>/stat``, proc(5); the same counters as ``os.times()`` in that process).
    None when unknown (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()    # after "(comm)", which may hold spaces
        ticks = os.sysconf("SC_CLK_TCK")
        # fields[0] is the state (field 3 of proc(5)): utime..cstime are fields 14-17
        return sum(int(x) for x in fields[11:15]) / ticks
    except (OSError, ValueError, IndexError):
        return None


def own_cpu_s() -> float:
    """CPU seconds this process has used, counted as :func:`process_cpu_s` counts them
    (``os.times()``: user + system, own and waited-for children's)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
