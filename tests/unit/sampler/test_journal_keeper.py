"""The sampler program's journal keeper (rlflow.sampler.journal_keeper): writes every
N // 2 decode calls keyed by lease, the journal on disk never more than N calls behind;
hands a re-leased prompt its samples (reading a dead replica's journal again when needed,
a restarted replica carrying its predecessor's entries), drops a partial generation older
than the staleness bound and skips entries that do not fit, counted."""

from __future__ import annotations

import numpy as np
import pytest

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
    k = JournalKeeper(str(tmp_path), "sampler-0", every=6, max_staleness=1)   # cadence 3
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


def test_a_snapshot_waits_for_the_previous_write(tmp_path, monkeypatch):
    import threading

    release, calls = threading.Event(), []

    def slow_write(run_path, replica, entries, launch=""):
        calls.append(len(entries))
        release.wait(30)

    monkeypatch.setattr(journal, "write_journal", slow_write)
    r = _request(1)
    batcher, leases = _Batcher([(r, [_c(1, 0, 2, 0)])]), {id(r): {"stream_index": 0, "seed": 1}}
    k = JournalKeeper(str(tmp_path), "sampler-0", every=2, max_staleness=0)   # cadence 1
    k.after_step(batcher, leases)        # a write starts and hangs
    waiter = threading.Thread(target=k.after_step, args=(batcher, leases))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and batcher.calls == 1     # the next snapshot waits for it
    release.set()
    waiter.join(30)
    k.flush()
    m = k.metrics()
    assert calls == [1, 1] and batcher.calls == 2
    assert (m["sampler/journal_writes"], m["sampler/journal_write_waits"]) == (2.0, 1.0)


class _Counting:
    """A batcher whose one sample has decoded as many tokens as decode calls were made."""

    def __init__(self, request):
        self.request, self.decoded = request, 0

    def partials(self):
        return [(self.request, [_c(1, 0, self.decoded, 0)])]


@pytest.mark.parametrize("every", [1, 2, 3, 5])
def test_the_journal_on_disk_is_never_more_than_n_decode_calls_behind(tmp_path, monkeypatch,
                                                                      every):
    """A kill can come at any moment: after each decode call, before and after the keeper
    runs, the journal file (read back) holds the sample as of at most N calls ago, with
    writes of random length (0-3 ms) against decode calls of 0-1 ms."""
    import time

    real = journal.write_journal
    rng = np.random.default_rng(every)
    delays = iter(rng.uniform(0, 3e-3, 1000))

    def slow_write(run_path, replica, entries, launch=""):
        time.sleep(next(delays))
        real(run_path, replica, entries, launch)

    monkeypatch.setattr(journal, "write_journal", slow_write)
    r = _request(1, g=1, max_tokens=1000)
    batcher, leases = _Counting(r), {id(r): {"stream_index": 0, "seed": 1}}
    k = JournalKeeper(str(tmp_path), "sampler-0", every=every, max_staleness=0)

    def on_disk():
        index, damaged = journal.read_journals(str(tmp_path))
        assert damaged == 0
        return int(index[(0, 1)][0].tokens.size) if index else 0

    worst = 0
    for _ in range(120):
        time.sleep(rng.uniform(0, 1e-3))
        batcher.decoded += 1                      # a decode call finished
        worst = max(worst, batcher.decoded - on_disk())
        k.after_step(batcher, leases)
        worst = max(worst, batcher.decoded - on_disk())
    k.flush()
    assert worst <= every, worst
    assert k.metrics()["sampler/journal_lag_max"] <= every
    assert on_disk() >= batcher.decoded - every


def test_a_replica_given_a_dead_replicas_prompt_reads_its_journal_again(tmp_path):
    """sampler-1 started (and read the journals) before sampler-0 journaled prompt 4; when
    the ledger hands it prompt 4 taken back, it reads sampler-0's journal again. A lease
    not taken back reads nothing."""
    r = _request(10, g=2)
    k = JournalKeeper(str(tmp_path), "sampler-1", every=1, max_staleness=0)
    journal.write_journal(str(tmp_path), "sampler-0", [
        journal.JournalEntry(4, 77, 10, 1, *_arrays(3), "")])
    fresh = {"stream_index": 4, "seed": 77, "redispatched": False}
    k.refresh([fresh], version=0)
    assert k.metrics()["sampler/journal_refreshes"] == 0.0 and k.index == {}
    again = dict(fresh, redispatched=True)
    k.refresh([again], version=0)
    assert [(c.sample_index, c.tokens.size) for c in k.resumed(again, r, 0)] == [(1, 3)]
    assert k.metrics()["sampler/journal_refreshes"] == 1.0


