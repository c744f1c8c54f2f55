"""Run-folder writer: config, metrics JSONL, TensorBoard events, sample completions."""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlflow.run.metrics import (REQUIRED_METRICS, MetricsWriter, NonFiniteMetricError,
                            staleness_histogram, truncate_after)
from rlflow.run.folder import RunFolderError, metrics_by_step, read_jsonl, validate_run_folder

from _synthetic_run import (GROUP, NUM_SAMPLES, NUM_STEPS, SAMPLES_EVERY, expected_metrics,
                            sample, write_run)
from tolerances import sum_tol


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runs"))
    cfg = write_run(root)
    return cfg, cfg.run_path


def _tb(run_dir):
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_run_folder_has_config(run):
    cfg, run_dir = run
    with open(os.path.join(run_dir, "config.json")) as f:
        saved = json.load(f)
    assert saved["name"] == "synthetic"
    assert saved["learner"]["lr"] == 3e-6 and saved["learner"]["num_steps"] == NUM_STEPS
    assert saved["metrics"]["samples_every"] == SAMPLES_EVERY
    assert saved["sampler"]["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "sequence": 1,
                                        "tensor": 1}
    assert saved["sampler"]["prefill_buckets"] == list(cfg.sampler.prefill_buckets)


def test_jsonl_has_every_required_metric_finite(run):
    _, run_dir = run
    records, problems = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert problems == []
    assert len(records) == 2 * NUM_STEPS  # sampler and learner call per step
    by_step = metrics_by_step(records)
    assert list(by_step) == list(range(1, NUM_STEPS + 1))
    for step, row in by_step.items():
        want = expected_metrics(step)
        missing = [n for n in REQUIRED_METRICS if n not in row]
        assert missing == [], f"step {step} lacks {missing}"
        for name in REQUIRED_METRICS:
            assert math.isfinite(row[name])
            assert row[name] == pytest.approx(want[name], rel=1e-6), name
    validate_run_folder(run_dir)


def test_tensorboard_event_file_readable(run):
    _, run_dir = run
    assert len(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))) == 1
    acc = _tb(run_dir)
    tags = set(acc.Tags()["scalars"])
    assert set(REQUIRED_METRICS) <= tags
    for name in ("reward/mean", "sampler/tokens_per_s", "staleness/frac_3plus"):
        events = acc.Scalars(name)
        assert [e.step for e in events] == list(range(1, NUM_STEPS + 1))
        want = [expected_metrics(s)[name] for s in range(1, NUM_STEPS + 1)]
        # TensorBoard stores float32: one rounding of each float64 value (<= eps / 2)
        np.testing.assert_allclose([e.value for e in events], want, rtol=sum_tol(1))
    assert "config/text_summary" in acc.Tags()["tensors"]  # add_text: a tensor summary


def test_sample_completions(run):
    _, run_dir = run
    samples, problems = read_jsonl(os.path.join(run_dir, "samples.jsonl"))
    assert problems == []
    due = [s for s in range(1, NUM_STEPS + 1) if s % SAMPLES_EVERY == 0]
    assert [r["step"] for r in samples] == [s for s in due for _ in range(NUM_SAMPLES)]
    for r in samples:
        i = samples.index(r) % NUM_SAMPLES
        want = sample(r["step"], i)
        assert {k: r[k] for k in want} == want
    assert NUM_SAMPLES < GROUP


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_non_finite_error_mode_writes_nothing(tmp_path):
    with MetricsWriter(str(tmp_path), on_non_finite="error", tensorboard=False) as w:
        with pytest.raises(NonFiniteMetricError, match=r"step 3: .*policy/kl=nan"):
            w.log(3, {"reward/mean": 1.0, "policy/kl": float("nan")})
        with pytest.raises(NonFiniteMetricError, match="reward/max=inf"):
            w.log(4, {"reward/max": np.float32("inf")})
    assert _read(tmp_path / "metrics.jsonl") == []


def test_non_finite_flag_mode_records_null_and_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rlflow.run.metrics"):
        with MetricsWriter(str(tmp_path), on_non_finite="flag") as w:
            w.log(1, {"reward/mean": 0.5, "policy/kl": 0.1})
            w.log(2, {"reward/mean": 0.7, "policy/kl": float("-inf")})
            assert w.non_finite_count == 1
    rec = _read(tmp_path / "metrics.jsonl")[1]
    assert rec["policy/kl"] is None and rec["non_finite"] == ["policy/kl"]
    assert rec["reward/mean"] == 0.7
    assert "step 2" in caplog.text and "policy/kl" in caplog.text
    assert [e.step for e in _tb(str(tmp_path)).Scalars("policy/kl")] == [1]
    assert math.isnan(metrics_by_step(_read(tmp_path / "metrics.jsonl"))[2]["policy/kl"])
    with pytest.raises(RunFolderError, match=r"step 2: non-finite values \['policy/kl'\]"):
        validate_run_folder(str(tmp_path), required=("reward/mean",), expect_samples=False)


