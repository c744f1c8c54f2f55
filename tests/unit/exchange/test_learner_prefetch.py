"""Issue 15 item 2: the learner program takes the next step's groups and builds their batch
while the current step runs on the device, and trains exactly what a take after the step
would have: the same groups, judged against the same version, into the same batches."""

import numpy as np
import pytest

from rlflow.config import (ExperimentConfig, LearnerConfig, ModelConfig, RuntimeConfig,
                           SamplerConfig)
from rlflow.exchange.ring import ProducerError
from learner_fixtures import make_group_records
from program_fakes import FakeLearner, ListBuffer, stand_in_program

G, T, GPS, STEPS = 4, 5, 2, 5
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8)
# Wall-clock metrics differ between any two runs. The take for the next step happens during
# this one, so this step's record already counts what it did: ledger states (consumed, not
# buffered) and groups it rejected (stale). The totals at the end are compared instead.
DIFFER = {"learner/step_time_s", "learner/idle_frac", "learner/wall_s",
          "learner/stale_groups_dropped", "perf/time_wait_s", "perf/time_batch_s",
          "perf/time_compute_s", "perf/time_publish_s"}


def config():
    return ExperimentConfig(
        model=MODEL,
        sampler=SamplerConfig(group_size=G, max_tokens=T, max_prefill_length=8,
                              prefill_buckets=(8,)),
        learner=LearnerConfig(groups_per_step=GPS, seq_buckets=(16,), num_steps=STEPS),
        runtime=RuntimeConfig(mode="async", max_staleness=1, stale_policy="drop"))


VERSIONS = [0, 0, 0, 1, 0, 1, 2, 2, 3, 3, 4, 4, 4]


def groups(versions=VERSIONS):
    """Groups in buffer order, by the policy version that generated them. With
    max_staleness 1, the version-0 group 5th in line is too stale for step 3 (taken at
    version 2) but not at version 1: judging prefetched groups against the version before
    the step in flight would train it."""
    out = []
    for i, v in enumerate(versions):
        (g,) = make_group_records(100 + i, 1, vocab=64, group_size=G, max_tokens=T, version=v)
        g["prompt_id"] = np.int64(i)
        out.append(g)
    return out


class RecordingLearner(FakeLearner):
    """Records the order of builds, dispatches and metric pulls, and every dispatched batch."""

    def __init__(self, cfg, events, *, no_update_at=(), rejected_tokens=0.0):
        super().__init__(cfg)
        self.events, self.dispatched, self.no_update_at = events, [], set(no_update_at)
        self.rejected_tokens = rejected_tokens

    def build_batch(self, recs, version=None):
        self.events.append(("build", self.version if version is None else version))
        return super().build_batch(recs, version)

    def dispatch(self, batch, checked=False):
        self.events.append(("dispatch", self.version))
        self.dispatched.append((self.version, batch, checked))
        if self.version in self.no_update_at:    # the step's guard: no loss token, no update
            self.no_update_at.discard(self.version)
            return {"learner/skipped": 1.0, "learner/tokens": self.rejected_tokens}
        return super().dispatch(batch, checked)


def run_program(monkeypatch, *, prefetch=True, learner_kw=None, buffer=ListBuffer,
                versions=VERSIONS):
    events = []
    monkeypatch.setattr("rlflow.learner.program.pull_metrics",
                        lambda m: (events.append(("pull",)), dict(m))[1])
    cfg = config()
    learner = RecordingLearner(cfg, events, **(learner_kw or {}))
    p = stand_in_program(cfg, groups(versions), learner)
    p.buffer = buffer(p.buffer.groups)
    if not prefetch:
        p.prefetch = lambda: None
    return p, events


def same_batch(a, b):
    return all((x is None and y is None) or np.array_equal(x, y) for x, y in zip(a, b))


