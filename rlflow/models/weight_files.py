"""A model folder's safetensors weight files, checked from their headers (no tensor read).

A Hugging Face folder holds its weights in ``model.safetensors``, or in shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). A file cut
short by an interrupted copy or download otherwise passes every check that looks at names
and fails deep inside the loader (``SafetensorError: ... incomplete metadata``), without the
file named. :func:`check_weight_files` reads only each file's header and size.

The safetensors format (https://huggingface.co/docs/safetensors, "Format"): 8 bytes, a
little-endian unsigned 64-bit integer ``N``; ``N`` bytes of a UTF-8 JSON object (it may end
in spaces), whose entries are ``name: {"dtype": str, "shape": [int, ...], "data_offsets":
[begin, end]}`` plus an optional ``"__metadata__"`` object of strings; then the byte buffer,
in which each tensor takes ``[begin, end)``. The reference implementation also requires the
tensors to cover the buffer exactly (no hole, no overlap) and the buffer to end at the end
of the file; these checks are the same ones, each with its own message.
"""

from __future__ import annotations

import json
import math
import os
import struct

from safetensors.numpy import save_file

from rlflow.models.config import ModelFormatError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: bits per element of each safetensors dtype (the format's list, safetensors 0.6+)
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
              "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6,
              "F6_E3M2": 6}
#: the reference implementation's bound on the header length
MAX_HEADER_BYTES = 100_000_000


def weight_files(path: str) -> list[str]:
    """The safetensors files the loader reads from the folder ``path``: the shards the index
    lists (sorted), or the single file.

    Raises: ModelFormatError naming the file: an index that is not JSON or has no
    ``weight_map`` object of file names, a shard it lists that is missing, or neither an
    index nor ``model.safetensors``.
    """
    weight_map = index_weight_map(path)
    if weight_map is not None:
        files = sorted({os.path.join(path, v) for v in weight_map.values()})
        for fname in files:
            if not os.path.isfile(fname):
                n = sum(os.path.join(path, v) == fname for v in weight_map.values())
                raise ModelFormatError(f"{fname}: missing (expected: {INDEX_FILE} lists it "
                                       f"for {n} tensors)")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise ModelFormatError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                               "weights are supported)")
    return [single]


def index_weight_map(path: str) -> dict[str, str] | None:
    """The ``weight_map`` (``{tensor name: shard file name}``) of the folder ``path``'s
    ``model.safetensors.index.json``; None without an index.

    Raises: ModelFormatError naming the index: not JSON, or no ``weight_map`` object of
    file names.
    """
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ModelFormatError(f"{index}: not a JSON object ({e}) (expected "
                                   '{"weight_map": {tensor name: shard file}})') from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ModelFormatError(f"{index}: has no 'weight_map' object of file names "
                                   '(expected {"weight_map": {tensor name: shard file}})')
        return weight_map
    return None


