"""End to end: several sampler replicas feeding one learner through the prompt ledger,
replica faults, and exact async resume (real processes; the demo's tiny model on CPU).

What was trained comes from the run's own record, ``trained_prompts.jsonl`` (one line per
learner step: the stream indices, prompt ids and epochs of its groups).
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from rlflow.control.ledger import read_trained_prompts
from test_runtime_e2e import HANG_GUARD_S, _cmd, _start, _steps, _wait_for_step, env  # noqa: F401

pytestmark = pytest.mark.slow

PROMPTS = ["1>", "2>", "3>", "4>", "5>", "6>"]          # the 6-prompt JSONL


def _digits_args(tmp_path, prompts, epochs, steps, groups):
    """Writes ``prompts`` (answer: the digit + 1) to a JSONL in ``tmp_path``; returns the
    ``rlflow train`` flags of a run over it: ``epochs`` epochs, ``steps`` learner steps of
    ``groups`` groups of 4."""
    data = tmp_path / f"digits-{len(prompts)}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": str(int(p[0]) + 1)}) + "\n"
                            for p in prompts))
    return ["--learner.num_steps", str(steps), "--data.source", "jsonl", "--data.path",
            str(data), "--data.prompt_field", "prompt", "--data.answer_field", "answer",
            "--data.num_epochs", str(epochs), "--learner.groups_per_step", str(groups),
            "--sampler.group_size", "4"]


def _trained(run):
    recs = read_trained_prompts(run)
    steps = [r["step"] for r in recs]
    assert len(steps) == len(set(steps)), f"a step recorded twice: {steps}"
    return recs


def _by_epoch(recs):
    out = {}
    for r in recs:
        for pid, epoch in zip(r["prompt_id"], r["epoch"]):
            out.setdefault(epoch, []).append(pid)
    return {e: sorted(v) for e, v in out.items()}


def _wait_gone(pids, limit_s=60):
    deadline = time.monotonic() + limit_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"process {pid} still alive")


def _finish(proc):
    try:
        return proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()


def _wait_for_log(path, pattern, proc, count=1, limit_s=HANG_GUARD_S):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if os.path.isfile(path):
            found = re.findall(pattern, open(path).read())
            if len(found) >= count:
                return found
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not {count} times in {path} within {limit_s} s")


def _wait_for_metric(run, key, proc, limit_s=60):
    """Step of the newest metrics record whose ``key`` is >= 1, once there is one (None
    after ``limit_s``)."""
    path = os.path.join(run, "metrics.jsonl")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None
        lines = [json.loads(x) for x in open(path) if x.strip().endswith("}")]
        if lines and lines[-1].get(key, 0) >= 1:
            return lines[-1]["step"]
        time.sleep(0.01)
    return None


def _wait_holding(run, replica, proc, limit_s=60):
    """Until the newest metrics record says ``replica`` holds leased groups (or limit_s)."""
    _wait_for_metric(run, f"replica/{replica}/in_flight", proc, limit_s)


def test_three_replicas_one_killed_and_restarted(env, tmp_path):
    """3 replicas, async: all generate; sampler-1 is killed (-9) mid-run and restarted; it
    rejoins with weights no older than the learner's at the kill; the prompts it held go
    back to the ledger and out again; no stream index is trained twice and every admitted
    one is trained or accounted for by the ledger."""
    proc = _start(env, tmp_path, "r3", "--learner.num_steps", "100000",
                  "--sampler.num_replicas", "3", "--runtime.restart_sampler", "True",
                  "--runtime.replica_timeout_s", "30")
    run = os.path.join(str(tmp_path), "r3")
    log1 = os.path.join(run, "logs", "sampler-1.log")
    try:
        killed_at = _wait_for_step(run, 3, proc)
        _wait_holding(run, 1, proc)      # best effort: kill it while it holds leases
        os.kill(json.load(open(os.path.join(run, "processes.json")))["sampler-1"],
                signal.SIGKILL)
        loaded = _wait_for_log(log1, r"loaded weights version (\d+)", proc, count=2)
        rejoined_at = _wait_for_step(run, 1, proc)
        _wait_for_step(run, rejoined_at + 3, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "the sampler-1 process died (killed by SIGKILL); restarting it (1/3)" in err
    assert int(loaded[1]) >= killed_at           # the restarted replica: current weights
    by_step = _steps(run)
    last_step = max(by_step)
    last = by_step[last_step]
    for i in range(3):                                  # every replica delivered groups
        assert max(m.get(f"replica/{i}/groups_delivered", 0) for m in by_step.values()) > 0
    assert last["replica/1/restarts"] == 1
    # the prompts taken back from the dead instance went out again (re-dispatched first)
    learner_log = open(os.path.join(run, "logs", "learner.log")).read()
    released = sum(int(n) for n in re.findall(
        r"replica sampler-1 (?:restarted|silent for over 30 s \(lost\)): (\d+) leased",
        learner_log))
    assert released == last["ledger/released"]
    assert last["ledger/redispatched"] == \
        last["ledger/released"] + last["ledger/stale_returned"] - last["ledger/returned"]
    # exactly once: no index twice; the untrained admitted ones are the ledger's open ones
    recs = [r for r in _trained(run) if r["step"] <= last_step]
    assert [r["step"] for r in recs] == list(range(1, last_step + 1))
    trained = [i for r in recs for i in r["stream_index"]]
    assert len(trained) == len(set(trained)) == last_step * 8
    open_now = sum(last[f"ledger/{k}"] for k in ("in_flight", "buffered", "consumed",
                                                 "returned"))
    assert int(last["ledger/next_index"]) - len(trained) - int(last["ledger/dropped"]) == open_now
    assert set(trained) <= set(range(int(last["ledger/next_index"])))


def test_replica_lost_run_goes_on_then_every_replica_dead_is_named(env, tmp_path):
    proc = _start(env, tmp_path, "lost", "--learner.num_steps", "100000",
                  "--sampler.num_replicas", "2", "--runtime.replica_timeout_s", "5")
    run = os.path.join(str(tmp_path), "lost")
    try:
        step = _wait_for_step(run, 2, proc)
        pids = json.load(open(os.path.join(run, "processes.json")))
        os.kill(pids["sampler-0"], signal.SIGKILL)
        _wait_for_log(os.path.join(run, "logs", "learner.log"),
                      r"replica sampler-0 silent for over 5 s \(lost\)", proc)
        # the verdict reaches the step records; the other replica carries the run
        lost_at = _wait_for_metric(run, "replica/0/lost", proc, limit_s=HANG_GUARD_S)
        assert lost_at is not None
        _wait_for_step(run, max(step, lost_at) + 2, proc)
        os.kill(pids["sampler-1"], signal.SIGKILL)
        _, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "the sampler-0 process died (killed by SIGKILL); going on with 1 sampler" in err
    # the learner's verdict is in the records; the console said it once (the death)
    assert "declared sampler-0 lost" not in err
    assert "every sampler replica died (2)" in err


def test_async_resume_trains_each_prompt_once_per_epoch(env, tmp_path):
    """The issue's reproduction: 6 prompts, 2 epochs, 2 groups per step, a checkpoint every
    step. Stopped by SIGTERM after step 2, then the launcher killed (-9) after step 4, then
    run to the end: across the three runs each epoch trains each of the 6 prompts exactly
    once, which is what an uninterrupted run trains (all 12 prompts of 2 epochs in 6 steps)."""
    args = _digits_args(tmp_path, PROMPTS, epochs=2, steps=6, groups=2) + [
        "--checkpoint.every_steps", "1", "--checkpoint.keep_last", "2"]
    run = os.path.join(str(tmp_path), "six")
    first = _start(env, tmp_path, "six", *args)
    try:
        _wait_for_step(run, 2, first)
        first.send_signal(signal.SIGTERM)
        _finish(first)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130
    second = _start(env, tmp_path, "six", *args)
    try:
        _wait_for_step(run, 4, second)
        pids = json.load(open(os.path.join(run, "processes.json")))
        second.kill()                                   # kill -9 of the launcher
        second.communicate(timeout=60)
        _wait_gone(pids.values())                       # the programs die with it
    finally:
        if second.poll() is None:
            second.kill()
    third = subprocess.run(_cmd(tmp_path, "six", *args), env=env, capture_output=True,
                           text=True, timeout=HANG_GUARD_S)
    assert third.returncode == 0, third.stderr[-3000:]
    recs = _trained(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert _by_epoch(recs) == {0: list(range(6)), 1: list(range(6))}
    assert "ran out" not in third.stderr


GATED_REWARD = """import os
import time

