"""Per-replica metrics (rlflow.control.replica_metrics) and the report's replica plots."""

import os

from rlflow.run.report import PLOTS, plot, replica_plots
import pytest

from rlflow.control.replica_metrics import StepRates, replica_metrics
from rlflow.sampler.background import RateCounters
from rlflow.control.run_control import SamplerStatus


def _status(name, version, received, **metrics):
    return SamplerStatus(consumer=name, version=version, received=received, metrics=metrics)


def test_replica_metrics_sum_mean_newest_and_per_replica():
    statuses = {
        "sampler-0": _status("sampler-0", 3, 10.0, **{"sampler/tokens_per_s": 100.0,
                                                     "sampler/slot_occupancy": 0.5,
                                                     "sampler/groups_delivered": 7.0,
                                                     "sync/swap_version": 3.0,
                                                     "sync/swap_time": 50.0,
                                                     "sampler/weight_pause_s": 9.0,
                                                     "sampler/dropped_bad_reward_groups": 2.0,
                                                     "reward/errors/f": 1.0,
                                                     "reward/timeouts/f": 4.0,
                                                     "reward/http_retries/judge": 5.0,
                                                     "eval/reward_timeouts/f": 1.0,
                                                     "sampler/journal_resumed_samples": 3.0,
                                                     "sampler/journal_lag_max": 2.0}),
        "sampler-2": _status("sampler-2", -1, 11.0, **{"sampler/tokens_per_s": 20.0,
                                                      "sampler/slot_occupancy": 0.25,
                                                      "sync/swap_version": 2.0,
                                                      "sync/swap_time": 40.5,
                                                      "sampler/weight_pause_s": 0.25,
                                                      "sampler/weight_transfer_s": 1.5,
                                                      "sampler/dropped_bad_reward_groups": 1.0,
                                                      "reward/errors/f": 3.0,
                                                      "reward/errors/g": 1.0,
                                                      "reward/http_retries/judge": 2.0,
                                                      "eval/reward_timeouts/f": 2.0,
                                                      "sampler/journal_resumed_samples": 1.0,
                                                      "sampler/journal_lag_max": 4.0}),
    }
    m = replica_metrics(statuses, {"sampler-0": 0, "sampler-2": 2}, {2: 40.0, 3: 49.0})
    assert m["sampler/replicas_alive"] == 2.0
    assert m["sampler/version"] == 3.0                 # newest; -1 (no weights yet) skipped
    assert m["replica/0/version"] == 3.0 and "replica/2/version" not in m
    assert m["replica/2/restarts"] == 2.0 and m["replica/0/groups_delivered"] == 7.0
    # the swap figures are the last reporter's (sampler-2): swapped v2 0.5 s after publish
    assert m["sync/swap_version"] == 2.0 and m["sync/weight_sync_s"] == 0.5
    # and so is the pause per version beside the transfer time (not summed)
    assert (m["sampler/weight_pause_s"], m["sampler/weight_transfer_s"]) == (0.25, 1.5)
    # counts of groups dropped and of reward-function failures: summed over the replicas
    assert m["sampler/dropped_bad_reward_groups"] == 3.0
    assert (m["reward/errors/f"], m["reward/errors/g"], m["reward/timeouts/f"]) == (4.0, 1.0, 4.0)
    assert m["reward/http_retries/judge"] == 7.0       # a served reward's tries, too
    assert m["eval/reward_timeouts/f"] == 3.0          # and the held-out evaluations' failures
    assert replica_metrics({}, {}, {}) == {"sampler/replicas_alive": 0.0}
    assert "sampler/replicas_lost" not in m
    # the journal's counts are summed, its lag behind decoding is the largest replica's
    assert (m["sampler/journal_resumed_samples"], m["sampler/journal_lag_max"]) == (4.0, 4.0)


def _totals(instance, tokens, used, run, idle):
    return {"sampler/instance": instance, "sampler/tokens_total": tokens,
            "sampler/slot_steps_used": used, "sampler/slot_steps_total": run,
            "sampler/idle_s_total": idle}


