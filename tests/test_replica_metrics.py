"""Per-replica metrics (rlflow.runtime.metrics) and the report's replica plots."""

import os

from rlflow.run.report import PLOTS, plot, replica_plots
import pytest

from rlflow.runtime.metrics import StepRates, replica_metrics
from rlflow.sampler.background import RateCounters
from rlflow.runtime.control import SamplerStatus


def _status(name, version, received, **metrics):
    return SamplerStatus(consumer=name, version=version, received=received, metrics=metrics)


def test_replica_metrics_sum_mean_newest_and_per_replica():
    statuses = {
        "sampler-0": _status("sampler-0", 3, 10.0, **{"sampler/tokens_per_s": 100.0,
                                                     "sampler/slot_occupancy": 0.5,
                                                     "sampler/groups_delivered": 7.0,
                                                     "sync/swap_version": 3.0,
                                                     "sync/swap_time": 50.0,
                                                     "sampler/dropped_bad_reward_groups": 2.0,
                                                     "reward/errors/f": 1.0,
                                                     "reward/timeouts/f": 4.0}),
        "sampler-2": _status("sampler-2", -1, 11.0, **{"sampler/tokens_per_s": 20.0,
                                                      "sampler/slot_occupancy": 0.25,
                                                      "sync/swap_version": 2.0,
                                                      "sync/swap_time": 40.5,
                                                      "sampler/dropped_bad_reward_groups": 1.0,
                                                      "reward/errors/f": 3.0,
                                                      "reward/errors/g": 1.0}),
    }
    m = replica_metrics(statuses, {"sampler-0": 0, "sampler-2": 2}, {2: 40.0, 3: 49.0})
    assert m["sampler/replicas_alive"] == 2.0
    assert m["sampler/version"] == 3.0                 # newest; -1 (no weights yet) skipped
    assert m["replica/0/version"] == 3.0 and "replica/2/version" not in m
    assert m["replica/2/restarts"] == 2.0 and m["replica/0/groups_delivered"] == 7.0
    # the swap figures are the last reporter's (sampler-2): swapped v2 0.5 s after publish
    assert m["sync/swap_version"] == 2.0 and m["sync/weight_sync_s"] == 0.5
    # counts of groups dropped and of reward-function failures: summed over the replicas
    assert m["sampler/dropped_bad_reward_groups"] == 3.0
    assert (m["reward/errors/f"], m["reward/errors/g"], m["reward/timeouts/f"]) == (4.0, 1.0, 4.0)
    assert replica_metrics({}, {}, {}) == {"sampler/replicas_alive": 0.0}
    assert "sampler/replicas_lost" not in m


def _totals(instance, tokens, used, run, idle):
    return {"sampler/instance": instance, "sampler/tokens_total": tokens,
            "sampler/slot_steps_used": used, "sampler/slot_steps_total": run,
            "sampler/idle_s_total": idle}