def test_prefetched_steps_train_what_a_take_after_the_step_would(monkeypatch):
    runs = {}
    for prefetch in (True, False):
        p, _ = run_program(monkeypatch, prefetch=prefetch)
        while p.version < STEPS:
            assert p.step() is not None
        runs[prefetch] = p
    a, b = runs[True], runs[False]
    assert [c for _, _, c in a.learner.dispatched] == [False] + [True] * (STEPS - 1)
    assert [c for _, _, c in b.learner.dispatched] == [False] * STEPS
    assert len(a.learner.dispatched) == len(b.learner.dispatched) == STEPS
    for (va, ba, _), (vb, bb, _) in zip(a.learner.dispatched, b.learner.dispatched):
        assert va == vb and same_batch(ba, bb), va
    assert [s for s, _ in a.writer.logged] == [s for s, _ in b.writer.logged] == [1, 2, 3, 4, 5]
    for (step, ma), (_, mb) in zip(a.writer.logged, b.writer.logged):
        assert {k: v for k, v in ma.items() if k not in DIFFER and "ledger/" not in k} == \
            {k: v for k, v in mb.items() if k not in DIFFER and "ledger/" not in k}, step
        if step < STEPS:
            assert ma["ledger/consumed"] == GPS and mb["ledger/consumed"] == 0, step
    assert a.counts == b.counts and a.counts["stale_groups"] == 1     # the case under test
    assert a.ledger.metrics() == b.ledger.metrics()
    assert a.ledger.metrics()["ledger/trained"] == STEPS * GPS
    assert a.next_groups is None                   # nothing taken after the last step
    assert [len(x.groups) for x in (a.buffer, b.buffer)] == [2, 2]


def test_the_next_batch_is_built_before_the_step_is_waited_for(monkeypatch):
    p, events = run_program(monkeypatch)
    for _ in range(3):
        p.step()
    assert events == [("build", 0), ("dispatch", 0), ("build", 1), ("pull",),
                      ("dispatch", 1), ("build", 2), ("pull",),
                      ("dispatch", 2), ("build", 3), ("pull",)]


def test_a_step_that_makes_no_update_has_the_next_batch_rebuilt_at_its_version(monkeypatch):
    """The step's own guard (no loss token anywhere: no update) leaves the version at 0; the
    batch built for version 1 while it ran is built again at 0 from the same groups."""
    p, events = run_program(monkeypatch, learner_kw=dict(no_update_at={0}), versions=[0] * 6)
    assert p.step() is None and p.version == 0 and p.skips.metrics()[
        "learner/skipped_steps/mixed"] == 1.0
    taken = [int(g["prompt_id"]) for g in p.next_groups.groups]
    assert p.step() is not None and p.version == 1
    assert events == [("build", 0), ("dispatch", 0), ("build", 1), ("pull",),
                      ("build", 0), ("dispatch", 0), ("build", 1), ("pull",)]
    version, batch, checked = p.learner.dispatched[1]
    assert (version, checked) == (0, False)
    assert taken == [2, 3]                  # groups 0 and 1 went with the skipped step
    assert p.ledger.metrics()["ledger/trained"] == GPS


def test_a_step_whose_loss_tokens_the_correction_all_rejects_is_counted_as_all_rejected(
        monkeypatch):
    """The step's guard with loss tokens (every one rejected by the rollout correction): no
    new version, counted under its own reason, whose message names the setting."""
    p, _ = run_program(monkeypatch, learner_kw=dict(no_update_at={0}, rejected_tokens=12.0),
                       versions=[0] * 6)
    assert p.step() is None and p.version == 0
    m = p.skips.metrics()
    assert m["learner/skipped_steps/all_rejected"] == 1.0 and m["learner/skipped_steps"] == 1.0
    assert m["learner/skipped_steps/mixed"] == 0.0
    assert p.step() is not None and p.version == 1


def test_all_rejected_skips_name_the_rollout_correction():
    from rlflow.learner.skips import DegenerateStepsError, SkipCounter
    counter = SkipCounter(config())
    with pytest.raises(DegenerateStepsError, match=r"rejected by learner\.rollout_correction"):
        for _ in range(counter.limit):
            counter.skipped("all_rejected", 3)


class FailingBuffer(ListBuffer):
    """A producer's failure surfaces on the 3rd take: the first take while step 1 runs."""

    calls = 0

    def get_groups(self, n, *, timeout, accept):
        self.calls += 1
        if self.calls == 3:
            raise ProducerError("producer failed: sampler-0 crashed")
        return super().get_groups(n, timeout=timeout, accept=accept)


def test_an_error_while_prefetching_is_raised_by_the_next_step_after_this_one_is_recorded(
        monkeypatch):
    p, _ = run_program(monkeypatch, buffer=FailingBuffer)
    assert p.step() is not None and p.version == 1
    assert [s for s, _ in p.writer.logged] == [1]
    assert p.ledger.metrics()["ledger/trained"] == GPS
    with pytest.raises(ProducerError, match="sampler-0 crashed"):
        p.step()
    assert p.version == 1 and len(p.learner.dispatched) == 1