def read_header(fname: str) -> dict[str, dict]:
    """The tensor entries of one safetensors file's header, checked against the file's size
    (module docstring); reads the 8-byte length and the header only.

    Returns: ``{tensor name: {"dtype", "shape", "data_offsets"}}`` (``__metadata__`` left out).

    Raises: ModelFormatError ``"<file>: <what is wrong> (expected ...)"``.
    """
    size = os.path.getsize(fname)
    if size < 8:
        raise ModelFormatError(f"{fname}: {size} bytes, too short for the header length "
                               f"(expected at least 8 bytes: a safetensors file)")
    with open(fname, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ModelFormatError(
                f"{fname}: header length {n} bytes, but the file has {size - 8} bytes after "
                f"it (expected a header of at most {min(size - 8, MAX_HEADER_BYTES)} bytes; "
                f"the file is truncated or not safetensors)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{fname}: header is not valid JSON ({e}) (expected the "
                               f"safetensors JSON header)") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{fname}: header is a JSON {type(header).__name__} (expected "
                               f"an object of tensor entries)")
    header.pop("__metadata__", None)
    buffer = size - 8 - n
    spans = []
    for name, t in header.items():
        _check_entry(fname, name, t)
        begin, end = t["data_offsets"]
        if end > buffer:
            raise ModelFormatError(
                f"{fname}: tensor {name!r} ends at byte {end} of the data, but the file holds "
                f"{buffer} data bytes (expected the whole tensor in the file; it is truncated)")
        count = math.prod(t["shape"]) * DTYPE_BITS[t["dtype"]]
        if count % 8 or end - begin != count // 8:
            raise ModelFormatError(
                f"{fname}: tensor {name!r} takes {end - begin} bytes, but {t['dtype']} "
                f"{t['shape']} needs {count / 8:g} (expected data_offsets to span "
                f"its elements exactly)")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ModelFormatError(
                f"{fname}: tensor {name!r} starts at data byte {begin}, expected {at} (the "
                f"tensors must cover the data without holes or overlaps)")
        at = end
    if at != buffer:
        raise ModelFormatError(
            f"{fname}: the tensors end at data byte {at}, but the file holds {buffer} data "
            f"bytes (expected them to end together; the file was cut or appended to)")
    return header


def _check_entry(fname: str, name: str, t) -> None:
    ok = (isinstance(t, dict) and isinstance(t.get("dtype"), str)
          and isinstance(t.get("shape"), list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                  for d in t["shape"])
          and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
          and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0
                  for o in t["data_offsets"])
          and t["data_offsets"][0] <= t["data_offsets"][1])
    if not ok:
        raise ModelFormatError(
            f"{fname}: tensor {name!r} has header entry {json.dumps(t)[:200]} (expected "
            '{"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]} with '
            "0 <= begin <= end)")
    if t["dtype"] not in DTYPE_BITS:
        raise ModelFormatError(f"{fname}: tensor {name!r} has dtype {t['dtype']!r} (expected "
                               f"one of {', '.join(DTYPE_BITS)})")


def check_weight_files(path: str) -> dict[str, str]:
    """Check every weight file of the model folder ``path`` (:func:`weight_files`,
    :func:`read_header`); reads headers only.

    Returns: ``{tensor name: file}`` from the files' own headers (an index can be stale:
    a tensor found in another shard than the index says is taken from where it is).

    Raises: ModelFormatError naming the file and what is wrong; with an index, a tensor it
    lists that no shard holds names the shard the index maps it to, the tensor and how
    many are missing in all (the loader would refuse the folder).
    """
    out: dict[str, str] = {}
    for fname in weight_files(path):
        out.update({k: fname for k in read_header(fname)})
    missing = sorted((f, n) for n, f in (index_weight_map(path) or {}).items() if n not in out)
    if missing:
        shard, name = missing[0]
        names = [n for _, n in missing]
        raise ModelFormatError(
            f"{os.path.join(path, shard)}: has no tensor {name!r} (expected: {INDEX_FILE} "
            f"maps it to this file; {len(missing)} listed tensors are in no shard: "
            f"{names[:5]}{' ...' if len(names) > 5 else ''})")
    return out


def save_safetensors(tensors: dict, path: str, metadata: dict) -> None:
    """``safetensors.numpy.save_file``, then the file's mode as any file this process
    creates (``0o666`` less the umask: usually ``-rw-r--r--``): save_file leaves it
    ``0o600``, so another user could not load an export beside its readable config.json."""
    save_file(tensors, path, metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _write_safetensors(tensors: dict, out_dir: str, max_shard_bytes: int) -> None:
    for old in os.listdir(out_dir):
        if old.endswith(".safetensors") or old == INDEX_FILE:
            os.remove(os.path.join(out_dir, old))
    meta = {"format": "pt"}
    shards, current, size = [], {}, 0
    for name, arr in tensors.items():
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = arr
        size += arr.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_safetensors(shards[0], os.path.join(out_dir, SINGLE_FILE), meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, os.path.join(out_dir, fname), meta)
        weight_map.update({name: fname for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
