"""End to end: ``rlflow train`` on the distillation demo config with a teacher (the unit
tests of the teacher, the distillation advantages and the learner are tests/unit/learner/test_distill.py;
both build their student and teacher folders with tests/distill_fixtures.py)."""

import json
import os
import subprocess

import numpy as np
import pytest

from e2e_runs import rlflow_argv
from repo_paths import REPO
from rlflow.run.folder import metrics_by_step, read_jsonl
from distill_fixtures import student_teacher_folders


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``(student, teacher)`` HF folders: random digit-task models with the task's tokenizer."""
    return student_teacher_folders(tmp_path_factory.mktemp("distill"))


@pytest.mark.slow
def test_rlflow_train_two_steps_with_a_teacher(folders, tmp_path):
    """``rlflow train`` on the distillation demo config with a teacher built here: two steps,
    the reverse KL logged every step, the teacher never in the checkpoint."""
    student, teacher = folders
    env = dict(os.environ, RLFLOW_CACHE_DIR=str(tmp_path / "cache"))
    cmd = rlflow_argv() + [
        "train", "--config", os.path.join(REPO, "configs", "distill_demo.py"),
        "--metrics.report", "False",
        "--run_dir", str(tmp_path), "--name", "distill", "--metrics.progress", "plain",
        "--learner.num_steps", "2", "--buffer.timeout_s", "120",
        "--model.path", student, "--teacher.path", teacher]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records, problems = read_jsonl(str(tmp_path / "distill" / "metrics.jsonl"))
    steps = metrics_by_step(records)
    assert not problems and sorted(steps) == [1, 2]
    for m in steps.values():
        assert np.isfinite(m["distill/reverse_kl"]) and m["distill/teacher_time_s"] > 0
    with open(tmp_path / "distill" / "config.json") as f:
        assert json.load(f)["teacher"]["path"] == teacher
