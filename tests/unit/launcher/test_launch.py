"""Launcher pieces that need no JAX program: config round trip, child environment, addresses."""

import io
import json

import pytest

from rlflow import config as C
from rlflow.launcher import supervisor
from rlflow.control import programs_common as pc


def test_config_round_trip_through_json(tmp_path):
    cfg = C.ExperimentConfig(
        name="x", run_dir=str(tmp_path),
        sampler=C.SamplerConfig(prefill_buckets=(8, 16), max_prefill_length=16, num_devices=2,
                                mesh=C.MeshConfig(tensor=2)),
        reward=C.RewardConfig(functions=("a", "b"), weights=(0.5, 2.0)),
        runtime=C.RuntimeConfig(mode="sync", max_staleness=0))
    path = tmp_path / "config.json"
    pc.save_config(cfg, str(path))
    json.loads(path.read_text())            # plain JSON on disk
    back = pc.load_config(str(path))
    assert back == cfg
    assert isinstance(back.sampler.prefill_buckets, tuple)
    assert isinstance(back.sampler.mesh, C.MeshConfig)


def test_config_from_dict_names_unknown_field_and_revalidates():
    d = pc.config_to_dict(C.ExperimentConfig())
    d["learner"]["lr_typo"] = 1.0
    with pytest.raises(C.ConfigError, match="lr_typo"):
        pc.config_from_dict(C.ExperimentConfig, d)
    d = pc.config_to_dict(C.ExperimentConfig())
    d["runtime"]["mode"] = "sync"           # sync needs max_staleness 0 (default is 2)
    with pytest.raises(C.ConfigError, match="runtime.max_staleness"):
        pc.config_from_dict(C.ExperimentConfig, d)


def test_publish_every_bounded_by_staleness():
    C.RuntimeConfig(max_staleness=2, publish_every=3)
    with pytest.raises(C.ConfigError, match="runtime.publish_every"):
        C.RuntimeConfig(max_staleness=1, publish_every=3)
    with pytest.raises(C.ConfigError, match="runtime.publish_every"):
        C.RuntimeConfig(mode="sync", max_staleness=0, publish_every=2)


def test_child_env_replaces_device_count_and_sets_addresses():
    eps = pc.Endpoints("127.0.0.1:5001", "127.0.0.1:5002", instance=3)
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_foo=1", "PATH": "/bin"}
    env = supervisor.child_env("sampler", 2, eps, "/tmp/c.json", base=base)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=2"]
    assert env[pc.ENV_ROLE] == "sampler" and env[pc.ENV_CONFIG] == "/tmp/c.json"
    assert pc.Endpoints.from_env(env) == eps
    assert base["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=4")  # untouched


def test_endpoints_from_env_names_missing_variable():
    with pytest.raises(KeyError, match=pc.ENV_COORDINATOR):
        pc.Endpoints.from_env({pc.ENV_BUFFER: "127.0.0.1:1"})


def test_split_address():
    assert pc.split_address("127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert pc.split_address("[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError, match="host:port"):
        pc.split_address("nohost")


def test_split_cpus_gives_each_program_its_own_cores():
    assert supervisor.split_cpus([3, 1, 0, 2]) == {"learner": [0, 1], "sampler": [2, 3]}
    assert supervisor.split_cpus([0, 1, 2]) == {"learner": [0, 1], "sampler": [2]}
    assert supervisor.split_cpus([5]) == {}


def test_reward_rise_first_and_last_tenth_against_numpy():
    import math

    import numpy as np

    from rlflow.run.summary import reward_rise

    rng = np.random.default_rng(0)
    r = rng.random(37)
    got = reward_rise({i + 1: float(x) for i, x in enumerate(r)})
    k = 4                                                     # round(0.1 * 37)
    assert got["window"] == k and got["steps"] == 37
    assert math.isclose(got["reward_first"], r[:k].mean())
    assert math.isclose(got["reward_last"], r[-k:].mean())
    assert math.isclose(got["reward_rise"], r[-k:].mean() - r[:k].mean())
    assert reward_rise({1: 0.5, 2: float("nan")})["window"] == 1     # NaN steps skipped
    assert math.isnan(reward_rise({})["reward_rise"])


def test_run_watcher_reads_only_complete_step_records(tmp_path):
    import io

    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="w", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=3),
                             metrics=C.MetricsConfig(progress="plain"))
    run = tmp_path / "w"
    run.mkdir()
    out = io.StringIO()
    watcher = RunWatcher(cfg, str(run), stream=out)
    path = run / "metrics.jsonl"
    path.write_text('{"step": 1, "learner/step_time_s": 0.1, "reward/mean": 0.25}\n'
                    '{"step": 2, "learner/step_ti')            # a half-written line
    assert watcher.poll() == 1
    with open(path, "a") as f:
        f.write('me_s": 0.1, "reward/mean": 0.75}\n{"step": 3, "reward/mean": 1.0}\n')
    assert watcher.poll() == 2          # step 3 has no learner figures: not a step record
    lines = [x for x in out.getvalue().splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in lines] == ["1/3", "2/3"]
    summary = watcher.close(success=True, report=False)
    assert summary["steps_completed"] == 2 and summary["reward_rise"] == 0.75
    assert json.load(open(run / "summary.json"))["reward_last"] == 1.0


