"""The weight coordinator: a tiny ZeroMQ request/reply service in the learner process.

A sampler host asks "latest?" with the version it has; the coordinator answers either
``{"version": v}`` (nothing newer) or an *offer*::

    {"version": v, "address": "host:port", "uuid": u, "layout": {...}, "transports": n}

for which the publisher has just registered one ``TransferServer.await_pull(u, ...)``:
one uuid per consumer per version (per attempt), since each ``await_pull`` serves exactly
one pull. ``layout`` is :func:`rlflow.exchange.layout.describe` of the published arrays;
``transports`` is the publisher's count of bulk-transport sockets (the puller's transfer
server needs at least as many, see :mod:`rlflow.exchange.transfer`). With delta sync an
offer may instead carry ``"delta"`` (the pull is the compressed change from the version the
sampler holds); a sampler that cannot apply one asks with ``"full": true``.
The coordinator binds 127.0.0.1 unless configured; off loopback it requires the shared token.
"""

from __future__ import annotations

import inspect
from typing import Protocol

from rlflow.exchange import wire

LATEST = b"latest"
RELAY = b"relay"


class OfferSource(Protocol):
    """What the coordinator serves (``rlflow.exchange.transfer.WeightPublisher``)."""

    def offer(self, consumer: str, have_version: int) -> dict: ...
    # a delta-aware source (WeightPublisher, RelayOffers) also takes ``full=True``


def takes_full(source) -> bool:
    """Whether ``source.offer`` takes ``full=`` (delta sync); an offer source without it
    (or with no ``offer``: one that only answers ``latest``) is only ever asked plainly."""
    offer = getattr(source, "offer", None)
    if offer is None:
        return False
    try:
        return "full" in inspect.signature(offer).parameters
    except (TypeError, ValueError):
        return False


class Coordinator(wire.RouterService):
    """Serves "latest?" requests from samplers with offers from ``publisher``.

    Args:
      publisher: answers ``offer(consumer, have_version)``.
      bind_address, port, token: see :class:`rlflow.exchange.wire.RouterService`.
    """

    def __init__(self, publisher: OfferSource, *, bind_address: str = "127.0.0.1",
                 port: int = 0, token: str = ""):
        super().__init__(bind_address=bind_address, port=port, token=token,
                         name="weight coordinator")
        self.publisher = publisher
        self._takes_full = takes_full(publisher)
        self.requests = 0

    def handle(self, identity, rid, kind, payload):
        if kind == RELAY and payload and hasattr(self.publisher, "register"):
            try:
                req = wire.loads(payload[0])
                base = req.get("base")
                ok = self.publisher.register(
                    str(req["consumer"]), int(req["version"]), str(req["address"]),
                    int(req["transports"]), [int(u) for u in req["uuids"]],
                    **({} if base is None else {"base": int(base)}))
            except (wire.ProtocolError, KeyError, TypeError, ValueError):
                return wire.BAD_REQUEST, [b"expected {consumer, version, address, ...}"]
            return wire.OK, [wire.dumps({"registered": bool(ok)})]
        if kind != LATEST or not payload:
            return wire.BAD_REQUEST, [b"expected a 'latest' request"]
        try:
            req = wire.loads(payload[0])
            consumer, have = str(req["consumer"]), int(req["have_version"])
            failed = req.get("failed")
            kw = {"full": True} if req.get("full") and self._takes_full else {}
        except (wire.ProtocolError, KeyError, TypeError, ValueError):
            return wire.BAD_REQUEST, [b"expected {consumer, have_version}"]
        self.requests += 1
        if failed and hasattr(self.publisher, "register"):   # a relay-aware offer source
            kw["failed"] = str(failed)
        return wire.OK, [wire.dumps(self.publisher.offer(consumer, have, **kw))]


class CoordinatorClient:
    """Sampler side of the coordinator.

    Args:
      address: the coordinator's endpoint ``tcp://host:port``.
      consumer_id: this sampler host's name (one uuid per consumer per version).
      token: the shared secret.
      timeout_s: seconds to wait for an answer.
    """

    def __init__(self, address: str, *, consumer_id: str, token: str = "",
                 timeout_s: float = 30.0):
        self.consumer_id, self.timeout_s = consumer_id, timeout_s
        self._req = wire.Requester(address, token=token, name="weight coordinator")

    def cancel(self) -> None:
        """Abandon the request in progress (``wire.RequestCancelled``); for shutdown."""
        self._req.cancel()

    def latest(self, have_version: int, failed: str | None = None, full: bool = False) -> dict:
        """The coordinator's answer: ``{"version": v}`` or an offer (see module doc).
        ``failed``: the address of a source whose pull just failed (relay trees); ``full``:
        offer the whole version, never a delta.

        Raises:
          wire.PeerTimeoutError: the coordinator (learner process) did not answer in time.
          wire.PeerRefusedError: wrong or missing token.
        """
        body = {"consumer": self.consumer_id, "have_version": have_version}
        if failed:
            body["failed"] = failed
        if full:
            body["full"] = True
        _, rest = self._req.request(LATEST, [wire.dumps(body)], timeout_s=self.timeout_s)
        return wire.loads(rest[0])

    def register(self, *, version: int, address: str, transports: int, uuids: list,
                 base: int | None = None) -> bool:
        """Relay: this consumer awaits one pull per uuid of ``version`` on ``address``;
        ``base``: what it serves is the delta from that version (None: the whole version)."""
        body = {"consumer": self.consumer_id, "version": version, "address": address,
                "transports": transports, "uuids": uuids}
        if base is not None:
            body["base"] = base
        _, rest = self._req.request(RELAY, [wire.dumps(body)], timeout_s=self.timeout_s)
        return bool(wire.loads(rest[0]).get("registered"))

    def close(self) -> None:
        self._req.close()
