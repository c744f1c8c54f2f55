"""The sampler program's background pieces: its weight-pull and heartbeat threads, and the
window its rates are reported over.

:class:`WeightPuller` pulls each newly published version on its own thread so decoding never
waits on a pull; :class:`Heartbeat` keeps a replica counted alive while it compiles or
decodes (``rlflow.runtime.replicas``); :class:`RateWindow` turns the decode loop's counts into
the rates of the last ~``WINDOW_S`` seconds (tokens/s, slot occupancy, idle fraction).
"""

from __future__ import annotations

import logging
import threading
import time

from rlflow.runtime.control import ControlClient
from rlflow.runtime.replicas import HEARTBEAT_S

log = logging.getLogger("rlflow.sampler")

WINDOW_S = 1.0             # window of the rates reported to the learner (seconds)


class RateWindow:
    """Rates over the last closed window of about ``WINDOW_S`` seconds; ``chips``: devices
    of the replica's mesh (``sampler/tokens_per_s_per_chip`` = tokens/s over them)."""

    def __init__(self, chips: int = 1):
        self.chips = max(int(chips), 1)
        self.t0 = time.monotonic()
        self.tokens = self.slots_used = self.slots_total = 0
        self.idle = 0.0
        self.last: dict = {}

    def add(self, tokens=0, slots_used=0, slots_total=0, idle=0.0):
        self.tokens += tokens
        self.slots_used += slots_used
        self.slots_total += slots_total
        self.idle += idle

    def figures(self) -> dict:
        now = time.monotonic()
        dt = max(now - self.t0, 1e-9)
        current = {"sampler/tokens_per_s": self.tokens / dt,
                   "sampler/tokens_per_s_per_chip": self.tokens / dt / self.chips,
                   "sampler/slot_occupancy": self.slots_used / max(self.slots_total, 1),
                   "sampler/idle_frac": min(1.0, self.idle / dt)}
        if dt >= WINDOW_S:
            self.last = current
            self.t0, self.tokens, self.slots_used, self.slots_total, self.idle = \
                now, 0, 0, 0, 0.0
        return self.last or current


class WeightPuller:
    """Pulls new weight versions on a background thread and hands each to ``on_weights``
    (the batcher swaps it in before its next decode step), so decoding never waits on a
    pull. An error stops the thread and is re-raised by :meth:`check`."""

    def __init__(self, subscriber, on_weights):
        self.subscriber, self.on_weights = subscriber, on_weights
        self._want, self._stop = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rlflow-weight-puller",
                                        daemon=True)
        self._thread.start()

    def request(self) -> None:
        """A newer version was published: pull it (no-op while a pull is pending)."""
        self._want.set()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._want.wait(0.1):
                continue
            self._want.clear()
            try:
                t0 = time.monotonic()
                got = self.subscriber.poll()
                if got is not None:
                    self.on_weights(got[0], got[1], time.monotonic() - t0)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                if not self._stop.is_set():     # a pull cancelled by close() is no error
                    self._error = e
                return

    def close(self) -> None:
        """Stop the thread: cancel the pull in progress (``subscriber.cancel()``), then join.

        Without the cancel, a pull from a learner that is gone (a run stopped by SIGTERM)
        kept the thread calling into jaxlib past the join's timeout, and CPython's
        finalisation ended it inside a C++ frame, aborting the process.
        """
        self._stop.set()
        self.subscriber.cancel()
        self._thread.join(timeout=10.0)


class Heartbeat:
    """Sends a heartbeat every ``HEARTBEAT_S`` seconds on its own socket and thread, so a
    replica busy compiling or decoding still counts as alive; errors are logged (the main
    loop's status requests find a learner that is gone)."""

    def __init__(self, client: ControlClient):
        self.client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlflow-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.client.heartbeat()
            except Exception as e:  # noqa: BLE001 - the main loop decides
                if not self._stop.is_set():      # a heartbeat cancelled by close() is fine
                    log.warning("heartbeat: %s", e)

    def close(self) -> None:
        """Stop the thread, cancelling a heartbeat that waits for a learner that is gone."""
        self._stop.set()
        self.client.cancel()
        self._thread.join(timeout=5.0)
        self.client.close()
