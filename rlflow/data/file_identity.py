"""Which files a data path reaches, and which files two data paths share (by identity).

A data path (``data.path``, ``eval.path``) is a file or a glob (:func:`rlflow.data.sources.
open_source`). Two different spellings can name the same file: a symlink, a hard link, a
path with ``..``, a glob or a folder that covers it. Comparing strings (even absolute ones)
misses all but the last; a file's identity is its ``(st_dev, st_ino)`` pair, which every
spelling and every hard link shares (POSIX ``stat``; ``os.path.samefile`` compares the same
pair).
"""

from __future__ import annotations

import glob
import os


def reached_files(path: str) -> list[str]:
    """The existing files ``path`` reaches: the glob's matches (or ``path`` itself), and for
    a folder among them every file below it (symlinks followed). Sorted, deduplicated by
    spelling; an empty list when nothing exists."""
    matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    out: set[str] = set()
    for m in matches:
        if os.path.isfile(m):
            out.add(m)
        elif os.path.isdir(m):
            for root, _, names in os.walk(m, followlinks=True):
                out.update(os.path.join(root, n) for n in names
                           if os.path.isfile(os.path.join(root, n)))
    return sorted(out)


def shared_files(a: str, b: str) -> list[tuple[str, str]]:
    """Pairs ``(file of a, file of b)`` that are one file: the same ``(st_dev, st_ino)``
    (symlinks resolved, hard links included) or the same real path.

    Args:
      a, b: data paths (files, globs or folders; see :func:`reached_files`).

    Returns: the pairs in ``a``'s file order; empty when no file is shared or a side reaches
    no existing file.
    """
    def ident(p: str):
        st = os.stat(p)                                   # follows symlinks
        return (st.st_dev, st.st_ino), os.path.realpath(p)

    b_ids: dict = {}
    for f in reached_files(b):
        key, real = ident(f)
        b_ids.setdefault(key, f)
        b_ids.setdefault(real, f)
    pairs = []
    for f in reached_files(a):
        key, real = ident(f)
        other = b_ids.get(key) or b_ids.get(real)
        if other is not None:
            pairs.append((f, other))
    return pairs
