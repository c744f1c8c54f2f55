"""The Python tool's sandbox: run one program in a separate, limited, killable process.

:func:`run_python` starts a fresh interpreter per call (``python -I``,
:mod:`rlflow.envs.sandbox_child`) in its own session (process group), in an empty temporary
working folder that is deleted afterwards, with a minimal environment (``PATH``, ``HOME`` = the
folder, ``LANG``, one BLAS/OpenMP thread: no variable of the caller's, so no secret, reaches
user code). A fresh process per call isolates calls from each other: a crash, a leaked
thread or a patched module never reaches the next call. Cost: one interpreter start-up per
call (measured: 50 ms of CPU time, 0.2 s wall clock on 2 shared, loaded cores).

Limits (:class:`SandboxLimits`):
  * wall clock ``timeout_s``: past it the process group is killed (SIGKILL), status
    ``"timeout"``;
  * CPU time ``cpu_s`` (``RLIMIT_CPU``): SIGXCPU, then SIGKILL a second later, status
    ``"cpu_limit"``;
  * memory ``memory_mb`` (``RLIMIT_AS`` above what the interpreter maps at start-up): an
    allocation past it raises ``MemoryError`` in the program, status ``"error"``;
  * output ``max_output_bytes`` (stdout and stderr together): past it the group is killed,
    status ``"output_limit"``; the text returned is cut to ``max_output_chars``;
  * file size ``file_size_mb`` (``RLIMIT_FSIZE``); no core files;
  * network: an audit hook in the child refuses sockets and process creation
    (``PermissionError``); with ``network="auto"`` the child also runs in a new network
    namespace with no interfaces (``unshare -rn``: needs unprivileged user namespaces; used when
    a probe succeeds, silently skipped otherwise). The hook alone does not stop native code
    (``ctypes``); see :mod:`rlflow.envs.sandbox_child`. This is a guard against a policy's
    accidents, not a security boundary against hostile code: for that, run the sampler in a
    container (gVisor, Firecracker) without network.

A crash (SIGSEGV, ``os.abort``) gives status ``"crash"``; an uncaught exception ``"error"``
with its traceback as output. Nothing here raises for what the program does.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from rlflow.system.process_limits import exit_text, kill_process_group

logger = logging.getLogger(__name__)

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
STATUSES = ("ok", "error", "timeout", "cpu_limit", "crash", "output_limit")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one Python tool call.

    Attributes:
      timeout_s: wall-clock seconds before the process group is killed (> 0).
      cpu_s: CPU seconds (``RLIMIT_CPU``, whole seconds, >= 1).
      memory_mb: MiB the program may allocate above the interpreter's start-up mapping
        (``RLIMIT_AS``, >= 16).
      max_output_chars: characters of output returned (the rest is cut, with a note; >= 1).
      max_output_bytes: bytes of output read before the process is killed (>= 1).
      file_size_mb: largest file the program may write, MiB (``RLIMIT_FSIZE``, >= 0).
      network: ``"auto"`` (audit hook, plus ``unshare -rn`` when available) or ``"hook"``
        (audit hook only).

    Raises:
      ValueError: a field out of range (the message names it).
    """

    timeout_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_chars: int = 2000
    max_output_bytes: int = 1 << 20
    file_size_mb: int = 16
    network: str = "auto"

    def __post_init__(self):
        checks = {"timeout_s": self.timeout_s > 0, "cpu_s": self.cpu_s >= 1,
                  "memory_mb": self.memory_mb >= 16, "max_output_chars": self.max_output_chars >= 1,
                  "max_output_bytes": self.max_output_bytes >= 1,
                  "file_size_mb": self.file_size_mb >= 0,
                  "network": self.network in ("auto", "hook")}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"sandbox limits: {name} out of range: {getattr(self, name)!r} "
                                 f"(see SandboxLimits)")


@dataclass(frozen=True)
class SandboxResult:
    """What one call gave.

    Attributes:
      status: one of :data:`STATUSES`.
      output: stdout and stderr (interleaved as written), cut to ``max_output_chars``, then
        a note on what went wrong when ``status != "ok"`` (the text the model sees).
      returncode: the process's return code (negative: killed by that signal); None if it
        never started.
    """

    status: str
    output: str
    returncode: Optional[int]

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether ``unshare -rn`` can start a process here (unprivileged user + network
    namespaces); probed once per process."""
    try:
        return subprocess.run(["unshare", "-rn", "true"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` (a Python program; its output is what it prints) under ``limits``.

    Returns:
      :class:`SandboxResult`; never raises for what the program does.

    Raises:
      OSError: the interpreter cannot be started at all (a broken installation).
    """
    with tempfile.TemporaryDirectory(prefix="rlflow-python-tool-") as work:
        code_file = os.path.join(work, "program.py")
        with open(code_file, "w", encoding="utf-8") as f:
            f.write(code)
        child_limits = json.dumps({"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
                                   "file_size_mb": limits.file_size_mb})
        cmd = [sys.executable, "-I", CHILD, child_limits, code_file]
        if limits.network == "auto" and network_namespace_available():
            cmd = ["unshare", "-rn"] + cmd
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work,
               "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            data, killed_for = _read_bounded(proc, limits)
        finally:
            kill_process_group(proc.pid)   # what the program left running in its group
            proc.stdout.close()
            proc.wait()
    return _result(proc.returncode, data, killed_for, limits)


def _read_bounded(proc, limits: SandboxLimits):
    """Read the child's output until EOF, the wall-clock deadline or the byte cap; returns
    ``(bytes, None | "timeout" | "output_limit")``."""
    deadline = time.monotonic() + limits.timeout_s
    chunks, size = [], 0
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                kill_process_group(proc.pid)
                return b"".join(chunks), "timeout"
            if not sel.select(timeout=left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break                              # EOF: the program (and its group) ended
            chunks.append(chunk)
            size += len(chunk)
            if size > limits.max_output_bytes:
                kill_process_group(proc.pid)
                return b"".join(chunks), "output_limit"
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
    except subprocess.TimeoutExpired:
        kill_process_group(proc.pid)
        return b"".join(chunks), "timeout"
    return b"".join(chunks), None


def _result(returncode: int, data: bytes, killed_for: Optional[str],
            limits: SandboxLimits) -> SandboxResult:
    text = data.decode("utf-8", errors="replace")
    if len(text) > limits.max_output_chars:
        text = (text[:limits.max_output_chars]
                + f"\n[output cut: {len(text) - limits.max_output_chars} more characters]")
    if killed_for == "timeout":
        status, note = "timeout", f"timed out after {limits.timeout_s:g} s (wall clock)"
    elif killed_for == "output_limit":
        status, note = "output_limit", (f"stopped: printed more than "
                                        f"{limits.max_output_bytes} bytes")
    elif returncode == -signal.SIGXCPU:
        status, note = "cpu_limit", f"stopped: used more than {limits.cpu_s} s of CPU time"
    elif returncode == -signal.SIGKILL:   # the hard CPU limit (SIGXCPU ignored), or the OS
        status, note = "cpu_limit", (f"killed (SIGKILL): past the CPU time limit of "
                                     f"{limits.cpu_s} s or killed by the system")
    elif returncode < 0:
        status, note = "crash", f"the program crashed ({exit_text(returncode)})"
    elif returncode != 0:
        status = "error"
        note = (f"error: out of memory (limit {limits.memory_mb} MB)" if "MemoryError" in text
                else f"error ({exit_text(returncode)})")
    else:
        return SandboxResult("ok", text, returncode)
    return SandboxResult(status, (text.rstrip("\n") + "\n" if text.strip() else "") + note,
                         returncode)
