"""Issue 14 item 2: a step whose groups leave no sample for the loss is skipped and counted,
nothing is re-published, the admission budget does not shrink, and too many skips in a row
stop the run with an error naming the reason and the settings behind it."""

import os

import numpy as np
import pytest

from rlflow.config import (ExperimentConfig, LearnerConfig, ModelConfig, RuntimeConfig,
                           SamplerConfig)
from rlflow.learner.batch import BatchSpec, build_batch
from rlflow.learner.skips import (DegenerateStepsError, FilterStreak, SkipCounter,
                                  skip_reason)
from rlflow.control.run_control import groups_to_admit
from learner_fixtures import make_group_records
from program_fakes import stand_in_program

G, T, GPS = 4, 5, 2
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8)


def config(*, learner=None, runtime=None, temperature=1.0):
    lc = dict(groups_per_step=GPS, seq_buckets=(16,), num_steps=3,
              max_consecutive_skipped_steps=3)
    lc.update(learner or {})
    return ExperimentConfig(
        model=MODEL,
        sampler=SamplerConfig(group_size=G, max_tokens=T, max_prefill_length=8,
                              prefill_buckets=(8,), temperature=temperature),
        learner=LearnerConfig(**lc), runtime=RuntimeConfig(**(runtime or {})))


def records(seed=0, *, version=0, learner_version=0):
    return make_group_records(seed, GPS, vocab=64, group_size=G, max_tokens=T,
                              version=version)


def info_of(cfg, recs, learner_version=0):
    return build_batch(recs, BatchSpec.from_config(cfg), learner_version)[1]


# ------------------------------------------------------------------ each degenerate kind

def test_all_masked():
    cfg = config(learner=dict(mask_truncated=True))
    recs = records()
    for r in recs:
        r["truncated"][:] = True
    assert skip_reason(info_of(cfg, recs)) == "all_masked"
    recs[1]["truncated"][2] = False                  # one sample left: the step trains
    assert skip_reason(info_of(cfg, recs)) is None


def test_all_stale():
    cfg = config(runtime=dict(max_staleness=1, stale_policy="drop"))
    recs = records(version=0)
    assert skip_reason(info_of(cfg, recs, learner_version=2)) == "all_stale"
    assert skip_reason(info_of(cfg, recs, learner_version=1)) is None


def test_all_filtered():
    cfg = config(learner=dict(dynamic_sampling=True))
    recs = records()
    for r in recs:
        r["rewards"][:] = 1.0
    assert skip_reason(info_of(cfg, recs)) == "all_filtered"
    recs[0]["rewards"][0] = 0.0
    assert skip_reason(info_of(cfg, recs)) is None


def test_all_bad_reward():
    cfg = config(learner=dict(on_bad_reward="drop"))
    recs = records()
    for i, r in enumerate(recs):
        r["rewards"][i] = np.nan
    assert skip_reason(info_of(cfg, recs)) == "all_bad_reward"


def test_mixed():
    """Group 0 all stale, group 1 all truncated and masked: no filter alone covers the step."""
    cfg = config(learner=dict(mask_truncated=True), runtime=dict(max_staleness=0))
    recs = records()
    recs[0]["policy_versions"][recs[0]["policy_versions"] >= 0] = 0
    recs[1]["policy_versions"][recs[1]["policy_versions"] >= 0] = 1
    recs[1]["truncated"][:] = True
    recs[0]["truncated"][:] = False
    assert skip_reason(info_of(cfg, recs, learner_version=1)) == "mixed"


@pytest.mark.parametrize("reason,fields", [
    ("all_masked", ["sampler.max_tokens=5", "learner.mask_truncated=True",
                    "sampler.temperature=0"]),
    ("all_stale", ["runtime.max_staleness=2", "runtime.stale_policy='drop'"]),
    ("all_filtered", ["learner.dynamic_sampling=True", "sampler.temperature=0"]),
    ("all_bad_reward", ["learner.on_bad_reward='drop'"]),
    ("mixed", ["learner.mask_truncated"]),
])
def test_counter_stops_after_the_limit_naming_reason_and_fields(reason, fields):
    counter = SkipCounter(config(temperature=0.0))
    counter.skipped(reason, 4)
    counter.trained()                                  # a trained step ends the streak
    counter.skipped(reason, 5)
    counter.skipped(reason, 5)
    with pytest.raises(DegenerateStepsError) as e:
        counter.skipped(reason, 5)
    msg = str(e.value)
    assert "3 steps in a row" in msg and reason in msg
    assert "learner.max_consecutive_skipped_steps=3" in msg
    for f in fields:
        assert f in msg, (f, msg)
    m = counter.metrics()
    assert m["learner/skipped_steps"] == 4.0 and m[f"learner/skipped_steps/{reason}"] == 4.0


def test_limit_zero_never_stops():
    counter = SkipCounter(config(learner=dict(max_consecutive_skipped_steps=0)))
    for _ in range(50):
        counter.skipped("all_masked", 0)
    assert counter.metrics()["learner/skipped_steps"] == 50.0


def test_filter_streak_bounds_dynamic_sampling_rejections():
    streak = FilterStreak(config(learner=dict(dynamic_sampling=True), temperature=0.0))
    for _ in range(3 * GPS - 2):
        streak.rejected(0)
    streak.accepted()                                  # one group with signal resets it
    for _ in range(3 * GPS - 1):
        streak.rejected(0)
    with pytest.raises(DegenerateStepsError, match="learner.dynamic_sampling=True"):
        streak.rejected(0)


# ------------------------------------------------------------------ the program's step

