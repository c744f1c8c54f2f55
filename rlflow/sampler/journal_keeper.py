"""The sampler program's side of the journal of partial generations (issue 53; the file
format and its reading: :mod:`rlflow.run.journal`; the batcher's side:
:mod:`rlflow.sampler.journal_slots`).

A thin shell, one per replica, when ``sampler.journal_every_steps = N > 0``:

* at start it reads every replica's journal in the run folder (a replica restarted after a
  kill -9, or the replicas of a resumed run, find them there); the entries of its own
  predecessor's journal that no prompt has taken yet are carried into its own writes, so
  that another replica given those prompts still finds them;
* once the replica holds its first weights, prompts with tokens of a newer version written
  by an earlier launch of the run (a run resumed from a checkpoint older than the journal)
  are dropped (:meth:`forget_newer`; journals read again later, the same);
* :meth:`JournalKeeper.refresh` reads the other replicas' journals again when the ledger
  hands this replica a prompt it took back (``redispatched`` in the lease): a replica
  that died after this one read them;
* :meth:`JournalKeeper.resumed` gives a newly leased prompt its samples from the journal
  (matched by the lease's ``(stream_index, seed)``, which the ledger keeps when it hands an
  unfinished prompt back): dropped whole and counted when its oldest token lags the
  replica's weights by more than ``runtime.max_staleness`` versions; an entry that does not
  fit the request (sample index, length) is skipped and counted as damaged;
* :meth:`JournalKeeper.after_step` snapshots the replica's samples in flight (the batcher's
  :meth:`partials`, copies, and the finished groups still being scored or in the learner's
  buffer not yet surely trained, keyed by each request's lease; on the decode thread) and
  writes
  the snapshot. **Bound:** at every moment the journal on disk holds every sample as of at
  most N decode calls ago, so a kill -9 loses at most N decode calls per slot. With N = 1
  each snapshot is written on the decode thread; with N >= 2 a snapshot is taken every
  ``N // 2`` calls and written on a writer thread while decoding goes on, and a snapshot
  due while the previous write still runs first waits for it (the previous snapshot is
  then at most ``2 (N // 2) <= N`` calls old). A write that fails is logged and counted,
  never fatal; the bound then holds from the next write that succeeds.

Multi-turn episodes are journaled alike (an episode's ids so far, the environment's with
version -1, and a finished one's reward and ``failed``); the batcher and the episode driver
resume them (:mod:`rlflow.sampler.journal_slots`, the environment rebuilt by replaying the
turns: :meth:`rlflow.sampler.episodes.EpisodeDriver.resume`). The staleness bound counts
sampled tokens only.

Figures (running totals of this replica instance, in its status): ``sampler/journal_writes``,
``sampler/journal_write_waits`` (snapshots that waited for the previous write),
``sampler/journal_snapshot_s`` (decode-thread seconds the journal took: snapshots, waits,
and the writes when N = 1: its cost to decoding), ``sampler/journal_write_s`` (seconds
writing), ``sampler/journal_write_errors``, ``sampler/journal_lag_max`` (the most decode
calls the journal on disk was behind, looked at after each call: <= N),
``sampler/journal_resumed_samples``, ``sampler/journal_resumed_tokens`` (tokens not generated
again), ``sampler/journal_damaged``, ``sampler/journal_dropped_stale`` (prompts whose partial
generations were too old), ``sampler/journal_refreshes``.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from rlflow.run import journal
from rlflow.sampler.requests import Completion

log = logging.getLogger("rlflow.sampler")

COUNTS = ("writes", "write_waits", "snapshot_s", "write_s", "write_errors", "lag_max",
          "resumed_samples", "resumed_tokens", "damaged", "dropped_stale", "refreshes")


class JournalKeeper:
    """Args: run_path (the run folder, local or ``gs://``), replica (``sampler-<i>``),
    every (N: the most decode calls a kill may lose per slot, >= 1), max_staleness
    (``runtime.max_staleness``).

    Raises:
      ValueError: ``every < 1``.
    """

    def __init__(self, run_path: str, replica: str, every: int, max_staleness: int):
        if every < 1:
            raise ValueError(f"journal interval must be >= 1 decode call, got {every}")
        self.run_path, self.replica = run_path, replica
        self.every, self.max_staleness = int(every), int(max_staleness)
        self.cadence = 1 if every == 1 else every // 2     # decode calls between snapshots
        self.steps = 0             # decode calls so far
        self.committed = 0         # decode calls the journal on disk covers
        self._writer = None        # the thread writing the latest snapshot (N >= 2)
        self.counts = dict.fromkeys(COUNTS, 0.0)
        self.version = -1          # the replica's weights, for pruning (forget_newer)
        self.first_version = -1    # its first weights in this launch
        self.launch = ""           # the run's launch (ControlReply.launch)
        self.index, damaged = journal.read_journals(run_path)
        own, _ = journal.read_journal(run_path, replica)
        self.carried = {e.key for e in own}    # the predecessor's, still to be taken
        self.counts["damaged"] = float(damaged)
        if self.index or damaged:
            log.info("journal of partial generations: %d prompts in flight found in %s "
                     "(%d damaged entries skipped)", len(self.index), run_path, damaged)

    @classmethod
    def for_config(cls, cfg, replica: str) -> "JournalKeeper | None":
        """The keeper of ``replica`` for an ``ExperimentConfig``; None when
        ``sampler.journal_every_steps`` is 0 (off)."""
        every = cfg.sampler.journal_every_steps
        return cls(cfg.run_path, replica, every, cfg.runtime.max_staleness) if every else None

    def forget_newer(self, version: int, launch: str = "") -> None:
        """The replica loaded its first weights, ``version``, in the run's launch ``launch``
        (``ControlReply.launch``): drop (counted as stale) every prompt whose journal, of
        another launch, holds a token of a newer version. Such tokens come from a run that
        went past its last checkpoint before it stopped: the resumed learner publishes that
        version number again with other weights. Tokens of versions up to the checkpoint's
        were sampled by the same weights as before the stop."""
        self.version = self.first_version = int(version)
        self.launch = launch
        self.counts["dropped_stale"] += self._drop_other_launches(self.index)

    def _drop_other_launches(self, index: dict) -> int:
        """Drop from ``index`` the prompts of which an entry of another launch holds a token
        newer than the first weights (:meth:`forget_newer`); how many."""
        gone = [k for k, entries in index.items()
                if any(e.launch != self.launch and e.versions.size and
                       int(e.versions.max()) > self.first_version for e in entries)]
        for key in gone:
            del index[key]
            self.carried.discard(key)
        return len(gone)

    def refresh(self, elements, version: int) -> None:
        """Before ``elements`` (leases of one status reply) are submitted: when one was taken
        back from a replica (``redispatched``: lost, restarted, or the run resumed), read
        the other replicas' journals again, once for the reply (what was read before may be
        an older write of a replica that went on decoding, then died); prompts whose
        partial generations are too old for ``version`` are let go (not counted: no lease
        asked for them). Entries of one sample: :func:`rlflow.run.journal.merge`."""
        if not any(e.get("redispatched") for e in elements):
            return
        index, damaged = journal.read_journals(self.run_path, exclude=(self.replica,))
        self.counts["refreshes"] += 1
        self.counts["damaged"] += damaged
        self._drop_other_launches(index)
        journal.merge(self.index, [e for entries in index.values() for e in entries])
        for key in [k for k, v in self.index.items()
                    if journal.stale(v, version, self.max_staleness)]:
            del self.index[key]
            self.carried.discard(key)

    def resumed(self, element, request, version: int) -> list[Completion]:
        """The journaled samples of a leased prompt (``element``: the lease, with
        ``stream_index`` and ``seed``), for ``batcher.submit(request, resumed=...)``;
        ``version``: the replica's weights version (for the staleness bound)."""
        key = (int(element["stream_index"]), int(element["seed"]))
        self.carried.discard(key)
        entries = self.index.pop(key, None)
        if not entries:
            return []
        if journal.stale(entries, version, self.max_staleness):
            self.counts["dropped_stale"] += 1
            log.info("prompt_id %d: its partial generation is older than runtime.max_staleness"
                     "=%d versions (version %d now); generated again", request.prompt_id,
                     self.max_staleness, version)
            return []
        out, limit = [], request.sampling.max_tokens
        for e in entries:
            n = int(e.tokens.size)
            fits = 0 <= e.sample_index < request.num_samples and e.prompt_id == \
                request.prompt_id and ((e.finish_reason and 0 < n <= limit) or
                                       (not e.finish_reason and 0 < n < limit))
            if not fits:
                self.counts["damaged"] += 1
                continue
            out.append(Completion(request.prompt_id, e.sample_index, e.tokens, e.logprobs,
                                  e.versions, e.finish_reason, reward=e.reward,
                                  failed=e.failed))
            self.counts["resumed_samples"] += 1
            self.counts["resumed_tokens"] += n
        log.info("prompt_id %d (stream_index %d): %d samples resumed from the journal, %d "
                 "tokens not generated again", request.prompt_id, key[0], len(out),
                 sum(int(c.tokens.size) for c in out))
        return out

    def after_step(self, batcher, in_flight: dict, held=()) -> None:
        """Count a decode call; snapshot and write the journal when one is due (module doc;
        ``in_flight``: ``id(request) -> lease``,
        :attr:`rlflow.sampler.delivery.GroupDelivery.in_flight`; ``held``: ``[(lease,
        request, completions)]`` of finished groups being scored or in the learner's buffer
        not yet trained, :meth:`rlflow.sampler.delivery.GroupDelivery.held`, journaled as
        finished samples)."""
        self.steps += 1
        self.counts["lag_max"] = max(self.counts["lag_max"], float(self.steps - self.committed))
        if self.steps % self.cadence:
            return
        t0 = time.monotonic()
        if self._writer is not None and self._writer.is_alive():
            self.counts["write_waits"] += 1       # the previous write is still going
            self._writer.join()
        entries = self._snapshot(batcher, in_flight, held)
        if self.every == 1:
            self._write(entries, self.steps)
        else:
            self._writer = threading.Thread(target=self._write, args=(entries, self.steps),
                                            name="rlflow-journal", daemon=True)
            self._writer.start()
        self.counts["snapshot_s"] += time.monotonic() - t0

    def _snapshot(self, batcher, in_flight: dict, held) -> list:
        """The journal's entries now: every leased request's samples in flight, its
        finished groups held (``after_step``), then the predecessor's entries no prompt has
        taken yet (still fresh enough)."""
        entries = []
        groups = [(in_flight.get(id(r)), r, samples) for r, samples in batcher.partials()]
        for element, request, samples in groups + list(held):
            if element is None:           # an evaluation's request: not leased, not kept
                continue
            entries += [journal.JournalEntry(
                int(element["stream_index"]), int(element["seed"]), request.prompt_id,
                c.sample_index, np.asarray(c.tokens), np.asarray(c.logprobs),
                np.asarray(c.versions), c.finish_reason,
                reward=c.reward if c.finish_reason else None,
                failed=bool(c.failed)) for c in samples]
        version = max(self.version, int(getattr(batcher, "version", -1)))
        for key in list(self.carried):
            kept = self.index.get(key)
            if not kept or (version >= 0 and journal.stale(kept, version, self.max_staleness)):
                self.carried.discard(key)
                continue
            entries += kept
        return entries

    def _write(self, entries, step: int) -> None:
        """Write one snapshot (the writer thread, or the decode thread when N = 1); the
        journal then covers decode call ``step``."""
        t0 = time.monotonic()
        try:
            journal.write_journal(self.run_path, self.replica, entries, self.launch)
            self.counts["writes"] += 1
            self.committed = step
        except OSError as e:
            self.counts["write_errors"] += 1
            log.warning("could not write the journal of partial generations to %s: %s "
                        "(decoding goes on; a restart would generate them again)",
                        self.run_path, e)
        self.counts["write_s"] += time.monotonic() - t0

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for the write in progress (tests; a clean stop)."""
        if self._writer is not None:
            self._writer.join(timeout)

    def metrics(self) -> dict:
        return {f"sampler/journal_{k}": float(v) for k, v in self.counts.items()}
