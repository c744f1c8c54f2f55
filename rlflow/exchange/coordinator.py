"""The weight coordinator: a tiny ZeroMQ request/reply service in the learner process.

A sampler host asks "latest?" with the version it has; the coordinator answers either
``{"version": v}`` (nothing newer) or an *offer*::

    {"version": v, "address": "host:port", "uuid": u, "layout": {...}, "transports": n}

for which the publisher has just registered one ``TransferServer.await_pull(u, ...)``:
one uuid per consumer per version (per attempt), since each ``await_pull`` serves exactly
one pull. ``layout`` is :func:`rlflow.exchange.layout.describe` of the published arrays;
``transports`` is the publisher's count of bulk-transport sockets (the puller's transfer
server needs at least as many, see :mod:`rlflow.exchange.transfer`).
The coordinator binds 127.0.0.1 unless configured; off loopback it requires the shared token.
"""

from __future__ import annotations

from typing import Protocol

from rlflow.exchange import wire

LATEST = b"latest"


class OfferSource(Protocol):
    """What the coordinator serves (``rlflow.exchange.transfer.WeightPublisher``)."""

    def offer(self, consumer: str, have_version: int) -> dict: ...


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
        self.requests = 0

    def handle(self, identity, rid, kind, payload):
        if kind != LATEST or not payload:
            return wire.BAD_REQUEST, [b"expected a 'latest' request"]
        try:
            req = wire.loads(payload[0])
            consumer, have = str(req["consumer"]), int(req["have_version"])
        except (wire.ProtocolError, KeyError, TypeError, ValueError):
            return wire.BAD_REQUEST, [b"expected {consumer, have_version}"]
        self.requests += 1
        return wire.OK, [wire.dumps(self.publisher.offer(consumer, have))]


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

    def latest(self, have_version: int) -> dict:
        """The coordinator's answer: ``{"version": v}`` or an offer (see module doc).

        Raises:
          wire.PeerTimeoutError: the coordinator (learner process) did not answer in time.
          wire.PeerRefusedError: wrong or missing token.
        """
        _, rest = self._req.request(
            LATEST, [wire.dumps({"consumer": self.consumer_id, "have_version": have_version})],
            timeout_s=self.timeout_s)
        return wire.loads(rest[0])

    def close(self) -> None:
        self._req.close()