@pytest.mark.parametrize("step, metrics, error, match", [
    (1, {"reward/mean": "high"}, TypeError, "'reward/mean' at step 1 must be a real scalar"),
    (1, {"reward/mean": np.zeros(3)}, TypeError, r"shape \(3,\)"),
    (1, {"": 1.0}, TypeError, "non-empty strings"),
    (1, {"step": 1.0}, ValueError, "reserved"),
    (-1, {"reward/mean": 1.0}, ValueError, "step must be an int >= 0"),
    (True, {"reward/mean": 1.0}, ValueError, "step must be an int >= 0"),
    (1.5, {"reward/mean": 1.0}, ValueError, "step must be an int >= 0"),
])
def test_log_rejects_bad_input(tmp_path, step, metrics, error, match):
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        with pytest.raises(error, match=match):
            w.log(step, metrics)


def test_log_accepts_numpy_and_jax_scalars(tmp_path):
    import jax.numpy as jnp
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        w.log(np.int64(7), {"a": np.float32(0.25), "b": np.array(3), "c": jnp.float32(1.5),
                            "d": True, "e": jnp.ones((1,)) * 2})
    assert _read(tmp_path / "metrics.jsonl")[0] | {"time": 0} == {
        "step": 7, "time": 0, "a": 0.25, "b": 3.0, "c": 1.5, "d": 1.0, "e": 2.0}


def test_closed_writer_refuses(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    w.close()
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.log(1, {"a": 1.0})


def test_samples_validation_and_schedule(tmp_path, caplog):
    good = {"prompt": "p", "completion": "c", "reward": 1.0, "version": 0}
    with MetricsWriter(str(tmp_path), samples_every=3, num_samples=2, tensorboard=False) as w:
        assert [s for s in range(10) if w.samples_due(s)] == [0, 3, 6, 9]
        assert w.log_samples(4, [good]) == 0
        with pytest.raises(ValueError, match="sample 1 at step 3: missing key 'version'"):
            w.log_samples(3, [good, {k: v for k, v in good.items() if k != "version"}])
        with pytest.raises(TypeError, match="sample 0 at step 3: 'completion' must be str"):
            w.log_samples(3, [good | {"completion": [1, 2]}])
        with pytest.raises(TypeError, match="'version' must be int"):
            w.log_samples(3, [good | {"version": 1.0}])
        with pytest.raises(TypeError, match="sample 0 at step 3: 'reward' must be a real scalar"):
            w.log_samples(3, [good | {"reward": "high"}])
        with caplog.at_level(logging.WARNING, logger="rlflow.run.metrics"):
            assert w.log_samples(6, [good | {"reward": float("nan")}, good, good]) == 2
    rows = _read(tmp_path / "samples.jsonl")
    assert len(rows) == 2 and rows[0]["reward"] is None and rows[0]["non_finite"] == ["reward"]
    assert rows[1] == {"step": 6, **good}
    assert "non-finite reward" in caplog.text


def test_staleness_histogram_oracle():
    s = np.array([0, 0, 1, 2, 3, 5, 7, 1])
    out = staleness_histogram(s)
    # hand counts: 0 -> 2, 1 -> 2, 2 -> 1, >=3 -> 3 of 8
    assert out == {"staleness/mean": 19 / 8, "staleness/max": 7.0,
                   "staleness/frac_0": 2 / 8, "staleness/frac_1": 2 / 8,
                   "staleness/frac_2": 1 / 8, "staleness/frac_3plus": 3 / 8}
    assert set(out) <= set(REQUIRED_METRICS)
    with pytest.raises(ValueError, match="must be >= 0"):
        staleness_histogram([1, -1])
    with pytest.raises(ValueError, match="non-empty"):
        staleness_histogram([])
    with pytest.raises(ValueError, match="integers"):
        staleness_histogram([0.5])


def test_required_metrics_cover_the_issue_list():
    # Issue 8, deliverable 2, one entry per item of its list.
    items = ["reward/mean", "reward/std", "reward/min", "reward/max", "reward/accuracy",
             "response/length_mean", "response/length_max", "response/truncation_rate",
             "policy/kl", "policy/entropy", "policy/clip_frac_low", "policy/clip_frac_high",
             "policy/is_weight_mean", "staleness/frac_0", "learner/step_time_s",
             "sampler/tokens_per_s", "sampler/slot_occupancy", "sync/weight_sync_s",
             "sync/sampler_pause_s", "buffer/fill", "buffer/producer_wait_s",
             "buffer/consumer_wait_s", "learner/idle_frac", "sampler/idle_frac"]
    assert [n for n in items if n not in REQUIRED_METRICS] == []
    assert len(set(REQUIRED_METRICS)) == len(REQUIRED_METRICS)


def test_read_jsonl_reports_bad_lines_and_merges_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n\n{"step": 1, "a": 2.0, "b": null}\n'
                    '["not an object"]\n{"step": 2, "a": 3')
    records, problems = read_jsonl(str(path))
    assert len(records) == 2
    assert problems == [f"{path}:4: expected an object with an int 'step'",
                        f"{path}:5: not valid JSON (Expecting ',' delimiter)"]
    merged = metrics_by_step(records)
    assert merged[1]["a"] == 2.0 and math.isnan(merged[1]["b"])
    with pytest.raises(RunFolderError, match="file not found"):
        read_jsonl(str(tmp_path / "missing.jsonl"))


