"""Issue 52 end to end: ``rlflow train --config configs/gateway_demo.py`` for 3 steps: leased
prompts run as sessions of an openai-client agent (the agent runner process) through the
sampler's gateway, their episodes go to the learner as group records, and the gateway's
counters reach the run's metrics (sessions ended, no branch, no failed session)."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rlflow.run.folder import metrics_by_step, read_jsonl

pytestmark = pytest.mark.slow
pytest.importorskip("openai")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HANG_GUARD_S = 300          # a run that takes longer than this is a hang (the test fails)
NUM_STEPS, GROUPS, G = 3, 2, 4


def test_gateway_demo_three_steps(tmp_path):
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    base = [exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]
    cmd = base + ["train", "--config", os.path.join(REPO, "configs", "gateway_demo.py"),
                  "--metrics.report", "False",
                  "--learner.num-steps", str(NUM_STEPS), "--learner.groups-per-step",
                  str(GROUPS), "--sampler.group-size", str(G), "--sampler.num-slots", "8",
                  "--gateway.agent-threads", "8", "--metrics.progress", "plain",
                  "--checkpoint.every-steps", "0", "--run-dir", str(tmp_path / "runs")]
    env = dict(os.environ, RLFLOW_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records, problems = read_jsonl(str(tmp_path / "runs" / "gateway_demo" / "metrics.jsonl"))
    assert not problems, problems
    by_step = metrics_by_step(records)
    assert sorted(by_step) == list(range(1, NUM_STEPS + 1))
    for step, m in by_step.items():
        assert 0.0 <= m["reward/min"] <= m["reward/max"] <= 1.0, (step, m)
        assert np.isfinite(m["reward/mean"]), (step, m)
    last = by_step[NUM_STEPS]
    # the replica's counters as of its last status before the step was logged (a status
    # may lag the groups by a report): at least the sessions of the first two steps
    assert last["gateway/calls"] >= last["gateway/sessions_ended"] >= GROUPS * G * 2, last
    # agents re-send their histories: every recorded id is reused, never a branch; a call
    # refused because the episode is full ends the agent's episode (reward 0), not a failure
    assert last["gateway/branches"] == 0 and last["gateway/reused_tokens"] > 0, last
    assert last["gateway/sessions_failed"] == 0 and last["gateway/agent_restarts"] == 0, last