def program(cfg, groups):
    return stand_in_program(cfg, groups)


def budget(p, k):
    return groups_to_admit(version=p.version, groups_per_step=GPS, max_staleness=k,
                           accepted=p.counts["accepted"], buffered=0, in_flight=0)


def test_skipped_step_keeps_version_and_budget_then_trains():
    """The issue's case (every completion truncated, mask_truncated) twice, then a good step:
    no update and no publish for the skips, the sync-mode budget is a full step's groups
    again after each skip, and the next step trains and publishes version 1 with the skip
    counts in its metrics."""
    cfg = config(learner=dict(mask_truncated=True), runtime=dict(mode="sync",
                                                                 max_staleness=0))
    bad = records(1) + records(2)
    for r in bad:
        r["truncated"][:] = True
    good = records(3)
    p = program(cfg, bad + good)
    assert budget(p, 0) == GPS
    for _ in range(2):
        assert p.step() is None
        assert p.version == 0 and p.learner.updates == 0 and p.publisher.published == [0]
        assert p.counts["accepted"] == 0 and budget(p, 0) == GPS      # did not shrink
    assert p.ledger.metrics()["ledger/dropped"] == 2 * GPS   # the ledger resolved them
    m = p.step()
    assert m is not None and p.version == 1 and p.publisher.published == [0, 1]
    assert m["learner/skipped_steps"] == 2.0 and m["learner/skipped_steps/all_masked"] == 2.0
    assert p.counts["accepted"] == GPS and p.skips.in_a_row == 0
    assert p.ledger.metrics()["ledger/trained"] == GPS
    assert [s for s, _ in p.writer.logged] == [1]


def test_run_totals_go_on_after_a_resume():
    """Skipped steps and groups rejected without reward variance, counted before a
    checkpoint, are where a resumed program's metrics start (not 0): run_totals is what the
    checkpoint keeps (as JSON) and restore_totals what the resumed program reads back."""
    import json
    import types

    cfg = config(learner=dict(mask_truncated=True, dynamic_sampling=True))
    flat, bad = records(1)[0], records(2)
    flat["rewards"][:] = 0.0                         # a group without reward variance
    for r in bad:
        r["truncated"][:] = True
    p = program(cfg, [flat] + bad + records(3))
    assert p.step() is None                          # flat rejected; bad: all masked
    m = p.step()                                     # records(3) train
    assert m["learner/zero_variance_groups_dropped"] == 1
    saved = []                                       # what the checkpoint's extra holds
    p.learner.checkpoint, p.learner.mesh = (lambda **fields: fields), None
    p.checkpointer = types.SimpleNamespace(save=lambda ck, metrics: saved.append(ck))
    p._checkpoint(m)
    totals = json.loads(json.dumps(saved[0]["extra"]["run_totals"]))
    assert totals == {"stale_groups": 0, "zero_variance_groups": 1,
                      "skipped_steps": {"all_masked": 1}}
    resumed = program(cfg, records(5) + records(6))
    resumed.restore_totals(totals)
    m2 = resumed.step()
    assert m2["learner/zero_variance_groups_dropped"] == 1
    assert m2["learner/skipped_steps"] == 1.0 and m2["learner/skipped_steps/all_masked"] == 1.0
    fresh = program(cfg, records(7))
    fresh.restore_totals({})                         # a checkpoint without them: from 0
    assert fresh.run_totals() == {"stale_groups": 0, "zero_variance_groups": 0,
                                  "skipped_steps": {}}


def test_run_of_skips_stops_the_program_with_the_reason():
    cfg = config(learner=dict(mask_truncated=True), temperature=0.0)
    bad = [r for s in range(5) for r in records(s)]
    for r in bad:
        r["truncated"][:] = True
    p = program(cfg, bad)
    with pytest.raises(DegenerateStepsError, match=r"3 steps in a row .*all_masked.*"
                       r"learner\.mask_truncated=True"):
        p.run()
    assert p.version == 0 and p.learner.updates == 0 and p.publisher.published == [0]


def test_dynamic_sampling_rejections_stop_the_program():
    cfg = config(learner=dict(dynamic_sampling=True), temperature=0.0)
    flat = [r for s in range(5) for r in records(s)]
    for r in flat:
        r["rewards"][:] = 0.0
    p = program(cfg, flat)
    with pytest.raises(DegenerateStepsError, match="no reward variance"):
        p.step()
    assert p.counts["zero_variance_groups"] == 3 * GPS and p.counts["accepted"] == 0


def test_a_stop_during_a_periodic_checkpoint_lets_it_finish_first(monkeypatch):
    """SIGTERM while the periodic checkpoint of step 1 is being started: that save is not
    cut in half (the exit checkpoint would start the same step's save again over it); the
    stop is raised after it, and the exit checkpoint then runs once."""
    import signal
    import types

    from rlflow.control import programs_common as pc

    monkeypatch.setattr(pc, "_stop_requested", [])
    previous = signal.getsignal(signal.SIGTERM)
    p = program(config(), [r for s in range(3) for r in records(s)])
    events = []
    p.checkpointer = types.SimpleNamespace(should_save=lambda version: version == 1)

    def checkpoint(metrics=None, *, final=False):
        if final:
            events.append(("exit save", p.version))
            return
        events.append(("save begins", p.version))
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(1000))                  # Python runs the SIGTERM handler in here
        events.append(("save ends", p.version))

    p._checkpoint = checkpoint
    pc.install_signal_handlers()
    try:
        with pytest.raises(pc.Stopped, match="SIGTERM"):
            p.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert events == [("save begins", 1), ("save ends", 1), ("exit save", 1)]