def test_rates_are_averaged_over_each_step_interval_and_the_run():
    """Issue 39.10: a replica decodes in bursts (400 tokens in its first 0.5 s, then idle).
    A 1-second window sampled at log time read 0 on such steps; the rate now spans the
    step's interval, at least MIN_RATE_SPAN_S (1 s) of reports, so a 20 ms step between
    two bursts does not read 0, and only an idle second does."""
    from rlflow.control.replica_metrics import MIN_RATE_SPAN_S

    assert MIN_RATE_SPAN_S == 1.0
    rates = StepRates(now=100.0)

    def one(received, *totals):
        return {"sampler-0": _status("sampler-0", 0, received, **_totals(*totals))}

    m = rates.update(one(100.5, 0, 400.0, 40, 80, 0.0), now=100.6)
    assert m["sampler/tokens_per_s"] == pytest.approx(400 / 0.5)     # since the start
    assert m["sampler/slot_occupancy"] == pytest.approx(0.5)
    m = rates.update(one(100.6, 0, 400.0, 40, 80, 0.1), now=100.62)  # a 20 ms step, idle
    assert m["sampler/tokens_per_s"] == pytest.approx(400 / 0.6)     # over the last second
    assert m["sampler/idle_frac"] == pytest.approx(0.1 / 0.6)
    m = rates.update(one(102.0, 0, 400.0, 40, 80, 1.5), now=102.0)   # idle for 1.4 s
    assert m["sampler/tokens_per_s"] == 0.0
    assert m["sampler/idle_frac"] == pytest.approx(1.0)
    assert m["sampler/tokens_total"] == 400.0
    assert m["sampler/tokens_per_s_run"] == pytest.approx(400 / 2.0)
    m = rates.update(one(102.0, 0, 400.0, 40, 80, 1.5), now=102.3)   # no new report
    assert m["sampler/tokens_per_s"] == 0.0 and m["sampler/tokens_total"] == 400.0


def test_rates_sum_over_replicas_and_a_restart_counts_from_zero():
    rates = StepRates(now=100.0)
    s = {"sampler-0": _status("sampler-0", 0, 104.0, **_totals(0, 400.0, 40, 80, 1.0)),
         "sampler-1": _status("sampler-1", 0, 102.0, **_totals(0, 200.0, 20, 80, 1.0))}
    m = rates.update(s, now=104.0)
    assert m["replica/0/tokens_per_s"] == pytest.approx(400 / 4.0)
    assert m["replica/1/tokens_per_s"] == pytest.approx(200 / 2.0)
    assert m["sampler/tokens_per_s"] == pytest.approx(200.0)
    assert m["sampler/slot_occupancy"] == pytest.approx(60 / 160)
    assert m["replica/0/slot_occupancy"] == pytest.approx(0.5)
    assert m["sampler/idle_frac"] == pytest.approx((1.0 / 4 + 1.0 / 2) / 2)
    # replica 1 restarted (new instance: its totals start again) and decoded 30 tokens in
    # the 4 s since its last report; never a negative count
    s = {"sampler-0": _status("sampler-0", 0, 106.0, **_totals(0, 500.0, 50, 100, 2.0)),
         "sampler-1": _status("sampler-1", 0, 106.0, **_totals(1, 30.0, 3, 10, 0.0))}
    m = rates.update(s, now=106.0)
    assert m["replica/0/tokens_per_s"] == pytest.approx(100 / 2.0)
    assert m["replica/1/tokens_per_s"] == pytest.approx(30 / 4.0)
    assert m["sampler/tokens_total"] == pytest.approx(730.0)
    assert m["sampler/tokens_per_s_run"] == pytest.approx(730.0 / 6.0)
    assert StepRates(0.0).update({"sampler-0": _status("sampler-0", 0, 0.0)}, 1.0) == {}


def test_sampler_reports_running_totals_not_a_window():
    c = RateCounters(chips=4)
    c.add(tokens=5, slots_used=5, slots_total=8)
    c.add(idle=0.25)
    c.add(tokens=3, slots_used=3, slots_total=8)
    assert c.figures() == {"sampler/tokens_total": 8.0, "sampler/slot_steps_used": 8.0,
                           "sampler/slot_steps_total": 16.0, "sampler/idle_s_total": 0.25,
                           "sampler/chips": 4.0}
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


def test_tokens_per_s_per_chip_divides_by_every_replicas_devices():
    """Two replicas of 4 and 2 devices decoding 600 and 300 tokens in a second: 900 tokens/s
    over 6 chips."""
    rates = StepRates(now=0.0)
    statuses = {f"sampler-{i}": _status(f"sampler-{i}", 0, 1.0, **_totals(0, tokens, 1, 1, 0.0),
                                        **{"sampler/chips": chips})
                for i, (tokens, chips) in enumerate([(600.0, 4.0), (300.0, 2.0)])}
    m = rates.update(statuses, now=1.0)
    assert m["sampler/tokens_per_s"] == pytest.approx(900.0)
    assert m["sampler/tokens_per_s_per_chip"] == pytest.approx(900.0 / 6)
