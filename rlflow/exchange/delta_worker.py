"""The learner's delta encoding off the train step's thread (``runtime.weight_sync="delta"``).

:meth:`rlflow.exchange.transfer.WeightPublisher.publish` runs on the learner's thread
between two train steps. Making a version's delta (:class:`rlflow.exchange.delta.
DeltaEncoder`: a device -> host copy of every leaf on an accelerator, the XOR, the byte
planes, zstd and the xxh3 hash) took that thread a median 30-54 ms per version of the GSM8K
model (17.8 MB float32 or 8.9 MB bf16) on this 2-core host, and it grows with the model (14
GB of a 7B bf16 model at the measured 675 MB/s one-core codec rate: ~20 s).
:class:`DeltaWorker` makes the deltas on one background thread instead, in publish order;
``publish`` returns once the version is handed over: a median 1.7-2.7 ms (float32) /
2.7-4.4 ms (bf16) with delta sync against 1.5-2.7 ms with full sync, two runs of
``benchmarks/weight_sync_delta.py`` (``replicas_1_*_publish_call_ms``).

Ordering and exactness:

* One worker thread and at most one version waiting for it: a version published while
  another waits replaces it (the replaced one is never coded and is no delta's base). Each
  delta is made against the version the encoder took before it (the base its offer names),
  in publish order.
* A delta is offered only for the version it was made for (:meth:`DeltaWorker.ready`
  checks the version and the base), with the xxh3 hashes of that version's tensors, so a
  subscriber can never apply a stale or mismatched delta without the hash check catching it.
* While the newest version's delta is being made, a subscriber that holds its base is told
  to wait (:meth:`DeltaWorker.pending`; the offer says ``"pending"`` and the subscriber asks
  again within its poll), never offered the whole version it would otherwise pull: the
  bytes saved are the point. Everyone else is offered the whole version at once.
* An error in the worker is logged, the version goes without a delta (subscribers pull it
  whole), and the next ``submit`` raises it on the learner's thread (never a silent loss).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from rlflow.exchange import delta as delta_lib
from rlflow.exchange import layout as layout_lib

log = logging.getLogger(__name__)


class DeltaWorker:
    """Makes each published version's delta on one background thread (module docstring).

    Args:
      full_every: ``runtime.delta_full_every`` (:class:`rlflow.exchange.delta.DeltaEncoder`).
      device: where the delta's ``uint8`` payload arrays are placed (the publisher's first
        local device).

    Attributes:
      thread_name: the prefix of its thread's name.
      last_nbytes: compressed bytes of the last delta made (0: none yet).
      last_encode_s: seconds the worker spent on the last version (host copy + codec).
    """

    def __init__(self, full_every: int, device):
        self._encoder = delta_lib.DeltaEncoder(full_every)
        self._device = device
        self.thread_name = f"rlflow-delta-encode-{id(self):x}"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.thread_name)
        self._cond = threading.Condition()
        self._newest = -1                 # the newest submitted version
        self._queued = None               # (version, paths, leaves) not taken yet
        self._busy = False                # a version is being coded
        self._last_taken = -1             # the version the encoder holds (or is taking)
        self._taken = 0                   # versions given to the encoder (its count)
        self._pending: tuple[int, int] | None = None   # (version, base) being made
        self._ready = None                # (version, Delta, payload arrays, their layout)
        self._error: BaseException | None = None
        self.last_nbytes = 0
        self.last_encode_s = 0.0

    def submit(self, version: int, paths: Sequence[str], leaves: Sequence) -> None:
        """Hand over ``version`` (its flattened ``paths`` and ``leaves``: ``jax.Array`` the
        caller never writes or donates afterwards); returns at once. A version handed over
        earlier and not started yet is dropped (never coded, never a base: at most one
        version waits, so a slow codec never piles up versions in device memory).

        Raises: RuntimeError: the worker failed on an earlier version (chained to its error).
        """
        with self._cond:
            if self._error is not None:
                err, self._error = self._error, None
                raise RuntimeError(f"making a weight delta failed: {err}") from err
            base = self._last_taken       # what the encoder will hold before this version
            due = base >= 0 and not self._encoder.keyframe(self._taken)
            self._pending = (version, base) if due else None    # (a keyframe goes whole)
            self._queued = (version, list(paths), list(leaves))
            self._newest, self._ready = version, None
        self._pool.submit(self._make)

    def _make(self) -> None:
        with self._cond:
            if self._queued is None:      # an earlier task took the newest version
                return
            (version, paths, leaves), self._queued = self._queued, None
            self._last_taken, self._busy = version, True
            self._taken += 1
        t0 = time.perf_counter()
        try:
            d = self._encoder.update(version, [np.asarray(x) for x in leaves])
            made = None
            if d is not None:
                arrays = delta_lib.payload_arrays(d, self._device)
                made = (version, d, arrays, layout_lib.describe(paths, arrays))
            with self._cond:
                if made is not None and version == self._newest:
                    self._ready = made
                if d is not None:
                    self.last_nbytes = d.nbytes
                self.last_encode_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - raised by the next submit
            log.exception("weights: making the delta of version %d failed", version)
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                if self._pending is not None and self._pending[0] == version:
                    self._pending = None
                self._busy = False
                self._cond.notify_all()

    def pending(self, version: int, base: int) -> bool:
        """Whether ``version``'s delta from ``base`` is still being made (a subscriber
        holding ``base`` should ask again shortly)."""
        with self._cond:
            return self._pending == (version, base)

    def ready(self, version: int, base: int):
        """``(Delta, payload arrays, their layout)`` of ``version`` from ``base``, or None
        (none made: a version that goes whole, another base, or not ready)."""
        with self._cond:
            r = self._ready
            if r is None or r[0] != version or r[1].base != base:
                return None
            return r[1:]

    def expected(self, version: int) -> bool:
        """Whether ``version`` has a delta (from the version published before it), made or
        being made."""
        with self._cond:
            return (self._ready is not None and self._ready[0] == version) or (
                self._pending is not None and self._pending[0] == version)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every version handed over is coded (tests, benchmarks); False on
        timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued is None and not self._busy,
                                       timeout_s)

    def close(self) -> None:
        """Finish the version in hand and stop the thread."""
        self._pool.shutdown(wait=True)
