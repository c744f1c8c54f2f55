"""Run control: the admission rule (staleness budget) and the status channel over loopback."""

import threading
import time

import numpy as np
import pytest

from rlflow.exchange import wire
from rlflow.exchange.records import synthetic_group
from rlflow.learner.batch import sample_staleness
from rlflow.control.ledger import PromptLedger
from rlflow.control.replicas import ReplicaTable
from rlflow.control.run_control import (DONE_ACK_SILENCE_S, ControlClient, RunCoordinator,
                                    groups_to_admit)
from rlflow.system.ports import free_port


def oracle_admit(version, gps, k, accepted, buffered, in_flight, n=1):
    budget = (version + 1 + k) * gps - accepted - buffered
    share = int(np.ceil(budget / n)) if budget > 0 else 0
    return max(0, share - in_flight)


@pytest.mark.parametrize("version,gps,k,accepted,buffered,in_flight,n", [
    (0, 4, 0, 0, 0, 0, 1), (0, 4, 0, 0, 0, 4, 1), (3, 4, 0, 12, 0, 0, 1),
    (3, 4, 2, 12, 3, 5, 1), (5, 8, 1, 30, 40, 0, 1), (2, 5, 1, 7, 1, 2, 3),
    (7, 2, 0, 14, 0, 1, 2)])
def test_groups_to_admit_matches_oracle(version, gps, k, accepted, buffered, in_flight, n):
    got = groups_to_admit(version=version, groups_per_step=gps, max_staleness=k,
                          accepted=accepted, buffered=buffered, in_flight=in_flight,
                          num_samplers=n)
    assert got == oracle_admit(version, gps, k, accepted, buffered, in_flight, n)


def test_groups_to_admit_rejects_bad_inputs():
    with pytest.raises(ValueError, match="version"):
        groups_to_admit(version=-1, groups_per_step=4, max_staleness=0, accepted=0,
                        buffered=0, in_flight=0)


def _simulate(k_learner_admits, steps=3, gps=4):
    """Learner (drop policy with ``k_learner_admits``) and sampler (admission with k = 0)
    stepping in lockstep; the sampler is one version behind at the start, as in the issue's
    deadlock case. Returns the versions of the groups each step consumed."""
    rng = np.random.default_rng(0)
    learner_v, sampler_v = 13, 12
    accepted, buffer, in_flight = 13 * gps, [], 0
    # The sampler, still on 12, emits gps groups tagged 12 after the learner moved to 13.
    buffer += [synthetic_group(rng, version=12) for _ in range(gps)]
    consumed = []
    for _ in range(steps):
        sampler_v = learner_v                               # it catches up (pulls weights)
        taken, spins = [], 0
        while len(taken) < gps:
            spins += 1
            assert spins < 100, "the learner waits forever"
            if not buffer:                                   # sampler's turn
                n = groups_to_admit(version=sampler_v, groups_per_step=gps, max_staleness=0,
                                    accepted=accepted, buffered=len(buffer),
                                    in_flight=in_flight)
                buffer += [synthetic_group(rng, version=sampler_v) for _ in range(n)]
                continue
            g = buffer.pop(0)
            stale = sample_staleness(g["policy_versions"], g["completion_lengths"], learner_v)
            if (stale > k_learner_admits).all():             # the learner's accept filter
                continue                                     # dropped: budget reopens
            accepted += 1
            taken.append(g)
        consumed.append(sorted({int(v) for g in taken for v in
                                g["policy_versions"][g["policy_versions"] >= 0]}))
        learner_v += 1
    return consumed


def test_staleness_deadlock_case_gets_current_samples():
    # max_staleness 0: the 12s are dropped, the sampler replaces them with 13s.
    assert _simulate(0) == [[13], [14], [15]]


def test_staleness_deadlock_case_admits_one_version_old_when_configured():
    # admitting staleness 1: the learner takes the four 12s first.
    assert _simulate(1)[0] == [12]


class _Offers:
    def __init__(self):
        self.version = -1

    def offer(self, consumer, have_version):
        return {"version": self.version}