def test_validate_run_folder_lists_every_problem(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        w.log(1, {"reward/mean": 1.0})
    with pytest.raises(RunFolderError) as err:
        validate_run_folder(str(tmp_path))
    msg = str(err.value)
    assert "config.json: file not found" in msg
    assert "'policy/kl'" in msg and "'reward/mean'" not in msg.split("never logged")[1]
    assert "no TensorBoard event file" in msg and "no sample completions" in msg


def test_resume_purges_tensorboard_steps_of_the_interrupted_run(tmp_path):
    with MetricsWriter(str(tmp_path), samples_every=1, num_samples=1) as w:
        for step in range(1, 6):
            w.log(step, {"reward/mean": float(step)})
            w.log_samples(step, [{"prompt": "p", "completion": f"c{step}", "reward": 0.0,
                                  "version": step - 1}])
    # The interrupted run wrote steps 1..5; its newest checkpoint is step 3, so the resumed
    # run logs 4, 5, 6 again.
    with MetricsWriter(str(tmp_path), start_step=3, samples_every=1, num_samples=1) as w:
        for step in range(4, 7):
            w.log(step, {"reward/mean": 10.0 * step})
            w.log_samples(step, [{"prompt": "p", "completion": f"r{step}", "reward": 0.0,
                                  "version": step - 1}])
    events = _tb(str(tmp_path)).Scalars("reward/mean")
    assert [(e.step, e.value) for e in events] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    records = _read(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in records] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]   # each step once
    samples = _read(tmp_path / "samples.jsonl")
    assert [(r["step"], r["completion"]) for r in samples] == [
        (1, "c1"), (2, "c2"), (3, "c3"), (4, "r4"), (5, "r5"), (6, "r6")]


def test_truncate_after_drops_later_steps_and_a_cut_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n{"step": 2}\n{"step": 4, "x"')
    assert truncate_after(str(path), 2) == 2          # step 3 and the cut line
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'
    assert truncate_after(str(path), 2) == 0          # nothing more: file untouched
    assert truncate_after(str(tmp_path / "missing.jsonl"), 0) == 0


def test_importing_the_writer_and_progress_stays_light():
    # Every program imports these; torch (behind tensorboardX) loads only with a TB writer.
    code = ("import sys, rlflow.run.metrics, rlflow.launcher.progress, rlflow.run.folder; "
            "print(sorted(m for m in ('torch', 'tensorboardX', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_the_tensorboard_writer_is_imported_without_torch(tmp_path):
    """A fresh process opening a MetricsWriter (TensorBoard on) has not imported torch, and
    leaves no blocker behind (``sys.modules`` has no "torch" entry, so a later ``import torch``
    loads it); an event file is written."""
    pytest.importorskip("torch")     # without torch there is nothing to hide
    from repo_paths import REPO

    code = """
import sys
from rlflow.run.metrics import MetricsWriter
w = MetricsWriter(sys.argv[1], tensorboard=True)
w.log(1, {"reward/mean": 0.5})
w.close()
print(sys.modules.get("torch", "absent"))
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["absent"]
    events = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    assert len(events) == 1 and os.path.getsize(events[0]) > 0
