"""Local stand-in for a multi-host slice: K JAX processes x D fake CPU devices on this machine.

What a multi-host TPU slice is, on one machine: each process sets
``XLA_FLAGS=--xla_force_host_platform_device_count=D`` before importing jax, selects gloo CPU
collectives, and calls :func:`rlflow.learner.multihost.initialize` (``jax.distributed``,
coordinator on ``127.0.0.1:<free port>``); then it runs ``fn(ctx)`` and writes the result to
``<work_dir>/result_<i>.json`` + ``.npz``. The parent waits for all, kills every process group
on timeout (never hangs) and raises :class:`ProcessesFailed` naming the failed process with its
log tail. The job and the results travel as JSON + ``.npz`` files, never pickle
(:mod:`rlflow.launcher.local_host_files`: ``fn``'s result is a tree of plain values and numpy
arrays).

Used by the multi-host tests and ``benchmarks/learner_multihost.py``. Usage (``fn`` must be
importable in the child: a module of the repository, or on ``extra_paths``)::

    results = run_processes("mp_jobs:train_multihost", num_processes=2,
                            devices_per_process=2, work_dir=tmp_path, args={...},
                            extra_paths=["tests"])
    results[0]   # what process 0's fn returned
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow.system.ports import free_port
from rlflow.launcher.local_host_files import Job, read_value, result_path, write_job

REPO_DIR = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "_local_host_child.py"


class ProcessesFailed(RuntimeError):
    """A child process exited non-zero or the group timed out; the message names the process
    (``process i``), its exit status and the tail of its log."""

    def __init__(self, message: str, failed: list[int]):
        super().__init__(message)
        self.failed = failed


@dataclass(frozen=True)
class Context:
    """What ``fn`` receives in each child process."""
    process_id: int
    num_processes: int
    devices_per_process: int
    work_dir: str          # shared by all processes (results, checkpoints, ...)
    args: dict


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


def start_processes(target: str, *, num_processes: int, devices_per_process: int, work_dir,
                    args: dict | None = None, distributed: bool | None = None,
                    init_timeout_s: float = 300.0, heartbeat_timeout_s: float = 100.0,
                    port: int | None = None,
                    extra_paths=(), env: dict | None = None) -> list[subprocess.Popen]:
    """Start the K children (each in its own process group) and return their ``Popen``s.

    ``distributed`` (default: ``num_processes > 1``) joins them by ``jax.distributed``;
    ``port``: the coordinator port (default: a free one); ``extra_paths``: folders put on
    the children's ``PYTHONPATH`` (after the repository); ``env``: more environment variables.
    """
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    distributed = num_processes > 1 if distributed is None else distributed
    port = port or free_port()
    job = write_job(work, Job(target=target, num_processes=num_processes,
                              devices_per_process=devices_per_process, work_dir=str(work),
                              args=args or {}, distributed=distributed,
                              coordinator=f"127.0.0.1:{port}", init_timeout_s=init_timeout_s,
                              heartbeat_timeout_s=heartbeat_timeout_s))
    env = {**os.environ, **(env or {})}
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split()
         if "xla_force_host_platform_device_count" not in f]
        + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR), *map(str, extra_paths),
                                         env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    procs = []
    for i in range(num_processes):
        log = open(work / f"log_{i}.txt", "wb")
        procs.append(subprocess.Popen([sys.executable, str(CHILD), str(job), str(i)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
        log.close()
    return procs


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def wait_processes(procs, work_dir, *, timeout_s: float = 600.0, grace_s: float = 60.0,
                   expect_failure: bool = False) -> list:
    """Wait for all children; return their results in process order.

    A child that exits non-zero gives the others ``grace_s`` seconds (they may be blocked in a
    collective with it), then all are killed and :class:`ProcessesFailed` names it. With
    ``expect_failure`` the exit codes are returned instead of raising (None for a child that
    had to be killed).

    Raises:
      ProcessesFailed: a child exited non-zero or the group timed out.
      HostFileError: a child's result file is malformed (names the file and the field).
    """
    work = Path(work_dir)
    deadline = time.monotonic() + timeout_s
    first_fail = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if first_fail is None and any(c not in (None, 0) for c in codes):
                first_fail = time.monotonic()
                deadline = min(deadline, first_fail + grace_s)
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        kill_all(procs)
    codes = [p.returncode for p in procs]
    if expect_failure:
        return codes
    bad = [i for i, c in enumerate(codes) if c != 0]
    if bad:
        first = bad[0]
        what = "timed out" if first_fail is None else f"exited with {codes[first]}"
        raise ProcessesFailed(
            f"process {first} {what} (exit codes {codes}); log of process {first}:\n"
            + _tail(work / f"log_{first}.txt"), bad)
    return [read_value(result_path(work, i), what=f"result of process {i}")
            for i in range(len(procs))]


def run_processes(target: str, *, num_processes: int, devices_per_process: int, work_dir,
                  args: dict | None = None, timeout_s: float = 600.0, **kw) -> list:
    """:func:`start_processes` then :func:`wait_processes`; returns the K results."""
    procs = start_processes(target, num_processes=num_processes,
                            devices_per_process=devices_per_process, work_dir=work_dir,
                            args=args, **kw)
    return wait_processes(procs, work_dir, timeout_s=timeout_s)