def test_rates_are_averaged_over_each_step_interval_and_the_run():
    """Issue 39.10: a replica that decodes in bursts (all its tokens of a 4 s step within
    0.5 s, idle the rest) has the rate of the whole interval, not of the last second (0);
    a step shorter than the report interval keeps the last rates instead of reading 0."""
    rates = StepRates(now=100.0)

    def statuses(t0, t1, tot0, tot1):
        return {"sampler-0": _status("sampler-0", 0, t0, **_totals(*tot0)),
                "sampler-1": _status("sampler-1", 0, t1, **_totals(*tot1))}

    m = rates.update(statuses(104.0, 102.0, (0, 400.0, 40, 80, 1.0), (0, 200.0, 20, 80, 1.5)),
                     now=104.5)
    assert m["replica/0/tokens_per_s"] == pytest.approx(400 / 4.0)    # since the start
    assert m["replica/1/tokens_per_s"] == pytest.approx(200 / 2.0)
    assert m["sampler/tokens_per_s"] == pytest.approx(200.0)
    assert m["sampler/slot_occupancy"] == pytest.approx(60 / 160)
    assert m["replica/0/slot_occupancy"] == pytest.approx(0.5)
    assert m["sampler/idle_frac"] == pytest.approx((1.0 / 4 + 1.5 / 2) / 2)
    # next step: replica 0 reported again 2 s later (100 more tokens); replica 1 restarted
    # (new instance) and decoded 30 in the 4 s since its last report: its count starts
    # again from 0, never negative
    m = rates.update(statuses(106.0, 106.0, (0, 500.0, 50, 100, 2.0), (1, 30.0, 3, 10, 0.0)),
                     now=106.5)
    assert m["replica/0/tokens_per_s"] == pytest.approx(100 / 2.0)
    assert m["replica/1/tokens_per_s"] == pytest.approx(30 / 4.0)
    assert m["sampler/tokens_total"] == pytest.approx(730.0)
    assert m["sampler/tokens_per_s_run"] == pytest.approx(730.0 / 6.5)
    # a step with no new report (shorter than the report interval): the last rates stand
    again = rates.update(statuses(106.0, 106.0, (0, 500.0, 50, 100, 2.0),
                                  (1, 30.0, 3, 10, 0.0)), now=106.7)
    assert again["sampler/tokens_per_s"] == pytest.approx(m["sampler/tokens_per_s"])
    # a new report with no new tokens: an idle interval reads 0, the run keeps its total
    m = rates.update(statuses(116.0, 116.0, (0, 500.0, 50, 100, 12.0), (1, 30.0, 3, 10, 10.0)),
                     now=116.0)
    assert m["sampler/tokens_per_s"] == 0.0 and m["sampler/idle_frac"] == pytest.approx(1.0)
    assert m["sampler/tokens_per_s_run"] == pytest.approx(730.0 / 16.0)
    assert StepRates(0.0).update({"sampler-0": _status("sampler-0", 0, 0.0)}, 1.0) == {}


def test_sampler_reports_running_totals_not_a_window():
    c = RateCounters()
    c.add(tokens=5, slots_used=5, slots_total=8)
    c.add(idle=0.25)
    c.add(tokens=3, slots_used=3, slots_total=8)
    assert c.figures() == {"sampler/tokens_total": 8.0, "sampler/slot_steps_used": 8.0,
                           "sampler/slot_steps_total": 16.0, "sampler/idle_s_total": 0.25}
    assert c.figures()["sampler/tokens_total"] == 8.0     # reading does not reset


def test_replicas_lost_for_silence_are_counted_live_or_not():
    live = {"sampler-0": _status("sampler-0", 1, 5.0)}
    m = replica_metrics(live, {}, {}, {"sampler-0": 1, "sampler-1": 2, "sampler-2": 0})
    assert m["sampler/replicas_lost"] == 3.0
    assert (m["replica/0/lost"], m["replica/1/lost"]) == (1.0, 2.0)
    assert "replica/2/lost" not in m
    m = replica_metrics({}, {}, {}, {"sampler-1": 1})
    assert m == {"sampler/replicas_alive": 0.0, "sampler/replicas_lost": 1.0,
                 "replica/1/lost": 1.0}


def test_replica_plots_only_for_runs_with_replicas(tmp_path):
    assert replica_plots({1: {"reward/mean": 0.1}}) == ()
    by_step = {s: {"replica/0/tokens_per_s": 10.0 * s, "replica/1/tokens_per_s": 5.0,
                   "replica/0/version": s - 1.0, "replica/1/version": s - 2.0,
                   "ledger/admitted": 8.0 * s, "ledger/trained": 8.0 * (s - 1),
                   "ledger/in_flight": 4.0} for s in (1, 2, 3)}
    specs = replica_plots(by_step)
    assert [s.name for s in specs] == ["replicas", "ledger"]
    assert specs[0].panels[0].series == ("replica/0/tokens_per_s", "replica/1/tokens_per_s")
    assert not {s.name for s in specs} & {s.name for s in PLOTS}
    path = os.path.join(tmp_path, "replicas.png")
    assert plot(specs[0], by_step, path) and os.path.getsize(path) > 0
