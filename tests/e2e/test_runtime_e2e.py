"""End to end: `rlflow train` as a real subprocess, learner and sampler as two processes.

Each test runs the demo config (tiny model written to a temporary cache) for a few steps
and reads what happened from the run folder (metrics.jsonl, processes.json, logs/). The plain
asynchronous run (staleness bound, versions, run folder) is tests/e2e/test_run_outputs_e2e.py's
shared run; the plain sync run is tests/e2e_runs.py's (the ``sync_run`` session fixture);
the other tests inject faults or resume, so each starts its own.
"""

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

import e2e_runs
from rlflow.run.folder import metrics_by_step, read_jsonl

pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HANG_GUARD_S = e2e_runs.HANG_GUARD_S


@pytest.fixture(scope="module")
def env():
    return e2e_runs.demo_env()          # the session's demo model folder


_cmd = e2e_runs.demo_train_cmd


def _train(env, run_dir, name, *overrides):
    proc = subprocess.run(_cmd(run_dir, name, *overrides), env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    return proc, os.path.join(str(run_dir), name)


def _steps(run):
    """The train steps' merged metrics (evaluation records, logged at their version, apart)."""
    records, problems = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert not problems, problems
    return metrics_by_step(r for r in records if "eval/complete" not in r)


def test_sync_mode_two_learner_devices_sleeping_sampler_two_lanes(sync_run):
    """tests/e2e_runs.py's shared sync run (k = 0): the learner on 2 fake devices (fsdp) and
    the sampler on 1, weights through jax.experimental.transfer gathered on one device, a
    sampler that frees its KV cache whenever it waits and decodes in two lanes (its slots in
    two batchers decoding at once). Every step trains complete groups, every consumed sample
    version-current, so the sampler kept generating with the last synced weights after each
    free. The learner runs with glibc keeping freed memory (the default), the sampler does not
    (runtime.keep_freed_host_memory=false: tests/e2e/test_runtime_e2e.py's resume runs)."""
    proc, run = sync_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_step = _steps(run)
    assert sorted(by_step) == list(range(1, e2e_runs.SYNC_STEPS + 1))
    for step, m in by_step.items():
        assert m["staleness/max"] == 0 and m["staleness/frac_0"] == 1.0
        assert m["rollout/version_min"] == m["rollout/version_max"] == step - 1
        assert m["learner/stale_groups_dropped"] == 0
        assert m["batch/groups"] == 8
    logs = {p: open(os.path.join(run, "logs", f"{p}.log")).read() for p in ("learner", "sampler")}
    assert "host memory: glibc malloc keeps freed memory" in logs["learner"]
    assert "host memory:" not in logs["sampler"]


def _start(env, run_dir, name, *overrides):
    return subprocess.Popen(_cmd(run_dir, name, *overrides), env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(run, step, proc, limit_s=HANG_GUARD_S):
    path = os.path.join(run, "metrics.jsonl")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if os.path.isfile(path):
            lines = [json.loads(x) for x in open(path) if x.strip().endswith("}")]
            if lines and lines[-1]["step"] >= step:
                return lines[-1]["step"]
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {limit_s} s")


@pytest.mark.parametrize("victim", ["sampler", "learner"])
def test_killed_program_stops_the_run_with_its_name(env, tmp_path, victim):
    proc = _start(env, tmp_path, victim, "--learner.num_steps", "100000")
    run = os.path.join(str(tmp_path), victim)
    try:
        _wait_for_step(run, 2, proc)
        pids = json.load(open(os.path.join(run, "processes.json")))
        os.kill(pids[victim], signal.SIGKILL)
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert f"the {victim} process died (killed by SIGKILL)" in err
    other = "learner" if victim == "sampler" else "sampler"
    with pytest.raises(ProcessLookupError):
        os.kill(pids[other], 0)                     # the other side was stopped too


def test_ctrl_c_stops_both_programs_and_saves_the_exit_checkpoint(env, tmp_path):
    proc = _start(env, tmp_path, "ctrlc", "--learner.num_steps", "100000")
    run = os.path.join(str(tmp_path), "ctrlc")
    try:
        _wait_for_step(run, 2, proc)
        pids = json.load(open(os.path.join(run, "processes.json")))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted; stopping both programs" in err
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    saved = [int(d) for d in os.listdir(os.path.join(run, "checkpoints")) if d.isdigit()]
    assert saved and max(saved) >= 2                  # the learner's exit checkpoint
    assert "stopped: received SIGTERM" in open(os.path.join(run, "logs", "sampler.log")).read()


def test_kill_9_of_the_launcher_still_leaves_a_whole_exit_checkpoint(env, tmp_path):
    """The children get SIGTERM from the kernel (PDEATHSIG), several times over as the
    dying launcher's threads go; a later one once cut the learner's exit save short (a LoRA
    run kept only ``<step>.orbax-checkpoint-tmp``: everything trained was lost)."""
    proc = _start(env, tmp_path, "kill9", "--learner.num_steps", "100000",
                  "--learner.lora.rank", "4")
    run = os.path.join(str(tmp_path), "kill9")
    try:
        _wait_for_step(run, 3, proc)
        pids = json.load(open(os.path.join(run, "processes.json")))
        proc.kill()
        proc.communicate(timeout=HANG_GUARD_S)
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any(_alive(p) for p in pids.values())
    names = os.listdir(os.path.join(run, "checkpoints"))
    saved = [int(d) for d in names if d.isdigit()]
    assert saved and max(saved) >= 3, names              # the learner's exit checkpoint
    assert not [d for d in names if "tmp" in d], names   # none left half-written
    assert "stopped: received SIGTERM" in open(os.path.join(run, "logs", "learner.log")).read()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_restarted_sampler_generates_with_last_synced_version(env, tmp_path):
    proc = _start(env, tmp_path, "restart", "--learner.num_steps", "10",
                  "--runtime.restart_sampler", "True", "--runtime.mode", "sync",
                  "--runtime.max_staleness", "0")
    run = os.path.join(str(tmp_path), "restart")
    try:
        killed_at = _wait_for_step(run, 3, proc)
        os.kill(json.load(open(os.path.join(run, "processes.json")))["sampler"], signal.SIGKILL)
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "restarting it (1/3)" in err
    by_step = _steps(run)
    assert sorted(by_step) == list(range(1, 11))
    for step, m in by_step.items():              # on-policy all the way, across the restart
        assert m["rollout/version_min"] == m["rollout/version_max"] == step - 1
    log = open(os.path.join(run, "logs", "sampler.log")).read()
    second = log.split("--- rlflow sampler start #1 ---")[1]
    first_version = int(re.search(r"loaded weights version (\d+)", second).group(1))
    assert first_version >= killed_at, (first_version, killed_at)   # not the initial weights


def _samples_by_step(run):
    records, problems = read_jsonl(os.path.join(run, "samples.jsonl"))
    assert not problems, problems
    out = {}
    for r in records:
        out.setdefault(r["step"], []).append((r["prompt_id"], r["completion"], r["version"],
                                              r["reward"]))
    return {k: sorted(v) for k, v in out.items()}


def test_sync_resume_continues_exactly(env, tmp_path):
    """Stop after step 3 and resume to 6: the same prompts, completions and versions per
    step, and the same final parameters, as an uninterrupted run (sync mode, CPU; weights
    through the orbax folder fallback, so that path runs end to end too; the programs with
    the system's malloc settings, runtime.keep_freed_host_memory=false)."""
    from rlflow.checkpoint import Checkpointer, checkpoint_dir

    common = ["--runtime.mode", "sync", "--runtime.max_staleness", "0",
              "--runtime.weight_transfer", "orbax", "--runtime.keep_freed_host_memory", "false",
              "--metrics.samples_every", "1", "--metrics.num_samples", "64"]
    ref, ref_run = _train(env, tmp_path, "ref", "--learner.num_steps", "6", *common)
    assert ref.returncode == 0, ref.stderr[-3000:]
    first, run = _train(env, tmp_path, "resumed", "--learner.num_steps", "3", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    # An invocation that got further than its newest checkpoint (killed before saving step
    # 4 and 5) left records of those steps, the last one cut mid-write: the resume from
    # checkpoint 3 replaces them, so each step is recorded once (issue 14 item 8).
    for name, extra in (("metrics.jsonl", {"learner/step_time_s": 9.0, "reward/mean": 9.0}),
                        ("samples.jsonl", {"prompt": "stale", "completion": "stale",
                                           "reward": 9.0, "version": 9, "prompt_id": -1})):
        with open(os.path.join(run, name), "a") as f:
            for step in (4, 5):
                f.write(json.dumps({"step": step, **extra}) + "\n")
            f.write('{"step": 5, "cut')
    second, _ = _train(env, tmp_path, "resumed", "--learner.num_steps", "6", *common)
    assert second.returncode == 0, second.stderr[-3000:]
    learner_log = open(os.path.join(run, "logs", "learner.log")).read()
    assert "resumed from checkpoint step 3" in learner_log
    # runtime.keep_freed_host_memory=false: the learner too starts with the system's malloc
    # settings (no "host memory:" line; the shared sync run's learner shows the default's)
    assert "host memory:" not in learner_log
    want, got = _samples_by_step(ref_run), _samples_by_step(run)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    records, _ = read_jsonl(os.path.join(run, "metrics.jsonl"))
    steps = [r["step"] for r in records if "learner/step_time_s" in r]
    assert steps == [1, 2, 3, 4, 5, 6]                                   # each step once
    for step in want:
        assert got[step] == want[step], step
    leaves = []
    for r in (ref_run, run):
        with Checkpointer(checkpoint_dir(r), read_only=True) as ck:
            assert ck.latest_step() == 6
            leaves.append(jax_leaves(ck.restore(restore_opt_state=False).params))
    for a, b in zip(*leaves):
        assert (a == b).all()                       # bit-identical on CPU


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]
