"""The journal of partial generations (rlflow.run.journal): round trip, atomic replace,
damaged files and entries skipped and counted, the staleness bound."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlflow.run import journal
from rlflow.run.journal import JournalEntry


def _entry(rng, stream_index, sample_index, n, versions=(3,), reason=""):
    return JournalEntry(stream_index, seed=1000 + stream_index, prompt_id=7 * stream_index,
                        sample_index=sample_index,
                        tokens=rng.integers(0, 50_000, n).astype(np.int32),
                        logprobs=-rng.exponential(size=n).astype(np.float32),
                        versions=np.resize(np.asarray(versions, np.int32), n),
                        finish_reason=reason)


def _same(a, b):
    assert (a.stream_index, a.seed, a.prompt_id, a.sample_index, a.finish_reason) == \
        (b.stream_index, b.seed, b.prompt_id, b.sample_index, b.finish_reason)
    for x, y in zip(a.arrays(), b.arrays()):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def test_write_read_round_trip_and_replace(tmp_path):
    rng = np.random.default_rng(0)
    first = [_entry(rng, 4, 0, 5), _entry(rng, 4, 1, 0), _entry(rng, 9, 0, 12, (2, 3), "stop")]
    journal.write_journal(str(tmp_path), "sampler-0", first)
    journal.write_journal(str(tmp_path), "sampler-1", [_entry(rng, 11, 2, 3)])
    got, damaged = journal.read_journals(str(tmp_path))
    assert damaged == 0 and sorted(got) == [(4, 1004), (9, 1009), (11, 1011)]
    for want, have in zip(first[:2], got[(4, 1004)]):
        _same(want, have)
    _same(first[2], got[(9, 1009)][0])
    # a newer write replaces the replica's journal whole; no temporary file is left
    journal.write_journal(str(tmp_path), "sampler-0", first[2:])
    got, _ = journal.read_journals(str(tmp_path))
    assert sorted(got) == [(9, 1009), (11, 1011)]
    assert sorted(p.name for p in (tmp_path / "journal").iterdir()) == \
        ["sampler-0.npz", "sampler-1.npz"]
    assert journal.read_journals(str(tmp_path / "nothing")) == ({}, 0)


def test_damaged_entries_and_files_are_skipped_and_counted(tmp_path):
    rng = np.random.default_rng(1)
    entries = [_entry(rng, i, 0, 64) for i in range(3)]
    data = bytearray(journal.encode("sampler-0", entries))
    # flip a byte inside the second entry's token array (stored uncompressed in the zip)
    t1 = entries[1].arrays()[0].tobytes()
    at = bytes(data).index(t1)
    data[at + 10] ^= 0xFF
    got, damaged = journal.decode(bytes(data))
    assert damaged == 1 and [e.stream_index for e in got] == [0, 2]
    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / "sampler-0.npz").write_bytes(bytes(data))
    (tmp_path / "journal" / "sampler-1.npz").write_bytes(b"PK\x03\x04 cut short")
    journal.write_journal(str(tmp_path), "sampler-2", [_entry(rng, 5, 1, 4)])
    got, damaged = journal.read_journals(str(tmp_path))
    assert damaged == 2 and sorted(got) == [(0, 1000), (2, 1002), (5, 1005)]
    assert journal.decode(b"") == ([], 1)


def test_unequal_arrays_are_refused_with_the_sample_named():
    e = JournalEntry(1, 2, 3, 0, np.zeros(4, np.int32), np.zeros(3, np.float32),
                     np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="prompt_id 3 sample 0"):
        journal.encode("sampler-0", [e])


def test_staleness_counts_the_oldest_tokens_version():
    rng = np.random.default_rng(2)
    group = [_entry(rng, 1, 0, 6, (5, 6)), _entry(rng, 1, 1, 4, (4, 6))]
    assert not journal.stale(group, version=6, max_staleness=2)      # lag 2: kept
    assert journal.stale(group, version=7, max_staleness=2)          # lag 3: dropped
    assert not journal.stale([_entry(rng, 1, 0, 0)], version=99, max_staleness=0)  # no tokens
    # an episode's environment ids (version -1) were not sampled: they do not count
    episode = [_entry(rng, 1, 0, 6, (5, -1, -1, 6))]
    assert not journal.stale(episode, version=6, max_staleness=1)
    assert journal.stale(episode, version=7, max_staleness=1)


def test_a_finished_episodes_reward_and_failure_round_trip():
    rng = np.random.default_rng(3)
    done = dataclasses.replace(_entry(rng, 2, 1, 6, (4, -1, 4), "stop"), reward=0.25,
                               failed=True)
    got, damaged = journal.decode(journal.encode("sampler-0", [done, _entry(rng, 2, 0, 3)]))
    assert damaged == 0 and (got[0].reward, got[0].failed) == (0.25, True)
    assert (got[1].reward, got[1].failed) == (None, False)       # a sample in flight
    _same(done, got[0])
