"""Weight transfer learner -> sampler with ``jax.experimental.transfer``.

:class:`WeightPublisher` (learner) runs a ``TransferServer`` and holds the newest published
version; the :class:`~rlflow.exchange.coordinator.Coordinator` hands each sampler an offer
``(address, uuid, version, layout)`` and registers one ``await_pull`` per offer.
:class:`WeightSubscriber` (sampler) asks for offers, pulls in the learner's shard layout
(``pull`` must match the source layout), waits for the arrays under a watchdog, re-lays them
onto its own shardings (``jax.device_put``) and returns them for the swap.

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
  (:func:`_start_server`). Device counts only matter for the layout (``layout.pull_avals``).

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
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import transfer as jax_transfer

from rlflow.exchange import delta as delta_lib
from rlflow.exchange import layout as layout_lib
from rlflow.exchange.delta_worker import DeltaWorker
from rlflow.exchange.coordinator import CoordinatorClient
from rlflow.runtime.ports import advertised_host

log = logging.getLogger(__name__)


class WeightTransferError(RuntimeError):
    """A weight pull failed after all retries (the message names version, uuid, address)."""


class WeightTransferTimeout(WeightTransferError, TimeoutError):
    """One pull did not complete within the watchdog's timeout."""


class WeightPullCancelled(WeightTransferError):
    """:meth:`WeightSubscriber.cancel` was called (the process is shutting down): the pull
    in progress, or the one asked for, was abandoned. Never retried."""


