"""The files a local host child (:mod:`rlflow.launcher.local_hosts`) reads and writes: no pickle.

Each file is a pair: ``<name>.json`` holds the plain fields and ``<name>.npz`` the arrays
(``numpy.savez``, read with ``allow_pickle=False``). The job (``job.json``/``job.npz``:
:class:`Job`) is written by the parent and read by every child; each child writes its
result (``result_<i>.json``/``.npz``), which the parent reads once the child exits.

A value is a tree of ``None``, ``bool``, ``int``, ``float`` (NaN and inf included),
``str``, ``list``, ``tuple``, ``dict`` (any keys that are themselves such values: e.g. the
tuple paths of ``nnx.to_flat_state``), numpy arrays and numpy scalars (a ``jax.Array`` is
saved as its numpy value). In the JSON, a node that is not plain JSON is a one-key object:

* ``{"__array__": "a3"}``: the array ``a3`` of the ``.npz`` (``"__scalar__"``: a numpy
  scalar, saved as a 0-d array and read back with its dtype);
* ``{"__tuple__": [...]}``: a tuple;
* ``{"__items__": [[key, value], ...]}``: a dict whose keys are not all strings, or that
  has a key starting with ``__``.

Reading a malformed file raises :class:`HostFileError` naming the file and the field.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import numpy as np

JOB = "job"
_TAGS = ("__array__", "__scalar__", "__tuple__", "__items__")


class HostFileError(ValueError):
    """A job or result file of a local host child is malformed (names the file and field),
    or a value to write is of a type the files do not hold (names the field)."""


@dataclass(frozen=True)
class Job:
    """What every child of a local host group is told (the parent's ``job.json``).

    Attributes:
      target: ``"module:function"``, the ``fn(ctx)`` to run.
      num_processes: processes in the group (>= 1).
      devices_per_process: fake CPU devices of each process (>= 1).
      work_dir: folder shared by the group (job, results, logs).
      args: the ``ctx.args`` given to ``fn`` (a value as in the module docstring).
      distributed: join the processes by ``jax.distributed``.
      coordinator: ``host:port`` of the ``jax.distributed`` coordinator.
      init_timeout_s: seconds to wait for every process to join.
      heartbeat_timeout_s: seconds without a heartbeat before a process counts as lost.
    """

    target: str
    num_processes: int
    devices_per_process: int
    work_dir: str
    args: dict
    distributed: bool
    coordinator: str
    init_timeout_s: float
    heartbeat_timeout_s: float


_JOB_TYPES = {"target": (str,), "num_processes": (int,), "devices_per_process": (int,),
              "work_dir": (str,), "args": (dict,), "distributed": (bool,), "coordinator": (str,),
              "init_timeout_s": (int, float), "heartbeat_timeout_s": (int, float)}


def result_path(work_dir, process_id: int) -> Path:
    """``<work_dir>/result_<process_id>.json`` (its arrays: the same name with ``.npz``)."""
    return Path(work_dir) / f"result_{process_id}.json"


def job_path(work_dir) -> Path:
    """``<work_dir>/job.json`` (its arrays: ``job.npz``)."""
    return Path(work_dir) / f"{JOB}.json"


# --- encoding ----------------------------------------------------------------------------------

def _encode(value: Any, where: str, arrays: dict) -> Any:
    if isinstance(value, np.generic):          # before float: np.float64 is a float
        name = f"a{len(arrays)}"
        arrays[name] = np.asarray(value)
        return {"__scalar__": name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.ndarray) or (hasattr(value, "__array__") and hasattr(value, "dtype")):
        arr = np.asarray(value)
        if arr.dtype.hasobject:
            raise HostFileError(f"{where}: an object array cannot be saved without pickle")
        name = f"a{len(arrays)}"
        arrays[name] = arr
        return {"__array__": name}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", arrays) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]", arrays) for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, f"{where}[{k!r}]", arrays) for k, v in value.items()}
        return {"__items__": [[_encode(k, f"{where} key {k!r}", arrays),
                               _encode(v, f"{where}[{k!r}]", arrays)]
                              for k, v in value.items()]}
    raise HostFileError(f"{where}: a {type(value).__name__} is not saved (expected None, bool, "
                        f"int, float, str, list, tuple, dict or a numpy array)")


def write_value(path, value: Any, *, what: str = "value") -> None:
    """Write ``value`` as ``path`` (JSON) and ``path`` with ``.npz`` (its arrays).

    The ``.npz`` is written first and each file is renamed into place, so a complete JSON
    file means a complete pair.

    Raises:
      HostFileError: a node of ``value`` is of another type (names it, from ``what``).
    """
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    doc = _encode(value, what, arrays)
    npz = path.with_suffix(".npz")
    with open(npz.with_suffix(".npz.tmp"), "wb") as f:
        np.savez(f, **arrays)
    os.replace(npz.with_suffix(".npz.tmp"), npz)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


# --- decoding ----------------------------------------------------------------------------------

class _Reader:
    """Decodes one JSON document against its ``.npz``; errors name both files and the field."""

    def __init__(self, path: Path, arrays):
        self.path, self.arrays = path, arrays

    def fail(self, where: str, what: str):
        raise HostFileError(f"{self.path}: field {where}: {what}")

    def array(self, name, where: str) -> np.ndarray:
        npz = self.path.with_suffix(".npz")
        if not isinstance(name, str) or name not in self.arrays.files:
            self.fail(where, f"array {name!r} is not in {npz} (it holds {self.arrays.files[:8]})")
        try:
            return self.arrays[name]
        except ValueError as e:          # an object array: would need pickle
            self.fail(where, f"array {name!r} of {npz} cannot be read without pickle: {e}")

    def decode(self, node: Any, where: str) -> Any:
        if isinstance(node, list):
            return [self.decode(v, f"{where}[{i}]") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        tag = next(iter(node)) if len(node) == 1 else None
        if tag not in _TAGS:
            return {k: self.decode(v, f"{where}[{k!r}]") for k, v in node.items()}
        body = node[tag]
        if tag == "__array__":
            return self.array(body, where)
        if tag == "__scalar__":
            arr = self.array(body, where)
            if arr.ndim != 0:
                self.fail(where, f"scalar {body!r} has shape {arr.shape}, expected ()")
            return arr[()]
        if not isinstance(body, list):
            self.fail(where, f"{tag} holds a {type(body).__name__}, expected a list")
        if tag == "__tuple__":
            return tuple(self.decode(v, f"{where}[{i}]") for i, v in enumerate(body))
        out = {}
        for i, pair in enumerate(body):
            if not (isinstance(pair, list) and len(pair) == 2):
                self.fail(f"{where} item {i}", f"expected a [key, value] pair, got {pair!r}")
            key = self.decode(pair[0], f"{where} key {i}")
            try:
                hash(key)
            except TypeError:
                self.fail(f"{where} key {i}", f"{key!r} cannot be a dict key")
            out[key] = self.decode(pair[1], f"{where}[{key!r}]")
        return out


def read_value(path, *, what: str = "value") -> Any:
    """Read what :func:`write_value` wrote to ``path`` (and ``path`` with ``.npz``).

    Raises:
      HostFileError: either file is missing or unreadable, the JSON does not parse (line
        and column), or a field's node is malformed or names an array the ``.npz`` lacks
        (names the file and the field, from ``what``).
    """
    path = Path(path)
    npz = path.with_suffix(".npz")
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise HostFileError(f"{path}: cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise HostFileError(f"{path}: line {e.lineno} column {e.colno}: not JSON ({e.msg})"
                            ) from None
    try:
        arrays = np.load(npz, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise HostFileError(f"{npz}: cannot be read as .npz: {e}") from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise HostFileError(f"{npz}: is a single .npy array, expected an .npz archive")
    with arrays:
        return _Reader(path, arrays).decode(doc, what)


# --- the job -----------------------------------------------------------------------------------

def write_job(work_dir, job: Job) -> Path:
    """Write ``job`` into ``work_dir`` (:func:`job_path`); returns the JSON file's path."""
    path = job_path(work_dir)
    write_value(path, {f.name: getattr(job, f.name) for f in fields(Job)}, what="job")
    return path


def read_job(path) -> Job:
    """The :class:`Job` of ``path`` (a ``job.json``).

    Raises:
      HostFileError: the file is malformed (:func:`read_value`), or a field is missing,
        unknown or of the wrong type (names the file and the field).
    """
    doc = read_value(path, what="job")
    if not isinstance(doc, dict):
        raise HostFileError(f"{path}: expected a JSON object of the job's fields, "
                            f"got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(_JOB_TYPES))
    if unknown:
        raise HostFileError(f"{path}: unknown field(s) {unknown}; expected {sorted(_JOB_TYPES)}")
    for name, types in _JOB_TYPES.items():
        if name not in doc:
            raise HostFileError(f"{path}: field {name!r} is missing")
        value = doc[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise HostFileError(f"{path}: field {name!r}: expected "
                                f"{' or '.join(t.__name__ for t in types)}, got "
                                f"{type(value).__name__} {value!r}")
    if ":" not in doc["target"]:
        raise HostFileError(f"{path}: field 'target': expected 'module:function', "
                            f"got {doc['target']!r}")
    return Job(**doc)
