"""The gateway's HTTP server (standard library ``http.server``, one thread per connection).

Routes (every one needs ``Authorization: Bearer <run key>``; 401 otherwise)::

    POST /s/<session>/v1/chat/completions     OpenAI chat completions in a session
    POST /s/<session>/v1/completions          OpenAI completions in a session
    GET  /s/<session>/v1/models               the served model
    POST /v1/chat/completions, /v1/completions    the same, session in ``X-Rlflow-Session``
    POST /rlflow/v1/sessions                  open a session ({"task": ..., "session": id?})
                                              -> {"session", "base_url"}
    POST /rlflow/v1/sessions/<session>/end    end it: {"reward": float} or {"error": str}
    GET  /rlflow/v1/sessions/<session>        its record (head episode, counts) as JSON
    POST /rlflow/v1/next                      the agent runner's next session to run
                                              (long poll; 204 when none came)
    GET  /rlflow/v1/metrics                   the gateway's counters

An agent's base URL is ``http://<host>:<port>/s/<session>/v1``: an OpenAI client given it and
the key needs nothing else. A session id is 128 random bits: knowing it is what lets an agent
call in, or end, that session (the run key alone does not name one).

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 malformed
JSON or a refused field (named), 401 wrong key, 404 unknown session or route, 409 a closed
session, 413 a body over ``gateway.max_request_bytes``, 503 shutting down, 504 the sampler did
not answer in time. A failed call records nothing and the session stays usable.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from rlflow.gateway.openai_api import chat_chunks, error_body
from rlflow.gateway.sessions import GatewayError

log = logging.getLogger("rlflow.gateway")


class GatewayServer:
    """Serves a :class:`rlflow.gateway.service.Gateway` on ``host:port`` (port 0: any free).

    Args:
      gateway: the calls and sessions.
      key: the run's key (clients send ``Authorization: Bearer <key>``).
      host, port: where to bind (the launcher's choice; default loopback).
      max_request_bytes: largest request body (413 past it).
      next_session: ``timeout_s -> Optional[dict]``: the agent runner's next session (the
        rollouts' queue), or None (the route answers 404).

    Attributes:
      port: the bound port. ``base_url``: ``http://host:port``.
    """

    def __init__(self, gateway, key: str, *, host: str = "127.0.0.1", port: int = 0,
                 max_request_bytes: int = 8 << 20, next_session=None):
        if not key:
            raise ValueError("the gateway needs a non-empty key")
        self.gateway, self.key = gateway, key
        self.max_request_bytes = int(max_request_bytes)
        self.next_session = next_session
        owner = self

        class Handler(_Handler):
            server_owner = owner

        self.httpd = _Server((host, int(port)), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self.base_url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="gateway-http",
                                        daemon=True)
        self._thread.start()
        log.info("gateway serving on %s", self.base_url)

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL of a session."""
        return f"{self.base_url}/s/{session_id}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)


class _Server(ThreadingHTTPServer):
    request_queue_size = 256          # many agents connect at once (the default is 5)

    def handle_error(self, request, client_address):
        import sys

        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, TimeoutError)):      # a client went away
            log.debug("gateway: client %s: %s", client_address, err)
            return
        log.exception("gateway: error serving %s", client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_owner: GatewayServer
    timeout = 120                     # a client that stops sending mid-request is dropped

    def log_message(self, format, *args):       # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    # ------------------------------------------------------------------ plumbing
    def _send(self, status: int, body: Optional[dict] = None, *, raw: bytes = b"",
              content_type: str = "application/json") -> None:
        data = raw if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)

    def _error(self, err: GatewayError) -> None:
        self.server_owner.gateway.store.count("refused_calls")
        try:
            self._send(err.status, error_body(err))
        except (BrokenPipeError, ConnectionResetError):      # the client is gone
            self.close_connection = True

    def _read(self) -> bytes:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        limit = self.server_owner.max_request_bytes
        if n < 0 or n > limit:
            self.close_connection = True          # the body is not read
            raise GatewayError(413 if n > limit else 400, "request_too_large" if n > limit
                               else "invalid_request_error",
                               f"the request body is {n} bytes; at most {limit} "
                               f"(gateway.max_request_bytes)" if n > limit else
                               "bad Content-Length header")
        return self.rfile.read(n) if n else b""

    @staticmethod
    def _parse(data: bytes):
        try:
            return json.loads(data or b"{}", parse_constant=_no_constant)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise GatewayError(400, "invalid_json", f"the request body is not valid JSON: "
                               f"{e}") from None

    def _auth(self) -> None:
        got = self.headers.get("Authorization", "")
        want = f"Bearer {self.server_owner.key}"
        if not hmac.compare_digest(got.encode(), want.encode()):
            raise GatewayError(401, "invalid_api_key", "wrong or missing API key (send "
                               "'Authorization: Bearer <the run's gateway key>')")

    def _route(self, method: str) -> None:
        try:
            path = self.path.split("?", 1)[0].rstrip("/")
            data = self._read() if method == "POST" else b""
            self._auth()
            body = self._parse(data) if method == "POST" else None
            self._dispatch(method, path, body)
        except GatewayError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            log.info("gateway: the client %s hung up", self.address_string())
        except Exception as e:  # noqa: BLE001 - a bug: 500 with the reason, the server goes on
            log.exception("gateway: %s %s failed", method, self.path)
            self._error(GatewayError(500, "internal_error", f"{type(e).__name__}: {e}"))

    def do_POST(self):  # noqa: N802 - http.server's name
        self._route("POST")

    def do_GET(self):  # noqa: N802
        self._route("GET")

    # ------------------------------------------------------------------ routes
    def _dispatch(self, method: str, path: str, body) -> None:
        owner = self.server_owner
        gw = owner.gateway
        parts = path.strip("/").split("/")
        session_id = None
        if len(parts) >= 3 and parts[0] == "s":
            session_id, parts = parts[1], parts[2:]
        elif parts[:1] == ["v1"]:
            session_id = self.headers.get("X-Rlflow-Session")
        if parts[:1] == ["v1"]:
            tail = "/".join(parts[1:])
            if method == "GET" and tail == "models":
                return self._send(200, {"object": "list", "data": [
                    {"id": gw.model_name, "object": "model", "created": 0,
                     "owned_by": "rlflow"}]})
            if method == "POST" and tail in ("chat/completions", "completions"):
                if not session_id:
                    raise GatewayError(400, "missing_session",
                                       "no session: use the base URL /s/<session>/v1 or the "
                                       "X-Rlflow-Session header")
                session = gw.store.get(session_id)
                if tail == "completions":
                    return self._send(200, gw.completion(session, body)[0])
                response, spec = gw.chat(session, body)
                if spec.stream:
                    return self._stream(chat_chunks(response, spec.include_usage))
                return self._send(200, response)
        if parts[:2] == ["rlflow", "v1"]:
            return self._admin(method, parts[2:], body)
        raise GatewayError(404, "unknown_route", f"no route {method} {path}")

    def _stream(self, chunks) -> None:
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        self._send(200, raw=data + b"data: [DONE]\n\n", content_type="text/event-stream")

    def _admin(self, method: str, parts: list, body) -> None:
        owner = self.server_owner
        gw = owner.gateway
        if parts == ["metrics"] and method == "GET":
            return self._send(200, gw.store.metrics())
        if parts == ["next"] and method == "POST" and owner.next_session is not None:
            wait = body.get("wait_s", 1.0) if isinstance(body, dict) else 1.0
            got = owner.next_session(min(max(float(wait), 0.0), 30.0))
            if got is None:
                return self._send(204)
            return self._send(200, dict(got, base_url=owner.session_url(got["session"])))
        if parts == ["sessions"] and method == "POST":
            body = body if isinstance(body, dict) else {}
            s = gw.store.open(body.get("session") or None, task=body.get("task"))
            return self._send(200, {"session": s.id, "base_url": owner.session_url(s.id)})
        if len(parts) == 3 and parts[0] == "sessions" and parts[2] == "end" and method == "POST":
            session = gw.store.get(parts[1])
            reward, error = _end_fields(body)
            gw.end(session, reward=reward, error=error)
            return self._send(200, {"session": session.id, "status": session.status})
        if len(parts) == 2 and parts[0] == "sessions" and method == "GET":
            return self._send(200, session_record(gw.store, parts[1]))
        raise GatewayError(404, "unknown_route", f"no route {method} /rlflow/v1/"
                           f"{'/'.join(parts)}")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _end_fields(body) -> tuple:
    if not isinstance(body, dict):
        raise GatewayError(400, "invalid_request_error", "the body must be a JSON object with "
                           "'reward' (a number) or 'error' (a string)")
    reward, error = body.get("reward"), body.get("error") or ""
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise GatewayError(400, "invalid_request_error",
                           f"'reward' must be a finite number or null, got {reward!r}", "reward")
    if not isinstance(error, str):
        raise GatewayError(400, "invalid_request_error", "'error' must be a string", "error")
    return (None if reward is None else float(reward)), error


def session_record(store, session_id: str) -> dict:
    """A session's state as JSON: status, reward, the head episode's lists, trajectories."""
    s = store.peek(session_id)
    if s is None:
        raise GatewayError(404, "unknown_session", f"unknown session {session_id!r}")
    ep = s.episode()
    return {"session": s.id, "status": s.status, "reward": s.reward, "error": s.error,
            "trajectories": len(s.trajectories), "head": s.head,
            "episode": None if ep is None else {k: v.tolist() for k, v in ep.items()}}
