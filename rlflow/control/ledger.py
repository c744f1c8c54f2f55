"""The prompt ledger: the one owner of the prompt stream (learner host 0).

Every prompt an RL run trains on passes through here. The stream is a random-access
sequence (``source(i)`` -> element ``i``; the grain ``MapDataset`` of
:func:`rlflow.data.pipeline.prompt_dataset`: shuffled per epoch, repeated, element ``i``
carries ``stream_index == i``). The ledger admits elements in stream order to sampler
replicas under one staleness budget and follows each admitted element until its group is
trained or dropped::

    admit (lease to a replica) -> LEASED --group stored in the ring--> BUFFERED
        --taken into a batch--> CONSUMED --step done--> trained (removed, counted)
    LEASED  --replica lost / restarted--------------------> returned (re-dispatched first)
    BUFFERED --its put timed out before entering the ring--> returned
    CONSUMED --too stale for the learner (stale_policy drop)--> returned
    CONSUMED --no reward variance (dynamic sampling)---------> dropped (removed, counted)

A group whose lease is no longer current (its replica was declared lost and the prompt went
to another one) is a *duplicate*: :meth:`PromptLedger.stored` and :meth:`take` refuse it and
count it, so no prompt is ever trained twice, and none is lost: every admitted element is
trained, dropped (counted), or waiting in the ledger.

**Admission** (AReaL's rollout control, Fu et al. 2025, Sec. 5, made global): a replica
generating with policy version ``v`` may be leased prompts while
``(v + 1 + k) * groups_per_step - trained - active > 0``, where ``trained`` counts the
groups of completed learner steps, ``active`` every admitted group not yet trained or
dropped (leased, buffered or in the current batch, over all replicas) and
``k = runtime.max_staleness``. ``k = 0`` is the synchronous mode.

**Checkpoint** (:meth:`state`, JSON): the admission position ``next_index`` and every
admitted-but-untrained element as ``[stream_index, seed]`` (and the lease counter, so a
lease made before the checkpoint is never current again). :meth:`from_state` puts those
back at the head of the queue, so a resumed run trains exactly the prompts an
uninterrupted run would (none skipped, none twice), with the same per-sample seeds. A
legacy grain iterator state ``{"next_index": n}`` is read as a ledger with nothing in
flight.

Thread safety: every public method takes the ledger's lock (the coordinator's thread
leases, the buffer's thread stores, the learner's thread takes and trains).
"""

from __future__ import annotations

import heapq
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import numpy as np

LEASED, BUFFERED, CONSUMED = "leased", "buffered", "consumed"
STATE_FORMAT = 1

Key = tuple[int, int]          # (stream_index, lease_id)


class LedgerError(ValueError):
    """A ledger state that cannot be restored (the message names the field)."""


class PromptsExhaustedError(RuntimeError):
    """The prompt stream ran out while the learner still needs groups for its steps."""


@dataclass
class _Entry:
    state: str
    lease_id: int
    replica: str


