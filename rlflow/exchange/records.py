"""Rollout group records: schema validation and binary framing (never pickle).

A *group* is one prompt's ``G`` completions, never split (``docs/interfaces.md``): a
``dict`` of plain numpy arrays

====================  =======  ========  ===============================================
field                 dtype    shape     meaning
====================  =======  ========  ===============================================
prompt_id             int64    []        dataset index of the prompt
prompt_tokens         int32    [P]       prompt token ids (no padding)
completion_tokens     int32    [G, T]    sampled ids, right-padded with 0
completion_lengths    int32    [G]       real tokens per completion (EOS included)
behaviour_logprobs    float32  [G, T]    logprob each token was sampled with (0 on padding)
policy_versions       int32    [G, T]    version that produced each token (-1 on padding)
rewards               float32  [G]       scalar reward per completion
truncated             bool     [G]       cut by ``max_tokens`` (no EOS)
stream_index          int64    []        optional: the prompt's position in the prompt stream
lease_id              int64    []        optional (with stream_index): the prompt ledger's lease
loss_mask             bool     [G, T]    optional (multi-turn episodes): 1 exactly on the tokens
                                         the policy sampled; 0 on environment tokens (tool
                                         results, user turns, template scaffolding), which carry
                                         behaviour logprob 0 and policy version -1
failed                bool     [G]       optional (record version 2): 1 on a completion cut by
                                         an infrastructure failure (an environment error or
                                         timeout, a reward function error or timeout), not by
                                         the policy; present only when one is set
prompt_routing        int8     [P, L, k] optional (record version 3, with
                      | int16              completion_routing): rollout routing replay, the
completion_routing    int8     [G, T,    experts a mixture-of-experts sampler chose per
                      | int16  L, k]     token and layer (:mod:`rlflow.exchange.routing`)
====================  =======  ========  ===============================================

``failed`` marks samples whose reward says nothing about the policy: the learner leaves them
out of the loss and out of their group's baseline (``learner.on_failed_sample="mask"``) or
trains on them with reward 0 (``"zero_reward"``). A record without it (version 1, or no
failure) has none failed; G bytes travel only when a sample failed.

A multi-turn episode is one completion row: the sampled turns and the environment's tokens
between them, in order, right after the prompt; ``completion_lengths`` counts both kinds.
Without ``loss_mask`` every real token was sampled (single-turn).

``stream_index`` and ``lease_id`` (:data:`OPTIONAL_SCHEMA`) come with every group of the
runtime's samplers: the learner's prompt ledger (``rlflow.control.ledger``) follows each
leased prompt by them.

Framing (any dict of named arrays, not only groups). As ZeroMQ frames
(:func:`encode_frames`): frame 0 is a UTF-8 JSON header
``{"format": "rlflow-arrays/1", "fields": [[name, dtype, shape], ...]}``, then one frame of
raw little-endian C-order bytes per field. As one buffer (:func:`encode_bytes`): the magic
``b"RLFA"``, the header length as little-endian uint32, the header, then the raw bytes of the
fields back to back. Only the dtypes in :data:`WIRE_DTYPES` travel, so decoding never builds
Python objects from the wire.
"""

from __future__ import annotations

import json
import struct
from typing import Mapping, Sequence

import numpy as np

from rlflow.exchange.routing import check_routing

FORMAT = "rlflow-arrays/1"
MAGIC = b"RLFA"
MAX_HEADER_BYTES = 1 << 16

# dtype name on the wire -> explicit little-endian numpy dtype.
WIRE_DTYPES = {
    "bool": np.dtype("|b1"),
    "int8": np.dtype("<i1"), "uint8": np.dtype("<u1"),
    "int16": np.dtype("<i2"), "int32": np.dtype("<i4"), "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"), "float32": np.dtype("<f4"), "float64": np.dtype("<f8"),
}

# field -> (dtype name, shape as dimension symbols); a symbol binds to one size per group.
GROUP_SCHEMA: dict[str, tuple[str, tuple[str, ...]]] = {
    "prompt_id": ("int64", ()),
    "prompt_tokens": ("int32", ("P",)),
    "completion_tokens": ("int32", ("G", "T")),
    "completion_lengths": ("int32", ("G",)),
    "behaviour_logprobs": ("float32", ("G", "T")),
    "policy_versions": ("int32", ("G", "T")),
    "rewards": ("float32", ("G",)),
    "truncated": ("bool", ("G",)),
}