def _start_server(bind_address: str, transports: int | None = None, *,
                  raw_buffers: bool = False):
    """A transfer server with ``transports`` bulk-transport sockets (default: one per local
    device). A puller needs at least as many as the server it pulls from (module doc).
    ``raw_buffers``: serve ``await_pull`` arrays through raw aliases of their buffers (one
    host copy fewer per byte sent, module doc); only for arrays nothing else can delete or
    donate while a pull is pending."""
    host = bind_address if ":" not in bind_address else f"[{bind_address.strip('[]')}]"
    devices = jax.local_devices()
    n = len(devices) if transports is None else transports
    if n < 1:
        raise ValueError(f"a transfer server needs >= 1 transports, got {n}")
    return jax_transfer.start_transfer_server(devices[0].client, f"{host}:0",
                                              [f"{host}:0"] * n,
                                              use_raw_buffers=raw_buffers), n


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
        self._server, self.transports = _start_server(bind_address, transports,
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


class WeightSubscriber:
    """Sampler side: polls the coordinator, pulls new versions, re-lays them.

    Args:
      coordinator_address: ``tcp://host:port`` of the learner's coordinator.
      consumer_id: this sampler host's name.
      token: the shared secret.
      target: pytree with the publisher's structure whose leaves are arrays,
        ``ShapeDtypeStruct`` with shardings, or ``Sharding`` objects: where the new weights
        go. None: return ``{path: array}`` in the publisher's layout.
      timeout_s: watchdog seconds for one pull.
      retries: extra attempts (each with a fresh offer/uuid) after a failed pull.
      bind_address: host of this process's own transfer server (used to connect).
      devices: local devices to pull onto (default ``jax.local_devices()``).
      relay_fanout: after each pull, serve the pulled version to this many other
        replicas (``rlflow.exchange.relay``); 0: no relaying.
      relay_timeout_s: seconds the relay keeps a version for its children's pulls.
      weight_sync: "delta": keep a host copy of the version held and apply the learner's
        deltas to it (module docstring); a delta that fails its hash is counted
        (``metrics["delta_rejected"]``) and replaced by a full pull. "full": always pull
        whole versions.
    """

    def __init__(self, coordinator_address: str, *, consumer_id: str, token: str = "",
                 target=None, timeout_s: float = 120.0, retries: int = 2,
                 bind_address: str = "127.0.0.1", devices: Sequence[jax.Device] | None = None,
                 request_timeout_s: float = 30.0, relay_fanout: int = 0,
                 relay_timeout_s: float = 120.0, weight_sync: str = "full"):
        if weight_sync not in ("full", "delta"):
            raise ValueError(f"weight_sync must be 'full' or 'delta', got {weight_sync!r}")
        self._decoder = delta_lib.DeltaDecoder() if weight_sync == "delta" else None
        self.target, self.timeout_s, self.retries = target, timeout_s, retries
        self.relay_fanout, self.relay_timeout_s = relay_fanout, relay_timeout_s
        self._devices = list(jax.local_devices() if devices is None else devices)
        self._bind_address = bind_address
        self._advertise = advertised_host(bind_address)
        self._server, self.transports = None, 0  # started at the first pull (_connect)
        self._coord = CoordinatorClient(coordinator_address, consumer_id=consumer_id,
                                        token=token, timeout_s=request_timeout_s)
        self._connections: dict[str, Any] = {}
        self.version = -1
        self.metrics = dict(pulls=0, failed_pulls=0, timeouts=0, bytes=0, last_pull_s=0.0,
                            last_relayout_s=0.0, delta_pulls=0, full_pulls=0, delta_rejected=0)
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Abandon the pull in progress and refuse later ones (shutdown; thread-safe).

        The thread waiting in :meth:`poll` or :meth:`pull` raises
        :class:`WeightPullCancelled` within one watchdog pause (<= 2 ms) instead of waiting
        up to ``timeout_s`` for a learner that may be gone (or, asking the coordinator,
        ``wire.RequestCancelled`` within ``wire.CANCEL_POLL_S``): a process must not
        finalise while a Python thread still calls into jaxlib (CPython ends such a daemon
        thread with ``pthread_exit``, which aborts the process when it unwinds C++ frames:
        "FATAL: exception not rethrown").
        """
        self._cancelled.set()
        self._coord.cancel()

    def poll(self) -> tuple[int, Any] | None:
        """Fetch the newest version if the learner has one newer than ``self.version``.

        Returns:
          ``(version, params)`` laid out on ``target``'s shardings, or None when current.

        Raises:
          WeightTransferError: every attempt (1 + ``retries``) failed; chained to the last
            error (a :class:`WeightTransferTimeout` or the runtime's error).
          layout.LayoutError: this process has fewer devices than the published layout
            uses (set ``runtime.transfer_layout="single_device"``), or ``target`` does not
            match the published leaves.
          wire.PeerTimeoutError / wire.PeerRefusedError: from the coordinator.
          WeightPullCancelled: :meth:`cancel` was called.
        """
        last: BaseException | None = None
        failed = None
        # a delta needs the held version's host copy; without one, ask for the whole version
        full = self._decoder is None or self._decoder.version != self.version
        for attempt in range(self.retries + 1):
            offer = self._latest(failed, full)
            if "uuid" not in offer or offer["version"] <= self.version:
                return None
            if "delta" in offer:
                try:
                    arrays = self._pull_async(offer)
                    self._await(arrays, offer, self.timeout_s)
                    if self.relay_fanout > 0:   # forward the bytes first, then decode
                        self._serve(offer, arrays)
                    out = self._apply_delta(offer, arrays)
                    break
                except (WeightTransferTimeout, jax.errors.JaxRuntimeError,
                        delta_lib.DeltaError) as e:
                    last, failed, full = e, offer["address"], True
                    self._failed(attempt, offer, e)
                    continue
            try:
                # each leaf is re-laid as soon as its bytes have landed, overlapping the
                # re-layout with the rest of the transfer. Never dispatch on a leaf that is not
                # ready: a stuck pull would leave that work queued on the device for good.
                if self.target is None:
                    shardings, treedef = None, None
                else:
                    shardings, treedef = layout_lib.target_shardings(
                        self.target, offer["layout"]["leaves"])
                arrays = self._pull_async(offer)
                relaid: list = []
                on_ready = None if shardings is None else \
                    (lambda i, a: relaid.append(jax.device_put(a, shardings[i])))
                self._await(arrays, offer, self.timeout_s, on_ready)
                out = self._full_version(offer, arrays, shardings, treedef, relaid)
                break
            except (WeightTransferTimeout, jax.errors.JaxRuntimeError) as e:
                last, failed = e, offer["address"]  # the coordinator strikes that source off
                self._failed(attempt, offer, e)
        else:
            raise WeightTransferError(f"pulling weights failed after {self.retries + 1} "
                                      f"attempts: {last}") from last
        self.version = offer["version"]
        if self.relay_fanout > 0 and "delta" not in offer:   # (a delta was forwarded above)
            self._serve(offer, arrays)
        return self.version, out

    def _latest(self, failed: str | None, full: bool) -> dict:
        """The coordinator's answer, asked again (pauses of 1 -> 20 ms) while it is
        ``"pending"`` (the learner is making the delta from the version held here, module
        doc), for up to ``timeout_s``; after that the pending answer is returned (no uuid:
        the poll finds nothing new, and the next one asks again)."""
        deadline, pause = time.monotonic() + self.timeout_s, 1e-3
        while True:
            self._check_cancelled("a poll")
            offer = self._coord.latest(self.version, failed=failed, full=full)
            if not offer.get("pending") or time.monotonic() > deadline:
                return offer
            if self._cancelled.wait(pause):
                self._check_cancelled("a poll")
            pause = min(pause * 2, 0.02)

    def _failed(self, attempt: int, offer: dict, e: BaseException) -> None:
        self.metrics["failed_pulls"] += 1
        if isinstance(e, delta_lib.DeltaError):
            self.metrics["delta_rejected"] += 1
        self._connections.pop(offer["address"], None)
        log.warning("weights: pull attempt %d/%d failed: %s", attempt + 1, self.retries + 1, e)

    def _full_version(self, offer: dict, arrays: list, shardings, treedef, relaid: list):
        """A whole pulled version on the target (the decoder keeps its host copy)."""
        t0 = time.perf_counter()
        if shardings is None:
            out = layout_lib.relayout(arrays, None, offer["layout"]["leaves"])
        else:
            out = jax.tree_util.tree_unflatten(treedef, relaid)
        jax.block_until_ready(out)
        # the re-layout left after the last byte arrived (the rest overlapped the transfer)
        self.metrics["last_relayout_s"] = time.perf_counter() - t0
        self.metrics["full_pulls"] += 1
        if self._decoder is not None:
            self._decoder.hold(offer["version"], [np.asarray(a) for a in arrays])
        return out

    def _apply_delta(self, offer: dict, arrays: list):
        """The version an offer's delta arrays make from the held one, on the target
        (``delta.apply_offer``; a subscriber with ``weight_sync="full"`` refuses it).

        Raises: delta_lib.DeltaError, layout.LayoutError: see ``delta.apply_offer``.
        """
        if self._decoder is None:
            raise delta_lib.DeltaError("offered a delta, but this subscriber has "
                                       "weight_sync='full'")
        t0 = time.perf_counter()
        out = delta_lib.apply_offer(self._decoder, offer, arrays, self.target, self._devices)
        self.metrics["last_relayout_s"] = time.perf_counter() - t0   # decode + place
        self.metrics["delta_pulls"] += 1
        return out

    def _serve(self, offer: dict, arrays: list) -> None:
        """Relay: register ``relay_fanout`` one-shot pulls of the arrays just pulled (in
        the publisher's layout) on this process's server and tell the coordinator. A failure
        here is logged, never fatal (the coordinator then uses other sources)."""
        n = min(self.relay_fanout, int(offer.get("relay", self.relay_fanout)))
        if n <= 0:
            return                      # the coordinator needs no children served by us
        try:
            uuids = [secrets.randbits(63) for _ in range(n)]
            deadline = datetime.datetime.now() + datetime.timedelta(
                seconds=self.relay_timeout_s)
            for uuid in uuids:
                self._server.await_pull(uuid, arrays, timeout=deadline)
            port = self._server.address().rsplit(":", 1)[1]
            base = offer["delta"]["base"] if "delta" in offer else None
            self._coord.register(version=offer["version"], address=f"{self._advertise}:{port}",
                                 transports=self.transports, uuids=uuids, base=base)
            self.metrics["relay_offers"] = self.metrics.get("relay_offers", 0) + len(uuids)
        except Exception as e:  # noqa: BLE001 - relaying is an optimisation
            log.warning("weights: cannot relay version %s: %s", offer["version"], e)

    def pull(self, offer: dict, timeout_s: float | None = None) -> list[jax.Array]:
        """Pull one offer in the publisher's layout, waiting at most ``timeout_s``.

        Raises:
          WeightTransferTimeout: not complete in time (e.g. no ``await_pull`` for the uuid).
          WeightPullCancelled: :meth:`cancel` was called.
          layout.LayoutError: this process lacks the devices the layout needs.
          WeightTransferError: the offer does not say how many transports the publisher has.
          jax.errors.JaxRuntimeError: the transfer itself failed.
        """
        arrays = self._pull_async(offer)
        self._await(arrays, offer, self.timeout_s if timeout_s is None else timeout_s)
        return arrays

    def _pull_async(self, offer: dict) -> list[jax.Array]:
        """Start the pull; the arrays become ready as their bytes arrive."""
        avals = layout_lib.pull_avals(offer["layout"], self._devices)
        conn = self._connect(offer)
        self._t_pull = time.perf_counter()
        return conn.pull(offer["uuid"], avals)

    def _connect(self, offer: dict):
        """The connection to the offer's server, from a local server with at least as many
        bulk transports as the publisher advertises (fewer would abort this process)."""
        address, need = offer["address"], offer.get("transports")
        if not isinstance(need, int) or isinstance(need, bool) or need < 1:
            raise WeightTransferError(
                f"offer of version {offer['version']} from {address} has transports={need!r}, "
                "expected an int >= 1: the learner runs an older rlflow.exchange.transfer")
        if self._server is None or need > self.transports:
            if self._server is not None:
                log.info("weights: publisher %s has %d transports, this server %d: restarting "
                         "it with %d", address, need, self.transports, need)
            self._connections.clear()
            self._server = None  # drop the old server before binding the new one
            self._server, self.transports = _start_server(
                self._bind_address, max(need, len(self._devices)))
        conn = self._connections.get(address)
        if conn is None:
            conn = self._connections[address] = self._server.connect(address)
        return conn

    def _await(self, arrays: list[jax.Array], offer: dict, timeout_s: float,
               on_ready=None) -> None:
        """The watchdog: wait until every pulled array is ready or raise after ``timeout_s``;
        ``on_ready(i, array)`` is called for each array, in order, once it is ready."""
        address = offer["address"]
        deadline, pause, done = time.monotonic() + timeout_s, 1e-4, 0
        while True:
            while done < len(arrays) and arrays[done].is_ready():  # ready stays ready
                if on_ready is not None:
                    on_ready(done, arrays[done])
                done += 1
            if done == len(arrays):
                break
            if time.monotonic() > deadline:
                self.metrics["timeouts"] += 1
                raise WeightTransferTimeout(
                    f"weight pull of version {offer['version']} (uuid {offer['uuid']}) from "
                    f"{address} not complete after {timeout_s:.1f} s")
            if self._cancelled.wait(pause):
                self._check_cancelled(f"the pull of version {offer['version']} from {address}")
            pause = min(pause * 2, 0.002)
        jax.block_until_ready(arrays)  # raises the transfer's error, if any
        self.metrics["last_pull_s"] = time.perf_counter() - self._t_pull
        self.metrics["pulls"] += 1
        self.metrics["bytes"] += sum(a.nbytes for a in arrays)

    def _check_cancelled(self, what: str) -> None:
        if self._cancelled.is_set():
            raise WeightPullCancelled(f"weights: {what} was cancelled (shutting down)")

    def close(self) -> None:
        self._coord.close()
        self._connections.clear()
