"""The run folder's file system: every file of a run folder is read and written here.

One layer for local paths and object stores (``gs://bucket/runs/x``, ``s3://...``: any URL
that ``etils.epath`` resolves, through ``fsspec``, as orbax does for the checkpoints), so
that ``metrics.jsonl``, ``samples.jsonl``, ``config.json``, ``run.json``, ``summary.json``,
``processes.json``, ``trained_prompts.jsonl``, the TensorBoard events and the report reach
the same place as the checkpoints.

What an object store cannot do, and what is done instead:

* **atomic replace** (a ``.tmp`` then ``os.replace``): an object is written whole by one
  put, which readers see entirely or not at all, so :func:`write_atomic` writes it directly;
  on a local disk it writes ``<path>.tmp`` and renames it, and removes the ``.tmp`` when the
  write fails (a full disk leaves no empty ``.tmp`` behind).
* **appending** (the JSONL logs): :class:`AppendFile` keeps an object's lines in memory
  (those already there read at open, for a resume) and puts the whole object again on each
  ``flush``; locally it is a plain append.
* **a POSIX lock and the programs' log files** (``open`` by a child process): these stay in a
  local folder that the run folder names, :func:`local_side` (``$RLFLOW_LOCAL_RUNS`` or
  ``~/.cache/rlflow/runs``, then the URL's bucket and path).

Disk full: :func:`no_space` finds an ``ENOSPC`` / ``EDQUOT`` / ``EROFS`` behind an exception
(its ``__cause__`` / ``__context__`` chain included) and :func:`full_line` turns it into the
one line every writer of the run reports: the folder, its file system's free space and what
failed. Programs that stop on it exit with :data:`NO_SPACE_EXIT_CODE`, so that the launcher
can say so even when their log (in the full folder) could not be written.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Optional, Union

#: errno values that mean "this file system takes no more writes".
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
#: Exit code of a program that stopped because its run folder's file system is full.
NO_SPACE_EXIT_CODE = 75           # EX_TEMPFAIL: free space and run again
#: A program that died while its run folder's file system had less free than this died of
#: it (its own error may not have reached its log, in the same folder).
NEARLY_FULL_BYTES = 64 * 1024


class RunFolderFull(OSError):
    """A write to the run folder failed for lack of space (or a read-only file system); the
    message is :func:`full_line`'s one line."""


