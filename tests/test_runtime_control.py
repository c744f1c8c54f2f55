"""Run control: the admission rule (staleness budget) and the status channel over loopback."""

import numpy as np
import pytest

from rlflow.exchange.records import synthetic_group
from rlflow.learner.batch import sample_staleness
from rlflow.runtime_control import (ControlClient, RunCoordinator, decode_state, encode_state,
                                    groups_to_admit)


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
        coord.data_state = encode_state(b"\x00\x01state")
        coord.set_progress(learner_version=3, published_version=3)
        client = ControlClient(coord.address, consumer_id="s0", instance=0, timeout_s=5)
        r1 = client.status(version=3, prompts_started=9,
                           metrics={"sampler/tokens_per_s": 12.5})
        assert (r1.learner_version, r1.published_version, r1.accepted, r1.buffered) == \
            (3, 3, 5, 2)
        assert decode_state(r1.data_state) == b"\x00\x01state"   # first reply carries it
        assert not r1.done
        st = coord.latest_status()
        assert st.consumer == "s0" and st.prompts_started == 9
        assert st.metrics["sampler/tokens_per_s"] == 12.5
        r2 = client.status(version=3, prompts_started=10, data_state={"pos": 10})
        assert r2.data_state is None                              # only on the first request
        assert coord.data_state == {"pos": 10}                    # the newest reported
        assert not coord.acknowledged_done()
        coord.set_progress(done=True)
        assert not coord.acknowledged_done()
        assert client.status(version=3, prompts_started=10).done
        assert coord.acknowledged_done()
        # a restarted instance gets the last reported state back
        again = ControlClient(coord.address, consumer_id="s0", instance=1, timeout_s=5)
        assert again.status(version=-1, prompts_started=0).data_state == {"pos": 10}
        client.close()
        again.close()
    finally:
        coord.close()