def test_a_restarted_replica_carries_its_predecessors_entries_until_taken(tmp_path):
    """sampler-0 restarts holding prompts 4 and 5 from its predecessor's journal; its own
    writes keep them (another replica given them still finds them) until it takes one
    itself (then it is journaled as a sample in flight) or they are too old."""
    journal.write_journal(str(tmp_path), "sampler-0", [
        journal.JournalEntry(4, 77, 10, 0, *_arrays(3), ""),
        journal.JournalEntry(5, 78, 11, 0, *_arrays(2), "")])
    k = JournalKeeper(str(tmp_path), "sampler-0", every=1, max_staleness=0)
    k.forget_newer(0)
    k.after_step(_Batcher([]), {})
    index, _ = journal.read_journals(str(tmp_path))
    assert sorted(index) == [(4, 77), (5, 78)]
    assert len(k.resumed({"stream_index": 4, "seed": 77}, _request(10), 0)) == 1
    k.after_step(_Batcher([]), {})
    assert sorted(journal.read_journals(str(tmp_path))[0]) == [(5, 78)]
    moved_on = _Batcher([])
    moved_on.version = 1                 # at version 1, tokens of version 0 lag 1 > 0
    k.after_step(moved_on, {})
    assert journal.read_journals(str(tmp_path))[0] == {}


def test_tokens_newer_than_the_first_weights_are_dropped(tmp_path):
    """A run resumed from a checkpoint at version 2 (launch "B") publishes versions 3, 4
    again with other weights: a prompt journaled by launch "A" holding a token of version 3
    is dropped (counted); one whose tokens are all of versions <= 2 is kept. Read again
    later (another replica's journal), the same rule holds for launch "A"'s entries, while
    launch "B"'s own entries of version 3 are kept."""
    r = _request(10)
    journal.write_journal(str(tmp_path), "sampler-0", [
        journal.JournalEntry(4, 77, 10, 0, np.arange(3, dtype=np.int32), np.zeros(3, np.float32),
                             np.array([2, 2, 3], np.int32)),
        journal.JournalEntry(5, 78, 10, 0, np.arange(2, dtype=np.int32), np.zeros(2, np.float32),
                             np.array([1, 2], np.int32))], launch="A")
    k = JournalKeeper(str(tmp_path), "sampler-0", every=1, max_staleness=4)
    k.forget_newer(2, launch="B")
    assert k.resumed({"stream_index": 4, "seed": 77}, r, version=3) == []
    assert [c.tokens.size for c in k.resumed({"stream_index": 5, "seed": 78}, r, version=3)] == [2]
    assert k.metrics()["sampler/journal_dropped_stale"] == 1.0
    newer = [journal.JournalEntry(i, 80 + i, 10, 0, np.arange(2, dtype=np.int32),
                                  np.zeros(2, np.float32), np.array([3, 3], np.int32))
             for i in (6, 7)]
    journal.write_journal(str(tmp_path), "sampler-1", newer[:1], launch="A")
    journal.write_journal(str(tmp_path), "sampler-2", newer[1:], launch="B")
    k.refresh([{"stream_index": 6, "seed": 86, "redispatched": True}], version=3)
    assert sorted(k.index) == [(7, 87)]

