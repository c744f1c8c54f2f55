"""End to end: skipped steps (rlflow.learner.skips) on a real ``rlflow train`` run; the unit
tests of the counters, filters and the learner's handling are tests/unit/learner/test_skipped_steps.py."""

import os
import subprocess

import pytest

from e2e_runs import demo_env, demo_train_cmd
from repo_paths import REPO


@pytest.mark.slow
def test_issue_flags_stop_the_run_with_the_reason(tmp_path):
    """The issue's flags on the demo config, sync budget (max_staleness 0): three skipped
    steps need three steps' worth of groups while the version stays 0, which the sampler
    can only make when each skip gives its groups back to the budget."""
    env = demo_env()
    cmd = demo_train_cmd(tmp_path, "skip",
                         "--sampler.temperature", "0", "--sampler.max-tokens", "1",
                         "--learner.mask-truncated", "True", "--learner.num_steps", "4",
                         "--runtime.max_staleness", "0",
                         "--learner.max_consecutive_skipped_steps", "3")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "weight versions never go backwards" not in proc.stderr
    assert "DegenerateStepsError: 3 steps in a row left no sample to train on (all_masked)" \
        in proc.stderr
    assert "learner.mask_truncated=True" in proc.stderr
    log = open(os.path.join(str(tmp_path), "skip", "logs", "learner.log")).read()
    assert log.count("skipped a step at version 0 (all_masked)") == 3