# optional fields: checked like the others when present
OPTIONAL_SCHEMA: dict[str, tuple[str, tuple[str, ...]]] = {
    "stream_index": ("int64", ()),
    "lease_id": ("int64", ()),
    "loss_mask": ("bool", ("G", "T")),
    "failed": ("bool", ("G",)),
    # rollout routing replay (record version 3): int8 or int16 (rlflow.exchange.routing)
    "prompt_routing": ("int8|int16", ("P", "L", "k")),
    "completion_routing": ("int8|int16", ("G", "T", "L", "k")),
}


class FrameError(ValueError):
    """Bytes that are not a well-formed array frame (bad magic, header, dtype or size)."""


class RecordError(ValueError):
    """A group record that breaks the schema.

    Attributes:
      field: the offending field name ("" when the record as a whole is wrong).
      expected: what the schema wants (text).
      got: what the record has (text).
    """

    def __init__(self, field: str, expected: str, got: str):
        self.field, self.expected, self.got = field, expected, got
        where = f"field {field!r}" if field else "record"
        super().__init__(f"bad group record: {where}: expected {expected}, got {got}")

    def to_dict(self) -> dict:
        return {"field": self.field, "expected": self.expected, "got": self.got}

    @classmethod
    def from_dict(cls, d: Mapping) -> "RecordError":
        return cls(str(d.get("field", "")), str(d.get("expected", "?")), str(d.get("got", "?")))


# ----------------------------------------------------------------------------- schema


def validate_group(group: Mapping[str, np.ndarray], *, group_size: int | None = None,
                   max_tokens: int | None = None) -> dict[str, int]:
    """Check a group record against :data:`GROUP_SCHEMA`.

    Args:
      group: field name -> numpy array.
      group_size: the ``G`` every group must have (None: any G >= 1).
      max_tokens: upper bound on ``T`` (None: any).

    Returns:
      The bound dimensions ``{"P": ..., "G": ..., "T": ...}``.

    Raises:
      RecordError: naming the field, what was expected and what the record has, for a
        missing or extra field, a non-array, a wrong dtype or rank, sizes that disagree
        between fields, a length outside ``[0, T]``, a non-finite reward or logprob, a sampled
        token tagged with a policy version < 0, or (with ``loss_mask``) an environment token
        with a version other than -1 or a logprob other than 0, or routing fields that break
        :func:`rlflow.exchange.routing.check_routing`.
    """
    if not isinstance(group, Mapping):
        raise RecordError("", "a mapping of field name -> numpy array", type(group).__name__)
    missing = [k for k in GROUP_SCHEMA if k not in group]
    extra = [k for k in group if k not in GROUP_SCHEMA and k not in OPTIONAL_SCHEMA]
    if missing:
        raise RecordError(missing[0], "field present", f"missing (all missing: {missing})")
    if extra:
        raise RecordError(str(extra[0]), f"only the fields {list(GROUP_SCHEMA)} (and "
                          f"optionally {list(OPTIONAL_SCHEMA)})", f"unknown field(s) {extra}")
    dims: dict[str, int] = {}
    if group_size is not None:
        dims["G"] = int(group_size)
    schema = dict(GROUP_SCHEMA, **{k: v for k, v in OPTIONAL_SCHEMA.items() if k in group})
    for name, (dtype, symbols) in schema.items():
        arr = group[name]
        if not isinstance(arr, np.ndarray):
            raise RecordError(name, f"numpy array of {dtype}",
                              f"object of type {type(arr).__name__}")
        if arr.dtype not in [np.dtype(d) for d in dtype.split("|")]:
            raise RecordError(name, f"dtype {dtype.replace('|', ' or ')}", f"dtype {arr.dtype}")
        want = "[" + ", ".join(symbols) + "]"
        if arr.ndim != len(symbols):
            raise RecordError(name, f"shape {want}", f"shape {list(arr.shape)}")
        for sym, size in zip(symbols, arr.shape):
            if sym in dims and dims[sym] != size:
                bound = ", ".join(f"{k}={v}" for k, v in dims.items())
                raise RecordError(name, f"shape {want} with {bound}", f"shape {list(arr.shape)}")
            dims.setdefault(sym, int(size))
    if dims["G"] < 1:
        raise RecordError("completion_tokens", "G >= 1 completions", "G = 0")
    if max_tokens is not None and dims["T"] > max_tokens:
        raise RecordError("completion_tokens", f"T <= max_tokens={max_tokens}", f"T = {dims['T']}")
    lengths = group["completion_lengths"]
    if lengths.size and (lengths.min() < 0 or lengths.max() > dims["T"]):
        raise RecordError("completion_lengths", f"values in [0, T={dims['T']}]",
                          f"values {lengths.tolist()}")
    for name in ("rewards", "behaviour_logprobs"):
        if not np.isfinite(group[name]).all():
            raise RecordError(name, "finite values", "NaN or inf")
    sampled = sampled_mask(group)
    if (group["policy_versions"][sampled] < 0).any():
        raise RecordError("policy_versions", "a version >= 0 on every sampled token",
                          "a negative version on a sampled token within completion_lengths")
    if "loss_mask" in group:
        real = np.arange(dims["T"])[None, :] < lengths[:, None]
        env = real & ~group["loss_mask"]
        if (group["policy_versions"][env] != -1).any() or \
                (group["behaviour_logprobs"][env] != 0).any():
            raise RecordError("loss_mask", "policy version -1 and behaviour logprob 0 on every "
                              "environment token (loss_mask 0)", "other values")
    bad = check_routing(group, dims)
    if bad is not None:
        raise RecordError(*bad)
    return dims


