"""Weights & Biases logging (rlflow/run/wandb_sink.py, issue 42 item 3) in offline mode (no
network): the offline run folder holds every step's metrics, the redacted config and a
held-out evaluation's samples table, no secret, and a resumed run continues the same W&B
run id."""

import dataclasses
import glob
import json
import os
import struct

import numpy as np
import pytest

from rlflow.config import BufferConfig, ExperimentConfig, MetricsConfig, WandbConfig
from rlflow.config.secrets import REDACTED
from rlflow.run.metrics import MetricsWriter
from rlflow.run.report import make_report
from rlflow.eval.scoring import EVAL_SAMPLES_FILE
from rlflow.run.wandb_sink import EVAL_SAMPLE_COLUMNS, EVAL_TABLE, RUN_ID_FILE

pytest.importorskip("wandb")

SECRET = "s3cret-buffer-token-4f1d"
STEPS = (1, 2, 3)


def read_offline_records(path: str) -> list:
    """The protobuf records of a W&B ``run-<id>.wandb`` file: a 7-byte header (":W&B", magic,
    version), then LevelDB log-format chunks in 32 KiB blocks (crc32 4 bytes, length 2,
    type 1: full 1, first 2, middle 3, last 4), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:                    # a block's tail too short for a header: padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


def offline_run(run_path: str, run_id: str, index: int = -1):
    """(run record, {step: history values}) of the ``index``-th offline run folder of
    ``run_id`` (sorted by start time)."""
    folders = sorted(glob.glob(os.path.join(run_path, "wandb", f"offline-run-*-{run_id}")))
    records = read_offline_records(os.path.join(folders[index], f"run-{run_id}.wandb"))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in r.history.item}
            history[row["_step"]] = row
    return run, history


def config(run_dir) -> ExperimentConfig:
    return ExperimentConfig(
        name="wandb-test", run_dir=str(run_dir), buffer=BufferConfig(token=SECRET),
        metrics=MetricsConfig(samples_every=1, wandb=WandbConfig(
            mode="offline", project="rlflow-tests", tags=("unit",))))


def metrics_of(step: int) -> dict:
    return {"reward/mean": 0.25 * step, "perf/mfu": 0.01 * step, "learner/step_time_s": 1.5}


EVAL_VERSION = 1          # evaluated version; its result arrives after step 3 (async)
EVAL_ROWS = [("1 + 1 =", "2", "2", 1.0), ("2 + 5 =", "8", "7", 0.0)]


def eval_records() -> list:
    """Prompt records (rlflow/eval/scoring.py) of a 2-prompt evaluation, k = 1."""
    return [{"prompt_id": i, "rewards": [r], "correct": [r >= 0.5], "lengths": [1],
             "truncated": [False], "answers": [c], "versions": [EVAL_VERSION] * 2,
             "prompt": p, "completion": c, "answer": a}
            for i, (p, c, a, r) in enumerate(EVAL_ROWS)]


def log_evaluation(writer, every_steps: int = 1) -> None:
    """An evaluation of EVAL_VERSION delivered by a replica and logged as the learner does
    (rlflow.control.evals.RunEvals)."""
    from rlflow.config import EvalConfig
    from rlflow.control.evals import EvalSchedule, RunEvals

    evals = RunEvals(EvalSchedule(every_steps, len(EVAL_ROWS), 600.0), writer,
                     EvalConfig(every_steps=every_steps, num_logged_samples=len(EVAL_ROWS)))
    evals.request(EVAL_VERSION)
    assert evals.schedule.assign("sampler-0", EVAL_VERSION) == EVAL_VERSION
    assert evals.schedule.deliver("sampler-0", {"requested": EVAL_VERSION,
                                                "version": EVAL_VERSION,
                                                "records": eval_records()})
    evals.log_finished()


@pytest.fixture(scope="module")
def three_step_run(tmp_path_factory):
    """A 3-step run folder logged through MetricsWriter.for_experiment with W&B offline,
    then a held-out evaluation of version 1 (finished after step 3, as in async runs)."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "RLFLOW_BUFFER_TOKEN": SECRET}                  # not to be captured either
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    cfg = config(tmp_path_factory.mktemp("runs"))
    try:
        with MetricsWriter.for_experiment(cfg, report_plots=make_report) as writer:
            for step in STEPS:
                writer.log(step, metrics_of(step))
                writer.log_samples(step, [dict(prompt="2+2=", completion="4", reward=1.0,
                                               version=step - 1)])
            log_evaluation(writer)
        yield cfg
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_offline_run_holds_metrics_and_redacted_config(three_step_run):
    cfg = three_step_run
    with open(os.path.join(cfg.run_path, RUN_ID_FILE)) as f:
        run_id = f.read().strip()
    run, history = offline_run(cfg.run_path, run_id)
    assert run.run_id == run_id and run.project == "rlflow-tests"
    assert list(run.tags) == ["unit"] and run.display_name == "wandb-test"
    for step in STEPS:
        for name, value in metrics_of(step).items():
            assert history[step][name] == pytest.approx(value), (step, name)
        assert history[step]["samples/nrows"] == 1
    assert any(k.startswith("report/reward") for k in history[STEPS[-1]])   # the plots
    logged = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert logged["buffer"]["token"] == REDACTED
    assert logged["learner"] == json.loads(json.dumps(dataclasses.asdict(cfg.learner)))