class PromptLedger:
    """Admission, dispatch and tracking of the prompt stream (see the module docstring).

    Args:
      source: ``i -> element`` (a dict with ``prompt_id``, ``prompt_tokens`` int32 ``[P]``,
        ``answer``); called for each element leased.
      length: elements in the stream (``data.num_epochs x`` prompts per epoch), None when
        it repeats forever.
      groups_per_step: ``learner.groups_per_step``.
      max_staleness: ``runtime.max_staleness`` (k >= 0).
      seed_of: ``stream_index -> request seed`` (``rlflow.control.seeds.derive_seed``).
      trained_groups: groups of the learner steps already taken (resume: step x gps, with
        this run's gps: the admission rule and :meth:`check_enough` count a step as
        ``groups_per_step`` groups, so a run resumed with another ``learner.groups_per_step``
        starts from ``step x`` the new value; :meth:`restore` keeps it).

    Raises:
      ValueError: a bad argument (named).
    """

    def __init__(self, source: Callable[[int], dict], length: Optional[int], *,
                 groups_per_step: int, max_staleness: int, seed_of: Callable[[int], int],
                 trained_groups: int = 0):
        if groups_per_step < 1 or max_staleness < 0 or trained_groups < 0:
            raise ValueError(f"bad ledger arguments: groups_per_step={groups_per_step}, "
                             f"max_staleness={max_staleness}, trained_groups={trained_groups}")
        if length is not None and length < 0:
            raise ValueError(f"length must be >= 0 or None, got {length}")
        self.source, self.length, self.seed_of = source, length, seed_of
        self.gps, self.k = groups_per_step, max_staleness
        self._lock = threading.Lock()
        self.next_index = 0
        self._returned: list[int] = []          # heap of stream indices to re-dispatch
        self._seeds: dict[int, int] = {}        # seeds of restored / returned elements
        self._entries: dict[int, _Entry] = {}
        self._lease_ids = 0
        self.trained_groups = trained_groups
        self.counts = dict(admitted=0, redispatched=0, trained=0, dropped=0, duplicates=0,
                           released=0, stale_returned=0)

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict:
        """JSON-able checkpoint of the ledger (see the module docstring)."""
        with self._lock:
            untrained = sorted(set(self._entries) | set(self._returned))
            return {"ledger": {"format": STATE_FORMAT, "next_index": self.next_index,
                               "untrained": [[i, self._seed(i)] for i in untrained],
                               "trained_groups": self.trained_groups,
                               "lease_ids": self._lease_ids,
                               "counts": dict(self.counts)}}

    def restore(self, state: Any) -> None:
        """Load :meth:`state` output, or a legacy grain iterator state ``{"next_index": n}``.

        Raises:
          LedgerError: the state is neither (names the field).
        """
        if state is None:
            return
        if not isinstance(state, dict):
            raise LedgerError(f"data state: expected a dict, got {type(state).__name__}")
        with self._lock:
            if "ledger" not in state:              # a grain iterator state (older runs)
                if not isinstance(state.get("next_index"), int):
                    raise LedgerError(f"data state: expected 'ledger' or 'next_index', got "
                                      f"keys {sorted(state)}")
                self.next_index = state["next_index"]
                return
            s = state["ledger"]
            if not isinstance(s, dict) or s.get("format") != STATE_FORMAT:
                raise LedgerError(f"ledger state: expected format {STATE_FORMAT}, got "
                                  f"{s.get('format') if isinstance(s, dict) else s!r}")
            try:
                self.next_index = int(s["next_index"])
                # "trained_groups" is not read back: with another learner.groups_per_step
                # the checkpoint's count (old gps x steps) would hold admission at 0 for good
                self._lease_ids = int(s.get("lease_ids", 0))
                untrained = [(int(i), int(seed)) for i, seed in s["untrained"]]
                self.counts.update({k: int(v) for k, v in s.get("counts", {}).items()
                                    if k in self.counts})
            except (KeyError, TypeError, ValueError) as e:
                raise LedgerError(f"ledger state: malformed ({type(e).__name__}: {e})") from None
            if any(i >= self.next_index or i < 0 for i, _ in untrained):
                raise LedgerError(f"ledger state: 'untrained' holds indices outside "
                                  f"[0, next_index={self.next_index})")
            self._entries.clear()
            self._returned = [i for i, _ in untrained]
            heapq.heapify(self._returned)
            self._seeds = dict(untrained)

    # ------------------------------------------------------------------ admission
    def budget(self, version: int) -> int:
        """Groups a replica generating with ``version`` may still be leased (>= 0)."""
        with self._lock:
            return self._budget(version)

    def _budget(self, version: int) -> int:
        return max(0, (version + 1 + self.k) * self.gps - self.trained_groups -
                   len(self._entries))

    def lease(self, replica: str, version: int, want: int) -> list[dict]:
        """Lease up to ``want`` prompts to ``replica`` (generating with ``version``) within
        the staleness budget; returned prompts first (lowest stream index first), then new
        ones in stream order.

        Returns:
          a list of ``{"stream_index", "lease_id", "seed", "redispatched",
          **source(stream_index)}``; ``redispatched``: the prompt was taken back (from a
          lost replica, a failed put, a stale group, or a checkpoint's untrained prompts),
          so a replica's journal may hold its partial generation.
        """
        if version < 0 or want <= 0:
            return []
        out = []
        with self._lock:
            n = min(want, self._budget(version))
            while len(out) < n:
                again = bool(self._returned)
                if again:
                    i = heapq.heappop(self._returned)
                    self.counts["redispatched"] += 1
                elif self.length is None or self.next_index < self.length:
                    i = self.next_index
                    self.next_index += 1
                else:
                    break
                self._lease_ids += 1
                self._entries[i] = _Entry(LEASED, self._lease_ids, replica)
                self.counts["admitted"] += 1
                out.append((i, self._lease_ids, self._seed(i), again))
        return [{**self.source(i), "stream_index": i, "lease_id": lid, "seed": seed,
                 "redispatched": again} for i, lid, seed, again in out]

    def _seed(self, i: int) -> int:
        seed = self._seeds.get(i)
        return int(self.seed_of(i)) if seed is None else seed

    # ------------------------------------------------------------------ group events
    def _current(self, key: Key, state: str) -> Optional[_Entry]:
        e = self._entries.get(int(key[0]))
        if e is None or e.lease_id != int(key[1]) or e.state != state:
            return None
        return e

    def _advance(self, key: Key, state: str, to: str) -> bool:
        """Move the current lease of ``key`` from ``state`` to ``to``; False (counted as a
        duplicate) when ``key`` is not the current lease in ``state``."""
        with self._lock:
            e = self._current(key, state)
            if e is None:
                self.counts["duplicates"] += 1
                return False
            e.state = to
            return True

    def stored(self, key: Key) -> bool:
        """The group of ``key`` entered the ring buffer. False (counted as a duplicate)
        when its lease is not current: a lost replica's late group."""
        return self._advance(key, LEASED, BUFFERED)

    def unstore(self, key: Key) -> None:
        """The stored group of ``key`` never reached the learner (its put timed out): the
        prompt goes back to the queue."""
        with self._lock:
            if self._current(key, BUFFERED) is not None:
                del self._entries[int(key[0])]
                heapq.heappush(self._returned, int(key[0]))
                self.counts["released"] += 1

    def take(self, key: Key) -> bool:
        """The learner takes the group of ``key`` into its batch. False (counted as a
        duplicate) when it is not the current lease's stored group."""
        return self._advance(key, BUFFERED, CONSUMED)

    def trained(self, keys: Iterable[Key]) -> None:
        """The learner finished the step that consumed ``keys``.

        Raises:
          LedgerError: a key is not a consumed group (a bookkeeping bug, never silent).
        """
        keys = list(keys)
        with self._lock:
            for key in keys:
                if self._current(key, CONSUMED) is None:
                    raise LedgerError(f"group {tuple(key)} was not taken into the batch")
            for key in keys:
                del self._entries[int(key[0])]
                self._seeds.pop(int(key[0]), None)
            self.trained_groups += len(keys)
            self.counts["trained"] += len(keys)

    def drop(self, key: Key) -> None:
        """The group of ``key`` was dropped for good (no reward variance under dynamic
        sampling, a degenerate step, or a NaN/inf reward on its replica): the prompt is
        resolved, counted in ``dropped``. A key whose lease is not current is ignored."""
        with self._lock:
            e = self._entries.get(int(key[0]))
            if e is not None and e.lease_id == int(key[1]):
                del self._entries[int(key[0])]
                self._seeds.pop(int(key[0]), None)
                self.counts["dropped"] += 1

    def give_back(self, key: Key) -> None:
        """The consumed group of ``key`` cannot be used (too stale): its prompt goes back
        to the head of the queue and is generated again."""
        with self._lock:
            if self._entries.pop(int(key[0]), None) is not None:
                heapq.heappush(self._returned, int(key[0]))
                self.counts["stale_returned"] += 1

    def release_replica(self, replica: str) -> int:
        """``replica`` is lost (dead, timed out or restarted): its leased prompts (not yet
        stored) go back to the queue. Returns how many."""
        with self._lock:
            lost = [i for i, e in self._entries.items()
                    if e.replica == replica and e.state == LEASED]
            for i in lost:
                del self._entries[i]
                heapq.heappush(self._returned, i)
            self.counts["released"] += len(lost)
            return len(lost)

    # ------------------------------------------------------------------ queries
    def exhausted(self) -> bool:
        """No prompt left to lease (the stream ended and nothing waits to be re-dispatched)."""
        with self._lock:
            return self._exhausted()

    def _exhausted(self) -> bool:
        return self.length is not None and self.next_index >= self.length and \
            not self._returned

    def check_enough(self, needed_groups: int) -> None:
        """Raise :class:`PromptsExhaustedError` when the stream cannot yield the groups the
        learner needs for its next step (``needed_groups`` trained in total)."""
        with self._lock:
            if self.length is None:
                return
            coming = self.trained_groups + len(self._entries) + len(self._returned) + \
                (self.length - self.next_index)
            if coming < needed_groups:
                raise PromptsExhaustedError(
                    f"the prompt dataset ran out after {self.next_index} prompts "
                    f"({self.length} in the stream; data.num_epochs) while the learner still "
                    f"needs groups: {self.trained_groups} trained, {len(self._entries)} in "
                    f"flight, {needed_groups} needed")

    def metrics(self) -> dict:
        """``ledger/*`` counts: admitted, redispatched, trained, dropped, duplicates,
        released (taken back from lost replicas or failed puts), stale_returned (too stale, generated
        again) (totals) and in_flight (leased), buffered, consumed, returned (now),
        next_index."""
        with self._lock:
            states = [e.state for e in self._entries.values()]
            out = {f"ledger/{k}": float(v) for k, v in self.counts.items()}
            out.update({"ledger/in_flight": float(states.count(LEASED)),
                        "ledger/buffered": float(states.count(BUFFERED)),
                        "ledger/consumed": float(states.count(CONSUMED)),
                        "ledger/returned": float(len(self._returned)),
                        "ledger/next_index": float(self.next_index)})
            return out


