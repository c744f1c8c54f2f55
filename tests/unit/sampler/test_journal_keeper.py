"""The sampler program's journal keeper (rlflow.sampler.journal_keeper): writes every N
decode calls keyed by lease, hands a re-leased prompt its samples, drops a partial
generation older than the staleness bound and skips entries that do not fit, counted."""

from __future__ import annotations

import numpy as np

from rlflow.run import journal
from rlflow.sampler.journal_keeper import JournalKeeper
from rlflow.sampler.requests import Completion, Request
from rlflow.sampler.sampling import SamplingParams


def _request(pid, g=3, max_tokens=8):
    return Request(pid, [1, 2], g, SamplingParams(max_tokens=max_tokens, seed=pid))


def _c(pid, i, n, version, reason=""):
    return Completion(pid, i, np.arange(n, dtype=np.int32), -np.ones(n, np.float32),
                      np.full(n, version, np.int32), reason)


class _Batcher:
    def __init__(self, partials):
        self._partials, self.calls = partials, 0

    def partials(self):
        self.calls += 1
        return self._partials


def test_writes_every_n_calls_and_a_new_keeper_resumes(tmp_path):
    r1, r2, ev = _request(10), _request(11), _request(99)
    leases = {id(r1): {"stream_index": 4, "seed": 77}, id(r2): {"stream_index": 5, "seed": 78}}
    batcher = _Batcher([(r1, [_c(10, 0, 8, 2, "length"), _c(10, 2, 3, 2)]),
                        (r2, [_c(11, 1, 5, 1)]), (ev, [_c(99, 0, 2, 2)])])   # ev: not leased
    k = JournalKeeper(str(tmp_path), "sampler-0", every=3, max_staleness=1)
    for _ in range(7):
        k.after_step(batcher, leases)
        k.flush()
    assert batcher.calls == 2 and k.metrics()["sampler/journal_writes"] == 2.0
    index, damaged = journal.read_journals(str(tmp_path))
    assert damaged == 0 and sorted(index) == [(4, 77), (5, 78)]

    again = JournalKeeper(str(tmp_path), "sampler-0", every=3, max_staleness=1)
    got = again.resumed({"stream_index": 4, "seed": 77}, r1, version=3)
    assert [(c.sample_index, c.finish_reason, c.tokens.size) for c in got] == \
        [(0, "length", 8), (2, "", 3)]
    assert again.resumed({"stream_index": 4, "seed": 77}, r1, version=3) == []  # taken once
    # r2's tokens are of version 1: at version 3 they lag 2 > max_staleness 1
    assert again.resumed({"stream_index": 5, "seed": 78}, r2, version=3) == []
    m = again.metrics()
    assert (m["sampler/journal_resumed_samples"], m["sampler/journal_resumed_tokens"],
            m["sampler/journal_dropped_stale"], m["sampler/journal_damaged"]) == (2, 11, 1, 0)


def test_entries_that_do_not_fit_the_request_are_skipped_and_counted(tmp_path):
    r = _request(10, g=2, max_tokens=4)
    entries = [journal.JournalEntry(4, 77, 10, 0, *(a for a in _arrays(4)), ""),  # = max
               journal.JournalEntry(4, 77, 10, 5, *_arrays(2), ""),              # index 5
               journal.JournalEntry(4, 77, 10, 1, *_arrays(2), "")]              # fits
    journal.write_journal(str(tmp_path), "sampler-1", entries)
    k = JournalKeeper(str(tmp_path), "sampler-0", every=1, max_staleness=0)
    got = k.resumed({"stream_index": 4, "seed": 77}, r, version=0)
    assert [c.sample_index for c in got] == [1]
    assert k.metrics()["sampler/journal_damaged"] == 2.0


def test_a_failed_write_is_counted_not_fatal(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run folder should be")
    r = _request(1)
    k = JournalKeeper(str(tmp_path / "nothing"), "sampler-0", every=1, max_staleness=0)
    k.run_path = str(blocker)
    k.after_step(_Batcher([(r, [_c(1, 0, 2, 0)])]), {id(r): {"stream_index": 0, "seed": 1}})
    k.flush()
    m = k.metrics()
    assert m["sampler/journal_write_errors"] == 1.0 and m["sampler/journal_writes"] == 0.0


def _arrays(n):
    return np.arange(n, dtype=np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32)


def test_a_snapshot_is_skipped_while_the_previous_write_goes_on(tmp_path, monkeypatch):
    import threading

    release, calls = threading.Event(), []

    def slow_write(run_path, replica, entries):
        calls.append(len(entries))
        release.wait(30)

    monkeypatch.setattr(journal, "write_journal", slow_write)
    r = _request(1)
    batcher, leases = _Batcher([(r, [_c(1, 0, 2, 0)])]), {id(r): {"stream_index": 0, "seed": 1}}
    k = JournalKeeper(str(tmp_path), "sampler-0", every=1, max_staleness=0)
    k.after_step(batcher, leases)
    k.after_step(batcher, leases)        # the first write has not returned: skipped
    release.set()
    k.flush()
    k.after_step(batcher, leases)
    k.flush()
    m = k.metrics()
    assert calls == [1, 1] and batcher.calls == 2
    assert (m["sampler/journal_writes"], m["sampler/journal_writes_skipped"]) == (2.0, 1.0)


def test_tokens_newer_than_the_first_weights_are_dropped(tmp_path):
    """A run resumed from a checkpoint at version 2 publishes versions 3, 4 again with other
    weights: a journaled prompt holding a token of version 3 is dropped (counted); one whose
    tokens are all of versions <= 2 is kept."""
    r = _request(10)
    journal.write_journal(str(tmp_path), "sampler-0", [
        journal.JournalEntry(4, 77, 10, 0, np.arange(3, dtype=np.int32), np.zeros(3, np.float32),
                             np.array([2, 2, 3], np.int32)),
        journal.JournalEntry(5, 78, 10, 0, np.arange(2, dtype=np.int32), np.zeros(2, np.float32),
                             np.array([1, 2], np.int32))])
    k = JournalKeeper(str(tmp_path), "sampler-0", every=1, max_staleness=4)
    k.forget_newer(2)
    assert k.resumed({"stream_index": 4, "seed": 77}, r, version=3) == []
    assert [c.tokens.size for c in k.resumed({"stream_index": 5, "seed": 78}, r, version=3)] == [2]
    assert k.metrics()["sampler/journal_dropped_stale"] == 1.0