def is_url(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` names an object store (``scheme://...``) rather than a local path."""
    return "://" in os.fspath(path)


def path(p: Union[str, os.PathLike]):
    """``p`` as an ``etils.epath.Path`` (local or object store; :func:`check_backend` says
    beforehand whether this machine can open the URL's scheme)."""
    from etils import epath

    return epath.Path(p)


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for local paths and URLs alike (URLs keep their ``//``)."""
    if is_url(base):
        return "/".join([base.rstrip("/"), *(q.strip("/") for q in parts)])
    return os.path.join(base, *parts)


def absolute(p: str) -> str:
    """A local path made absolute; a URL as it is."""
    return p if is_url(p) else os.path.abspath(p)


def check_backend(run_path: str) -> Optional[str]:
    """None when ``run_path``'s file system can be used here, else why not (one line naming
    the package that provides it). Local paths always can.

    Mirrors how ``etils.epath`` (and so orbax) opens a URL: ``gs://`` / ``s3://`` through
    TensorFlow's ``tf.io.gfile`` when TensorFlow is installed, else through an ``fsspec``
    file system (``gcsfs``, ``s3fs``, ``adlfs``)."""
    if not is_url(run_path):
        return None
    import importlib.util

    scheme = run_path.split("://", 1)[0]
    package = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs", "hf": "huggingface_hub"}.get(scheme)
    if package is None:
        return (f"--run-dir {run_path}: {scheme}:// is not a file system rlflow can write "
                f"(gs://, s3://, az:// or a local path)")
    if scheme in ("gs", "s3") and importlib.util.find_spec("tensorflow") is not None:
        return None
    try:
        import fsspec

        fsspec.get_filesystem_class({"gs": "gcs"}.get(scheme, scheme))
    except (ImportError, ValueError) as e:
        return (f"--run-dir {run_path}: this machine cannot write {scheme}:// ({e}); install "
                f"{package} (pip install {package}) or use a local --run-dir")
    return None


# ---------------------------------------------------------------------------- reading


def isfile(p: str) -> bool:
    return os.path.isfile(p) if not is_url(p) else path(p).is_file()


def isdir(p: str) -> bool:
    return os.path.isdir(p) if not is_url(p) else path(p).is_dir()


def listdir(p: str) -> list[str]:
    """Names in folder ``p``. Raises FileNotFoundError / NotADirectoryError like os.listdir."""
    if not is_url(p):
        return os.listdir(p)
    folder = path(p)
    if not folder.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such folder", p)
    return [child.name for child in folder.iterdir()]


def read_bytes(p: str) -> bytes:
    if not is_url(p):
        with open(p, "rb") as f:
            return f.read()
    q = path(p)
    if not q.is_file():
        raise FileNotFoundError(errno.ENOENT, "no such file", p)
    return q.read_bytes()


def read_text(p: str) -> str:
    return read_bytes(p).decode("utf-8")


def makedirs(p: str) -> None:
    if is_url(p):
        path(p).mkdir(parents=True, exist_ok=True)
    else:
        os.makedirs(p, exist_ok=True)


# ---------------------------------------------------------------------------- writing


def write_atomic(p: str, data: Union[str, bytes]) -> None:
    """Write ``data`` to ``p`` so that a reader sees the old file or the new one, never part.

    Local: ``<p>.tmp`` then ``os.replace``; on any failure the ``.tmp`` is removed and the
    error re-raised (``ENOSPC``: see :func:`no_space`). Object store: one put.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if is_url(p):
        path(p).write_bytes(raw)
        return
    tmp = p + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
        os.replace(tmp, p)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


class AppendFile:
    """A text file opened for appending lines (``write`` / ``flush`` / ``close``).

    Local: ``open(p, "a")``. Object store: the object's current text (read at open) plus
    what was written, put whole on every :meth:`flush` and at :meth:`close` (an object
    cannot be appended to; the JSONL logs of a run are small).
    """

    def __init__(self, p: str):
        self.name = p
        self._url = is_url(p)
        if self._url:
            self._text = read_text(p) if isfile(p) else ""
            self._dirty = False
            self._f = None
        else:
            self._f = open(p, "a", encoding="utf-8")

    def write(self, text: str) -> int:
        if not self._url:
            return self._f.write(text)
        self._text += text
        self._dirty = True
        return len(text)

    def flush(self) -> None:
        if not self._url:
            self._f.flush()
        elif self._dirty:
            path(self.name).write_text(self._text)
            self._dirty = False

    def close(self) -> None:
        if not self._url:
            self._f.close()
        else:
            self.flush()


def local_side(run_path: str) -> str:
    """The local folder of what must stay on this machine for ``run_path``: for a local run
    folder, the run folder itself; for a URL, ``$RLFLOW_LOCAL_RUNS`` (default
    ``~/.cache/rlflow/runs``) / scheme / bucket / path (the lock, the programs' logs)."""
    if not is_url(run_path):
        return run_path
    scheme, rest = run_path.split("://", 1)
    base = os.environ.get("RLFLOW_LOCAL_RUNS") or os.path.join(
        os.path.expanduser("~"), ".cache", "rlflow", "runs")
    return os.path.join(base, scheme, *[q for q in rest.split("/") if q])


# ---------------------------------------------------------------------------- disk full


def no_space(exc: Optional[BaseException]) -> Optional[OSError]:
    """The ``OSError`` with errno ENOSPC / EDQUOT / EROFS behind ``exc`` (itself, its
    ``__cause__`` / ``__context__`` chain, or an exception group's members), else None."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def free_bytes(p: str) -> Optional[int]:
    """Free bytes of the file system holding ``p`` (its nearest existing folder), or None
    (an object store, or nothing on the path exists)."""
    if is_url(p):
        return None
    q = os.path.abspath(p)
    while True:
        try:
            return shutil.disk_usage(q).free
        except OSError:
            parent = os.path.dirname(q)
            if parent == q:
                return None
            q = parent


def human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "unknown"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


RESUME_HINT = ("free space (or move the run with --run-dir) and run the same command again: "
               "it resumes from the last whole checkpoint")


def full_line(folder: str, err: Optional[OSError] = None, what: str = "",
              then: str = RESUME_HINT) -> str:
    """One line for a write that failed for lack of space: the folder, the free space of
    its file system, the error and the file, and what to do (``then``)."""
    cause = ""
    if err is not None:
        cause = f": {err.strerror or err}" + (f" ({err.filename})" if err.filename else "")
    free = human_bytes(free_bytes(folder))
    kind = ("is on a read-only file system" if err is not None and err.errno == errno.EROFS
            else f"is out of space ({free} free on its file system)")
    return f"the run folder {folder} {kind}{' writing ' + what if what else ''}{cause}; {then}"

