"""Liveness of the sampler replicas, as the learner sees it (heartbeats, pure state).

Each replica program sends a heartbeat (its name and restart count, ``instance``) every
``HEARTBEAT_S`` seconds from a background thread, and a status from its loop. The table
says which replicas are alive:

* a replica not heard from for ``timeout_s`` (``runtime.replica_timeout_s``) is *lost*;
* a heartbeat from a newer instance of a known replica (it was restarted) makes the older
  instance lost at once;
* a heartbeat from an older instance than the newest seen is ignored (a late message).

The caller gives every lost replica's prompts back to the ledger
(:meth:`rlflow.control.ledger.PromptLedger.release_replica`). :meth:`ReplicaTable.none_alive_for`
says how long no replica has been alive (the learner stops with
:class:`NoReplicaError` when that exceeds ``timeout_s``). Time is passed in (seconds on
any monotonic clock), so tests drive it by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

HEARTBEAT_S = 1.0
STARTUP_S = 600.0     # allowance for the first heartbeat of a run (process start, imports)


class NoReplicaError(RuntimeError):
    """No sampler replica has been alive for ``runtime.replica_timeout_s`` seconds."""


@dataclass
class ReplicaState:
    name: str
    instance: int
    last_seen: float
    alive: bool = True
    restarts: int = 0      # instances seen after the first (restarts the learner noticed)
    timeouts: int = 0      # times declared lost for silence (``timeout_s``)


class ReplicaTable:
    """Replica name -> :class:`ReplicaState` (see the module docstring).

    Args:
      timeout_s: seconds without a heartbeat after which a replica is lost (> 0).
      now: the clock reading at creation (the "none alive" timer starts here).
      startup_s: how long to wait for the very first heartbeat (at least ``timeout_s``).
    """

    def __init__(self, timeout_s: float, now: float, startup_s: float = STARTUP_S):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.startup_s = max(startup_s, timeout_s)
        self.replicas: dict[str, ReplicaState] = {}
        self._none_since: Optional[float] = now
        self.lost_total = 0

    def beat(self, name: str, instance: int, now: float) -> list[str]:
        """Record a heartbeat. Returns the replicas lost by it (``[name]`` when this is a
        newer instance of a replica still counted alive, else ``[]``)."""
        lost = []
        r = self.replicas.get(name)
        if r is None:
            self.replicas[name] = ReplicaState(name, instance, now)
        elif instance < r.instance:
            return []                               # a late message of an older instance
        else:
            if instance > r.instance:
                if r.alive:
                    lost.append(name)
                    self.lost_total += 1
                r.restarts += instance - r.instance
                r.instance = instance
            r.last_seen, r.alive = now, True
        self._none_since = None
        return lost

    def expire(self, now: float) -> list[str]:
        """Mark replicas silent for more than ``timeout_s`` as lost; returns their names."""
        lost = [r.name for r in self.replicas.values()
                if r.alive and now - r.last_seen > self.timeout_s]
        for name in lost:
            self.replicas[name].alive = False
            self.replicas[name].timeouts += 1
            self.lost_total += 1
        if lost and not self.alive() and self._none_since is None:
            self._none_since = max(self.replicas[n].last_seen for n in lost) + self.timeout_s
        return lost

    def alive(self) -> list[str]:
        return sorted(r.name for r in self.replicas.values() if r.alive)

    def none_alive_for(self, now: float) -> float:
        """Seconds since the last replica was lost (or since creation, before the first
        heartbeat); 0 while one is alive."""
        return 0.0 if self._none_since is None else max(0.0, now - self._none_since)

    def check(self, now: float) -> None:
        """Raise :class:`NoReplicaError` when no replica has been alive for ``timeout_s``."""
        silent = self.none_alive_for(now)
        if silent > (self.timeout_s if self.replicas else self.startup_s):
            seen = ", ".join(f"{r.name} (instance {r.instance})" for r in
                             self.replicas.values()) or "none ever"
            raise NoReplicaError(f"no sampler replica has been alive for {silent:.0f} s "
                                 f"(runtime.replica_timeout_s={self.timeout_s:g}); replicas "
                                 f"seen: {seen}")
