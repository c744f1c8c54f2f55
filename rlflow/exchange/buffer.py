"""The rollout buffer over ZeroMQ: a server in the learner process, clients in samplers.

Where it lives: the **learner program** (the consumer side) runs :class:`BufferServer`; the
learner takes groups straight from its in-process ring (:meth:`BufferServer.get_groups`),
so a batch never crosses the network twice, and the buffer lives exactly as long as the
run's consumer. Each sampler host (producer) holds a :class:`BufferClient`. Same host or
another host, the transport is the same: TCP through ZeroMQ, bound to 127.0.0.1 unless the
config names another address, with a shared token required off loopback. (On a multi-host
learner the server runs on the learner's process 0.)

Flow of one ``put``: the client sends the group as array frames (``records.encode_frames``:
a JSON header with names, dtypes and shapes, then raw bytes; never pickle). The server
decodes and validates it; a bad record is answered with its :class:`~rlflow.exchange.records.
RecordError` (field, expected, got), counted in ``rejected``, and the server keeps serving.
A good record enters the ring; when the ring is full under ``when_full="block"`` the reply
is held back until space frees (the producer blocks) or until the producer's timeout, when
it is answered with a timeout that names the consumer as the side that stopped.
A producer that fails for good calls :meth:`BufferClient.report_error`; the learner's next
``get_groups`` raises it (:class:`~rlflow.exchange.ring.ProducerError`).

Metrics (:meth:`BufferServer.metrics`): the ring's counters (fill level, producer/consumer
wait seconds, dropped_full, dropped_filtered, producer_errors, put, got, bytes_in) plus
``rejected`` records, ``refused`` requests (wrong token) and ``last_rejection``.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Mapping

import numpy as np

from rlflow.exchange import records, wire
from rlflow.exchange.ring import BufferClosedError, BufferTimeoutError, Group, RingBuffer

log = logging.getLogger(__name__)

PUT, ERROR, STATS = b"put", b"error", b"stats"
REJECTED, TIMEOUT, CLOSED = b"rejected", b"timeout", b"closed"

_Pending = collections.namedtuple("_Pending", "identity rid group nbytes arrived deadline")


class BufferServer(wire.RouterService):
    """ZeroMQ front of a :class:`RingBuffer`, served by a background thread.

    Args:
      ring: the ring to fill.
      bind_address, port, token: where to listen and the shared secret (see
        :class:`rlflow.exchange.wire.RouterService`).
      group_size: the ``G`` every record must have (None: any).
      max_tokens: upper bound on a record's ``T`` (None: any).

    Raises:
      ValueError: a non-loopback ``bind_address`` without a token.
    """

    def __init__(self, ring: RingBuffer, *, bind_address: str = "127.0.0.1", port: int = 0,
                 token: str = "", group_size: int | None = None, max_tokens: int | None = None):
        super().__init__(bind_address=bind_address, port=port, token=token, name="buffer server")
        self.ring, self.group_size, self.max_tokens = ring, group_size, max_tokens
        self._pending: collections.deque[_Pending] = collections.deque()
        self.rejected = 0
        self.last_rejection = ""

    @classmethod
    def from_config(cls, cfg, *, group_size: int | None = None,
                    max_tokens: int | None = None) -> "BufferServer":
        """Ring and server from a :class:`rlflow.config.BufferConfig` (not yet started)."""
        return cls(RingBuffer.from_config(cfg), bind_address=cfg.bind_address, port=cfg.port,
                   token=cfg.token, group_size=group_size, max_tokens=max_tokens)

    # ------------------------------------------------------------------ consumer API

    def get_groups(self, n: int, *, timeout: float | None = None,
                   accept: Callable[[Group], bool] | None = None) -> list[Group]:
        """:meth:`RingBuffer.get_groups` of the served ring; raises first if the serving
        thread died (RuntimeError naming its error)."""
        if self.error is not None:
            raise RuntimeError(f"buffer server thread failed: {self.error!r}") from self.error
        return self.ring.get_groups(n, timeout=timeout, accept=accept)

    def metrics(self) -> dict:
        out = self.ring.metrics()
        out.update(rejected=self.rejected, refused=self.refused,
                   last_rejection=self.last_rejection, pending_puts=len(self._pending))
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close the ring (waiters get BufferClosedError)."""
        super().close(timeout)
        self.ring.close()

    # ------------------------------------------------------------------ serving thread

    def handle(self, identity, rid, kind, payload):
        if kind == PUT:
            return self._put(identity, rid, payload)
        if kind == ERROR:
            msg = bytes(payload[0].buffer).decode("utf-8", "replace") if payload else "?"
            log.error("buffer server: a producer reported a failure: %s", msg)
            self.ring.report_error(msg)
            return wire.OK, []
        if kind == STATS:
            return wire.OK, [wire.dumps(self.metrics())]
        return wire.BAD_REQUEST, [b"unknown request kind"]

    def _put(self, identity, rid, payload):
        meta = None
        try:
            meta = wire.loads(payload[0]) if payload else None
            if not isinstance(meta, dict):
                raise records.FrameError("put: the first frame must be a JSON object")
            try:
                timeout = float(meta.get("timeout_s", self.ring.timeout_s))
            except (TypeError, ValueError):
                raise records.FrameError(f"put: timeout_s must be a number, got "
                                         f"{meta.get('timeout_s')!r}") from None
            group = records.decode_frames(payload[1:])
            records.validate_group(group, group_size=self.group_size, max_tokens=self.max_tokens)
        except (records.RecordError, records.FrameError, wire.ProtocolError) as e:
            return self._reject(meta, e)
        nbytes = records.group_nbytes(group)
        try:
            if not self._pending and self.ring.try_put(group, nbytes):
                return wire.OK, []
        except BufferClosedError:
            return CLOSED, [b"the buffer is closed"]
        now = time.monotonic()
        self._pending.append(_Pending(identity, rid, group, nbytes, now, now + timeout))
        return None

    def _reject(self, meta, e: Exception):
        producer = meta.get("producer", "?") if isinstance(meta, dict) else "?"
        self.rejected += 1
        self.last_rejection = f"from {producer}: {e}"
        log.warning("buffer server: rejected a record %s", self.last_rejection)
        if not isinstance(e, records.RecordError):
            e = records.RecordError("", "a well-formed array frame", str(e))
        return REJECTED, [wire.dumps(e.to_dict())]

    def tick(self) -> None:
        now = time.monotonic()
        try:
            while self._pending and self.ring.try_put(self._pending[0].group,
                                                      self._pending[0].nbytes):
                p = self._pending.popleft()
                self.ring.add_producer_wait(now - p.arrived)
                self.reply(p.identity, p.rid, wire.OK)
        except BufferClosedError:
            for p in self._pending:
                self.reply(p.identity, p.rid, CLOSED, [b"the buffer is closed"])
            self._pending.clear()
        keep = collections.deque()
        for p in self._pending:
            if p.deadline <= now:
                self.ring.add_producer_wait(now - p.arrived)
                err = self.ring.producer_timeout(now - p.arrived)
                self.reply(p.identity, p.rid, TIMEOUT, [str(err).encode()])
            else:
                keep.append(p)
        self._pending = keep

    def poll_interval_ms(self) -> int:
        return 2 if self._pending else 50