def test_offline_run_holds_the_eval_table(three_step_run):
    cfg = three_step_run
    with open(os.path.join(cfg.run_path, RUN_ID_FILE)) as f:
        run_id = f.read().strip()
    _, history = offline_run(cfg.run_path, run_id)
    # logged after step 3 (W&B drops a step below its current one): at step 3, charted
    # against eval/version
    row = history[STEPS[-1]]
    assert row["eval/version"] == EVAL_VERSION
    assert row["eval/pass@1"] == pytest.approx(np.mean([r for *_, r in EVAL_ROWS]))
    assert row[f"{EVAL_TABLE}/nrows"] == len(EVAL_ROWS)
    assert all(EVAL_TABLE not in h and "eval/version" not in h
               for step, h in history.items() if step != STEPS[-1])
    folder = sorted(glob.glob(os.path.join(cfg.run_path, "wandb", f"offline-run-*-{run_id}")))[-1]
    table_file = os.path.join(folder, "files", row[f"{EVAL_TABLE}/path"])
    with open(table_file) as f:
        table = json.load(f)
    assert table["columns"] == list(EVAL_SAMPLE_COLUMNS)
    want = [[EVAL_VERSION, p, c, a, r, r >= 0.5] for p, c, a, r in EVAL_ROWS]
    assert table["data"] == want
    with open(os.path.join(cfg.run_path, EVAL_SAMPLES_FILE)) as f:   # the same rows
        lines = [json.loads(line) for line in f]
    assert [[x[c] for c in EVAL_SAMPLE_COLUMNS] for x in lines] == want


def test_no_secret_anywhere_in_the_run_folder(three_step_run):
    hits = []
    for root, _, files in os.walk(three_step_run.run_path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                if SECRET.encode() in f.read():
                    hits.append(os.path.join(root, name))
    assert hits == []


def test_resumed_run_continues_the_same_wandb_run(three_step_run, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = three_step_run
    with open(os.path.join(cfg.run_path, RUN_ID_FILE)) as f:
        run_id = f.read().strip()
    with MetricsWriter.for_experiment(cfg, start_step=STEPS[-1]) as writer:
        assert writer.wandb.run_id == run_id
        writer.log(4, metrics_of(4))
    run, history = offline_run(cfg.run_path, run_id, index=-1)
    assert run.run_id == run_id
    assert history[4]["reward/mean"] == pytest.approx(1.0)


def test_off_by_default_and_mode_checked():
    from rlflow.config import ConfigError

    assert MetricsConfig().wandb.mode == "off"
    with pytest.raises(ConfigError, match="metrics.wandb.mode"):
        WandbConfig(mode="on")


def test_train_refuses_wandb_without_the_package(monkeypatch):
    import importlib.util

    from rlflow.config import ConfigError
    from rlflow.console.checks import _check_wandb

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = ExperimentConfig(metrics=MetricsConfig(wandb=WandbConfig(mode="online")))
    with pytest.raises(ConfigError, match=r"metrics.wandb.mode='online' needs the wandb"):
        _check_wandb(cfg)
    _check_wandb(ExperimentConfig())                      # off: nothing to check
