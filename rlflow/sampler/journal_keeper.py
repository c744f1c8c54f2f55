"""The sampler program's side of the journal of partial generations (issue 53; the file
format and its reading: :mod:`rlflow.run.journal`; the batcher's side:
:mod:`rlflow.sampler.journal_slots`).

A thin shell, one per replica, when ``sampler.journal_every_steps > 0``:

* at start it reads every replica's journal in the run folder (a replica restarted after a
  kill -9, or one that takes over a dead replica's prompts, finds them there);
* once the replica holds its first weights, prompts with tokens of a newer version (a run
  resumed from a checkpoint older than the journal) are dropped (:meth:`forget_newer`);
* :meth:`JournalKeeper.resumed` gives a newly leased prompt its samples from the journal
  (matched by the lease's ``(stream_index, seed)``, which the ledger keeps when it hands an
  unfinished prompt back): dropped whole and counted when its oldest token lags the
  replica's weights by more than ``runtime.max_staleness`` versions; an entry that does not
  fit the request (sample index, length) is skipped and counted as damaged;
* :meth:`JournalKeeper.after_step` snapshots the replica's samples in flight every
  ``journal_every_steps`` decode calls (the batcher's :meth:`partials`, copies, keyed by
  each request's lease; on the decode thread) and writes the snapshot on a writer thread,
  so decoding goes on during the encode and the write; while one write is still going, a
  snapshot is skipped (counted). A write that fails is logged and counted, never fatal.

Figures (running totals of this replica instance, in its status): ``sampler/journal_writes``,
``sampler/journal_writes_skipped``, ``sampler/journal_snapshot_s`` (decode-thread seconds
taking the snapshots: the journal's cost to decoding), ``sampler/journal_write_s`` (writer
thread seconds), ``sampler/journal_write_errors``, ``sampler/journal_resumed_samples``,
``sampler/journal_resumed_tokens`` (tokens not generated again), ``sampler/journal_damaged``,
``sampler/journal_dropped_stale`` (prompts whose partial generations were too old).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from rlflow.run import journal
from rlflow.sampler.requests import Completion

log = logging.getLogger("rlflow.sampler")

COUNTS = ("writes", "writes_skipped", "snapshot_s", "write_s", "write_errors",
          "resumed_samples", "resumed_tokens", "damaged", "dropped_stale")


class JournalKeeper:
    """Args: run_path (the run folder, local or ``gs://``), replica (``sampler-<i>``),
    every (decode calls between writes, >= 1), max_staleness (``runtime.max_staleness``)."""

    def __init__(self, run_path: str, replica: str, every: int, max_staleness: int):
        if every < 1:
            raise ValueError(f"journal interval must be >= 1 decode call, got {every}")
        self.run_path, self.replica = run_path, replica
        self.every, self.max_staleness = int(every), int(max_staleness)
        self.steps = 0
        self._writer = None        # the thread writing the latest snapshot
        self.counts = dict.fromkeys(COUNTS, 0.0)
        self.index, damaged = journal.read_journals(run_path)
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

    def forget_newer(self, version: int) -> None:
        """The replica loaded its first weights, ``version``: drop (counted as stale) every
        prompt whose journal holds a token of a newer version. Such tokens come from a run
        that went past its last checkpoint before it stopped: the resumed learner publishes
        that version number again with other weights. Tokens of versions up to the
        checkpoint's were sampled by the same weights as before the stop."""
        for key in [k for k, entries in self.index.items()
                    if any(e.versions.size and int(e.versions.max()) > version
                           for e in entries)]:
            del self.index[key]
            self.counts["dropped_stale"] += 1

    def resumed(self, element, request, version: int) -> list[Completion]:
        """The journaled samples of a leased prompt (``element``: the lease, with
        ``stream_index`` and ``seed``), for ``batcher.submit(request, resumed=...)``;
        ``version``: the replica's weights version (for the staleness bound)."""
        key = (int(element["stream_index"]), int(element["seed"]))
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
                                  e.versions, e.finish_reason))
            self.counts["resumed_samples"] += 1
            self.counts["resumed_tokens"] += n
        return out

    def after_step(self, batcher, in_flight: dict) -> None:
        """Count a decode call; every ``every``-th, write the journal (``in_flight``:
        ``id(request) -> lease``, :attr:`rlflow.sampler.delivery.GroupDelivery.in_flight`)."""
        self.steps += 1
        if self.steps % self.every:
            return
        if self._writer is not None and self._writer.is_alive():
            self.counts["writes_skipped"] += 1     # the previous write is still going
            return
        t0 = time.monotonic()
        entries = []
        for request, samples in batcher.partials():
            element = in_flight.get(id(request))
            if element is None:           # an evaluation's request: not leased, not kept
                continue
            entries += [journal.JournalEntry(
                int(element["stream_index"]), int(element["seed"]), request.prompt_id,
                c.sample_index, np.asarray(c.tokens), np.asarray(c.logprobs),
                np.asarray(c.versions), c.finish_reason) for c in samples]
        self.counts["snapshot_s"] += time.monotonic() - t0
        self._writer = threading.Thread(target=self._write, args=(entries,),
                                        name="rlflow-journal", daemon=True)
        self._writer.start()

    def _write(self, entries) -> None:
        """Writer thread: encode and write one snapshot (off the decode loop)."""
        t0 = time.monotonic()
        try:
            journal.write_journal(self.run_path, self.replica, entries)
            self.counts["writes"] += 1
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