class BufferClient:
    """Producer side: sends whole groups to a :class:`BufferServer`.

    One client per producer thread (requests are serialised by a lock).

    Args:
      address: the server's endpoint, ``tcp://host:port``.
      token: the shared secret (the server's ``buffer.token``).
      timeout_s: default seconds a put may wait for space.
      name: producer name shown in the server's logs (e.g. "sampler-0").
      reply_grace_s: extra seconds to wait for the server's answer beyond the put timeout
        before declaring the server (the consumer's process) gone.
    """

    def __init__(self, address: str, *, token: str = "", timeout_s: float = 300.0,
                 name: str = "sampler", reply_grace_s: float = 10.0):
        self.name, self.timeout_s, self.reply_grace_s = name, timeout_s, reply_grace_s
        self._req = wire.Requester(address, token=token, name="buffer server")

    @classmethod
    def from_config(cls, cfg, address: str, *, name: str = "sampler") -> "BufferClient":
        return cls(address, token=cfg.token, timeout_s=cfg.timeout_s, name=name)

    def put_group(self, group: Mapping[str, np.ndarray], *, timeout: float | None = None) -> None:
        """Send one group; blocks while the buffer is full (``when_full="block"``).

        Raises:
          records.RecordError: the server rejected the record (field, expected, got).
          records.FrameError: the record has a dtype that cannot travel (raised locally).
          BufferTimeoutError: (stalled_side "consumer") the buffer stayed full for
            ``timeout`` seconds, or the server did not answer at all.
          BufferClosedError: the learner closed the buffer (the run is ending).
          wire.PeerRefusedError: wrong or missing token.
        """
        timeout = self.timeout_s if timeout is None else timeout
        frames = records.encode_frames(group)
        meta = wire.dumps({"timeout_s": timeout, "producer": self.name})
        status, rest = self._request(PUT, [meta, *frames], timeout + self.reply_grace_s)
        if status == wire.OK:
            return
        if status == REJECTED:
            raise records.RecordError.from_dict(wire.loads(rest[0]) if rest else {})
        if status == TIMEOUT:
            raise BufferTimeoutError("consumer", rest[0].bytes.decode() if rest else "timeout")
        if status == CLOSED:
            raise BufferClosedError("the learner closed the buffer")
        raise wire.ProtocolError(f"buffer server answered {status!r} to a put")

    def report_error(self, message: str, *, timeout: float = 30.0) -> None:
        """Tell the consumer this producer failed; its next ``get_groups`` raises
        ``ProducerError(message)``."""
        self._request(ERROR, [f"{self.name}: {message}".encode()], timeout)

    def stats(self, *, timeout: float = 30.0) -> dict:
        """The server's :meth:`BufferServer.metrics`."""
        _, rest = self._request(STATS, [], timeout)
        return wire.loads(rest[0])

    def _request(self, kind, payload, timeout_s):
        try:
            return self._req.request(kind, payload, timeout_s=timeout_s)
        except wire.PeerTimeoutError as e:
            raise BufferTimeoutError("consumer", f"{e}: the consumer (learner) process that "
                                     "serves the buffer stopped answering") from None

    def close(self) -> None:
        self._req.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
