"""ZeroMQ request/reply plumbing shared by the buffer server and the weight coordinator.

One protocol for same-host and cross-host: TCP through ZeroMQ. A service is a ROUTER
socket served by one background thread (:class:`RouterService`); a client is a DEALER
socket (:class:`Requester`) that tags each request with an id, so a late reply to a request
that timed out is recognised and discarded.

Frames of a request: ``[MAGIC, kind, request id (8 bytes), token, *payload]``.
Frames of a reply:   ``[MAGIC, status, request id, *payload]``; status ``b"ok"`` or a
service-specific word; ``b"refused"`` for a wrong token, ``b"bad-request"`` for a
malformed request and ``b"server-error"`` when handling failed (the service logs it and
keeps serving).

Security: a service bound to a non-loopback address must have a shared token (ValueError
otherwise); when a service has a token, every request must carry it (compared in constant
time) or it is refused and counted. The token travels in clear: use it on a private network.
"""

from __future__ import annotations

import hmac
import ipaddress
import itertools
import json
import logging
import struct
import threading
import time

import zmq

MAGIC = b"rlfx/1"
OK = b"ok"
REFUSED = b"refused"
BAD_REQUEST = b"bad-request"
SERVER_ERROR = b"server-error"
CANCEL_POLL_S = 0.1     # a waiting request checks Requester.cancel this often (seconds)

log = logging.getLogger(__name__)


class PeerRefusedError(PermissionError):
    """The service refused the request: the client's token is missing or wrong."""


class PeerTimeoutError(TimeoutError):
    """No reply from the service in time (it is gone, hung or unreachable)."""


class RequestCancelled(RuntimeError):
    """:meth:`Requester.cancel` was called (the owner is shutting down): the request in
    progress, or one asked for after it, was abandoned without waiting for the reply."""


class ProtocolError(RuntimeError):
    """A peer sent frames that do not follow the protocol."""