def test_finished_groups_are_journaled_until_surely_trained(tmp_path):
    """A group being scored is not in the batcher any more, nor in the buffer yet; once in
    the buffer the learner may still die before training it. The journal keeps it (as
    finished samples) until the learner's version passes its oldest token's version
    + max_staleness + 1 (it was taken by then, or dropped as too stale)."""
    import types

    from rlflow.sampler.delivery import GroupDelivery
    from rlflow.sampler.requests import CompletedGroup

    r = _request(10, g=2)
    group = CompletedGroup(request=r, prompt_tokens=np.asarray([1, 2], np.int32), max_tokens=8,
                           completions=[_c(10, 0, 4, 3, "stop"), _c(10, 1, 8, 3, "length")])

    class _Rewarder:
        def __init__(self):
            self.keys = []

        def submit_group(self, key, *args):
            self.keys.append(key)

        def collect(self, timeout):
            keys, self.keys = self.keys, []
            return [(k, types.SimpleNamespace(nonfinite=[], total=[1.0, 0.0], failed=None))
                    for k in keys]

    class _Buffer:
        def put_groups(self, records):
            self.records = records
            return {}

    class _Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "x"

    class _Window:
        def add(self, **kw):
            pass

    delivery = GroupDelivery(_Tokenizer(), _Buffer(), _Rewarder(), _Window(), keep_sent=True)
    delivery.admit(r, {"stream_index": 4, "seed": 77, "lease_id": 1, "answer": "1"})
    delivery.score([group])
    k = JournalKeeper(str(tmp_path), "sampler-0", every=1, max_staleness=1)

    def journaled():
        k.after_step(_Batcher([]), delivery.in_flight, delivery.held())
        index, _ = journal.read_journals(str(tmp_path))
        return [(e.sample_index, e.finish_reason, e.tokens.size) for e in index.get((4, 77), [])]

    assert journaled() == [(0, "stop", 4), (1, "length", 8)]          # being scored
    delivery.collect()
    assert delivery.groups_delivered == 1 and not delivery.in_flight
    assert journaled() == [(0, "stop", 4), (1, "length", 8)]          # in the buffer
    delivery.release_sent(learner_version=5, max_staleness=1)         # 5 > 3 + 1 + 1: no
    assert journaled() == [(0, "stop", 4), (1, "length", 8)]
    delivery.release_sent(learner_version=6, max_staleness=1)
    assert journaled() == []


def test_finished_episode_groups_are_journaled_with_rewards_until_surely_trained(tmp_path):
    """Episode groups go to the buffer at once (their rewards come from the environments);
    the journal keeps them, rewards and failures included, until the learner's version
    passes their oldest *sampled* token's version + max_staleness + 1 (the environment's
    ids, version -1, do not count)."""
    import dataclasses
    import types

    from delivery_fakes import CharTokenizer, RecordingBuffer
    from rlflow.sampler.delivery import GroupDelivery
    from rlflow.sampler.requests import CompletedGroup

    r = dataclasses.replace(_request(10, g=2), episode=object())
    episodes = []
    for i, (reward, failed) in enumerate([(0.5, False), (0.0, True)]):
        c = _c(10, i, 6, 3, "stop")
        c.versions[2:4] = -1                                     # the environment's ids
        c.reward, c.failed, c.loss_mask = reward, failed, c.versions >= 0
        episodes.append(c)
    group = CompletedGroup(request=r, prompt_tokens=np.asarray([1, 2], np.int32), max_tokens=8,
                           completions=episodes)
    buffer = RecordingBuffer()
    delivery = GroupDelivery(CharTokenizer(), buffer, None,
                             types.SimpleNamespace(add=lambda **kw: None), keep_sent=True)
    delivery.admit(r, {"stream_index": 4, "seed": 77, "lease_id": 1, "answer": "1"})
    delivery.score([group])
    assert len(buffer.records) == 1 and buffer.records[0]["rewards"].tolist() == [0.5, 0.0]
    k = JournalKeeper(str(tmp_path), "sampler-0", every=1, max_staleness=1)

    def journaled():
        k.after_step(_Batcher([]), delivery.in_flight, delivery.held())
        index, _ = journal.read_journals(str(tmp_path))
        return [(e.sample_index, e.finish_reason, e.reward, e.failed)
                for e in index.get((4, 77), [])]

    assert journaled() == [(0, "stop", 0.5, False), (1, "stop", 0.0, True)]
    got = JournalKeeper(str(tmp_path), "sampler-1", every=1, max_staleness=1).resumed(
        {"stream_index": 4, "seed": 77}, r, version=4)           # lag 1 of sampled tokens
    assert [(c.reward, c.failed) for c in got] == [(0.5, False), (0.0, True)]
    late = JournalKeeper(str(tmp_path), "sampler-1", every=1, max_staleness=1)
    assert late.resumed({"stream_index": 4, "seed": 77}, r, version=5) == []    # lag 2
    assert late.metrics()["sampler/journal_dropped_stale"] == 1
    delivery.release_sent(learner_version=5, max_staleness=1)    # 5 > 3 + 1 + 1: no
    assert len(journaled()) == 2
    delivery.release_sent(learner_version=6, max_staleness=1)
    assert journaled() == []