def test_a_run_without_new_steps_prints_a_stall_notice_with_each_logs_last_line(tmp_path):
    """No step for stall_notice_s: one notice naming the wait and the last line of every
    program's log; the next after twice as long; a new step restarts the count."""
    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="w", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=3),
                             metrics=C.MetricsConfig(progress="plain"))
    run = tmp_path / "w"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "learner.log").write_text("start\nlearner ready at version 0\n\n")
    (run / "logs" / "sampler.log").write_text("WARNING environment 'e' ... (7 failures so far)\n")
    now = [0.0]
    out = io.StringIO()
    watcher = RunWatcher(cfg, str(run), stream=out, stall_notice_s=100.0, clock=lambda: now[0])

    def notices():
        return [x for x in out.getvalue().splitlines() if "no learner step" in x]

    now[0] = 99.0
    watcher.poll()
    assert notices() == []
    now[0] = 100.0
    watcher.poll()
    assert notices() == ["rlflow train: no learner step for 100 s since the start (a compile, "
                         "or the learner waiting for rollouts); the last line of each log:"]
    assert "  [learner] learner ready at version 0" in out.getvalue().splitlines()
    assert "  [sampler] WARNING environment 'e' ... (7 failures so far)" in \
        out.getvalue().splitlines()
    now[0] = 199.0
    watcher.poll()
    assert len(notices()) == 1                       # the next one after 200 s
    (run / "metrics.jsonl").write_text('{"step": 1, "learner/step_time_s": 0.1}\n')
    watcher.poll()                                    # a step at 199 s: the count restarts
    now[0] = 298.0
    watcher.poll()
    assert len(notices()) == 1
    now[0] = 299.0
    watcher.poll()
    assert notices()[-1].startswith("rlflow train: no learner step for 100 s since step 1 of 3")


