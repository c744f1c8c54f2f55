"""Issue 16 acceptance (smoke): ``rlflow train --config configs/gsm8k_calculator.py`` runs 3
steps end to end with a locally built tiny model and tokenizer (conftest's ``gsm8k_model``,
the GSM8K e2e test's model folder, whose BPE tokenizer has a chat template): episodes in the
sampler, environment workers, rewards from the environment, ``loss_mask`` records through the
buffer into the learner."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rlflow.run.folder import metrics_by_step, read_jsonl

from test_gsm8k_e2e import GSM8K_TEST, HANG_GUARD_S, REPO

pytestmark = pytest.mark.slow
NUM_STEPS = 3


def test_gsm8k_calculator_three_steps(tmp_path, gsm8k_model):
    model_dir, _ = gsm8k_model
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    base = [exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]
    cmd = base + ["train", "--config", os.path.join(REPO, "configs", "gsm8k_calculator.py"),
                  "--metrics.report", "False",
                  "--model.path", model_dir, "--data.path", GSM8K_TEST,
                  "--learner.num-steps", str(NUM_STEPS), "--learner.groups-per-step", "2",
                  "--sampler.group-size", "2", "--sampler.num-slots", "4",
                  "--sampler.max-tokens", "48", "--env.max-episode-tokens", "48",
                  "--env.num-workers", "1", "--env.max-turns", "2",
                  "--data.max-prompt-tokens", "192", "--sampler.max-prefill-length", "384",
                  "--sampler.prefill-buckets", "384", "--learner.seq-buckets", "448",
                  "--metrics.progress", "plain", "--buffer.timeout-s", "120",
                  "--run-dir", str(tmp_path / "runs")]
    env = dict(os.environ, RLFLOW_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records, problems = read_jsonl(str(tmp_path / "runs" / "gsm8k_calculator" / "metrics.jsonl"))
    assert not problems, problems
    by_step = metrics_by_step(records)
    assert sorted(by_step) == [1, 2, 3]
    for step, m in by_step.items():
        assert 0.0 <= m["reward/min"] <= m["reward/max"] <= 1.0, (step, m)
        assert np.isfinite(m["reward/mean"]), (step, m)
    last = by_step[NUM_STEPS]
    # the sampler ran episodes and reports the environment counters; no step failed
    assert last["sampler/episodes"] >= 2 * 2 * NUM_STEPS, last
    assert last["sampler/env_errors"] == 0 and last["sampler/env_timeouts"] == 0, last
