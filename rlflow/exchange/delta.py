"""Delta weight sync (``runtime.weight_sync = "delta"``): a version as the bits that changed.

Per published leaf (a parameter, or one shard of it on a multi-host learner, or a LoRA
adapter), the learner sends, to a subscriber that holds the previous version ``v - 1``, the
XOR of the two versions' raw bit patterns (bf16 / fp32 viewed as ``uint16`` / ``uint32``),
its bytes split into byte planes (the shuffle filter of blosc/HDF5: byte ``k`` of every
element, then byte ``k + 1``...) and compressed with Zstandard (``zstandard``), with the
xxh3-64 hash (``xxhash``) of the resulting full tensor's bytes. The subscriber XORs the
decompressed planes into its copy of ``v - 1`` and checks the hash; a mismatch (a corrupted
or misapplied delta) raises :class:`DeltaError` and the subscriber pulls the full version
instead (never a silently wrong tensor). Bit patterns, not differences of values: the
reconstruction is exact whatever the dtype (NaN payloads and signed zeros included).

Why it pays (the approach of verl / slime / SkyRL's delta sync): an optimizer step at an RL
learning rate moves each weight by far less than its magnitude, so the sign, the exponent and
the high mantissa bits rarely change and the XOR is mostly zero bytes. How much depends on
the published dtype (measured on 4M Gaussian weights of scale 0.02, one Adam-sized step of
1e-6, zstd; ``benchmarks/weight_sync_delta.py`` measures real optimizer steps):

* bf16 (7 mantissa bits): ~2.5% of the elements change at all; the delta is ~3% of the bytes;
* float32 (23 mantissa bits): every element's low ~10 mantissa bits change; the delta is
  ~42% of the bytes with the byte-plane shuffle (~54% without: the shuffle is kept).

So a float32 learner that publishes its master weights saves about half; the ~10x saving
needs the published weights in the sampler's bf16, which is what the learner publishes
beside a bf16 sampler (``ExperimentConfig.published_dtype``): 4.4% of a bf16 version per
step at ``configs/gsm8k.py``'s lr and dtype (``RESULT delta_bytes_over_full_gsm8k_config``).

The learner makes each version's delta on a background thread, off the train step's
(:mod:`rlflow.exchange.delta_worker`); the leaves are encoded and decoded on a thread per
core. A relay forwards a delta's bytes
as soon as they have landed, before it decodes them itself (each replica checks its own
rebuilt tensors, so a corrupt delta is never applied, wherever it came from).

Where the work runs (the trade-off): the XOR, the shuffle, the codec and the hash run on the
*host*, on numpy views of the arrays (``np.asarray``: zero-copy on CPU, one device -> host
copy on an accelerator), and the learner and every subscriber keep a host copy of the last
version they hold. No maintained compressor runs on a TPU (nvCOMP exists for GPUs only), so
the compressed bytes must be made on the host anyway; on an accelerator the extra cost per
version is one device -> host copy of the model on the learner and one host -> device copy
on each subscriber, over PCIe / the host link (tens of GB/s), against a network link
(~12 GB/s at 100 Gbit/s) that then carries ~3-50% of the bytes. The full path
(``jax.experimental.transfer``) stays array-native and untouched: a full version never
visits the host. The compressed delta travels as one ``uint8`` array per leaf through that
same transfer server and relay tree (a relay forwards the delta bytes it pulled, unchanged).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import numpy as np
import xxhash
import zstandard

from rlflow.exchange import layout as layout_lib

CODEC = "zstd-byteplanes"
LEVEL = 1        # zstd level: 3 made no smaller deltas (4M float32 / bf16 weights, one step)


PARALLEL_MIN_BYTES = 4 << 20   # below this a version is coded on the calling thread


def _each(fn: Callable, *args: Sequence, nbytes: int) -> list:
    """``[fn(*a) for a in zip(*args)]`` over a thread per core (the leaves are independent;
    zstd, xxhash and numpy's large-array loops release the GIL), or on the calling thread
    for a version of fewer than ``PARALLEL_MIN_BYTES`` (``nbytes``): starting the threads
    cost more than coding a small model (configs/demo.py's 150 KB: ~27 -> ~9 ms a version
    on the 2-core host). The threads end with each call (no idle thread outlives it, so
    none keeps a finished program from exiting)."""
    workers = min(len(args[0]), os.cpu_count() or 1)
    if workers <= 1 or nbytes < PARALLEL_MIN_BYTES:
        return [fn(*a) for a in zip(*args)]
    with ThreadPoolExecutor(workers, thread_name_prefix="rlflow-delta") as pool:
        return list(pool.map(fn, *args))


class DeltaError(ValueError):
    """A delta cannot be applied: it is corrupt (hash or codec error), it was made against
    a version the subscriber does not hold, or its leaves do not match (names the leaf)."""


def bit_view(a: np.ndarray) -> np.ndarray:
    """``a`` (any shape, dtype of 1, 2, 4 or 8 bytes) viewed, flat, as unsigned integers of
    the same width (``bfloat16`` -> ``uint16``, ``float32`` -> ``uint32``); no copy when
    ``a`` is C-contiguous.

    Raises: ValueError: an itemsize other than 1, 2, 4 or 8."""
    a = np.ascontiguousarray(a)
    if a.dtype.itemsize not in (1, 2, 4, 8):
        raise ValueError(f"cannot take the bits of dtype {a.dtype} (itemsize "
                         f"{a.dtype.itemsize}; expected 1, 2, 4 or 8 bytes)")
    return a.reshape(-1).view(np.dtype(f"uint{8 * a.dtype.itemsize}"))


def checksum(a: np.ndarray) -> int:
    """xxh3-64 of ``a``'s C-order bytes (an unsigned 64-bit int)."""
    return xxhash.xxh3_64_intdigest(memoryview(bit_view(a)).cast("B"))  # bf16: no buffer


def encode(prev: np.ndarray, new: np.ndarray, level: int = LEVEL) -> bytes:
    """The compressed delta from ``prev`` to ``new`` (same shape and dtype): zstd of the
    byte planes of ``bit_view(prev) ^ bit_view(new)`` (module docstring).

    Raises: ValueError: shapes or dtypes differ."""
    if prev.shape != new.shape or prev.dtype != new.dtype:
        raise ValueError(f"a delta needs one shape and dtype: {prev.dtype}{list(prev.shape)} "
                         f"-> {new.dtype}{list(new.shape)}")
    x = bit_view(prev) ^ bit_view(new)
    planes = x.view(np.uint8).reshape(-1, x.dtype.itemsize).T     # [itemsize, elements]
    return zstandard.ZstdCompressor(level=level).compress(np.ascontiguousarray(planes).data)


def decode(prev: np.ndarray, payload) -> np.ndarray:
    """``new`` from ``prev`` and :func:`encode`'s bytes (a fresh array, ``prev``'s shape and
    dtype).

    Raises: DeltaError: the payload is not a zstd frame of ``prev.nbytes`` bytes."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(memoryview(payload),
                                                      max_output_size=prev.nbytes)
    except zstandard.ZstdError as e:
        raise DeltaError(f"cannot decompress the delta: {e}") from None
    if len(raw) != prev.nbytes:
        raise DeltaError(f"the delta holds {len(raw)} bytes, the tensor {prev.nbytes}")
    size = prev.dtype.itemsize
    x = np.frombuffer(raw, np.uint8).reshape(size, -1).T.copy().view(bit_view(prev).dtype)
    return (bit_view(prev) ^ x.reshape(-1)).view(prev.dtype).reshape(prev.shape)


@dataclass(frozen=True)
class Delta:
    """One version as deltas: ``payloads[i]`` (bytes) turns leaf ``i`` of version ``base``
    into that of ``version``, whose xxh3-64 is ``checksums[i]``."""
    version: int
    base: int
    payloads: list
    checksums: list

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


class DeltaEncoder:
    """Learner side: remembers the last published version's leaves (host arrays) and makes
    each new version's :class:`Delta` against it.

    Args:
      full_every: every ``full_every``-th version (counting from the first) is sent whole,
        without a delta, which bounds the chain of deltas a subscriber applies (>= 1; 1:
        never a delta).
      level: zstd level.

    Raises: ValueError: ``full_every < 1``.
    """

    def __init__(self, full_every: int, level: int = LEVEL):
        if full_every < 1:
            raise ValueError(f"delta_full_every must be >= 1, got {full_every}")
        self.full_every, self.level = full_every, level
        self._prev: tuple[int, list] | None = None
        self._count = 0

    def keyframe(self, index: int) -> bool:
        """Whether the ``index``-th version given to :meth:`update` (from 0) goes whole."""
        return index % self.full_every == 0

    def update(self, version: int, leaves: Sequence[np.ndarray]) -> Delta | None:
        """Remember ``leaves`` as ``version``; return its delta against the previous version,
        or None when this version goes whole (the first, every ``full_every``-th, or a leaf
        whose shape or dtype changed)."""
        leaves = [np.asarray(x) for x in leaves]
        prev, self._prev = self._prev, (version, leaves)
        keyframe = self.keyframe(self._count)
        self._count += 1
        if prev is None or keyframe or len(prev[1]) != len(leaves) or any(
                (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(prev[1], leaves)):
            return None
        nbytes = sum(x.nbytes for x in leaves)
        return Delta(version, prev[0],
                     _each(lambda a, b: encode(a, b, self.level), prev[1], leaves,
                           nbytes=nbytes),
                     _each(checksum, leaves, nbytes=nbytes))


class DeltaDecoder:
    """Subscriber side: the host copy of the version it holds, and deltas applied to it."""

    def __init__(self):
        self.version = -1
        self._leaves: list | None = None

    def hold(self, version: int, leaves: Sequence[np.ndarray]) -> None:
        """Remember ``leaves`` (host arrays, publisher's leaf order) as ``version``."""
        self.version, self._leaves = version, [np.asarray(x) for x in leaves]

    def drop(self) -> None:
        """Forget the held version (the next pull is a full one)."""
        self.version, self._leaves = -1, None

    def apply(self, version: int, base: int, payloads: Sequence, checksums: Sequence[int],
              names: Sequence[str] = ()) -> list[np.ndarray]:
        """The leaves of ``version`` from the held ``base`` and one delta per leaf; they
        become the held version.

        Raises: DeltaError: ``base`` is not the held version, the leaf count differs, or a
          leaf fails to decompress or its hash differs from ``checksums`` (names the leaf;
          the held version is kept).
        """
        if self._leaves is None or base != self.version:
            raise DeltaError(f"a delta {base} -> {version} needs version {base}; this "
                             f"subscriber holds {self.version}")
        if len(payloads) != len(self._leaves) or len(checksums) != len(self._leaves):
            raise DeltaError(f"a delta of {len(payloads)} leaves ({len(checksums)} hashes) for "
                             f"a version of {len(self._leaves)}")
        def one(i, prev, payload, want):
            name = names[i] if i < len(names) else f"leaf {i}"
            try:
                new = decode(prev, payload)
            except DeltaError as e:
                raise DeltaError(f"{name}, delta {base} -> {version}: {e}") from None
            got = checksum(new)
            if got != int(want):
                raise DeltaError(f"{name}, delta {base} -> {version}: the rebuilt tensor's "
                                 f"xxh3-64 {got} is not the learner's {int(want)}")
            return new

        out = _each(one, range(len(payloads)), self._leaves, payloads, checksums,
                    nbytes=sum(x.nbytes for x in self._leaves))
        self.hold(version, out)
        return out


# ----------------------------------------------------------------- as transfer offers


def payload_arrays(d: Delta, device) -> list:
    """The delta's payloads as ``uint8 [bytes]`` arrays on ``device``: what the transfer
    server serves (and relays forward) in place of the version's leaves."""
    return [jax.device_put(np.frombuffer(p, np.uint8), device) for p in d.payloads]


def offer_fields(d: Delta, delta_layout: dict, full_layout: dict) -> dict:
    """The offer fields of a delta: ``layout`` (of :func:`payload_arrays`, what a puller
    pulls), ``nbytes`` (their bytes) and ``delta``: ``base``, per-leaf ``checksums``,
    ``codec`` and the full version's ``layout`` (shapes, dtypes, shardings)."""
    return {"layout": delta_layout, "nbytes": d.nbytes,
            "delta": {"base": d.base, "checksums": d.checksums, "codec": CODEC,
                      "layout": full_layout}}


def apply_offer(decoder: DeltaDecoder, offer: dict, arrays: Sequence, target, devices):
    """The version a pulled delta offer makes from ``decoder``'s held one, placed on
    ``target``'s shardings in its structure (``target=None``: ``{path: array}`` on the
    publisher's layout rebuilt on ``devices``); the decoder then holds it.

    Raises:
      DeltaError: another codec, or the delta does not rebuild the learner's tensors (base,
        codec or hash; the held version is kept).
      layout.LayoutError: ``target`` does not match the published leaves.
    """
    meta = offer["delta"]
    if meta.get("codec") != CODEC:
        raise DeltaError(f"delta codec {meta.get('codec')!r}, this subscriber reads {CODEC!r}")
    leaves = meta["layout"]["leaves"]
    if target is None:
        shardings = [a.sharding for a in layout_lib.pull_avals(meta["layout"], devices)]
    else:
        shardings, treedef = layout_lib.target_shardings(target, leaves)
    host = decoder.apply(offer["version"], int(meta["base"]), [np.asarray(a) for a in arrays],
                         meta["checksums"], [leaf["path"] for leaf in leaves])
    placed = jax.device_put(host, shardings)
    out = ({leaf["path"]: a for leaf, a in zip(leaves, placed)} if target is None
           else jax.tree_util.tree_unflatten(treedef, placed))
    jax.block_until_ready(out)
    return out
