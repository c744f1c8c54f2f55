"""Run control between the two programs: admission (staleness), status, stop.

The learner's weight coordinator (:class:`rlflow.exchange.coordinator.Coordinator`) also
answers ``status`` requests here (:class:`RunCoordinator`, same socket and address, so a
pod needs no extra port). A sampler replica sends its figures (tokens/s, slot occupancy,
idle time, swap times) and how many prompts it wants, and gets back what it needs
(:class:`ControlReply`): prompts leased by the learner's prompt ledger
(:mod:`rlflow.control.ledger`, which owns the prompt stream and applies the staleness
budget below once for all replicas), the learner's version, the newest published version,
whether the run is done. Replicas also send heartbeats from a background thread
(:mod:`rlflow.control.replicas`).

**Admission** (:func:`groups_to_admit`, the pure rule, applied by the ledger to all
replicas at once; AReaL's rollout control, Fu et al.
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

import logging
import threading
import uuid
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from rlflow.exchange import wire
from rlflow.exchange.coordinator import Coordinator
from rlflow.control.replicas import HEARTBEAT_S

STATUS = b"status"
HEARTBEAT = b"heartbeat"
# seconds without a heartbeat after which the run's end does not wait for a replica's ack
DONE_ACK_SILENCE_S = 3 * HEARTBEAT_S
log = logging.getLogger(__name__)


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


@dataclass
class ControlReply:
    """What a sampler replica learns from one status request.

    Attributes:
      done: the learner finished (or is stopping): the replica exits.
      learner_version: the learner's current policy version (= steps taken).
      published_version: newest version the replicas can pull.
      accepted: groups the learner has accepted in total.
      buffered: groups in the learner's buffer now.
      prompts: prompts the ledger leased to this replica with this reply (up to the
        request's ``want``, within the shared staleness budget): dicts with
        ``stream_index``, ``lease_id``, ``seed`` (request seed), ``prompt_id``,
        ``prompt_tokens`` (list of int), ``answer``.
      budget: groups the shared staleness budget still allows at this replica's version
        after this reply's leases (a replica with room asks again at once while > 0).
      weight_hosts: ``host:port`` of the weight coordinators of learner hosts 1..N-1 of a
        multi-host learner (each serves its host's shards; ``rlflow.learner.hosts``), else
        empty.
      eval_version: the held-out evaluation this replica is to run (the version requested,
        :mod:`rlflow.control.evals`), or -1 for none.
      launch: this start of the learner (a random hex id, new at each start of the run):
        the journal of partial generations tells a resumed run's versions from those of the
        launch before it (:mod:`rlflow.run.journal`).
    """

    done: bool = False
    learner_version: int = 0
    published_version: int = -1
    accepted: int = 0
    buffered: int = 0
    prompts: list = field(default_factory=list)
    budget: int = 0
    weight_hosts: list = field(default_factory=list)
    eval_version: int = -1
    launch: str = ""


@dataclass
class SamplerStatus:
    """Latest figures a replica reported (``status`` request body), plus arrival time."""

    consumer: str = ""
    instance: int = 0
    version: int = -1
    prompts_started: int = 0
    metrics: dict = field(default_factory=dict)
    received: float = 0.0
    saw_done: bool = False


def _jsonable_prompt(element: dict) -> dict:
    """A ledger element for the wire: plain ints, lists and strings."""
    return {"stream_index": int(element["stream_index"]), "lease_id": int(element["lease_id"]),
            "seed": int(element["seed"]), "prompt_id": int(element["prompt_id"]),
            "redispatched": bool(element.get("redispatched", False)),
            "prompt_tokens": [int(t) for t in element["prompt_tokens"]],
            "answer": str(element.get("answer", "")),
            # the record's text, for the environments of multi-turn episodes
            **({"prompt_text": str(element["prompt_text"])} if "prompt_text" in element
               else {})}


class RunCoordinator(Coordinator):
    """The learner's coordinator: weight offers (``latest``), run control (``status``) and
    replica heartbeats (``heartbeat``), on one socket.

    Args:
      publisher: weight offer source (see :class:`Coordinator`).
      buffer_counts: ``() -> (accepted, buffered)`` read on each status request.
      ledger: the run's :class:`rlflow.control.ledger.PromptLedger` (None: no prompts are
        leased, as in tests of the channel alone).
      replicas: :class:`rlflow.control.replicas.ReplicaTable`; every request of a replica
        counts as a heartbeat; replicas lost by timeout or restart get their leased
        prompts taken back (``ledger.release_replica``), checked on the serving thread.
      clock: monotonic clock (seconds) for the replica table.
      bind_address, port, token: where to listen (see ``rlflow.exchange.wire``).
      evals: the learner's :class:`rlflow.control.evals.EvalSchedule` (None: no held-out
        evaluation): a status names the evaluation its replica is to run and brings back
        the results of finished ones (``eval_results``); a lost replica's goes back.
    """

    def __init__(self, publisher, *, buffer_counts: Callable[[], tuple[int, int]],
                 ledger=None, replicas=None, clock: Callable[[], float] = time.monotonic,
                 bind_address: str = "127.0.0.1", port: int = 0, token: str = "",
                 evals=None):
        super().__init__(publisher, bind_address=bind_address, port=port, token=token)
        self._counts = buffer_counts
        self.ledger, self.replicas, self.clock = ledger, replicas, clock
        self.evals = evals
        self._lock = threading.Lock()
        self.done = False
        self.learner_version = 0
        self.published_version = -1
        self.statuses: dict[str, SamplerStatus] = {}
        self.released = 0          # leased prompts taken back from lost replicas
        self.weight_hosts: list = []   # learner hosts 1..N-1's weight coordinators
        self.launch = uuid.uuid4().hex   # this start of the learner (ControlReply.launch)

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
        """The most recent status of any replica (None before the first)."""
        with self._lock:
            if not self.statuses:
                return None
            return max(self.statuses.values(), key=lambda s: s.received)

    def live_statuses(self) -> dict[str, SamplerStatus]:
        """Latest status of each replica the replica table counts alive (all without one)."""
        with self._lock:
            alive = None if self.replicas is None else set(self.replicas.alive())
            return {k: v for k, v in self.statuses.items() if alive is None or k in alive}

    def check_replicas(self) -> None:
        """Raise ``NoReplicaError`` when no replica has been alive for the table's timeout."""
        if self.replicas is not None:
            with self._lock:
                self.replicas.check(self.clock())

    def restarts(self) -> dict[str, int]:
        """Replica name -> restarts the learner noticed."""
        if self.replicas is None:
            return {}
        with self._lock:
            return {n: r.restarts for n, r in self.replicas.replicas.items()}

    def timeouts(self) -> dict[str, int]:
        """Replica name -> times the learner declared it lost for silence
        (``runtime.replica_timeout_s``)."""
        if self.replicas is None:
            return {}
        with self._lock:
            return {n: r.timeouts for n, r in self.replicas.replicas.items()}

    def acknowledged_done(self, *, silent_s: float = DONE_ACK_SILENCE_S) -> bool:
        """Every live replica that reported has received a ``done`` reply since it was set.

        A replica not heard from for over ``silent_s`` seconds (no heartbeat, no status:
        killed or hung; the heartbeat thread beats every ``HEARTBEAT_S``) is not waited for,
        though the replica table still counts it alive until ``runtime.replica_timeout_s``:
        a run whose replica died just before the end stops without waiting for its ack.
        """
        with self._lock:
            now = self.clock()
            for name, status in self.statuses.items():
                if self.replicas is not None:
                    r = self.replicas.replicas.get(name)
                    if r is None or not r.alive or now - r.last_seen > silent_s:
                        continue
                if not status.saw_done:
                    return False
            return True

    def _beat(self, consumer: str, instance: int) -> None:
        """Under ``self._lock``."""
        if self.replicas is None:
            return
        for name in self.replicas.beat(consumer, instance, self.clock()):
            self._release(name, "restarted")

    def _release(self, name: str, why: str) -> None:
        n = self.ledger.release_replica(name) if self.ledger is not None else 0
        self.released += n
        log.warning("replica %s %s: %d leased prompt(s) go back to the ledger", name, why, n)
        if self.evals is not None and self.evals.release(name):
            log.warning("replica %s %s: its held-out evaluation goes to the next replica",
                        name, why)

    def tick(self) -> None:
        if self.replicas is None:
            return
        with self._lock:
            for name in self.replicas.expire(self.clock()):
                self._release(name, f"silent for over {self.replicas.timeout_s:g} s (lost)")

    def handle(self, identity, rid, kind, payload):
        if kind == HEARTBEAT:
            try:
                req = wire.loads(payload[0])
                consumer, instance = str(req["consumer"]), int(req.get("instance", 0))
            except (wire.ProtocolError, KeyError, TypeError, ValueError, IndexError):
                return wire.BAD_REQUEST, [b"expected a heartbeat {consumer, instance}"]
            with self._lock:
                self._beat(consumer, instance)
                done = self.done
            return wire.OK, [wire.dumps({"done": done})]
        if kind != STATUS:
            return super().handle(identity, rid, kind, payload)
        try:
            req = wire.loads(payload[0])
            status = SamplerStatus(
                consumer=str(req["consumer"]), instance=int(req.get("instance", 0)),
                version=int(req.get("version", -1)),
                prompts_started=int(req.get("prompts_started", 0)),
                metrics=dict(req.get("metrics", {})), received=time.time())
            want = int(req.get("want", 0))
            dropped = [(int(i), int(lid)) for i, lid in req.get("dropped", [])]
            eval_results = list(req.get("eval_results", []))
        except (wire.ProtocolError, KeyError, TypeError, ValueError, IndexError):
            return wire.BAD_REQUEST, [b"expected a status {consumer, version, ...}"]
        accepted, buffered = self._counts()
        if self.ledger is not None:
            for key in dropped:
                self.ledger.drop(key)
        with self._lock:
            self._beat(status.consumer, status.instance)
            current = self.replicas is None or status.consumer not in self.replicas.replicas or \
                self.replicas.replicas[status.consumer].instance == status.instance
            status.saw_done = self.done
            if current:
                self.statuses[status.consumer] = status
            prompts, budget, eval_version = [], 0, -1
            if self.evals is not None and current:
                for result in eval_results:
                    if not self.evals.deliver(status.consumer, result):
                        log.warning("replica %s: held-out evaluation of version %s not "
                                    "assigned to it any more (or incomplete): ignored",
                                    status.consumer, result.get("requested"))
                if status.version >= 0:
                    eval_version = self.evals.assign(status.consumer, status.version)
            if self.ledger is not None and want > 0 and not self.done and current:
                prompts = [_jsonable_prompt(e) for e in
                           self.ledger.lease(status.consumer, status.version, want)]
                budget = 0 if self.ledger.exhausted() else self.ledger.budget(status.version)
            reply = ControlReply(done=self.done, learner_version=self.learner_version,
                                 published_version=self.published_version,
                                 accepted=accepted, buffered=buffered, prompts=prompts,
                                 budget=budget, weight_hosts=list(self.weight_hosts),
                                 eval_version=eval_version, launch=self.launch)
        return wire.OK, [wire.dumps(asdict(reply))]