def test_status_round_trip_over_loopback():
    counts = {"accepted": 5, "buffered": 2}
    coord = RunCoordinator(_Offers(), buffer_counts=lambda: (counts["accepted"],
                                                             counts["buffered"])).start()
    try:
        coord.set_progress(learner_version=3, published_version=3)
        client = ControlClient(coord.address, consumer_id="s0", instance=0, timeout_s=5)
        r1 = client.status(version=3, prompts_started=9, want=4,
                           metrics={"sampler/tokens_per_s": 12.5})
        assert (r1.learner_version, r1.published_version, r1.accepted, r1.buffered) == \
            (3, 3, 5, 2)
        assert r1.prompts == []                                   # no ledger: no leases
        assert not r1.done
        st = coord.latest_status()
        assert st.consumer == "s0" and st.prompts_started == 9
        assert st.metrics["sampler/tokens_per_s"] == 12.5
        assert not coord.acknowledged_done()
        coord.set_progress(done=True)
        assert not coord.acknowledged_done()
        assert client.status(version=3, prompts_started=10).done
        assert coord.acknowledged_done()
        assert client.heartbeat()                                 # heartbeats carry "done"
        client.close()
    finally:
        coord.close()


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_done_is_not_waited_for_from_a_silent_replica():
    """The run's end waits for the ack of every replica heard from lately; one silent for
    over DONE_ACK_SILENCE_S (killed just before the end) is not waited for, though the
    replica table still counts it alive."""
    clock = _Clock()
    coord = RunCoordinator(_Offers(), buffer_counts=lambda: (0, 0),
                           replicas=ReplicaTable(60.0, clock()), clock=clock).start()
    a = ControlClient(coord.address, consumer_id="sampler-0", timeout_s=5)
    b = ControlClient(coord.address, consumer_id="sampler-1", timeout_s=5)
    try:
        a.status(version=0)
        b.status(version=0)
        coord.set_progress(done=True)
        clock.t = DONE_ACK_SILENCE_S / 2
        assert a.status(version=1).done
        assert not coord.acknowledged_done()          # sampler-1 is live and has not seen it
        clock.t = DONE_ACK_SILENCE_S + 0.5            # sampler-1 silent for longer than that
        assert coord.replicas.alive() == ["sampler-0", "sampler-1"]
        assert coord.acknowledged_done()
        assert b.heartbeat()                          # it beats again: waited for once more
        assert not coord.acknowledged_done()
        assert b.status(version=1).done
        assert coord.acknowledged_done()
    finally:
        a.close()
        b.close()
        coord.close()


def test_leases_over_loopback_and_lost_replica_prompts_go_to_another():
    """Two replicas lease from one ledger under one budget; the first goes silent, the
    coordinator's watchdog takes its prompts back and the second replica gets them."""
    clock = _Clock()
    ledger = PromptLedger(lambda i: {"prompt_id": i, "prompt_tokens": [1, i], "answer": "a"},
                          None, groups_per_step=2, max_staleness=1, seed_of=lambda i: 100 + i)
    coord = RunCoordinator(_Offers(), buffer_counts=lambda: (0, 0), ledger=ledger,
                           replicas=ReplicaTable(5.0, clock()), clock=clock).start()
    a = ControlClient(coord.address, consumer_id="sampler-0", timeout_s=5)
    b = ControlClient(coord.address, consumer_id="sampler-1", timeout_s=5)
    try:
        ra = a.status(version=0, want=3)
        assert [p["stream_index"] for p in ra.prompts] == [0, 1, 2]
        assert ra.prompts[1] == {"stream_index": 1, "lease_id": 2, "seed": 101, "prompt_id": 1,
                                 "prompt_tokens": [1, 1], "answer": "a",
                                 "redispatched": False}
        assert ra.budget == 1                                  # (0 + 1 + 1) * 2 - 3
        rb = b.status(version=0, want=3)
        assert [p["stream_index"] for p in rb.prompts] == [3]  # the shared budget
        clock.t = 4.0
        b.heartbeat()
        clock.t = 6.0                                          # sampler-0 silent for 6 s
        deadline = __import__("time").monotonic() + 10
        while ledger.metrics()["ledger/returned"] < 3:
            assert __import__("time").monotonic() < deadline, "the watchdog never ran"
            __import__("time").sleep(0.05)
        assert coord.released == 3
        rb = b.status(version=0, want=5)
        assert [p["stream_index"] for p in rb.prompts] == [0, 1, 2]   # re-dispatched first
        assert all(p["redispatched"] for p in rb.prompts)
        assert ledger.metrics()["ledger/redispatched"] == 3
    finally:
        a.close()
        b.close()
        coord.close()


def test_a_cancelled_request_ends_at_once_and_later_ones_are_refused():
    """Shutdown with the learner gone: a request waiting for its reply (600 s timeout here)
    raises RequestCancelled once ``cancel`` is called, and so does every later one."""
    client = ControlClient(f"tcp://127.0.0.1:{free_port()}", consumer_id="sampler-0",
                           timeout_s=600)                      # nobody answers there
    timer = threading.Timer(0.2, client.cancel)
    timer.start()
    with pytest.raises(wire.RequestCancelled, match="heartbeat request to the learner's run "
                                                    "control"):
        client.heartbeat()
    timer.join()
    with pytest.raises(wire.RequestCancelled):
        client.status(version=0)
    client.close()


def test_closing_the_heartbeat_ends_its_thread_while_the_learner_is_gone():
    from rlflow.control.replicas import HEARTBEAT_S
    from rlflow.sampler.background import Heartbeat

    beat = Heartbeat(ControlClient(f"tcp://127.0.0.1:{free_port()}", consumer_id="sampler-0",
                                   timeout_s=600))
    time.sleep(HEARTBEAT_S + 0.5)       # its first heartbeat now waits for a reply
    beat.close()                        # without the cancel: its 5 s join gives up
    assert [t for t in threading.enumerate() if t.name == "rlflow-heartbeat"] == []
