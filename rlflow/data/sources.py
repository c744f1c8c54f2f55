"""Prompt-record sources: random-access readers for JSONL, parquet and ArrayRecord files.

Each source follows grain's ``RandomAccessDataSource`` protocol (``__len__`` and
``__getitem__(index) -> dict``) so that ``grain.MapDataset.source(src)`` can shuffle and
index it, and adds ``location(index) -> str`` ("train.jsonl:17") for error messages.
Record ``index`` is the record's position in the (concatenated) files: it is the stable
``prompt_id`` of the prompt pipeline.

Formats:
  * JSONL: one JSON object per line; blank lines are ignored (they are not records) but
    line numbers in messages count them, so "file:17" is the editor's line 17.
  * parquet: one record per row (read with pyarrow).
  * ArrayRecord: one record per entry, each a UTF-8 JSON object (read with grain's
    ``ArrayRecordDataSource``).

A ``path`` may be a glob (``data/train-*.jsonl``); matching files are read in sorted order.

Errors (all :class:`DataError`, a ``ValueError``): :class:`BadRecordError` names the file and
line/row/entry of a record that cannot be decoded; :class:`MissingFieldError` names the field,
the record and the fields present; :class:`EmptyDatasetError` says which files held no records.
"""

from __future__ import annotations

import bisect
import glob
import json
import mmap
import os
from typing import Any, Sequence

import numpy as np


class DataError(ValueError):
    """Bad prompt data; the message names the file, line or field and what was expected."""


class BadRecordError(DataError):
    """One record cannot be used (malformed JSON, wrong type, missing field, empty prompt)."""


class MissingFieldError(BadRecordError):
    """A record lacks a field the config names (``data.prompt_field`` / ``data.answer_field``)."""


class EmptyDatasetError(DataError):
    """The dataset holds no usable records."""


class JsonlSource:
    """Random access to the JSON objects of one JSONL file.

    The file is memory-mapped; construction scans it once for line offsets (no parsing),
    ``__getitem__`` parses one line. Thread-safe for reads (grain reads in threads).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      BadRecordError (from ``__getitem__``): the line is not a JSON object; the message is
        ``"<path>:<line>: ..."``.
    """

    def __init__(self, path: str):
        self.path = path
        starts, ends, lines = [], [], []
        pos = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    starts.append(pos)
                    ends.append(pos + len(raw))
                    lines.append(lineno)
                pos += len(raw)
        self._starts = np.asarray(starts, np.int64)
        self._ends = np.asarray(ends, np.int64)
        self._lines = np.asarray(lines, np.int64)
        self._mm = None
        if pos > 0:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return len(self._starts)

    def location(self, index: int) -> str:
        return f"{self.path}:{int(self._lines[index])}"

    def __getitem__(self, index: int) -> dict:
        raw = self._mm[int(self._starts[index]):int(self._ends[index])]
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            # some of json's messages end in "at" ("Invalid control character at")
            raise BadRecordError(f"{self.location(index)}: malformed JSON "
                                 f"({e.msg.removesuffix(' at')} at character {e.pos} of the "
                                 f"record)") from None
        except UnicodeDecodeError as e:
            raise BadRecordError(f"{self.location(index)}: malformed JSON (not UTF-8: {e.reason} "
                                 f"at byte {e.start} of the record)") from None
        return _as_object(record, self.location(index))


class ParquetSource:
    """Random access to the rows of one parquet file, each row a dict of its columns.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      BadRecordError: pyarrow cannot read the file (names the file).
    """

    def __init__(self, path: str):
        import pyarrow.parquet as pq

        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"parquet file not found: {path}")
        try:
            self._table = pq.read_table(path)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError variants
            raise BadRecordError(f"{path}: not a readable parquet file ({e})") from None

    def __len__(self) -> int:
        return self._table.num_rows

    def location(self, index: int) -> str:
        return f"{self.path}: row {index}"

    def __getitem__(self, index: int) -> dict:
        return self._table.slice(int(index), 1).to_pylist()[0]


class ArrayRecordSource:
    """Random access to one ArrayRecord file whose entries are UTF-8 JSON objects.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      BadRecordError (from ``__getitem__``): an entry is not a UTF-8 JSON object; the message
        is ``"<path>: entry <i>: ..."``.
    """

    def __init__(self, path: str):
        import grain

        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ArrayRecord file not found: {path}")
        self._source = grain.sources.ArrayRecordDataSource([path])

    def __len__(self) -> int:
        return len(self._source)

    def location(self, index: int) -> str:
        return f"{self.path}: entry {index}"

    def __getitem__(self, index: int) -> dict:
        raw = self._source[int(index)]
        try:
            record = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRecordError(f"{self.location(index)}: not a UTF-8 JSON object ({e})") from None
        return _as_object(record, self.location(index))


class ConcatSource:
    """Several sources read as one; record ``i`` counts across them in order."""

    def __init__(self, sources: Sequence[Any]):
        self.sources = list(sources)
        self._offsets = np.cumsum([0] + [len(s) for s in self.sources]).tolist()

    def __len__(self) -> int:
        return self._offsets[-1]

    def _find(self, index: int):
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} out of range [0, {len(self)})")
        k = bisect.bisect_right(self._offsets, index) - 1
        return self.sources[k], index - self._offsets[k]

    def location(self, index: int) -> str:
        source, local = self._find(index)
        return source.location(local)

    def __getitem__(self, index: int) -> dict:
        source, local = self._find(index)
        return source[local]


_READERS = {"jsonl": JsonlSource, "parquet": ParquetSource, "arrayrecord": ArrayRecordSource}


def open_source(kind: str, path: str) -> ConcatSource:
    """Open ``path`` (a file or a glob) as a source of dict records.

    Args:
      kind: "jsonl", "parquet" or "arrayrecord" (``data.source``).
      path: a file, or a glob matched in sorted order.

    Returns:
      A :class:`ConcatSource` over the matching files (possibly empty: the pipeline raises
      :class:`EmptyDatasetError` with the file names).

    Raises:
      ValueError: unknown ``kind``.
      FileNotFoundError: no file matches ``path``.
    """
    if kind not in _READERS:
        raise ValueError(f"data.source: unknown file format {kind!r}; expected one of "
                         f"{sorted(_READERS)}")
    paths = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    paths = [p for p in paths if os.path.isfile(p)]
    if not paths:
        raise FileNotFoundError(f"data.path: no {kind} file matches {path!r}")
    return ConcatSource([_READERS[kind](p) for p in paths])


def source_files(source: Any) -> list[str]:
    """The file names behind a source (for messages)."""
    if isinstance(source, ConcatSource):
        return [f for s in source.sources for f in source_files(s)]
    path = getattr(source, "path", None)
    return [path] if path else [type(source).__name__]


def _as_object(record: Any, where: str) -> dict:
    if not isinstance(record, dict):
        raise BadRecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record