def group_key(group) -> Optional[Key]:
    """``(stream_index, lease_id)`` of a group record, or None for a group without them."""
    if "stream_index" not in group or "lease_id" not in group:
        return None
    return int(np.asarray(group["stream_index"])), int(np.asarray(group["lease_id"]))


TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"


class TrainedPromptsLog:
    """``<run>/trained_prompts.jsonl``: one line per learner step,
    ``{"step", "stream_index": [...], "prompt_id": [...], "epoch": [...]}`` (epoch =
    stream_index // prompts per epoch), the run's record of what it trained. Opening it
    for a run resumed from ``start_step`` drops the lines of later steps (they are trained
    again), so over any number of resumes each step appears once.
    """

    def __init__(self, run_path: str, start_step: int):
        from rlflow.run import files

        self.path = files.join(run_path, TRAINED_PROMPTS_FILE)
        files.makedirs(run_path)
        kept = []
        if files.isfile(self.path):
            for line in files.read_text(self.path).splitlines(keepends=True):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue                          # a line cut by a kill
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and \
                        rec["step"] <= start_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        files.write_atomic(self.path, "".join(kept))
        self._f = files.AppendFile(self.path)

    def write(self, step: int, tracked, prompts_per_epoch: int) -> None:
        """``tracked``: ``[((stream_index, lease_id), prompt_id), ...]`` of one step."""
        idx = [int(k[0]) for k, _ in tracked]
        self._f.write(json.dumps({"step": int(step), "stream_index": idx,
                                  "prompt_id": [int(p) for _, p in tracked],
                                  "epoch": [i // max(1, prompts_per_epoch) for i in idx]}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_trained_prompts(run_path: str) -> list[dict]:
    """The records of ``<run>/trained_prompts.jsonl`` (complete lines only)."""
    from rlflow.run import files

    out = []
    for line in files.read_text(files.join(run_path, TRAINED_PROMPTS_FILE)).splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
