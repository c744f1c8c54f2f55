"""The sampler program's background pieces: its weight-pull and heartbeat threads, and the
totals its rates are computed from.

:class:`WeightPuller` pulls each newly published version on its own thread so decoding never
waits on a pull; :class:`Heartbeat` keeps a replica counted alive while it compiles or
decodes (``rlflow.control.replicas``); :class:`RateCounters` keeps the decode loop's totals
(tokens, slot-steps, idle seconds) that the learner turns into rates over its steps.
"""

from __future__ import annotations

import logging
import threading
import time

from rlflow.control.run_control import ControlClient
from rlflow.control.replicas import HEARTBEAT_S

log = logging.getLogger("rlflow.sampler")

class RateCounters:
    """The decode loop's running totals since this sampler instance started: tokens decoded,
    slot-steps used / run, seconds idle (blocked on the buffer or on weights).

    Reported as totals with every status (:meth:`figures`); the learner turns them into
    rates over each step's interval and over the run
    (:class:`rlflow.control.replica_metrics.StepRates`). A rate of the last second sampled at
    status time read 0 whenever that second happened to be idle: on short or slow runs,
    every step. ``chips``: devices of the replica's mesh (reported as ``sampler/chips``, for
    ``sampler/tokens_per_s_per_chip``).
    """

    def __init__(self, chips: int = 1):
        self.chips = max(int(chips), 1)
        self.tokens = self.slots_used = self.slots_total = 0
        self.idle = 0.0

    def add(self, tokens=0, slots_used=0, slots_total=0, idle=0.0):
        self.tokens += tokens
        self.slots_used += slots_used
        self.slots_total += slots_total
        self.idle += idle

    def figures(self) -> dict:
        """``sampler/tokens_total``, ``slot_steps_used``, ``slot_steps_total``,
        ``idle_s_total``: the totals so far, and ``sampler/chips`` (floats)."""
        return {"sampler/tokens_total": float(self.tokens),
                "sampler/slot_steps_used": float(self.slots_used),
                "sampler/slot_steps_total": float(self.slots_total),
                "sampler/idle_s_total": float(self.idle),
                "sampler/chips": float(self.chips)}


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