from rlflow.data.tasks import digits_match


def gated_digits_match(completion, answer):
    gate = {gate!r}
    open(os.path.join(gate, "arrived-" + os.environ["RLFLOW_REPLICA"]), "w").close()
    deadline = time.monotonic() + 240
    while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
        time.sleep(0.02)
    return digits_match(completion, answer)
"""


def _wait_for_file(path, proc, limit_s=HANG_GUARD_S):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if os.path.exists(path):
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} not written within {limit_s} s")


def _wait_all_delivered(run, replicas, proc, limit_s=HANG_GUARD_S):
    """Until the metrics say every replica has delivered at least one group."""
    path = os.path.join(run, "metrics.jsonl")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        lines = [json.loads(x) for x in open(path) if x.strip().endswith("}")] \
            if os.path.isfile(path) else []
        if lines and all(lines[-1].get(f"replica/{i}/groups_delivered", 0) > 0
                         for i in range(replicas)):
            return lines[-1]["step"]
        time.sleep(0.05)
    raise AssertionError(f"not every replica delivered within {limit_s} s")


def test_three_replicas_complete_and_train_each_prompt_once_per_epoch_after_a_kill(env, tmp_path):
    """Demo model, 3 replicas, async, to the end: all 3 generate; one is killed (-9, no
    restart) mid-run and the other two finish the run; from the run's own record each epoch
    trains each prompt exactly once (what an uninterrupted run trains)."""
    prompts = [f"{d}>" for d in range(1, 10)]                 # 9 prompts x 3 epochs
    # All 3 replicas deliver for sure: the reward holds every group at a gate until each
    # replica has one there (a replica holds at most 2 groups with 4 slots: lease_cap, so the
    # first one up cannot take the whole staleness budget of 9). Without it the first two
    # replicas up could train all 9 steps (~0.1 s each) before the third finished starting.
    gate = tmp_path / "gate"
    gate.mkdir()
    reward = tmp_path / "gated_reward.py"
    reward.write_text(GATED_REWARD.format(gate=str(gate)))
    args = _digits_args(tmp_path, prompts, epochs=3, steps=9, groups=3) + [
        "--sampler.num_replicas", "3", "--runtime.replica_timeout_s", "5",
        "--sampler.num_slots", "4", "--reward.functions", f"{reward}:gated_digits_match",
        "--reward.timeout_s", "280"]
    run = os.path.join(str(tmp_path), "nine")
    proc = _start(env, tmp_path, "nine", *args)
    try:
        for i in range(3):
            _wait_for_file(gate / f"arrived-{i}", proc)
        (gate / "open").touch()
        _wait_all_delivered(run, 3, proc)
        os.kill(json.load(open(os.path.join(run, "processes.json")))["sampler-2"],
                signal.SIGKILL)
        out, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "the sampler-2 process died (killed by SIGKILL); going on with 2 sampler replica(s)" in err
    recs = _trained(run)
    assert [r["step"] for r in recs] == list(range(1, 10))
    assert _by_epoch(recs) == {e: list(range(9)) for e in range(3)}
    by_step = _steps(run)
    for i in range(3):                                  # every replica delivered groups
        assert max(m.get(f"replica/{i}/groups_delivered", 0) for m in by_step.values()) > 0
