"""A run folder on an object store (issue 39, fault 2): every file of a ``gs://`` run folder
goes through one file layer (rlflow.run.files, etils.epath) to the bucket, here a local
stand-in behind epath's real fsspec backend (tests/object_store.py); ``rlflow report
gs://...`` reads it; what an object store cannot hold (the lock, the programs' logs) stays
in a local folder the run folder names; a scheme this machine cannot write is refused."""

from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout

import pytest

import object_store
from _synthetic_run import NUM_STEPS, write_run
from rlflow import config as C
from rlflow.console.cli import main as cli_main
from rlflow.run import files
from rlflow.run.identity import prepare_run_folder
from rlflow.run.report import PLOTS
from rlflow.control import programs_common as pc
from rlflow.launcher import supervisor
from rlflow.control.ledger import TrainedPromptsLog, read_trained_prompts
from rlflow.run.run_lock import lock_path
from rlflow.run.summary import discard_records_after, latest_checkpoint_step
from rlflow.launcher.run_watch import RunWatcher

RUNS = "gs://bucket/runs"


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    """The bucket's local folder; the test runs in an empty working folder (a ``gs:``
    folder appearing there is the old bug: a URL taken for a relative path)."""
    root = tmp_path / "gcs"
    object_store.install(monkeypatch, root)
    monkeypatch.setenv("RLFLOW_LOCAL_RUNS", str(tmp_path / "local"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    yield root
    object_store.uninstall()
    assert not (tmp_path / "cwd" / "gs:").exists()


def test_every_file_of_the_run_folder_reaches_the_bucket(gcs):
    cfg = write_run(RUNS, name="demo")            # MetricsWriter: config, metrics, samples, TB
    run = f"{RUNS}/demo"
    assert cfg.run_path == run
    prepare_run_folder(cfg)                                     # run.json
    pc.save_config(cfg, files.join(run, "config.json"))         # the launcher's config.json
    log = TrainedPromptsLog(run, start_step=0)
    log.write(1, [((0, 7), 3), ((1, 7), 4)], prompts_per_epoch=10)
    log.close()
    assert read_trained_prompts(run) == [{"step": 1, "stream_index": [0, 1],
                                          "prompt_id": [3, 4], "epoch": [0, 0]}]
    # the launcher: progress from metrics.jsonl, summary.json; checkpoints are orbax's
    (gcs / "bucket" / "runs" / "demo" / "checkpoints" / "4").mkdir(parents=True)
    (gcs / "bucket" / "runs" / "demo" / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()
    assert latest_checkpoint_step(run) == 4
    watcher = RunWatcher(C.replace(cfg, metrics=C.MetricsConfig(progress="plain")), run,
                         stream=io.StringIO())
    assert watcher.poll() == NUM_STEPS
    watcher.close(success=True, report=False)
    local = gcs / "bucket" / "runs" / "demo"
    names = sorted(p.name for p in local.iterdir())
    assert {"config.json", "metrics.jsonl", "samples.jsonl", "run.json", "summary.json",
            "trained_prompts.jsonl", "checkpoints"} <= set(names)
    assert any(n.startswith("events.out.tfevents.") for n in names)   # copied from local
    assert json.loads((local / "summary.json").read_text())["steps_completed"] == NUM_STEPS
    assert not [n for n in names if n.endswith(".tmp")]
    assert discard_records_after(run, 4) == {"metrics.jsonl": 4, "samples.jsonl": 3}
    steps = {json.loads(x)["step"] for x in (local / "metrics.jsonl").read_text().splitlines()}
    assert steps == {1, 2, 3, 4}
    # the lock and the programs' logs: a local folder named after the run folder
    side = files.local_side(run)
    assert side == os.path.join(os.environ["RLFLOW_LOCAL_RUNS"], "gs", "bucket", "runs", "demo")
    assert lock_path(run) == os.path.join(os.path.dirname(side), ".demo.lock")


def test_rlflow_report_reads_a_bucket_run_folder_and_writes_the_report_there(gcs):
    write_run(RUNS)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert cli_main(["report", f"{RUNS}/synthetic"]) == 0, err.getvalue()
    assert out.getvalue().strip() == f"{RUNS}/synthetic/report/report.html"
    report = gcs / "bucket" / "runs" / "synthetic" / "report"
    page = (report / "report.html").read_text()
    assert f"run folder: {RUNS}/synthetic" in page and "Q6.0: what is 6 + 0?" in page
    assert (report / "report.md").is_file()
    # the synthetic run logs no replica, ledger or eval figures: the fixed plots only
    assert sorted(p.stem for p in (report / "plots").glob("*.png")) == sorted(
        spec.name for spec in PLOTS)


def test_a_run_folder_scheme_this_machine_cannot_write_is_refused(tmp_path, monkeypatch,
                                                                   capsys):
    """az:// without adlfs: exit 2 naming the package, nothing started, nothing written."""
    monkeypatch.chdir(tmp_path)

    def no_spawn(self, role, instance=0):
        raise AssertionError(f"the launcher started the {role}")

    monkeypatch.setattr(supervisor.Supervisor, "start", no_spawn)
    cfg = C.ExperimentConfig(name="demo", run_dir="az://container/runs")
    assert supervisor.run_train(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlflow train: --run-dir az://container/runs/demo: this machine "
                          "cannot write az://") and "pip install adlfs" in err
    assert os.listdir(tmp_path) == []


def test_rlflow_train_on_a_bucket_run_folder(gcs, tmp_path, monkeypatch, capsys):
    """The launcher on ``gs://bucket/runs/demo``: run.json, config.json, processes.json and
    summary.json in the bucket, the lock and the programs' logs in the local side, progress
    read from the bucket's metrics.jsonl. The programs are small Python processes started
    through the launcher's own ``Supervisor.start`` (their command swapped); the learner
    stand-in writes its records where the bucket keeps them."""
    import subprocess
    import sys

    bucket_run = gcs / "bucket" / "runs" / "demo"
    learner = ("import json, os, sys\nos.makedirs(sys.argv[1], exist_ok=True)\n"
               "with open(os.path.join(sys.argv[1], 'metrics.jsonl'), 'a') as f:\n"
               "    for s in (1, 2, 3):\n"
               "        f.write(json.dumps({'step': s, 'learner/step_time_s': 0.1,\n"
               "                            'reward/mean': s / 4}) + '\\n')\n")
    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):
        role = cmd[cmd.index("--role") + 1]
        code = learner if role == "learner" else "pass"
        return real_popen([sys.executable, "-c", code, str(bucket_run)],
                          stdout=kwargs["stdout"], stderr=kwargs["stderr"])

    monkeypatch.setattr(supervisor.subprocess, "Popen", popen)
    monkeypatch.setattr("rlflow.run.report.make_report", lambda run_dir: "report.html")
    cfg = C.ExperimentConfig(name="demo", run_dir=RUNS, learner=C.LearnerConfig(num_steps=3),
                             metrics=C.MetricsConfig(progress="plain"))
    assert supervisor.run_train(cfg) == 0
    out, err = capsys.readouterr()
    side = files.local_side(f"{RUNS}/demo")
    assert f"rlflow train: run folder {RUNS}/demo (logs in {side}/logs)" in out
    names = {p.name for p in bucket_run.iterdir()}
    assert {"run.json", "config.json", "processes.json", "summary.json",
            "metrics.jsonl"} <= names
    summary = json.loads((bucket_run / "summary.json").read_text())
    assert summary["success"] and summary["steps_completed"] == 3
    assert sorted(os.listdir(os.path.join(side, "logs"))) == ["learner.log", "sampler.log"]
    assert os.path.isfile(lock_path(f"{RUNS}/demo"))
    assert "3/3" in err
