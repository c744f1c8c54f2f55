"""Issue 52 acceptance 4: ``rlflow train --config configs/gateway_demo.py`` with a
``verifiers`` environment as the agent (``tests/verifiers_digit.py``: a verifiers 0.4.0
taskset built in memory, prompt "?", hidden digit, reward its share of the reply)
trains 2 learner steps: each leased prompt's sessions are verifiers episodes run by the
agent runner through the sampler's gateway (verifiers' interception server relays each
harness call to the session), their rewards are the task's, their episodes the learner's."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rlflow.run.folder import metrics_by_step, read_jsonl

pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TESTS = os.path.join(REPO, "tests")
HANG_GUARD_S = 300          # a run that takes longer than this is a hang (the test fails)
NUM_STEPS, GROUPS, G = 2, 2, 4


def test_verifiers_environment_trains_two_steps_through_the_gateway(tmp_path):
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    base = [exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]
    cmd = base + ["train", "--config", os.path.join(REPO, "configs", "gateway_demo.py"),
                  "--metrics.report", "False",
                  "--gateway.agent", os.path.join(TESTS, "verifiers_digit.py") + ":agent",
                  "--gateway.tool-parser", "hermes", "--gateway.agent-threads", "4",
                  "--learner.num-steps", str(NUM_STEPS), "--learner.groups-per-step",
                  str(GROUPS), "--sampler.group-size", str(G), "--sampler.num-slots", "8",
                  "--metrics.progress", "plain", "--checkpoint.every-steps", "0",
                  "--run-dir", str(tmp_path / "runs")]
    # the taskset plugin is imported by name (verifiers' loader), as an installed one would be
    path = os.pathsep.join(p for p in (REPO, TESTS, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, RLFLOW_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=path)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records, problems = read_jsonl(str(tmp_path / "runs" / "gateway_demo" / "metrics.jsonl"))
    assert not problems, problems
    by_step = metrics_by_step(records)
    assert sorted(by_step) == list(range(1, NUM_STEPS + 1))
    for step, m in by_step.items():
        assert 0.0 <= m["reward/min"] <= m["reward/max"] <= 1.0, (step, m)
        assert np.isfinite(m["reward/mean"]) and np.isfinite(m["learner/loss"]), (step, m)
        assert m["batch/failed_samples"] == 0, (step, m)
    # the task's rewards reached the learner: some group had a spread, so a gradient
    assert max(m["reward/max"] for m in by_step.values()) > 0, by_step
    assert max(m["learner/grad_norm"] for m in by_step.values()) > 0, by_step
    last = by_step[NUM_STEPS]
    # every session was one verifiers episode of one call, ended by the runner, none failed
    assert last["gateway/sessions_ended"] >= GROUPS * G, last
    assert last["gateway/sessions_ended"] <= last["gateway/calls"] <= \
        last["gateway/sessions_opened"], last
    assert last["gateway/sessions_failed"] == 0 and last["gateway/agent_restarts"] == 0, last
