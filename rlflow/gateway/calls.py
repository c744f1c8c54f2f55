"""Generation calls from the gateway's HTTP threads to the continuous batcher.

The batcher is driven by one thread (the sampler program's loop). An HTTP handler puts a
call (prompt ids, ``n``, sampling) on a :class:`CallQueue` and waits; the loop
:meth:`~CallQueue.pump` s the queued calls into the batcher as :class:`Request` s (they share
slots, weight swaps and policy versions with the rollouts) and passes what
``batcher.step()`` returns through :meth:`~CallQueue.take`, which answers the gateway's
groups and returns the others. Each call is one request with ``n`` samples whose prompt is the
whole conversation so far (prefilled whole: there is no prefix cache across calls).

:class:`BatcherThread` owns a batcher and runs that loop on its own (a gateway without the
sampler program: tests, local serving).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError, TimeoutError as FutureTimeout
import numpy as np

from rlflow.gateway.sessions import GatewayError
from rlflow.sampler.requests import Request

log = logging.getLogger("rlflow.gateway")

#: Gateway requests are numbered from here (far from any data set's prompt ids).
PROMPT_ID_BASE = 1 << 40


class CallQueue:
    """Calls waiting for the batcher, and the futures of those submitted."""

    def __init__(self):
        self._queue: "queue.Queue[tuple]" = queue.Queue()
        self._submitted: dict = {}           # id(Request) -> (Request, Future)
        self._ids = itertools.count(PROMPT_ID_BASE)
        self.wake = threading.Event()
        self.closed = False

    def generate(self, prompt_ids, n: int, sampling, timeout_s: float) -> list:
        """Generate ``n`` completions of ``prompt_ids`` (blocks the calling thread).

        Returns:
          ``n`` :class:`rlflow.sampler.requests.Completion` s, by sample index.

        Raises:
          GatewayError: 400 when the batcher refuses the prompt (its message), 503 when the
            gateway is closing, 504 when no answer came within ``timeout_s``.
        """
        if self.closed:
            raise GatewayError(503, "unavailable", "the gateway is shutting down")
        request = Request(prompt_id=next(self._ids),
                          prompt_tokens=np.asarray(prompt_ids, np.int32), num_samples=int(n),
                          sampling=sampling)
        future: Future = Future()
        self._queue.put((request, future))
        self.wake.set()
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            future.cancel()
            raise GatewayError(504, "generation_timeout",
                               f"no completion within {timeout_s:g} s (gateway.call_timeout_s); "
                               f"the sampler is busy or stalled") from None

    def pump(self, batcher) -> int:
        """Submit the queued calls to ``batcher`` (call from the thread that steps it).
        Returns how many were submitted."""
        n = 0
        while True:
            try:
                request, future = self._queue.get_nowait()
            except queue.Empty:
                return n
            if future.cancelled():
                continue
            try:
                batcher.submit(request)
            except Exception as e:  # noqa: BLE001 - the caller gets the batcher's reason
                future.set_exception(GatewayError(400, "invalid_request_error", str(e)))
                continue
            self._submitted[id(request)] = (request, future)
            n += 1

    def take(self, groups) -> list:
        """Answer the gateway's groups among ``groups``; returns the others."""
        rest = []
        for g in groups:
            got = self._submitted.pop(id(g.request), None)
            if got is None:
                rest.append(g)
                continue
            future = got[1]
            try:
                future.set_result(list(g.completions))
            except InvalidStateError:        # the caller timed out and cancelled it
                pass
        return rest

    @property
    def in_flight(self) -> int:
        return len(self._submitted) + self._queue.qsize()

    def close(self, why: str = "the gateway is shutting down") -> None:
        """Fail every waiting call with 503."""
        self.closed = True
        while True:
            try:
                _, future = self._queue.get_nowait()
            except queue.Empty:
                break
            future.set_exception(GatewayError(503, "unavailable", why))
        for _, future in self._submitted.values():
            if not future.done():
                future.set_exception(GatewayError(503, "unavailable", why))
        self._submitted.clear()


class BatcherThread:
    """A thread that steps ``batcher`` for a :class:`CallQueue` (and nothing else).

    ``on_groups`` (optional): called with the non-gateway groups a step returned."""

    def __init__(self, batcher, calls: CallQueue, on_groups=None):
        self.batcher, self.calls, self.on_groups = batcher, calls, on_groups
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gateway-batcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.calls.pump(self.batcher)
                if not self.batcher.has_work:
                    self.calls.wake.wait(0.05)
                    self.calls.wake.clear()
                    continue
                rest = self.calls.take(self.batcher.step())
                if rest and self.on_groups is not None:
                    self.on_groups(rest)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting call
            self.error = e
            log.exception("the gateway's batcher thread failed")
            self.calls.close(f"the sampler failed: {type(e).__name__}: {e}")

    def close(self) -> None:
        self._stop.set()
        self.calls.wake.set()
        self._thread.join(timeout=30)
        self.calls.close()

