"""The prompt ledger and the replica table: pure state, driven by seeded random schedules
against a plain-Python oracle (every prompt of the stream trained or dropped exactly once)."""

import random

import pytest

from rlflow.control.ledger import (LedgerError, PromptLedger, PromptsExhaustedError,
                                   group_key)
from rlflow.control.replicas import NoReplicaError, ReplicaTable
from rlflow.control.seeds import derive_seed


def _source(i):
    return {"prompt_id": i % 7, "prompt_tokens": [1, 2, 3], "answer": str(i)}


def _ledger(length, gps=3, k=1, trained_groups=0):
    return PromptLedger(_source, length, groups_per_step=gps, max_staleness=k,
                        seed_of=lambda i: derive_seed(5, i), trained_groups=trained_groups)


def _simulate(seed, *, length=60, gps=3, k=1, replicas=3, p_death=0.03, p_crash=0.02,
              p_stale=0.05, p_drop=0.03):
    """A random schedule of leases, deliveries, late deliveries of lost replicas, learner
    steps (with stale and zero-variance groups), replica deaths and learner crashes that
    resume from the last checkpoint. Returns (trained indices, dropped indices)."""
    rng = random.Random(seed)
    ledger = _ledger(length, gps, k)
    names = [f"r{i}" for i in range(replicas)]
    held = {n: [] for n in names}        # leases each live replica holds
    zombies = []                         # leases of lost replicas (may still be delivered)
    ring, batch, version = [], [], 0
    rversion = {n: 0 for n in names}
    trained, dropped, seeds = [], [], {}
    saved = (ledger.state(), 0, 0, 0)    # (state, version, len(trained), len(dropped))
    while len(trained) + len(dropped) < length:
        m = ledger.metrics()
        if ledger.exhausted() and m["ledger/in_flight"] + m["ledger/buffered"] == 0:
            ledger.trained(batch)               # the stream's last, partial step (drops)
            trained += [key[0] for key in batch]
            batch = []
            continue
        r = rng.choice(names)
        event = rng.random()
        if event < 0.35:                                   # lease
            rversion[r] = rng.randint(rversion[r], version)
            got = ledger.lease(r, rversion[r], rng.randint(1, 4))
            for e in got:
                assert 0 <= e["stream_index"] < length
                assert e["answer"] == str(e["stream_index"])
                assert e["seed"] == derive_seed(5, e["stream_index"])
                seeds[e["stream_index"]] = e["seed"]
                held[r].append((e["stream_index"], e["lease_id"]))
            active = ledger.metrics()
            live = sum(active[f"ledger/{s}"] for s in ("in_flight", "buffered", "consumed"))
            if got:     # the staleness budget holds after every lease
                assert ledger.trained_groups + live <= (rversion[r] + 1 + k) * gps
        elif event < 0.65 and held[r]:                     # a group is delivered
            key = held[r].pop(rng.randrange(len(held[r])))
            assert ledger.stored(key)
            ring.append(key)
        elif event < 0.70 and zombies:                     # a lost replica's late group
            key = zombies.pop(rng.randrange(len(zombies)))
            if ledger.stored(key):
                raise AssertionError(f"a revoked lease {key} was stored")
        elif event < 0.70 + p_death:                       # a replica dies
            zombies += held[r]
            held[r] = []
            ledger.release_replica(r)
        elif event < 0.70 + p_death + p_crash:             # learner crash: resume
            state, version, nt, nd = saved
            del trained[nt:], dropped[nd:]
            ledger = _ledger(length, gps, k, trained_groups=version * gps)
            ledger.restore(state)
            zombies, ring, batch = [], [], []
            held = {n: [] for n in names}
            rversion = {n: min(v, version) for n, v in rversion.items()}
        elif ring:                                          # the learner takes a group
            key = ring.pop(0)
            if not ledger.take(key):
                continue
            x = rng.random()
            if x < p_stale:
                ledger.give_back(key)
            elif x < p_stale + p_drop:
                ledger.drop(key)
                dropped.append(key[0])
            else:
                batch.append(key)
            if len(batch) == gps:
                ledger.trained(batch)
                trained += [key[0] for key in batch]
                batch, version = [], version + 1
                if rng.random() < 0.5:
                    saved = (ledger.state(), version, len(trained), len(dropped))
    return trained, dropped, ledger


