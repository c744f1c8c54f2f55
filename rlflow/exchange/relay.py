"""Weight fan-out over a relay tree: the learner's egress per version stays ~2x the model.

With N sampler replicas pulling every version from the learner (a star), the learner sends
N x the model's bytes per version. Here a replica that holds version ``v`` serves it again:
right after its pull it registers ``fanout`` one-shot pulls (``await_pull``, one uuid per
expected child: each serves exactly one pull) on its own transfer server, and tells the
coordinator (``relay`` request). The coordinator's :class:`RelayOffers` then answers each
"latest?" of a replica that lacks ``v`` with:

1. an offer from the learner while fewer than ``fanout`` replicas pulled ``v`` from it;
2. else an offer from a replica that holds ``v`` and has a free registered uuid;
3. else "wait" (no uuid: the replica asks again on its next status), while some pull of
   ``v`` is under way that will make a new relay; when none is (every relay died, or
   pulls older than ``assign_timeout_s``), the learner serves anyway, so nothing waits
   forever.

**Demand-driven relays.** A relay keeps the arrays of each uuid it registers until that uuid
is pulled or its timeout passes (``jax.experimental.transfer`` cannot cancel an
``await_pull``), so unneeded registrations would hold old versions in device memory. With
``num_consumers`` (the replica count) the coordinator tells each puller in its offer how many
children to serve (``"relay": k``): no more than the replicas still lacking the version,
less the slots already registered or promised. A relay registers exactly ``k`` uuids.

A replica whose pull from a relay fails (the relay died mid-transfer: the pull never
completes and the subscriber's watchdog fires, or the runtime reports an error) asks again
naming the failed address; that relay is struck off for ``v`` and the replica gets another
source. The tree is per version: a new publish starts a new tree (versions never go
backwards: the subscriber ignores offers older than what it holds). Pulls from a relay use
the learner's published layout (a relay serves the arrays it pulled, in that layout), so the
pull spec matches the source's shard layout as ``jax.experimental.transfer`` requires.

**Deltas** (``runtime.weight_sync = "delta"``): a relay that pulled the delta ``v-1 -> v``
serves that delta (the bytes it pulled, unchanged) and registers with ``base = v-1``; its
slots go only to replicas holding ``v-1`` that can apply a delta. A replica that needs the
whole version (it missed one, or its delta failed the hash check and it asks ``full``) takes
a slot of a relay that holds the whole version, else the learner serves it at once (no
waiting on delta relays that cannot serve it).

``bytes_sent`` counts, per source (``"learner"`` or a replica name), the bytes of every pull
handed out (each uuid is pulled once, or expires unused when the puller died).
Depth of the tree: ``ceil(log_fanout(N))`` hops after the learner's ``fanout`` direct pulls.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

import numpy as np

from rlflow.exchange.coordinator import takes_full

FANOUT = 2
# One learner host's relay figures, as gathered over the hosts of a multi-host learner
# (RelayOffers.totals, all_hosts_metrics): bytes, except waits (a count).
TOTALS = ("learner_bytes", "relayed_bytes", "learner_bytes_last_version", "unit_bytes",
          "waits")


class RelayOffers:
    """The coordinator's offer source with relays (wraps a ``WeightPublisher``).

    Args:
      publisher: ``rlflow.exchange.transfer.WeightPublisher`` (``version``, ``offer``,
        ``nbytes``, ``layout_desc``).
      fanout: pulls the learner and each relay serve per version (>= 1).
      assign_timeout_s: a pull handed out this long ago without the puller coming back is
        counted failed (the learner may then serve others directly).
      num_consumers: replicas that pull every version (demand-driven relays, see the module
        docstring); None: every puller relays ``fanout`` children.
      clock: monotonic clock, seconds.
    """

    def __init__(self, publisher, *, fanout: int = FANOUT, assign_timeout_s: float = 120.0,
                 num_consumers: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic):
        if fanout < 1:
            raise ValueError(f"fanout must be >= 1, got {fanout}")
        self.publisher, self.fanout, self.num_consumers = publisher, fanout, num_consumers
        self.assign_timeout_s, self.clock = assign_timeout_s, clock
        self._lock = threading.Lock()
        self._tree_version = None
        self._direct = 0
        self._relays: dict[str, dict] = {}
        self._pending: dict[str, tuple[str, float]] = {}   # consumer -> (source, handed out)
        self._promised: dict[str, int] = {}     # puller -> children it was asked to serve
        self._holders: set[str] = set()         # consumers known to hold the tree's version
        self.bytes_sent: collections.Counter = collections.Counter()
        self.learner_bytes_by_version: dict[int, int] = {}
        self.waits = 0

    @property
    def version(self) -> int:
        return self.publisher.version

    @version.setter
    def version(self, value) -> None:      # set by the learner's publish (read-through)
        pass

    def _new_tree(self, v: int) -> None:
        if v != self._tree_version:
            self._tree_version, self._direct = v, 0
            self._relays.clear()
            self._pending.clear()
            self._promised.clear()
            self._holders.clear()

    def _relay_count(self, consumer: str) -> int:
        """Children ``consumer`` (just handed a pull) should serve once it holds the version."""
        if self.num_consumers is None:
            return self.fanout
        covered = len(self._holders | set(self._pending)) + \
            sum(len(r["uuids"]) for r in self._relays.values()) + sum(self._promised.values())
        return max(0, min(self.fanout, self.num_consumers - covered))

    def _hand_out(self, consumer: str, source: str, now: float, offer: dict) -> dict:
        self._pending[consumer] = (source, now)
        self._promised.pop(consumer, None)
        k = self._relay_count(consumer)
        self._promised[consumer] = k
        self.bytes_sent[source] += offer.get("nbytes", self.publisher.nbytes)
        return dict(offer, source=source, relay=k)

    def _delta_base(self, have_version: int, full: bool) -> Optional[int]:
        """The base of the delta this consumer can take (its held version, when the
        publisher has a delta from it), or None: it needs the whole version."""
        fields = getattr(self.publisher, "delta_fields", None)
        if full or fields is None or fields(have_version) is None:
            return None
        return have_version

    def offer(self, consumer: str, have_version: int, failed: Optional[str] = None,
              full: bool = False) -> dict:
        """Answer one "latest?" (see the module docstring). ``failed``: the address of a
        source whose pull just failed for this consumer; ``full``: it needs the whole version
        (never a delta)."""
        with self._lock:
            v = self.publisher.version
            if v >= 0:
                self._new_tree(v)
            self._pending.pop(consumer, None)
            self._promised.pop(consumer, None)
            if v < 0 or v <= have_version:
                if v >= 0:
                    self._holders.add(consumer)
                return {"version": v}
            if failed:
                for name in [n for n, r in self._relays.items() if r["address"] == failed]:
                    del self._relays[name]
            now = self.clock()
            for c in [c for c, (_, t) in self._pending.items()
                      if now - t > self.assign_timeout_s]:
                del self._pending[c]
                self._promised.pop(c, None)
            base = self._delta_base(have_version, full)
            if self._direct < self.fanout:
                return self._from_learner(consumer, have_version, now, full)
            for name, r in self._relays.items():
                if r["uuids"] and name != consumer and r["base"] == base:
                    offer = {"version": v, "address": r["address"], "uuid": r["uuids"].pop(),
                             "layout": self.publisher.layout_desc,
                             "transports": r["transports"]}
                    if base is not None:          # the relay serves the delta it pulled
                        offer.update(self.publisher.delta_fields(base))
                    return self._hand_out(consumer, name, now, offer)
            # no relay slot will come, or this consumer needs the whole version while deltas
            # are what the tree carries: the learner serves it
            if not any(self._promised.values()) or (
                    base is None and self._delta_base(v - 1, False) is not None):
                return self._from_learner(consumer, have_version, now, full)
            self.waits += 1
            return {"version": v, "wait": True}

    def _from_learner(self, consumer: str, have_version: int, now: float,
                      full: bool = False) -> dict:
        kw = {"full": True} if full and takes_full(self.publisher) else {}
        out = self.publisher.offer(consumer, have_version, **kw)
        if "uuid" not in out:
            return out
        self._direct += 1
        v = int(out["version"])
        self.learner_bytes_by_version[v] = \
            self.learner_bytes_by_version.get(v, 0) + out.get("nbytes", self.publisher.nbytes)
        return self._hand_out(consumer, "learner", now, out)

    def register(self, consumer: str, version: int, address: str, transports: int,
                 uuids: list, base: Optional[int] = None) -> bool:
        """A replica holds ``version`` and awaits one pull per uuid on ``address``; ``base``:
        it serves the delta from that version (None: the whole version). Returns False
        (ignored) when ``version`` is no longer the newest."""
        with self._lock:
            self._pending.pop(consumer, None)
            self._promised.pop(consumer, None)
            if version != self.publisher.version:
                return False
            self._new_tree(version)
            self._holders.add(consumer)
            self._relays[consumer] = {"address": str(address), "transports": int(transports),
                                      "uuids": [int(u) for u in uuids],
                                      "base": None if base is None else int(base)}
            return True

    def totals(self) -> np.ndarray:
        """float64 ``[len(TOTALS)]``: bytes this host's learner sent (all versions), bytes
        its relays sent, the learner's bytes for the newest version, the bytes of one
        version of what it serves (its shards), asks that waited for a relay."""
        with self._lock:
            last = (self.learner_bytes_by_version[max(self.learner_bytes_by_version)]
                    if self.learner_bytes_by_version else 0)
            learner = self.bytes_sent.get("learner", 0)
            relayed = sum(self.bytes_sent.values()) - learner
            return np.array([learner, relayed, last, self.publisher.nbytes, self.waits],
                            np.float64)

    def metrics(self) -> dict:
        """``transfer/bytes_sent/<source>`` totals, the learner's bytes for the newest
        version, and how many asks had to wait for a relay."""
        with self._lock:
            out = {f"transfer/bytes_sent/{k}": float(v) for k, v in self.bytes_sent.items()}
            if self.learner_bytes_by_version:
                last = max(self.learner_bytes_by_version)
                out["transfer/learner_bytes_last_version"] = \
                    float(self.learner_bytes_by_version[last])
                if self.publisher.nbytes:
                    out["transfer/learner_egress_per_model"] = \
                        self.learner_bytes_by_version[last] / self.publisher.nbytes
            out["transfer/relay_waits"] = float(self.waits)
            return out


def all_hosts_metrics(rows) -> dict:
    """The ``transfer/*`` relay figures of a multi-host learner from every host's
    :meth:`RelayOffers.totals` (``rows``: ``[hosts, len(TOTALS)]``, host order; each host
    runs its own relay tree for its shards): ``transfer/bytes_sent/learner`` and
    ``transfer/bytes_sent/relays`` (all hosts, all versions), ``transfer/learner_bytes_last_
    version`` (all hosts), ``transfer/learner_egress_per_model`` (that over the model's
    bytes, the sum of the hosts' shards: ~fanout with relays), ``transfer/relay_waits``, and
    per host ``transfer/host/<h>/learner_bytes_last_version``. ``{}`` when no host relays
    (every row zero)."""
    rows = np.asarray(rows, np.float64)
    if rows.ndim != 2 or rows.shape[1] != len(TOTALS):
        raise ValueError(f"rows must be [hosts, {len(TOTALS)}], got shape {rows.shape}")
    if not rows.any():
        return {}
    col = {k: rows[:, i] for i, k in enumerate(TOTALS)}
    out = {"transfer/bytes_sent/learner": float(col["learner_bytes"].sum()),
           "transfer/bytes_sent/relays": float(col["relayed_bytes"].sum()),
           "transfer/learner_bytes_last_version": float(col["learner_bytes_last_version"].sum()),
           "transfer/relay_waits": float(col["waits"].sum())}
    if col["unit_bytes"].sum() > 0:
        out["transfer/learner_egress_per_model"] = float(
            col["learner_bytes_last_version"].sum() / col["unit_bytes"].sum())
    for h, v in enumerate(col["learner_bytes_last_version"]):
        out[f"transfer/host/{h}/learner_bytes_last_version"] = float(v)
    return out
