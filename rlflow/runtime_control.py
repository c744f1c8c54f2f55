"""Run control between the two programs: admission (staleness), status, stop.

The learner's weight coordinator (:class:`rlflow.exchange.coordinator.Coordinator`) also
answers ``status`` requests here (:class:`RunCoordinator`, same socket and address, so a
pod needs no extra port). A sampler sends its figures (tokens/s, slot occupancy, idle time,
swap times, its prompt iterator state) and gets back what it needs to decide what to do
next (:class:`ControlReply`): the learner's version, the newest published version, how
many groups the learner has accepted and holds in its buffer, whether the run is done.

**Admission** (:func:`groups_to_admit`, the pure rule; AReaL's rollout control, Fu et al.
2025, Sec. 5): a sampler generating with policy version ``v`` may have at most
``(v + 1 + k) * groups_per_step`` groups accepted by the learner, buffered, or in flight,
with ``k = runtime.max_staleness``. So

* ``k = 0`` is the synchronous on-policy mode: exactly ``groups_per_step`` groups are made
  with version ``v``, then the sampler waits for ``v + 1``; every consumed sample is
  version-current.
* A group the learner rejects (too stale, malformed, no reward variance under dynamic
  sampling) is counted neither as accepted nor as buffered, so its slot in the budget opens
  again and the sampler makes a replacement: the learner never waits forever for groups the
  sampler thinks it already delivered (the "staleness deadlock").
* A step the learner skips (its groups leave no sample for the loss,
  ``rlflow.learner.skips``) takes back its groups' count from ``accepted`` too: the version
  does not advance, so without that the budget would shrink by a step's groups with every
  skip and the run would deadlock.
* After a sampler restart its in-flight groups are gone from the count as well, and it
  resumes with the newest published weights.
"""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from rlflow.exchange import wire
from rlflow.exchange.coordinator import Coordinator

STATUS = b"status"
_BYTES_KEY = "__bytes_base64__"