def test_summary_of_a_run_stopped_before_its_first_step_is_strict_json(tmp_path):
    """No step, so no reward figures: summary.json holds null for them, not NaN (which
    strict JSON readers reject)."""
    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="w", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=3),
                             metrics=C.MetricsConfig(progress="plain"))
    (tmp_path / "w").mkdir()
    watcher = RunWatcher(cfg, str(tmp_path / "w"), stream=io.StringIO())
    watcher.close(success=False, report=False)
    text = (tmp_path / "w" / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert summary["reward_first"] is None and summary["reward_rise"] is None
    assert summary["steps_completed"] == 0 and summary["success"] is False


def test_summary_holds_the_throughput_of_this_invocation(tmp_path):
    """Issue 39.10: summary.json holds the run's rates (steps and trained tokens per
    wall-clock second of this invocation, tokens decoded and their rate over the run)."""
    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="w", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=4),
                             metrics=C.MetricsConfig(progress="plain"))
    (tmp_path / "w").mkdir()
    now = [100.0]
    watcher = RunWatcher(cfg, str(tmp_path / "w"), stream=io.StringIO(), resumed_from=1,
                         clock=lambda: now[0])
    records = [{"step": s, "learner/step_time_s": 0.1, "reward/mean": 0.5,
                "learner/tokens": 100.0 * s, "sampler/tokens_total": 250.0 * s,
                "sampler/tokens_per_s_run": 25.0 * s} for s in (1, 2, 3, 4)]
    with open(tmp_path / "w" / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    watcher.poll()
    now[0] = 110.0
    watcher.close(success=True, report=False)
    summary = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert summary["throughput"] == pytest.approx({
        "learner_steps_per_s": 3 / 10.0, "learner_tokens_per_s": (200 + 300 + 400) / 10.0,
        "sampler_tokens": 1000.0, "sampler_tokens_per_s": 100.0})


def test_summary_says_whether_the_run_was_healthy(tmp_path):
    """Issue 39.7: a run that finished with a reward function failing (timeouts included)
    on more than 1% of its calls, or an environment doing so, or NaN-reward drops, is not
    healthy; summary.json names why, and the console says so."""
    from rlflow.run.summary import health
    from rlflow.launcher.run_watch import RunWatcher

    assert health(True, {"reward/timeouts/f": 1.0}, {"sampler/groups_delivered": 50.0}, 8) == []
    assert health(True, {"reward/timeouts/f": 5.0, "reward/errors/f": 0.0},
                  {"sampler/groups_delivered": 50.0}, 8) == [
        "reward function 'f' failed on 5 of about 400 calls (0 errors, 5 timeouts; scored 0)"]
    assert health(True, {"sampler/env_timeouts": 3.0}, {"sampler/env_steps": 100.0}, 8) == [
        "the environment failed on 3 of 100 steps (sampler/env_errors, sampler/env_timeouts; "
        "reward 0)"]
    assert health(True, {"sampler/dropped_bad_reward_groups": 2.0}, {}, 4)[-1] == \
        "2 group(s) dropped for a NaN/inf reward"
    assert health(False, {}, {}, 4) == ["the run did not finish (see the lines above and logs/)"]

    cfg = C.ExperimentConfig(name="w", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=2),
                             metrics=C.MetricsConfig(progress="plain"))
    (tmp_path / "w").mkdir()
    out = io.StringIO()
    watcher = RunWatcher(cfg, str(tmp_path / "w"), stream=out)
    with open(tmp_path / "w" / "metrics.jsonl", "w") as f:
        for s in (1, 2):
            f.write(json.dumps({"step": s, "learner/step_time_s": 0.1, "reward/mean": 0.0,
                                "reward/errors/f": 0.0, "reward/timeouts/f": 4.0 * s,
                                "sampler/groups_delivered": 2.0 * s}) + "\n")
    watcher.poll()
    watcher.close(success=True, report=False)
    summary = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert summary["healthy"] is False and summary["success"] is True
    assert summary["unhealthy_reasons"] == [
        f"reward function 'f' failed on 8 of about {4 * cfg.sampler.group_size} calls "
        f"(0 errors, 8 timeouts; scored 0)"]
    assert "rlflow train: finished, but not healthy: reward function 'f'" in out.getvalue()


