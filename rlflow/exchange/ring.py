"""The bounded ring of rollout groups (in-process, thread-safe): the buffer's state.

:class:`RingBuffer` holds whole groups (never split) up to ``capacity``. When full, a
producer blocks (``when_full="block"``) or the oldest group is dropped and counted
(``"drop_oldest"``). A consumer blocks until it has ``n`` groups. Every wait has a timeout
that raises :class:`BufferTimeoutError` naming the side that stopped: a producer that waits
for space is told the *consumer* stopped consuming; a consumer that waits for groups is told
the *producer* stopped producing. A producer can report a failure
(:meth:`RingBuffer.report_error`); the consumer's next :meth:`RingBuffer.get_groups` raises it
as :class:`ProducerError` at once instead of waiting out its timeout.

The ZeroMQ server (``rlflow.exchange.buffer``) wraps one ring; the learner consumes from the
ring in its own process.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np

Group = Mapping[str, np.ndarray]


class BufferTimeoutError(TimeoutError):
    """A wait on the ring buffer ran out.

    Attributes:
      stalled_side: "consumer" (a producer found the buffer full for too long) or "producer"
        (a consumer found too few groups for too long).
    """

    def __init__(self, stalled_side: str, message: str):
        self.stalled_side = stalled_side
        super().__init__(message)


class ProducerError(RuntimeError):
    """A producer reported that it failed (e.g. a prompt that raises at every retry)."""


class BufferClosedError(RuntimeError):
    """The ring buffer was closed while a producer or consumer used it."""


class RingBuffer:
    """Bounded FIFO of groups with blocking, timeouts, drop-oldest and metrics.

    Args:
      capacity: most groups held (>= 1).
      when_full: "block" the producer or "drop_oldest" group (counted in ``dropped_full``).
      timeout_s: default seconds a producer or consumer waits before
        :class:`BufferTimeoutError`.

    Raises:
      ValueError: capacity < 1, an unknown ``when_full`` or a timeout <= 0.
    """

    def __init__(self, capacity: int, *, when_full: str = "block", timeout_s: float = 300.0):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 group, got {capacity}")
        if when_full not in ("block", "drop_oldest"):
            raise ValueError(f"when_full must be 'block' or 'drop_oldest', got {when_full!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.capacity, self.when_full, self.timeout_s = capacity, when_full, timeout_s
        self._groups: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._errors: collections.deque = collections.deque()
        self._closed = False
        self._m = dict(put=0, got=0, dropped_full=0, dropped_filtered=0, producer_errors=0,
                       bytes_in=0, producer_wait_s=0.0, consumer_wait_s=0.0)

    @classmethod
    def from_config(cls, cfg) -> "RingBuffer":
        """Build from a :class:`rlflow.config.BufferConfig`."""
        return cls(cfg.capacity, when_full=cfg.when_full, timeout_s=cfg.timeout_s)

    # -------------------------------------------------------------------- producer side

    def try_put(self, group: Group, nbytes: int = 0) -> bool:
        """Add a group without waiting. Returns False only when full under "block"."""
        with self._lock:
            self._check_open()
            return self._insert(group, nbytes)

    def _insert(self, group: Group, nbytes: int) -> bool:
        if len(self._groups) >= self.capacity:
            if self.when_full == "block":
                return False
            self._groups.popleft()
            self._m["dropped_full"] += 1
        self._groups.append(group)
        self._m["put"] += 1
        self._m["bytes_in"] += nbytes
        self._not_empty.notify_all()
        return True

    def put(self, group: Group, *, timeout: float | None = None, nbytes: int = 0) -> None:
        """Add a group, waiting for space under "block".

        Raises:
          BufferTimeoutError: (stalled_side "consumer") no space within ``timeout``
            (default ``timeout_s``) seconds.
          BufferClosedError: the ring was closed.
        """
        timeout = self.timeout_s if timeout is None else timeout
        start = time.monotonic()
        deadline = start + timeout
        with self._lock:
            while True:
                self._check_open()
                if len(self._groups) < self.capacity or self.when_full == "drop_oldest":
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._m["producer_wait_s"] += time.monotonic() - start
                    raise self.producer_timeout(timeout)
                self._not_full.wait(left)
            self._m["producer_wait_s"] += time.monotonic() - start
            self._insert(group, nbytes)

    def producer_timeout(self, waited_s: float) -> BufferTimeoutError:
        """The error a producer gets after waiting ``waited_s`` seconds for space."""
        return BufferTimeoutError(
            "consumer", f"ring buffer full ({self.capacity} groups) for {waited_s:.1f} s: the "
            "consumer (learner) stopped consuming")

    def add_producer_wait(self, seconds: float) -> None:
        """Account time a remote producer waited for space (the server's pending puts)."""
        with self._lock:
            self._m["producer_wait_s"] += seconds

    def report_error(self, message: str) -> None:
        """Record a producer failure; the consumer's next ``get_groups`` raises it."""
        with self._lock:
            self._errors.append(message)
            self._m["producer_errors"] += 1
            self._not_empty.notify_all()

    # -------------------------------------------------------------------- consumer side

    def get_groups(self, n: int, *, timeout: float | None = None,
                   accept: Callable[[Group], bool] | None = None) -> list[Group]:
        """Take exactly ``n`` whole groups, oldest first, waiting for them.

        Args:
          n: number of groups (>= 1).
          timeout: seconds to wait (default ``timeout_s``).
          accept: optional filter called on each group as it is taken (under the ring's
            lock: keep it cheap and pure, e.g. a staleness check against the learner's
            version). A group it rejects is dropped and counted in ``dropped_filtered``,
            which frees its slot for the producer, so a full ring of stale groups never
            deadlocks.

        Raises:
          ProducerError: a producer reported a failure (raised once per report).
          BufferTimeoutError: (stalled_side "producer") fewer than ``n`` accepted groups
            arrived within the timeout; groups already taken go back to the front.
          BufferClosedError: the ring was closed.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        timeout = self.timeout_s if timeout is None else timeout
        start = time.monotonic()
        deadline = start + timeout
        taken: list[Group] = []
        dropped = 0
        with self._lock:
            try:
                while len(taken) < n:
                    if self._errors:
                        raise ProducerError(f"producer failed: {self._errors.popleft()}")
                    self._check_open()
                    if self._groups:
                        group = self._groups.popleft()
                        try:
                            ok = accept is None or accept(group)
                        except BaseException:
                            self._groups.appendleft(group)
                            raise
                        self._not_full.notify()
                        if ok:
                            taken.append(group)
                        else:
                            dropped += 1
                            self._m["dropped_filtered"] += 1
                        continue
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BufferTimeoutError(
                            "producer", f"waited {timeout:.1f} s for {n} groups, got "
                            f"{len(taken)} (and dropped {dropped} rejected by the filter): the "
                            "producer (sampler) stopped producing")
                    self._not_empty.wait(left)
            except BaseException:
                self._groups.extendleft(reversed(taken))
                raise
            finally:
                self._m["consumer_wait_s"] += time.monotonic() - start
            self._m["got"] += len(taken)
        return taken

    # -------------------------------------------------------------------- life cycle

    def close(self) -> None:
        """Wake every waiter with :class:`BufferClosedError`; later calls raise it too."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("ring buffer is closed")

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def metrics(self) -> dict[str, Any]:
        """Counters: ``fill`` (groups held), ``capacity``, ``fill_fraction``, ``put``, ``got``,
        ``dropped_full``, ``dropped_filtered``, ``producer_errors``, ``bytes_in`` and the
        cumulative ``producer_wait_s`` / ``consumer_wait_s`` (seconds)."""
        with self._lock:
            fill = len(self._groups)
            return dict(self._m, fill=fill, capacity=self.capacity,
                        fill_fraction=fill / self.capacity)