@pytest.mark.parametrize("seed", range(12))
def test_every_prompt_trained_or_dropped_exactly_once(seed):
    trained, dropped, ledger = _simulate(seed)
    assert sorted(trained + dropped) == list(range(60))       # none lost, none twice
    m = ledger.metrics()
    assert m["ledger/dropped"] == len(dropped)
    assert ledger.exhausted()


@pytest.mark.parametrize("seed", range(4))
def test_sync_admission_is_exactly_one_step(seed):
    """k = 0: a replica at version v is leased at most (v + 1) * gps - trained groups."""
    trained, dropped, _ = _simulate(100 + seed, k=0, p_crash=0.0)
    assert sorted(trained + dropped) == list(range(60))


def test_epochs_multiset_matches_uninterrupted_oracle():
    """Two epochs of 10 prompts (prompt_id = stream_index mod 10): over crashes, deaths and
    re-dispatch, each epoch's prompt ids are trained exactly once each."""
    trained, dropped, _ = _simulate(7, length=20, gps=2, p_drop=0.0)
    assert not dropped
    for epoch in range(2):
        ids = sorted(i % 10 for i in trained if i // 10 == epoch)
        assert ids == list(range(10))


def test_state_round_trip_redispatches_untrained_first_with_seeds():
    a = _ledger(None, gps=2, k=1)
    leased = a.lease("r0", 0, 4)                    # budget (0 + 1 + 1) * 2 = 4
    assert [e["stream_index"] for e in leased] == [0, 1, 2, 3]
    assert a.lease("r1", 0, 4) == []                 # budget spent, shared by all replicas
    keys = [(e["stream_index"], e["lease_id"]) for e in leased]
    for key in keys[:3]:
        assert a.stored(key)
    assert a.take(keys[0]) and a.take(keys[2])
    a.trained([keys[0], keys[2]])
    state = a.state()
    assert state["ledger"]["untrained"] == [[1, derive_seed(5, 1)], [3, derive_seed(5, 3)]]
    b = _ledger(None, gps=2, k=1, trained_groups=2)
    b.restore(state)
    again = b.lease("r9", 1, 10)                     # (1 + 1 + 1) * 2 - 2 = 4
    assert [e["stream_index"] for e in again] == [1, 3, 4, 5]
    assert [e["seed"] for e in again] == [derive_seed(5, i) for i in (1, 3, 4, 5)]
    assert b.metrics()["ledger/redispatched"] == 2
    # the untrained ones are marked (a replica's journal may hold their partial generations)
    assert [e["redispatched"] for e in again] == [True, True, False, False]
    assert not any(e["redispatched"] for e in leased)
    # lease ids keep growing across the restore: an old lease is never current again
    assert min(e["lease_id"] for e in again) > max(k[1] for k in keys)


def test_legacy_iterator_state_and_bad_states():
    a = _ledger(None)
    a.restore({"next_index": 11})
    assert a.lease("r", 0, 1)[0]["stream_index"] == 11
    with pytest.raises(LedgerError, match="next_index"):
        _ledger(None).restore({"pos": 3})
    with pytest.raises(LedgerError, match="format"):
        _ledger(None).restore({"ledger": {"format": 99}})
    with pytest.raises(LedgerError, match="outside"):
        _ledger(None).restore({"ledger": {"format": 1, "next_index": 2,
                                          "untrained": [[5, 1]]}})


def test_duplicate_and_unknown_groups_are_refused_and_counted():
    a = _ledger(None, gps=1, k=0)
    (e,) = a.lease("r0", 0, 1)
    key = (e["stream_index"], e["lease_id"])
    assert a.release_replica("r0") == 1
    (e2,) = a.lease("r1", 0, 1)                       # same prompt, new lease
    assert e2["stream_index"] == e["stream_index"] and e2["lease_id"] != e["lease_id"]
    assert e2["seed"] == e["seed"] and e2["redispatched"] and not e["redispatched"]
    assert not a.stored(key)                          # the lost replica's late group
    assert a.stored((e2["stream_index"], e2["lease_id"]))
    assert not a.take(key)
    assert a.metrics()["ledger/duplicates"] == 2
    with pytest.raises(LedgerError, match="not taken"):
        a.trained([(e2["stream_index"], e2["lease_id"])])


def test_prompts_exhausted_is_named_only_when_groups_cannot_come():
    a = _ledger(5, gps=2, k=2)
    got = a.lease("r", 0, 10)
    assert len(got) == 5 and a.exhausted()
    a.check_enough(4)                                # 5 in flight: enough for 2 steps
    keys = [(e["stream_index"], e["lease_id"]) for e in got]
    for key in keys:
        a.stored(key)
        a.take(key)
    a.drop(keys[0])
    a.drop(keys[1])
    a.check_enough(2)
    with pytest.raises(PromptsExhaustedError, match="ran out after 5 prompts"):
        a.check_enough(4)


def test_group_key_reads_optional_fields():
    import numpy as np

    assert group_key({"prompt_id": np.int64(3)}) is None
    assert group_key({"stream_index": np.int64(4), "lease_id": np.int64(9)}) == (4, 9)


def test_replica_table_timeouts_restarts_and_none_alive():
    t = ReplicaTable(timeout_s=10.0, now=0.0, startup_s=100.0)
    t.check(50.0)                                    # before any heartbeat: startup allowance
    with pytest.raises(NoReplicaError, match="none ever"):
        t.check(101.0)
    assert t.beat("a", 0, 1.0) == [] and t.beat("b", 0, 1.0) == []
    assert t.expire(5.0) == []
    assert t.beat("a", 1, 6.0) == ["a"]               # restarted: the old instance is lost
    assert t.beat("a", 0, 6.5) == []                  # a late message of the old instance
    assert t.replicas["a"].instance == 1 and t.replicas["a"].restarts == 1
    assert t.expire(11.5) == ["b"]                    # b silent since 1.0
    assert t.alive() == ["a"] and t.none_alive_for(12.0) == 0.0
    assert t.expire(17.0) == ["a"]
    assert t.none_alive_for(20.0) == pytest.approx(20.0 - 16.0)
    t.check(26.0)
    with pytest.raises(NoReplicaError, match="replica_timeout_s=10"):
        t.check(26.5)
    t.beat("b", 0, 27.0)                              # a replica comes back
    t.check(1000.0 if not t.expire(27.0) else 0.0)


@pytest.mark.parametrize("new_gps", [1, 4])
def test_a_resume_with_another_groups_per_step_leases_within_the_new_budget(new_gps):
    """A run checkpointed with groups_per_step 2 and resumed with another value: admission
    counts the resumed steps at the new value ((v + 1 + k) * gps - v * gps - active), the
    untrained prompts come first, and the budget is never stuck at 0 (it was, for a smaller
    value, when the checkpoint's trained count was read back)."""
    a = _ledger(None, gps=2, k=1)
    version = 0
    for _ in range(3):                                   # 3 steps of 2 groups each
        leased = a.lease("r0", version, 10)
        keys = [(e["stream_index"], e["lease_id"]) for e in leased]
        for key in keys:
            assert a.stored(key)
        assert all(a.take(k) for k in keys[:2])
        a.trained(keys[:2])
        version += 1
    state = a.state()
    untrained = [i for i, _ in state["ledger"]["untrained"]]
    assert len(untrained) == 2 and state["ledger"]["trained_groups"] == 6
    b = _ledger(None, gps=new_gps, k=1, trained_groups=version * new_gps)
    b.restore(state)
    again = b.lease("r0", version, 10)
    assert len(again) == 2 * new_gps                      # (1 + k) * gps, nothing active
    assert [e["stream_index"] for e in again][:2] == untrained   # untrained ones first