class RemoteError(RuntimeError):
    """The service failed while handling the request (it logged the error and keeps serving)."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ``::1``; False otherwise
    (including ``0.0.0.0``, ``*`` and host names, which may reach other machines)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port`` with IPv6 hosts bracketed."""
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _socket(kind: int, host: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if ":" in host.strip("[]"):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


class RouterService:
    """A ROUTER socket and its serving thread; subclasses implement :meth:`handle`.

    Args:
      bind_address: host to bind ("127.0.0.1" default; "0.0.0.0" for all interfaces).
      port: TCP port, 0 for a free one.
      token: shared secret; required when ``bind_address`` is not loopback.
      name: service name used in log lines and errors.
      max_message_bytes: larger requests are dropped by ZeroMQ (protects memory).

    Raises:
      ValueError: a non-loopback bind without a token.
      zmq.ZMQError: the address cannot be bound.
    """

    def __init__(self, *, bind_address: str = "127.0.0.1", port: int = 0, token: str = "",
                 name: str = "service", max_message_bytes: int = 1 << 31):
        if not is_loopback(bind_address) and not token:
            raise ValueError(f"{name}: binding non-loopback address {bind_address!r} requires a "
                             "shared token (config: buffer.token)")
        self.name, self.bind_address = name, bind_address
        self._token = token.encode()
        self._sock = _socket(zmq.ROUTER, bind_address)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        host = "*" if bind_address in ("0.0.0.0", "*") else bind_address
        self._sock.bind(tcp_endpoint(host, port or "*"))
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"rlflow-{name}", daemon=True)
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        """Endpoint clients on this host connect to (loopback when bound to all interfaces)."""
        host = "127.0.0.1" if self.bind_address in ("0.0.0.0", "*") else self.bind_address
        return tcp_endpoint(host, self.port)

    def start(self) -> "RouterService":
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the serving thread and close the socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif not self._sock.closed:
            self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------- for subclasses

    def handle(self, identity: bytes, rid: bytes, kind: bytes, payload: list) -> \
            tuple[bytes, list] | None:
        """Serve one request. Return ``(status, payload frames)`` to reply now, or None to
        reply later with :meth:`reply` (from the serving thread)."""
        raise NotImplementedError

    def tick(self) -> None:
        """Called on every loop turn of the serving thread (deferred replies, deadlines)."""

    def poll_interval_ms(self) -> int:
        return 100

    def reply(self, identity: bytes, rid: bytes, status: bytes, payload=()) -> None:
        self._sock.send_multipart([identity, MAGIC, status, rid, *payload], copy=False)

    # ----------------------------------------------------------------- serving thread

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(self.poll_interval_ms()):
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._dispatch(frames)
                self.tick()
        except BaseException as e:  # surfaced by the owner through .error
            self._error = e
            log.exception("%s: serving thread failed", self.name)
        finally:
            self._sock.close()

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the serving thread, if any."""
        return self._error

    def _dispatch(self, frames: list) -> None:
        identity = frames[0].bytes
        if len(frames) < 5 or frames[1].bytes != MAGIC or len(frames[3].bytes) != 8:
            rid = frames[3].bytes if len(frames) > 3 else b"\0" * 8
            self.reply(identity, rid, BAD_REQUEST, [b"malformed request frames"])
            return
        kind, rid, token = frames[2].bytes, frames[3].bytes, frames[4].bytes
        if self._token and not hmac.compare_digest(token, self._token):
            self.refused += 1
            log.warning("%s: refused a %r request with a wrong token", self.name, kind)
            self.reply(identity, rid, REFUSED, [b"wrong or missing token"])
            return
        try:
            out = self.handle(identity, rid, kind, frames[5:])
        except Exception as e:  # one bad request never stops the service
            log.exception("%s: failed handling a %r request", self.name, kind)
            out = SERVER_ERROR, [f"{type(e).__name__}: {e}".encode()]
        if out is not None:
            self.reply(identity, rid, *out)


class Requester:
    """Client side: one DEALER socket, one request at a time (guarded by a lock).

    Args:
      address: service endpoint, ``tcp://host:port``.
      token: shared secret sent with every request.
      name: service name used in errors.
    """

    _ids = itertools.count(1)

    def __init__(self, address: str, *, token: str = "", name: str = "service"):
        self.address, self.name = address, name
        self._token = token.encode()
        self._host = address.split("://", 1)[-1].rsplit(":", 1)[0]
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._connect()

    def cancel(self) -> None:
        """Abandon the request in progress and refuse later ones (thread-safe, for shutdown):
        the thread waiting in :meth:`request` raises :class:`RequestCancelled` within
        ``CANCEL_POLL_S`` instead of waiting out its timeout for a peer that is gone."""
        self._cancelled.set()

    def _connect(self) -> None:
        self._sock = _socket(zmq.DEALER, self._host)
        self._sock.connect(self.address)

    def request(self, kind: bytes, payload=(), *, timeout_s: float) -> tuple[bytes, list]:
        """Send one request and wait for its reply.

        Returns:
          ``(status, payload frames as zmq.Frame)``.

        Raises:
          PeerRefusedError: the service refused the token.
          PeerTimeoutError: no reply within ``timeout_s`` seconds.
          RequestCancelled: :meth:`cancel` was called.
          ProtocolError: the reply is malformed or the service says the request was.
        """
        rid = struct.pack("<Q", next(self._ids))
        with self._lock:
            self._check_cancelled(kind)
            try:
                self._sock.send_multipart([MAGIC, kind, rid, self._token, *payload],
                                          flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # the send queue to an unreachable peer is full
                raise PeerTimeoutError(f"cannot send to the {self.name} at {self.address}: "
                                       "its queue is full (the peer is gone?)") from None
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left > 0 and not self._sock.poll(int(min(left, CANCEL_POLL_S) * 1000) + 1):
                    self._check_cancelled(kind)
                    continue            # no reply yet: wait on in slices (cancel is checked)
                if left <= 0:
                    # a fresh socket: a request still queued for a peer that is down must not
                    # be delivered if the peer comes back (e.g. a put the caller gave up on)
                    self._sock.close()
                    self._connect()
                    raise PeerTimeoutError(f"no reply from the {self.name} at {self.address} "
                                           f"within {timeout_s:.1f} s")
                frames = self._sock.recv_multipart(copy=False)
                if len(frames) < 3 or frames[0].bytes != MAGIC:
                    raise ProtocolError(f"malformed reply from the {self.name} at {self.address}")
                if frames[2].bytes == rid:
                    break  # else: a late reply to an earlier request that timed out
        status, rest = frames[1].bytes, frames[3:]
        if status == REFUSED:
            raise PeerRefusedError(f"the {self.name} at {self.address} refused the request: "
                                   "wrong or missing token")
        if status == BAD_REQUEST:
            raise ProtocolError(f"the {self.name} at {self.address} rejected a malformed request")
        if status == SERVER_ERROR:
            why = rest[0].bytes.decode("utf-8", "replace") if rest else "?"
            raise RemoteError(f"the {self.name} at {self.address} failed: {why}")
        return status, rest

    def _check_cancelled(self, kind: bytes) -> None:
        if self._cancelled.is_set():
            raise RequestCancelled(f"a {kind.decode(errors='replace')} request to the "
                                   f"{self.name} at {self.address} was cancelled")

    def close(self) -> None:
        self._sock.close()


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(frame) -> object:
    try:
        return json.loads(bytes(frame.buffer if hasattr(frame, "buffer") else frame))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"expected a JSON frame: {e}") from None