def sampled_mask(group: Mapping[str, np.ndarray]) -> np.ndarray:
    """bool ``[G, T]``: the tokens the policy sampled (within ``completion_lengths`` and, when
    the record has one, where ``loss_mask`` is 1)."""
    lengths = np.asarray(group["completion_lengths"])
    t = np.shape(group["policy_versions"])[1]
    real = np.arange(t)[None, :] < lengths[:, None]
    if "loss_mask" in group:
        real = real & np.asarray(group["loss_mask"], bool)
    return real


def policy_version_range(group: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """Oldest and newest policy version over the sampled tokens of a (valid) group
    (:func:`sampled_mask`: environment tokens of multi-turn episodes carry -1).

    Returns ``(-1, -1)`` when the group has no sampled token. The oldest one is what a
    staleness bound compares against the learner's version.
    """
    versions = group["policy_versions"]
    real = sampled_mask(group)
    if not real.any():
        return -1, -1
    v = versions[real]
    return int(v.min()), int(v.max())


# ----------------------------------------------------------------------------- samples log


def completion_samples(groups: Sequence[Mapping[str, np.ndarray]], tokenizer,
                       reasoning=None) -> list[dict]:
    """One dict per completion of ``groups``, for the samples log
    (:meth:`rlflow.run.metrics.MetricsWriter.log_samples`):

    * ``prompt`` and ``completion`` (text, ``tokenizer.decode``; special tokens dropped from
      the completion: the text a single-turn reward reads);
    * ``completion_ids`` (list of int, the completion's ``completion_lengths`` ids: the raw
      ids, special tokens and environment tokens included);
    * ``turns`` (multi-turn episodes only, i.e. groups with ``loss_mask``): the completion
      split where the loss mask changes, ``[{"role": "assistant" | "environment", "text":
      str, "num_tokens": int}]`` in episode order; ``assistant`` turns are the ids the policy
      sampled, ``environment`` turns the environment's tokens with the template's
      scaffolding (tool results, user turns, the next generation prompt). Both are decoded
      with special tokens kept, so the template's role headers and end-of-turn tokens show
      and ``sum(num_tokens) == len(completion_ids)``;
    * ``reward`` (float), ``version`` (the oldest policy version that sampled a token of it;
      -1 when none did), ``prompt_id`` (int) and ``truncated`` (bool);
    * for records that carry it, ``failed`` (bool: an environment or reward failure);
    * with ``reasoning`` (a thinking model's parser,
      :func:`rlflow.data.reasoning.get_reasoning_parser`, other than "none"), ``reasoning``
      and ``answer`` (the graded part; "" when the reasoning never closed)."""
    from rlflow.data.reasoning import split_none

    if reasoning is split_none:
        reasoning = None
    out = []
    for g in groups:
        prompt = tokenizer.decode(g["prompt_tokens"].tolist())
        mask = g.get("loss_mask")
        for i in range(len(g["rewards"])):
            n = int(g["completion_lengths"][i])
            toks = g["completion_tokens"][i, :n].tolist()
            versions = g["policy_versions"][i, :n]
            versions = versions[versions >= 0]          # env tokens of episodes: -1
            text = tokenizer.decode(toks, skip_special_tokens=True)
            sample = {"prompt": prompt, "completion": text,
                      "completion_ids": [int(t) for t in toks]}
            if reasoning is not None:
                split = reasoning(text)
                sample |= {"reasoning": split.reasoning, "answer": split.answer}
            sample |= {"reward": float(g["rewards"][i]),
                       "version": int(versions.min()) if versions.size else -1,
                       "prompt_id": int(g["prompt_id"]),
                       "truncated": bool(g["truncated"][i])}
            if "failed" in g:
                sample["failed"] = bool(g["failed"][i])
            if mask is not None:
                sample["turns"] = episode_turns(toks, np.asarray(mask[i, :n], bool), tokenizer)
            out.append(sample)
    return out


def episode_turns(ids: Sequence[int], loss_mask: np.ndarray, tokenizer) -> list[dict]:
    """A multi-turn episode's completion ``ids`` ``[n]`` split into turns where ``loss_mask``
    (bool ``[n]``: 1 on sampled ids) changes: ``[{"role", "text", "num_tokens"}]`` with role
    ``"assistant"`` on sampled runs and ``"environment"`` on the others, text decoded with
    special tokens kept (:func:`completion_samples`)."""
    turns: list[dict] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or loss_mask[end] != loss_mask[start]:
            turns.append({"role": "assistant" if loss_mask[start] else "environment",
                          "text": tokenizer.decode(list(ids[start:end]),
                                                   skip_special_tokens=False),
                          "num_tokens": end - start})
            start = end
    return turns


# ----------------------------------------------------------------------------- framing


def _header(arrays: Mapping[str, np.ndarray]) -> tuple[bytes, list[np.ndarray]]:
    fields, data = [], []
    for name, arr in arrays.items():
        arr = np.asarray(arr)
        wire = WIRE_DTYPES.get(arr.dtype.name)
        if wire is None or arr.dtype.kind not in "biuf":
            raise FrameError(f"field {name!r}: dtype {arr.dtype} cannot travel; "
                             f"allowed: {sorted(WIRE_DTYPES)}")
        data.append(np.ascontiguousarray(arr, dtype=wire))
        fields.append([str(name), arr.dtype.name, list(arr.shape)])
    header = json.dumps({"format": FORMAT, "fields": fields}, separators=(",", ":")).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    return header, data


def _parse_header(header: bytes | memoryview) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    if len(header) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        meta = json.loads(bytes(header).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError(f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise FrameError(f"header format: expected {FORMAT!r}, got {got!r}")
    out = []
    for i, entry in enumerate(meta.get("fields", ())):
        try:
            name, dtype, shape = entry
            shape = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            raise FrameError(f"header field #{i}: expected [name, dtype, shape], got {entry!r}") \
                from None
        if dtype not in WIRE_DTYPES:
            raise FrameError(f"field {name!r}: dtype {dtype!r} not allowed; "
                             f"allowed: {sorted(WIRE_DTYPES)}")
        if any(s < 0 for s in shape):
            raise FrameError(f"field {name!r}: negative size in shape {list(shape)}")
        out.append((str(name), WIRE_DTYPES[dtype], shape))
    return out


def _array(name: str, dtype: np.dtype, shape: tuple[int, ...], buf) -> np.ndarray:
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(buf) != need:
        raise FrameError(f"field {name!r}: {dtype.name}{list(shape)} needs {need} bytes, "
                         f"got {len(buf)}")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    return arr.astype(arr.dtype.newbyteorder("="), copy=False)


def encode_frames(arrays: Mapping[str, np.ndarray]) -> list:
    """Frames for ZeroMQ multipart: ``[header, raw bytes of field 0, field 1, ...]``.

    Raises:
      FrameError: a field has a dtype outside :data:`WIRE_DTYPES` (e.g. object).
    """
    header, data = _header(arrays)
    return [header] + [memoryview(a).cast("B") if a.size else b"" for a in data]


def decode_frames(frames: Sequence) -> dict[str, np.ndarray]:
    """Inverse of :func:`encode_frames`; arrays are read-only views of the frame buffers.

    Raises:
      FrameError: a malformed header, a disallowed dtype, a frame count or a byte count
        that does not match the header.
    """
    if not frames:
        raise FrameError("no frames")
    bufs = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
    fields = _parse_header(bufs[0])
    if len(bufs) - 1 != len(fields):
        raise FrameError(f"header names {len(fields)} fields but {len(bufs) - 1} data frames "
                         "follow")
    return {name: _array(name, dt, shape, buf)
            for (name, dt, shape), buf in zip(fields, bufs[1:])}


def encode_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """One buffer: ``b"RLFA" + uint32-LE header length + header + raw bytes of each field``."""
    header, data = _header(arrays)
    return b"".join([MAGIC, struct.pack("<I", len(header)), header] + [a.tobytes() for a in data])


def decode_bytes(buf: bytes | memoryview) -> dict[str, np.ndarray]:
    """Inverse of :func:`encode_bytes` (arrays are read-only views of ``buf``).

    Raises:
      FrameError: bad magic, a truncated buffer, trailing bytes, or a header problem.
    """
    view = memoryview(buf).cast("B")
    if len(view) < 8 or bytes(view[:4]) != MAGIC:
        raise FrameError(f"expected magic {MAGIC!r}, got {bytes(view[:4])!r}")
    (hlen,) = struct.unpack("<I", view[4:8])
    if 8 + hlen > len(view):
        raise FrameError(f"header of {hlen} bytes runs past the {len(view)}-byte buffer")
    fields = _parse_header(view[8:8 + hlen])
    out, pos = {}, 8 + hlen
    for name, dt, shape in fields:
        need = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if pos + need > len(view):
            raise FrameError(f"field {name!r}: buffer truncated ({len(view) - pos} of {need} "
                             "bytes)")
        out[name] = _array(name, dt, shape, view[pos:pos + need])
        pos += need
    if pos != len(view):
        raise FrameError(f"{len(view) - pos} trailing bytes after the last field")
    return out


def group_nbytes(group: Mapping[str, np.ndarray]) -> int:
    """Payload bytes of a record (sum of its arrays' ``nbytes``)."""
    return int(sum(np.asarray(a).nbytes for a in group.values()))


def synthetic_group(rng: np.random.Generator, *, group_size: int = 4, max_tokens: int = 16,
                    prompt_len: int = 8, version: int = 0, vocab: int = 512,
                    prompt_id: int = 0) -> dict[str, np.ndarray]:
    """A valid random group record (for tests and benchmarks; no model involved).

    Completion lengths are drawn in ``[1, max_tokens]``; padding follows the schema (token
    0, logprob 0, version -1); every real token carries ``version``.
    """
    G, T = group_size, max_tokens
    lengths = rng.integers(1, T + 1, size=G).astype(np.int32)
    real = np.arange(T)[None, :] < lengths[:, None]
    tokens = np.where(real, rng.integers(1, vocab, size=(G, T)), 0).astype(np.int32)
    logprobs = np.where(real, -rng.exponential(1.0, size=(G, T)), 0).astype(np.float32)
    return {
        "prompt_id": np.array(prompt_id, np.int64),
        "prompt_tokens": rng.integers(1, vocab, size=prompt_len).astype(np.int32),
        "completion_tokens": tokens,
        "completion_lengths": lengths,
        "behaviour_logprobs": logprobs,
        "policy_versions": np.where(real, version, -1).astype(np.int32),
        "rewards": rng.random(G).astype(np.float32),
        "truncated": lengths == T,
    }
