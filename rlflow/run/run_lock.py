"""One ``rlflow train`` per run folder at a time.

Two launchers on the same ``runs/<name>`` would both train and interleave their records
(``metrics.jsonl`` with every step twice, checkpoints of two runs under one step number).
:class:`RunLock` takes an exclusive ``fcntl.flock`` on ``<run_dir>/.<name>.lock`` (beside
the run folder, not in it: ``checkpoint.overwrite`` moves the folder aside) for the
launcher's lifetime; a second launcher is refused with the holder's pid. The kernel drops
the lock when its holder exits, however it exits (``kill -9`` included), so a stale lock
file never blocks a rerun. POSIX only (the lock is skipped where ``fcntl`` is missing).

No JAX here (the launcher takes it before anything else).
"""

from __future__ import annotations

import os
from typing import Optional

try:
    import fcntl
except ImportError:           # not POSIX: no lock (rlflow's programs need POSIX anyway)
    fcntl = None


class RunFolderInUse(RuntimeError):
    """Another ``rlflow train`` holds the run folder (message names it and its pid)."""


def lock_path(run_path: str) -> str:
    """``<parent>/.<name>.lock`` for the run folder ``<parent>/<name>``; for an object-store
    run folder (``gs://...``, which has no lock) the same beside its local side
    (:func:`rlflow.run.files.local_side`): it keeps two launchers on this machine apart."""
    from rlflow.run import files

    run_path = os.path.abspath(files.local_side(run_path))
    return os.path.join(os.path.dirname(run_path), f".{os.path.basename(run_path)}.lock")


class RunLock:
    """Held while a launcher uses ``run_path``; ``release`` (or exit) frees it.

    Raises (from :meth:`acquire`):
      RunFolderInUse: another process holds it.
      OSError: the lock file cannot be created (a read-only parent, no space).
    """

    def __init__(self, run_path: str):
        self.run_path = run_path if "://" in run_path else os.path.abspath(run_path)
        self.path = lock_path(run_path)
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        if fcntl is None:
            return self
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderInUse(
                f"run folder {self.run_path} is in use by another rlflow train (pid {holder}, "
                f"lock {self.path}); wait for it to end, or use another --name") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)            # closing drops the flock
            self._fd = None
