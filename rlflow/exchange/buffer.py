"""The rollout buffer over ZeroMQ: a server in the learner process, clients in samplers.

Where it lives: the **learner program** (the consumer side) runs :class:`BufferServer`; the
learner takes groups straight from its in-process ring (:meth:`BufferServer.get_groups`),
so a batch never crosses the network twice, and the buffer lives exactly as long as the
run's consumer. Each sampler host (producer) holds a :class:`BufferClient`. Same host or
another host, the transport is the same: TCP through ZeroMQ, bound to 127.0.0.1 unless the
config names another address, with a shared token required off loopback. (On a multi-host
learner the server runs on the learner's process 0.)

Batches (:meth:`BufferClient.put_groups`): several groups in one request and one reply, so
small records do not each pay a round trip. The server validates every group of the batch;
a bad one is rejected on its own (named by its index in the batch, with its RecordError) and
the good ones are accepted, in order. The reply comes when all accepted groups are in the
ring; on a timeout the groups already in stay in (groups are never split, a batch may be) and
the error says how many.

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
from typing import Callable, Mapping, Sequence

import numpy as np

from rlflow.exchange import records, wire
from rlflow.exchange.ring import BufferClosedError, BufferTimeoutError, Group, RingBuffer

log = logging.getLogger(__name__)

PUT, PUT_MANY, ERROR, STATS = b"put", b"put-many", b"error", b"stats"
REJECTED, TIMEOUT, CLOSED = b"rejected", b"timeout", b"closed"


class _Pending:
    """A put (one group) or a batch put (its accepted groups, FIFO) waiting for space.
    ``report`` is None for a single put, else the batch reply (accepted count, rejections)."""

    __slots__ = ("identity", "rid", "groups", "arrived", "deadline", "report")

    def __init__(self, identity, rid, groups, arrived, deadline, report=None):
        self.identity, self.rid, self.groups = identity, rid, groups
        self.arrived, self.deadline, self.report = arrived, deadline, report


class BufferServer(wire.RouterService):
    """ZeroMQ front of a :class:`RingBuffer`, served by a background thread.

    Args:
      ring: the ring to fill.
      bind_address, port, token: where to listen and the shared secret (see
        :class:`rlflow.exchange.wire.RouterService`).
      group_size: the ``G`` every record must have (None: any).
      max_tokens: upper bound on a record's ``T`` (None: any).
      on_arrival: ``group -> bool`` called on the serving thread for each valid group before
        it is queued; False discards it (counted in ``duplicates``, answered as accepted:
        the prompt ledger's way to refuse a lost replica's late group).
      on_discard: ``group -> None`` for a queued group that never entered the ring (its put
        timed out or the buffer closed).

    Raises:
      ValueError: a non-loopback ``bind_address`` without a token.
    """

    def __init__(self, ring: RingBuffer, *, bind_address: str = "127.0.0.1", port: int = 0,
                 token: str = "", group_size: int | None = None, max_tokens: int | None = None,
                 on_arrival: Callable[[Group], bool] | None = None,
                 on_discard: Callable[[Group], None] | None = None):
        super().__init__(bind_address=bind_address, port=port, token=token, name="buffer server")
        self.ring, self.group_size, self.max_tokens = ring, group_size, max_tokens
        self.on_arrival, self.on_discard = on_arrival, on_discard
        self._pending: collections.deque[_Pending] = collections.deque()
        self.duplicates = 0
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
        out.update(rejected=self.rejected, refused=self.refused, duplicates=self.duplicates,
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
        if kind == PUT_MANY:
            return self._put_many(identity, rid, payload)
        if kind == ERROR:
            msg = bytes(payload[0].buffer).decode("utf-8", "replace") if payload else "?"
            log.error("buffer server: a producer reported a failure: %s", msg)
            self.ring.report_error(msg)
            return wire.OK, []
        if kind == STATS:
            return wire.OK, [wire.dumps(self.metrics())]
        return wire.BAD_REQUEST, [b"unknown request kind"]

    def _meta(self, payload, kind: str) -> tuple[dict, float]:
        meta = wire.loads(payload[0]) if payload else None
        if not isinstance(meta, dict):
            raise records.FrameError(f"{kind}: the first frame must be a JSON object")
        try:
            timeout = float(meta.get("timeout_s", self.ring.timeout_s))
        except (TypeError, ValueError):
            raise records.FrameError(f"{kind}: timeout_s must be a number, got "
                                     f"{meta.get('timeout_s')!r}") from None
        return meta, timeout

    def _decode(self, frames) -> tuple[dict, int]:
        group = records.decode_frames(frames)
        records.validate_group(group, group_size=self.group_size, max_tokens=self.max_tokens)
        return group, records.group_nbytes(group)

    def _arrived(self, items) -> collections.deque:
        """``items`` less the groups ``on_arrival`` refuses (counted)."""
        if self.on_arrival is None:
            return items
        kept = collections.deque(it for it in items if self.on_arrival(it[0]))
        self.duplicates += len(items) - len(kept)
        return kept

    def _discard(self, items) -> None:
        if self.on_discard is not None:
            for group, _ in items:
                self.on_discard(group)

    def _put(self, identity, rid, payload):
        meta = None
        try:
            meta, timeout = self._meta(payload, "put")
            item = self._decode(payload[1:])
        except (records.RecordError, records.FrameError, wire.ProtocolError) as e:
            return REJECTED, [wire.dumps(self._reject(meta, e).to_dict())]
        return self._enqueue(identity, rid, self._arrived(collections.deque([item])), timeout,
                             None)

    def _put_many(self, identity, rid, payload):
        meta = None
        try:
            meta, timeout = self._meta(payload, "put-many")
            counts = meta.get("frames")
            if not (isinstance(counts, list) and all(type(c) is int and c >= 1 for c in counts)
                    and sum(counts) == len(payload) - 1):
                raise records.FrameError(
                    f"put-many: 'frames' must list the frame count of each group, summing to "
                    f"the {len(payload) - 1} frames sent; got {counts!r}")
        except (records.RecordError, records.FrameError, wire.ProtocolError) as e:
            return REJECTED, [wire.dumps(self._reject(meta, e).to_dict())]
        items, rejected, start = collections.deque(), [], 1
        for index, count in enumerate(counts):
            try:
                items.append(self._decode(payload[start:start + count]))
            except (records.RecordError, records.FrameError) as e:
                rejected.append(dict(index=index, **self._reject(meta, e, index).to_dict()))
            start += count
        report = {"accepted": len(items), "rejected": rejected}
        return self._enqueue(identity, rid, self._arrived(items), timeout, report)

    def _enqueue(self, identity, rid, items, timeout, report):
        """Put ``items`` into the ring in order; reply now when all fit, else hold the rest."""
        try:
            while not self._pending and items and self.ring.try_put(*items[0]):
                items.popleft()
        except BufferClosedError:
            self._discard(items)
            return CLOSED, [b"the buffer is closed"]
        if not items:
            return wire.OK, [] if report is None else [wire.dumps(report)]
        now = time.monotonic()
        self._pending.append(_Pending(identity, rid, items, now, now + timeout, report))
        return None

    def _reject(self, meta, e: Exception, index: int | None = None) -> records.RecordError:
        producer = meta.get("producer", "?") if isinstance(meta, dict) else "?"
        self.rejected += 1
        where = "" if index is None else f" (group {index} of a batch)"
        self.last_rejection = f"from {producer}{where}: {e}"
        log.warning("buffer server: rejected a record %s", self.last_rejection)
        if not isinstance(e, records.RecordError):
            e = records.RecordError("", "a well-formed array frame", str(e))
        return e

    def tick(self) -> None:
        now = time.monotonic()
        try:
            while self._pending:
                p = self._pending[0]
                while p.groups and self.ring.try_put(*p.groups[0]):
                    p.groups.popleft()
                if p.groups:
                    break
                self._pending.popleft()
                self.ring.add_producer_wait(now - p.arrived)
                self.reply(p.identity, p.rid, wire.OK,
                           [] if p.report is None else [wire.dumps(p.report)])
        except BufferClosedError:
            for p in self._pending:
                self._discard(p.groups)
                self.reply(p.identity, p.rid, CLOSED, [b"the buffer is closed"])
            self._pending.clear()
        keep = collections.deque()
        for p in self._pending:
            if p.deadline <= now:
                self._discard(p.groups)
                self.ring.add_producer_wait(now - p.arrived)
                err = self.ring.producer_timeout(now - p.arrived)
                extra = [] if p.report is None else [
                    wire.dumps(dict(p.report, accepted=p.report["accepted"] - len(p.groups)))]
                self.reply(p.identity, p.rid, TIMEOUT, [str(err).encode(), *extra])
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

    def put_groups(self, groups: Sequence[Mapping[str, np.ndarray]], *,
                   timeout: float | None = None) -> dict[int, records.RecordError]:
        """Send several groups in one request (one round trip); blocks until all accepted
        groups are in the buffer. Order is kept; each group stays whole.

        A bad group does not fail the batch: it is rejected on its own and the others are
        accepted. Check the returned dict (empty when every group was accepted).

        Returns:
          ``{index in groups: RecordError}`` for the rejected groups (server-side schema
          errors, and groups with a dtype that cannot travel, caught here and not sent).

        Raises:
          BufferTimeoutError: (stalled_side "consumer") the buffer stayed full for
            ``timeout`` seconds or the server did not answer; its ``accepted`` attribute is
            the number of this batch's good groups already in the buffer (None: unknown).
          BufferClosedError: the learner closed the buffer (the run is ending).
          wire.PeerRefusedError: wrong or missing token.
        """
        timeout = self.timeout_s if timeout is None else timeout
        rejected: dict[int, records.RecordError] = {}
        sent, frames, counts = [], [], []
        for i, g in enumerate(groups):
            try:
                f = records.encode_frames(g)
            except (records.FrameError, AttributeError, TypeError, ValueError) as e:
                rejected[i] = records.RecordError("", "a mapping of numpy arrays that can "
                                                  "travel", f"{type(e).__name__}: {e}")
                continue
            sent.append(i)
            frames.extend(f)
            counts.append(len(f))
        if not sent:
            return rejected
        meta = wire.dumps({"timeout_s": timeout, "producer": self.name, "frames": counts})
        status, rest = self._request(PUT_MANY, [meta, *frames], timeout + self.reply_grace_s)
        if status in (wire.OK, TIMEOUT):
            report = wire.loads(rest[-1]) if len(rest) > (status == TIMEOUT) else {}
            if not isinstance(report, dict):
                raise wire.ProtocolError(f"buffer server answered a batch with {report!r}")
            for r in report.get("rejected", []):
                rejected[sent[int(r["index"])]] = records.RecordError.from_dict(r)
            if status == wire.OK:
                return rejected
            err = BufferTimeoutError("consumer", rest[0].bytes.decode() if rest else "timeout")
            err.accepted = report.get("accepted")
            raise err
        if status == REJECTED:  # the request as a whole was malformed
            raise records.RecordError.from_dict(wire.loads(rest[0]) if rest else {})
        if status == CLOSED:
            raise BufferClosedError("the learner closed the buffer")
        raise wire.ProtocolError(f"buffer server answered {status!r} to a batch put")

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
            err = BufferTimeoutError("consumer", f"{e}: the consumer (learner) process that "
                                     "serves the buffer stopped answering")
            err.accepted = None  # a batch put cannot know what arrived
            raise err from None

    def close(self) -> None:
        self._req.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
