"""The sampler's side of the weight transfer: :class:`WeightSubscriber` asks the learner's
coordinator for offers, pulls them with ``jax.experimental.transfer`` under a watchdog,
re-lays them onto its own shardings, applies deltas, and relays what it pulled (the facts it
relies on, the speed figures and the delta protocol: :mod:`rlflow.exchange.transfer`).
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

from rlflow.exchange import delta as delta_lib
from rlflow.exchange import layout as layout_lib
from rlflow.exchange.coordinator import CoordinatorClient
from rlflow.exchange.transfer_server import (WeightPullCancelled, WeightTransferError,
                                             WeightTransferTimeout, start_server)
from rlflow.system.ports import advertised_host

log = logging.getLogger("rlflow.exchange.transfer")


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
            self._server, self.transports = start_server(
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
