"""Weight transfer learner -> sampler with ``jax.experimental.transfer``.

:class:`WeightPublisher` (learner) runs a ``TransferServer`` and holds the newest published
version; the :class:`~rlflow.exchange.coordinator.Coordinator` hands each sampler an offer
``(address, uuid, version, layout)`` and registers one ``await_pull`` per offer.
:class:`WeightSubscriber` (sampler, :mod:`rlflow.exchange.subscriber`) asks for offers, pulls
in the learner's shard layout (``pull`` must match the source layout), waits for the arrays
under a watchdog, re-lays them onto its own shardings (``jax.device_put``) and returns them
for the swap. Both start their server and raise their errors from
:mod:`rlflow.exchange.transfer_server`.

Facts this code relies on (jax 0.10, checked on CPU across two processes on 127.0.0.1):

* ``TransferServer.await_pull(uuid, arrays, timeout)`` returns at once; the server keeps the
  arrays until that uuid is pulled once or the (absolute) timeout passes.
* ``TransferConnection.pull`` returns at once with arrays that become ready when the bytes
  arrive. A pull of a uuid nobody registered never becomes ready and its own ``timeout``
  does not fire, hence the watchdog here: poll ``is_ready()`` up to ``timeout_s``, then
  raise :class:`WeightTransferTimeout`, drop the connection and retry with a fresh offer
  (a new uuid).
* A pull with a different shard layout fails with an error (no silent reshuffle).
* Each server opens ``transports`` bulk-transport sockets. A connection from a server with
  *fewer* transports than the server it pulls from aborts the pulling process (a failed
  ``CHECK`` in ``socket_bulk_transport.cc``: ``bind ... Bad file descriptor``), whatever the
  device counts; equal or more is fine. So the publisher advertises its count in every
  offer and the subscriber's own server is started (or restarted) with at least that many
  (:func:`rlflow.exchange.transfer_server.start_server`). Device counts only matter for the layout (``layout.pull_avals``).

Speed (``benchmarks/weight_transfer.py``: 2-core CPU host, loopback; it also measures a
raw-socket send of the same bytes and the CPU time of both processes). Where the time goes
(per-thread CPU from ``/proc/<pid>/task/*/schedstat`` and ``perf``, 50 MB in 16 shards):

* learner: with a donating train step, the publish copy (one memcpy); then, per buffer, a
  copy into the server's staging slots (``CopyRawToHost``, gone with raw buffer aliases)
  and the ``send-thread``'s ``MSG_ZEROCOPY`` send (on loopback the kernel copies the pages
  anyway);
* sampler: each ``recv-thread`` receives into a staging slab (the kernel copy) and then
  memcpys into the new array (``TransferRawDataToSubBuffer``), page-faulting the fresh
  pages of the new version (~4k faults per 50 MB, ~10k per 200 MB).

A raw socket does only the two kernel copies; the transfer does two to three memcpys more
and the faults: ~3x the raw socket's CPU time per byte. On a host with few cores the
copies of both processes share the cores, so that CPU time, not the link, bounds the
latency. Kept: the server sends through raw buffer aliases (``use_raw_buffers``: no
staging copy on the learner), which is safe only for arrays nothing donates, deletes or
writes under a pending pull: the learner's own params when its step keeps them
(``Learner(keep_params=True)``, ``donated=False`` here: no publish copy at all; 50 MB, three
runs: learner CPU per version 18-31 -> 9-15 ms, publish -> swap 22-39 -> 20-26 ms), else a
publish copy that is the publisher's alone (``donated=True``; ``publish`` does not wait for
it: the server sends each buffer once its copy is ready, so the pull overlaps the copy).
Each leaf is re-laid onto the target as soon as it has landed, so only the last leaf's
re-layout remains after the transfer. Measured and dropped (CPU time per
pull, loaded host, this and earlier sessions): one flat buffer for all leaves (shards
> 32 MB are fresh mmaps, page-faulted on every pull), ``transfer_size`` 1/4/16 MB (more
sender CPU), ``max_num_parallel_copies`` 2/16, 1 or 4 transports instead of one per
device, ``supports_pinned_allocator`` (``TCP_ZEROCOPY_RECEIVE``: no CPU saved on
loopback), several concurrent pulls of disjoint leaf groups (same copies, same CPU), and
glibc malloc thresholds (``mallopt``: 5x fewer page faults at 200 MB, CPU within noise).
Figures: ``benchmarks/README.md``.

Delta sync (``weight_sync="delta"``, :mod:`rlflow.exchange.delta`): the publisher also
makes each version's compressed XOR against the previous one on a background thread, off the
learner's (:mod:`rlflow.exchange.delta_worker`), as one ``uint8`` array per leaf on its first
device, and offers it (``"delta"`` in the offer: base version, per-leaf hashes,
the full layout; ``"layout"`` is then the delta arrays') to a subscriber that asks holding
exactly the base; anyone else, or a subscriber that asks ``full`` (it holds no base, or its
last delta failed the hash check), is offered the full version. While the newest delta is still being made, a subscriber that holds its base
is answered ``"pending"`` and asks again (:meth:`WeightSubscriber.poll`). The delta arrays
travel and relay like any version.

Versions never go backwards: the publisher refuses a version <= the last one; the subscriber
ignores offers <= the version it has. The transfer server has no authentication of its own:
its uuids are random 63-bit numbers handed out only by the (token-guarded) coordinator, and
off loopback it belongs on a private network.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading

import jax

from rlflow.exchange import delta as delta_lib
from rlflow.exchange import layout as layout_lib
from rlflow.exchange.delta_worker import DeltaWorker
from rlflow.exchange.subscriber import WeightSubscriber
from rlflow.exchange.transfer_server import (WeightPullCancelled, WeightTransferError,
                                             WeightTransferTimeout, start_server)
from rlflow.system.ports import advertised_host

log = logging.getLogger(__name__)

# the subscriber and the errors stay importable from here (their home until the split)
__all__ = ["WeightPublisher", "WeightSubscriber", "WeightTransferError",
           "WeightTransferTimeout", "WeightPullCancelled"]


@jax.jit
def _copy_on_devices(leaves: list) -> list:
    return [jax.numpy.copy(x) for x in leaves]


def _copy_leaves(leaves: list) -> list:
    """Fresh device copies of ``leaves`` (``jax.Array``), each in its own sharding: one
    compiled call per set of devices the leaves live on (a jitted function never returns a
    buffer aliased to an argument it was not donated). ``jax.device_put(...,
    may_alias=False)`` makes the same copies through a Python loop over the leaves: ~1 ms
    more host time per publish of a 50-leaf model, on the learner's critical path
    (benchmarks/async_vs_sync.py)."""
    groups: dict[frozenset, list[int]] = {}
    out = list(leaves)
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
        else:                                   # a host array: placed on the default device
            out[i] = jax.device_put(x)
    for idx in groups.values():
        for i, y in zip(idx, _copy_on_devices([leaves[i] for i in idx])):
            out[i] = y
    return out


class WeightPublisher:
    """Learner side: publishes versions of a params pytree for samplers to pull.

    Args:
      bind_address: host the transfer server binds (127.0.0.1 default).
      advertise_host: host samplers connect to (default: ``bind_address``, or this host's
        address when bound to all interfaces).
      pull_timeout_s: seconds an offer's ``await_pull`` keeps its arrays for the pull.
      donated: the caller's train step donates the published arrays' buffers (writes the
        next version into them), so ``publish`` makes a device copy, this publisher's alone.
        False: the caller never donates, deletes or writes them (a step that keeps its params,
        ``Learner(keep_params=True)``), so they are published as they are, with no copy.
        Either way the server sends them through raw buffer aliases (``use_raw_buffers``:
        no staging copy), which is safe only because nothing writes or frees them while a
        pull is pending.
      layout: "native" (the learner's shardings; the sampler needs as many devices) or
        "single_device" (gathered onto the first local device: any sampler can pull).
      transports: bulk-transport sockets of the server (default: one per local device);
        advertised in every offer so that subscribers match it.
      weight_sync: "full" (every pull moves the whole version) or "delta" (a subscriber
        holding the previous version pulls the compressed XOR, module docstring).
      delta_full_every: with "delta", every this many-th version has no delta (bounds the
        chain; ``runtime.delta_full_every``).

    Attributes:
      sync: counts of offers: ``delta_offers``, ``full_offers``, ``full_fallbacks``
        (full offers, while a delta existed, to a subscriber holding another version or
        asking ``full`` after a failed delta) and ``pending_answers`` (asks told to wait
        for the delta being made).
      delta_nbytes: compressed bytes of the last delta made (0: none).
      delta_encode_s: seconds the background thread spent on the last version.
    """

    def __init__(self, *, bind_address: str = "127.0.0.1", advertise_host: str | None = None,
                 pull_timeout_s: float = 120.0, donated: bool = True, layout: str = "native",
                 transports: int | None = None, weight_sync: str = "full",
                 delta_full_every: int = 10):
        if layout not in ("native", "single_device"):
            raise ValueError(f"layout must be 'native' or 'single_device', got {layout!r}")
        if weight_sync not in ("full", "delta"):
            raise ValueError(f"weight_sync must be 'full' or 'delta', got {weight_sync!r}")
        self.weight_sync = weight_sync
        self.pull_timeout_s, self.donated, self.layout = pull_timeout_s, donated, layout
        self._devices = jax.local_devices()
        self._deltas = (DeltaWorker(delta_full_every, self._devices[0])
                        if weight_sync == "delta" else None)
        self.sync = dict(delta_offers=0, full_offers=0, full_fallbacks=0, pending_answers=0)
        self._server, self.transports = start_server(bind_address, transports,
                                                      raw_buffers=True)
        port = self._server.address().rsplit(":", 1)[1]
        if advertise_host is None:
            advertise_host = advertised_host(bind_address)
        self.address = f"{advertise_host}:{port}"
        self._lock = threading.Lock()
        self._current: tuple[int, list, dict] | None = None
        self.version = -1
        self.offers = 0
        self.nbytes = 0             # bytes of the newest version (one pull sends them)
        self.layout_desc: dict | None = None

    @property
    def delta_nbytes(self) -> int:
        return 0 if self._deltas is None else self._deltas.last_nbytes

    @property
    def delta_encode_s(self) -> float:
        return 0.0 if self._deltas is None else self._deltas.last_encode_s

    def wait_delta(self, timeout_s: float | None = None) -> bool:
        """Block until the newest version's delta is made (benchmarks); False on timeout."""
        return True if self._deltas is None else self._deltas.wait(timeout_s)

    def close(self) -> None:
        """Stop the delta thread (after the version in hand)."""
        if self._deltas is not None:
            self._deltas.close()

    def publish(self, version: int, params) -> None:
        """Make ``params`` (pytree of ``jax.Array``) the newest version. With delta sync its
        delta is made on the background thread (:class:`DeltaWorker`); this returns first.

        Raises:
          ValueError: ``version`` is not greater than the last published one.
          layout.LayoutError: a leaf cannot be described (see ``layout.describe``).
          RuntimeError: making an earlier version's delta failed.
        """
        if version <= self.version:
            raise ValueError(f"weight versions never go backwards: publishing {version} after "
                             f"{self.version}")
        paths, leaves, _ = layout_lib.flatten(params)
        if self.layout == "single_device":
            dst = [jax.sharding.SingleDeviceSharding(self._devices[0])] * len(leaves)
            leaves = jax.device_put(leaves, dst, may_alias=not self.donated)
        elif self.donated:
            leaves = _copy_leaves(leaves)
        desc = layout_lib.describe(paths, leaves)
        if self._deltas is not None:      # marks the delta pending before the version shows
            self._deltas.submit(version, paths, leaves)
        with self._lock:
            self._current = (version, leaves, desc)
            self.version = version
            self.nbytes = int(sum(x.nbytes for x in leaves))
            self.layout_desc = desc

    def _delta(self, base: int):
        """``(Delta, arrays, fields)`` of the newest version from ``base``, or None."""
        got = None if self._deltas is None else self._deltas.ready(self.version, base)
        if got is None:
            return None
        d, arrays, dl = got
        return d, arrays, delta_lib.offer_fields(d, dl, self.layout_desc)

    def delta_fields(self, base: int) -> dict | None:
        """The offer fields (``layout``, ``nbytes``, ``delta``) of the newest version's delta
        from ``base``, or None when it has none from there (for relays' offers)."""
        with self._lock:
            got = self._delta(base)
            return None if got is None else got[2]

    def offer(self, consumer: str, have_version: int, full: bool = False) -> dict:
        """Register one pull of the newest version for ``consumer`` (called by the
        coordinator's thread): its delta when ``consumer`` holds the delta's base and does not
        ask ``full``, else the whole version. Returns ``{"version": v}`` when ``have_version``
        is current."""
        with self._lock:
            if self._current is None or self._current[0] <= have_version:
                return {"version": self.version}
            version, leaves, desc = self._current
            if not full and self._deltas is not None and \
                    self._deltas.pending(version, have_version):
                self.sync["pending_answers"] += 1
                return {"version": version, "pending": True}
            got = None if full else self._delta(have_version)
            uuid = secrets.randbits(63)
            deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.pull_timeout_s)
            if got is not None:
                self._server.await_pull(uuid, got[1], timeout=deadline)
                self.sync["delta_offers"] += 1
                fields = got[2]
            else:
                self._server.await_pull(uuid, leaves, timeout=deadline)
                self.sync["full_offers"] += 1
                if (full or have_version >= 0) and self._deltas is not None and \
                        self._deltas.expected(version):
                    self.sync["full_fallbacks"] += 1
                fields = {"layout": desc, "nbytes": self.nbytes}
            self.offers += 1
        log.info("weights: offered version %d to %s (uuid %d%s)", version, consumer, uuid,
                 ", delta" if "delta" in fields else "")
        return {"version": version, "address": self.address, "uuid": uuid,
                "transports": self.transports, **fields}
