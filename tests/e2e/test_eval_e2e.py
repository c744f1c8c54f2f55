"""Issue 42 item 1 acceptance on real runs: `rlflow train` (demo config, 4 steps) with a
held-out JSONL evaluated every 2 steps, synchronous (one replica: tests/e2e_runs.py's shared
``sync_run``, which evaluates) and asynchronous (two replicas: this file's run), as
subprocesses.

The held-out prompts are two-digit "next digit" prompts ("37>", answer "8"): the demo's
training prompts have one digit, so any held-out prompt in a learner batch would show in
samples.jsonl (every sample of every step is logged here). Checked: one complete evaluation
per requested version (0, 2, 4) at that version (sync: exactly; async: that or a newer one,
never past the learner), eval_samples.jsonl holds only held-out prompts, trained_prompts.jsonl
only the ledger's prompts; and `rlflow eval --run --step 4` on the async run's checkpoint
gives the same greedy completions and metrics as the in-run evaluation of version 4.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import e2e_runs
from rlflow.run.folder import metrics_by_step, read_jsonl
from rlflow.control.ledger import read_trained_prompts

pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HANG_GUARD_S = 300
NUM_STEPS, EVERY, HELD_OUT = e2e_runs.SYNC_STEPS, e2e_runs.EVAL_EVERY, e2e_runs.HELD_OUT
GROUPS, GROUP_SIZE = e2e_runs.DEMO_GROUPS, e2e_runs.DEMO_GROUP_SIZE


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-e2e")
    return root, e2e_runs.demo_env(), e2e_runs.write_held_out(root / "held_out.jsonl")


def _rlflow():
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]


def _train(setup, name, *overrides):
    root, env, held = setup
    cmd = _rlflow() + ["train", "--config", os.path.join(REPO, "configs", "demo.py"),
                       "--metrics.report", "False",
                       "--run-dir", str(root / "runs"), "--name", name,
                       "--metrics.progress", "plain", "--buffer.timeout-s", "120",
                       "--learner.num-steps", str(NUM_STEPS), "--checkpoint.every-steps", "0",
                       *e2e_runs.eval_flags(held), *overrides]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return os.path.join(str(root / "runs"), name)


def _evals(run):
    records, problems = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert not problems, problems
    return [r for r in records if "eval/complete" in r]


def _check_run(run, *, exact: bool):
    evals = _evals(run)
    assert sorted(r["eval/requested_version"] for r in evals) == [0, 2, 4]
    for r in evals:
        assert r["eval/complete"] == 1 and r["eval/num_prompts"] == HELD_OUT
        assert r["step"] == r["eval/version"]         # logged at the version that generated it
        want = r["eval/requested_version"]
        assert r["eval/version"] == want if exact else want <= r["eval/version"] <= NUM_STEPS
        assert 0 <= r["eval/pass@1"] <= 1 and 1 <= r["eval/completion_length"] <= 4
    samples, _ = read_jsonl(os.path.join(run, "eval_samples.jsonl"))
    assert len(samples) == 3 * HELD_OUT
    assert all(re.fullmatch(r"\d\d>", s["prompt"]) for s in samples)
    # the learner's batches: every sample of every step, none a held-out prompt
    trained, _ = read_jsonl(os.path.join(run, "samples.jsonl"))
    assert len(trained) == NUM_STEPS * GROUPS * GROUP_SIZE
    assert all(re.fullmatch(r"(<bos>)?\d>", s["prompt"]) for s in trained)   # decoded ids
    ledger = read_trained_prompts(run)
    assert [r["step"] for r in ledger] == list(range(1, NUM_STEPS + 1))
    indices = [i for r in ledger for i in r["stream_index"]]
    assert all(len(r["stream_index"]) == GROUPS for r in ledger)
    assert len(set(indices)) == len(indices)           # the ledger's stream only
    by_step = metrics_by_step(_evals(run))
    return evals, samples, by_step


def test_eval_in_sync_mode_at_the_step_boundary(sync_run):
    """The shared sync run (k = 0, a sleeping sampler in two decode lanes, the learner on 2
    devices): each evaluation exactly at its requested version."""
    proc, run = sync_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(run, exact=True)


def test_eval_in_async_mode_and_rlflow_eval_of_the_checkpoint_agree(setup, capsys):
    from rlflow.console import cli

    run = _train(setup, "async", "--sampler.num-replicas", "2")     # evals spread over both
    evals, samples, _ = _check_run(run, exact=False)
    last = max(evals, key=lambda r: r["eval/requested_version"])
    assert last["eval/version"] == NUM_STEPS           # nothing newer exists
    out = os.path.join(run, "offline.json")
    assert cli.main(["eval", "--run", run, "--step", str(NUM_STEPS), "--out", out]) == 0, \
        capsys.readouterr().err
    offline = json.load(open(out))
    assert offline["step"] == NUM_STEPS
    in_run = {k: v for k, v in last.items() if k.startswith("eval/") and k not in (
        "eval/requested_version", "eval/wait_s", "eval/attempts", "eval/complete")}
    # the reward calls that failed: per evaluation in rlflow eval, a replica's running totals
    # in the run (logged apart from the evaluation's record), so compared as counts only
    failures = ("eval/reward_errors/", "eval/reward_timeouts/", "eval/reward_http_")
    scored = {k: v for k, v in offline["metrics"].items() if not k.startswith(failures)}
    assert all(v == 0 for k, v in offline["metrics"].items() if k.startswith(failures))
    assert scored == pytest.approx(in_run, rel=1e-6)
    offline_samples, _ = read_jsonl(os.path.join(run, "offline_samples.jsonl"))
    got = [(s["prompt"], s["completion"]) for s in offline_samples]
    # the same greedy completions; in async mode the eval asked at step 2 may also have run at
    # NUM_STEPS (the learner got there first), so each evaluation at NUM_STEPS is compared
    at_last = [(s["prompt"], s["completion"]) for s in samples if s["version"] == NUM_STEPS]
    assert at_last and len(at_last) % HELD_OUT == 0
    for start in range(0, len(at_last), HELD_OUT):
        assert got == at_last[start:start + HELD_OUT]
