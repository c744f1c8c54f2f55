"""A local reward server for the served-reward tests: the stdlib ``ThreadingHTTPServer`` on
127.0.0.1 in a daemon thread, answering by a function the test gives.

``respond(n, path, body, headers) -> (status, text)`` is called for the n-th request (0, 1,
...; ``body`` the parsed JSON, or the raw text when it is not JSON); returning :data:`HANG`
holds the request until :meth:`RewardServer.stop` (or ``release``). The server records every
request (:attr:`RewardServer.requests`) and how many it answered (:attr:`answered`, counted
before the reply is written).
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: ``respond``'s answer for "never reply" (held until the server stops).
HANG = object()


def scores_reply(body, score) -> tuple:
    """A ``scores`` protocol reply: ``{"scores": [score(item) for item in body["samples"]]}``."""
    return 200, json.dumps({"scores": [score(item) for item in body["samples"]]})


def chat_reply(text: str) -> tuple:
    """An OpenAI-compatible chat completion whose message is ``text``."""
    return 200, json.dumps({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "finish_reason": "stop",
         "message": {"role": "assistant", "content": text}}]})


class RewardServer:
    """See the module docstring. ``start(port)`` (0: any free port) / ``stop()``; a stopped
    server starts again on the same port with ``start(server.port)``."""

    def __init__(self, respond):
        self.respond = respond
        self.requests: list = []            # (path, body, headers) in arrival order
        self.answered = 0
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._connections: set = set()      # open client connections (closed by stop)
        self._httpd = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int = 0) -> "RewardServer":
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"        # keep-alive, as real servers

            def setup(self):
                super().setup()
                with server._lock:
                    server._connections.add(self.connection)

            def finish(self):
                with server._lock:
                    server._connections.discard(self.connection)
                super().finish()

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = raw
                with server._lock:
                    n = len(server.requests)
                    server.requests.append((self.path, body, dict(self.headers)))
                out = server.respond(n, self.path, body, self.headers)
                if out is HANG:
                    server.release.wait()
                    return
                status, text = out
                data = text.encode()
                with server._lock:            # counted before the client can read it
                    server.answered += 1
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.release.clear()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, args=(0.01,), daemon=True,
                         name="test-reward-server").start()
        return self

    def stop(self) -> None:
        """Stop serving, close the port and every open connection (as a server process that
        exits would); held requests are released unanswered."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            with self._lock:
                for conn in list(self._connections):
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            self.release.set()
            self._httpd = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