def test_run_watcher_shows_prompt_and_drop_counts_on_the_console(tmp_path):
    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="demo", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=3),
                             data=C.DataConfig(max_prompt_tokens=64),
                             metrics=C.MetricsConfig(progress="plain"))
    (tmp_path / "demo").mkdir()
    out = io.StringIO()
    watcher = RunWatcher(cfg, str(tmp_path / "demo"), stream=out)
    records = [{"step": s, "learner/step_time_s": 0.1, "reward/mean": 0.5,
                "sampler/prompts_kept": 90.0, "sampler/prompts_too_long": 7.0,
                "sampler/prompts_bad": 3.0, "learner/stale_groups_dropped": float(s),
                "reward/errors/math": 2.0, "reward/timeouts/math": 0.0,
                "learner/skipped_steps": float(s > 2)} for s in (1, 2, 3)]
    with open(tmp_path / "demo" / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    watcher.poll()
    summary = watcher.close(success=False)
    lines = out.getvalue().splitlines()
    prompts = [ln for ln in lines if "prompts:" in ln]
    assert prompts == ["rlflow train: prompts: 90 kept, 7 longer than "
                       "data.max_prompt_tokens=64 (filtered), 3 bad records (skipped)"]
    first_step = next(ln for ln in lines if ln.startswith("step 1/3"))
    assert lines.index(prompts[0]) < lines.index(first_step)
    assert ("rlflow train: counts: 3 stale groups dropped, 1 learner step skipped (no sample "
            "for the loss), 2 reward errors in math") in lines
    assert summary["counts"]["learner/stale_groups_dropped"] == 3.0
    assert any(ln.startswith("rlflow train: 3 steps in ") and
               " s before the run stopped (see the lines above); mean reward" in ln
               for ln in lines), lines


_STUCK_AT_EXIT = """
import threading
from rlflow.control import programs_common as pc
threading.Thread(target=threading.Event().wait, name="stuck-commit").start()   # never ends
try:
    raise RuntimeError("the program failed")
finally:
    pc.arm_exit_watchdog(0.5)
"""


def test_a_thread_stuck_at_exit_does_not_keep_the_program_alive():
    """What a learner killed by its parent's death in the middle of a save showed: orbax
    threads waiting forever kept the process alive (an orphan holding the run folder). The
    watchdog armed by ``python -m rlflow.launcher.launch`` when the program ends exits it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _STUCK_AT_EXIT], capture_output=True,
                          text=True, timeout=120)          # without the watchdog: a hang
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: the program failed" in done.stderr
    dump = done.stderr.split("Timeout (0:00:00.500000)!", 1)
    assert len(dump) == 2, done.stderr                    # the watchdog fired, then dumped:
    assert "in _shutdown" in dump[1] and "in wait" in dump[1]   # the exit join, the stuck thread


@pytest.mark.parametrize("trained_last_step", [True, False])
def test_a_sampler_dying_after_the_last_step_is_a_warning_not_a_failed_run(
        tmp_path, capsys, trained_last_step):
    """The sampler stops with an error while the learner saves its final checkpoint: with
    every step in metrics.jsonl the run ends 0 and one warning names the sampler's error;
    one step short, it is a failure (exit 1, the sampler's error first). Real child
    processes: the sampler exits 1 with a traceback, the learner exits 0 a moment later."""
    import subprocess
    import sys

    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="w", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=2),
                             metrics=C.MetricsConfig(progress="plain"))
    run = tmp_path / "w"
    (run / "logs").mkdir(parents=True)
    steps = 2 if trained_last_step else 1
    (run / "metrics.jsonl").write_text("".join(
        f'{{"step": {i}, "learner/step_time_s": 0.1}}\n' for i in range(1, steps + 1)))
    sup = supervisor.Supervisor(cfg, str(run), str(run / "config.json"),
                                pc.Endpoints("127.0.0.1:1", "127.0.0.1:2"))

    def child(name, code):
        log = run / "logs" / f"{name}.log"
        role = name.split("-")[0]
        with open(log, "w") as f:
            f.write(f"--- rlflow {role} start #0 ---\n")
            f.flush()
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=f,
                                    stderr=subprocess.STDOUT)
        sup.children[name] = supervisor.Child(name, proc, str(log))

    child("sampler", "raise RuntimeError('env e: 3 steps in a row failed')")
    child("learner", "import time; time.sleep(3)")
    out = io.StringIO()
    watcher = RunWatcher(cfg, str(run), stream=out)
    try:
        code = supervisor._supervise(cfg, sup, watcher)
    finally:
        sup.stop_all(grace_s=5.0)
    err = capsys.readouterr().err
    if trained_last_step:
        assert code == 0
        assert (f"rlflow train: warning: the sampler process stopped after the learner's last "
                f"step (RuntimeError: env e: 3 steps in a row failed); every step trained and "
                f"the final checkpoint is saved. Its log is {run}/logs/sampler.log") in err
        assert sup.children["learner"].proc.returncode == 0    # not stopped: it finished
        assert ("every sampler stopped after the learner's last step; waiting for the learner "
                "to save its final checkpoint") in out.getvalue()
    else:
        assert code == 1
        assert "the sampler failed: RuntimeError: env e: 3 steps in a row failed" in err
        assert "warning" not in err


def test_the_printed_rise_is_the_difference_of_the_printed_means(tmp_path):
    """Means 0.0734 -> 0.0726 print as 0.073 -> 0.073, so the rise shown is +0.000 (the
    exact -0.0008 would print as -0.001 beside two equal figures); summary.json keeps it."""
    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="w", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=2),
                             metrics=C.MetricsConfig(progress="plain"))
    run = tmp_path / "w"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "learner/step_time_s": 0.1, "reward/mean": 0.0734}\n'
        '{"step": 2, "learner/step_time_s": 0.1, "reward/mean": 0.0726}\n')
    out = io.StringIO()
    watcher = RunWatcher(cfg, str(run), stream=out)
    watcher.poll()
    summary = watcher.close(success=True, report=False)
    assert "0.073 -> last 1 step(s) 0.073 (rise +0.000)" in out.getvalue()
    assert summary["reward_rise"] == pytest.approx(0.0726 - 0.0734)