def groups_to_admit(*, version: int, groups_per_step: int, max_staleness: int,
                    accepted: int, buffered: int, in_flight: int, num_samplers: int = 1
                    ) -> int:
    """How many new groups a sampler generating with ``version`` may start now.

    Args:
      version: policy version of the sampler's current weights (>= 0).
      groups_per_step: groups the learner consumes per step (``learner.groups_per_step``).
      max_staleness: ``runtime.max_staleness`` (k >= 0).
      accepted: groups the learner has taken from the buffer and accepted, in total.
      buffered: groups in the learner's buffer now.
      in_flight: groups this sampler has started and not yet delivered.
      num_samplers: sampler hosts sharing the budget (each gets an equal share).

    Returns:
      ``max(0, ceil(((version + 1 + k) * groups_per_step - accepted - buffered) /
      num_samplers) - in_flight)``.
    """
    if version < 0 or groups_per_step < 1 or max_staleness < 0 or num_samplers < 1:
        raise ValueError(f"bad admission inputs: version={version}, groups_per_step="
                         f"{groups_per_step}, max_staleness={max_staleness}, "
                         f"num_samplers={num_samplers}")
    budget = (version + 1 + max_staleness) * groups_per_step - accepted - buffered
    share = -(-budget // num_samplers) if budget > 0 else 0
    return max(0, share - in_flight)


def encode_state(state: Any) -> Any:
    """A prompt-iterator state for JSON (bytes become base64)."""
    if isinstance(state, (bytes, bytearray)):
        return {_BYTES_KEY: base64.b64encode(bytes(state)).decode("ascii")}
    return state


def decode_state(state: Any) -> Any:
    if isinstance(state, dict) and set(state) == {_BYTES_KEY}:
        return base64.b64decode(state[_BYTES_KEY])
    return state


@dataclass
class ControlReply:
    """What a sampler learns from one status request.

    Attributes:
      done: the learner finished (or is stopping): the sampler exits.
      learner_version: the learner's current policy version (= steps taken).
      published_version: newest version the samplers can pull.
      accepted: groups the learner has accepted in total.
      buffered: groups in the learner's buffer now.
      data_state: prompt iterator state to restore (only in the reply to a sampler's first
        request: from the learner's checkpoint, or the last state a previous sampler
        instance reported), else None.
    """

    done: bool = False
    learner_version: int = 0
    published_version: int = -1
    accepted: int = 0
    buffered: int = 0
    data_state: Any = None


@dataclass
class SamplerStatus:
    """Latest figures a sampler reported (``status`` request body), plus arrival time."""

    consumer: str = ""
    instance: int = 0
    version: int = -1
    prompts_started: int = 0
    data_state: Any = None
    metrics: dict = field(default_factory=dict)
    received: float = 0.0
    saw_done: bool = False


class RunCoordinator(Coordinator):
    """The learner's coordinator: weight offers (``latest``) and run control (``status``).

    Args:
      publisher: weight publisher (see :class:`Coordinator`).
      buffer_counts: ``() -> (accepted, buffered)`` read on each status request.
      bind_address, port, token: where to listen (see ``rlflow.exchange.wire``).
    """

    def __init__(self, publisher, *, buffer_counts: Callable[[], tuple[int, int]],
                 bind_address: str = "127.0.0.1", port: int = 0, token: str = ""):
        super().__init__(publisher, bind_address=bind_address, port=port, token=token)
        self._counts = buffer_counts
        self._lock = threading.Lock()
        self.done = False
        self.learner_version = 0
        self.published_version = -1
        self.data_state: Any = None        # for a (re)starting sampler
        self.statuses: dict[str, SamplerStatus] = {}
        self._seen: set[tuple[str, int]] = set()

    def set_progress(self, *, learner_version: Optional[int] = None,
                     published_version: Optional[int] = None, done: Optional[bool] = None):
        with self._lock:
            if learner_version is not None:
                self.learner_version = int(learner_version)
            if published_version is not None:
                self.published_version = int(published_version)
            if done is not None:
                self.done = bool(done)

    def latest_status(self) -> Optional[SamplerStatus]:
        """The most recent status of any sampler (None before the first)."""
        with self._lock:
            if not self.statuses:
                return None
            return max(self.statuses.values(), key=lambda s: s.received)

    def acknowledged_done(self) -> bool:
        """Every sampler that reported has received a ``done`` reply since it was set."""
        with self._lock:
            return all(s.saw_done for s in self.statuses.values())

    def handle(self, identity, rid, kind, payload):
        if kind != STATUS:
            return super().handle(identity, rid, kind, payload)
        try:
            req = wire.loads(payload[0])
            status = SamplerStatus(
                consumer=str(req["consumer"]), instance=int(req.get("instance", 0)),
                version=int(req.get("version", -1)),
                prompts_started=int(req.get("prompts_started", 0)),
                data_state=req.get("data_state"), metrics=dict(req.get("metrics", {})),
                received=time.time())
        except (wire.ProtocolError, KeyError, TypeError, ValueError, IndexError):
            return wire.BAD_REQUEST, [b"expected a status {consumer, version, ...}"]
        accepted, buffered = self._counts()
        with self._lock:
            key = (status.consumer, status.instance)
            first = key not in self._seen
            self._seen.add(key)
            if status.data_state is not None:
                self.data_state = status.data_state
            status.saw_done = self.done
            self.statuses[status.consumer] = status
            reply = ControlReply(done=self.done, learner_version=self.learner_version,
                                 published_version=self.published_version,
                                 accepted=accepted, buffered=buffered,
                                 data_state=self.data_state if first else None)
        return wire.OK, [wire.dumps(asdict(reply))]


class ControlClient:
    """Sampler side of the run control (a second socket to the coordinator's address).

    Args:
      address: the coordinator's endpoint ``tcp://host:port``.
      consumer_id: this sampler host's name.
      instance: restart count of this sampler program.
      token: the shared secret.
      timeout_s: seconds to wait for an answer before raising
        :class:`rlflow.exchange.wire.PeerTimeoutError` (the learner is gone).
    """

    def __init__(self, address: str, *, consumer_id: str, instance: int = 0, token: str = "",
                 timeout_s: float = 60.0):
        self.consumer_id, self.instance, self.timeout_s = consumer_id, instance, timeout_s
        self._req = wire.Requester(address, token=token, name="learner's run control")

    def status(self, *, version: int, prompts_started: int, data_state: Any = None,
               metrics: Optional[dict] = None) -> ControlReply:
        body = {"consumer": self.consumer_id, "instance": self.instance, "version": version,
                "prompts_started": prompts_started, "data_state": data_state,
                "metrics": metrics or {}}
        status, rest = self._req.request(STATUS, [wire.dumps(body)], timeout_s=self.timeout_s)
        if status != wire.OK:
            raise wire.ProtocolError(f"run control answered {status!r}")
        return ControlReply(**wire.loads(rest[0]))

    def close(self) -> None:
        self._req.close()