class ControlClient:
    """Replica side of the run control (a second socket to the coordinator's address).

    Args:
      address: the coordinator's endpoint ``tcp://host:port``.
      consumer_id: this replica's name (``sampler-<i>``).
      instance: restart count of this replica.
      token: the shared secret.
      timeout_s: seconds to wait for an answer before raising
        :class:`rlflow.exchange.wire.PeerTimeoutError` (the learner is gone).
    """

    def __init__(self, address: str, *, consumer_id: str, instance: int = 0, token: str = "",
                 timeout_s: float = 60.0):
        self.consumer_id, self.instance, self.timeout_s = consumer_id, instance, timeout_s
        self._req = wire.Requester(address, token=token, name="learner's run control")

    def status(self, *, version: int, prompts_started: int = 0, want: int = 0,
               metrics: Optional[dict] = None, dropped=(), eval_results=()) -> ControlReply:
        """Report figures, lease up to ``want`` prompts (see :class:`ControlReply`);
        ``dropped``: ``[stream_index, lease_id]`` of leased prompts whose groups this replica
        dropped (a NaN/inf reward under ``learner.on_bad_reward="drop"``); ``eval_results``:
        finished held-out evaluations, ``{"requested", "version", "records"}`` each
        (:mod:`rlflow.control.evals`)."""
        body = {"consumer": self.consumer_id, "instance": self.instance, "version": version,
                "prompts_started": prompts_started, "want": int(want),
                "metrics": metrics or {}, "dropped": [list(map(int, k)) for k in dropped]}
        if eval_results:
            body["eval_results"] = list(eval_results)
        status, rest = self._req.request(STATUS, [wire.dumps(body)], timeout_s=self.timeout_s)
        if status != wire.OK:
            raise wire.ProtocolError(f"run control answered {status!r}")
        return ControlReply(**wire.loads(rest[0]))

    def cancel(self) -> None:
        """Abandon the request in progress (``wire.RequestCancelled``); for shutdown."""
        self._req.cancel()

    def heartbeat(self) -> bool:
        """One heartbeat; returns the learner's ``done`` flag."""
        body = {"consumer": self.consumer_id, "instance": self.instance}
        status, rest = self._req.request(HEARTBEAT, [wire.dumps(body)], timeout_s=self.timeout_s)
        if status != wire.OK:
            raise wire.ProtocolError(f"run control answered {status!r}")
        return bool(wire.loads(rest[0]).get("done"))

    def close(self) -> None:
        self._req.close()
