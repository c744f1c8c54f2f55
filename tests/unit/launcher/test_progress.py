"""Live progress: rich bar on a TTY, plain lines without control characters elsewhere."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap

import pytest

from rlflow.launcher.progress import (ProgressReporter, format_duration, format_status, plain_text,
                             use_bar)

# Any C0/C1 control character other than newline (ESC, CR, BS, TAB, ...).
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
METRICS = {"reward/mean": 0.5, "policy/kl": 0.00123, "sampler/tokens_per_s": 1520.4,
           "staleness/mean": 0.75, "buffer/fill": 0.4, "learner/step_time_s": 1.0}


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_plain_lines_when_not_a_tty():
    out = io.StringIO()
    clock = FakeClock()                     # 2 s per step, not the machine's speed
    with ProgressReporter(10, mode="auto", stream=out, clock=clock) as p:
        assert not p.is_bar
        for step in range(1, 11):
            clock.t += 2.0
            p.update(step, METRICS)
        p.message("\x1b[31mred\x1b[0m\tdone\r")
    text = out.getvalue()
    assert CONTROL.search(text) is None, repr(CONTROL.search(text))
    lines = text.splitlines()
    assert len(lines) == 11
    assert lines[2].startswith("step 3/10 (30%) elapsed 0:00:06 eta 0:00:14 | ")
    assert lines[2].endswith("reward 0.500 | kl 1.23e-03 | tok/s 1520 | stale 0.75 | buf 40%")
    assert lines[-1] == "red done "


def test_subprocess_piped_output_has_no_control_characters():
    script = textwrap.dedent("""
        import sys
        from rlflow.launcher.progress import ProgressReporter
        p = ProgressReporter(4, stream=sys.stdout)
        for step in range(1, 5):
            p.update(step, {"reward/mean": step / 4, "buffer/fill": 0.5})
        p.message("weights \\x1b[1mv3\\x1b[0m swapped\\r")
        p.close()
    """)
    env = dict(os.environ, TERM="xterm-256color", FORCE_COLOR="", PYTHONPATH=os.getcwd())
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=60, check=True)
    assert CONTROL.search(res.stdout) is None, repr(res.stdout)
    assert res.stdout.splitlines()[0].startswith("step 1/4 (25%) elapsed")
    assert res.stdout.splitlines()[-1] == "weights v3 swapped "


def test_plain_forced_on_a_tty_and_bar_on_a_tty():
    plain = FakeTTY()
    with ProgressReporter(3, mode="plain", stream=plain) as p:
        p.update(1, METRICS)
    assert CONTROL.search(plain.getvalue()) is None

    tty = FakeTTY()
    with ProgressReporter(3, mode="auto", stream=tty) as p:
        assert p.is_bar
        for step in range(1, 4):
            p.update(step, METRICS)
        p.message("hello above the bar")
    text = tty.getvalue()
    assert "\x1b[" in text  # a live terminal display, not plain lines
    visible = plain_text(text)
    assert "3/3" in visible and "hello above the bar" in visible
    assert "reward 0.500 | kl 1.23e-03" in visible


def test_eta_waits_for_two_timed_steps_and_excludes_the_first_one():
    clock = FakeClock()
    out = io.StringIO()
    p = ProgressReporter(100, mode="plain", stream=out, clock=clock)
    clock.t += 60.0                         # start-up + compilation: not the pace
    p.update(1, {})
    clock.t += 2.0
    p.update(2, {})                         # one timed step: not enough for an estimate
    assert out.getvalue().splitlines() == ["step 1/100 (1%) elapsed 0:01:00 eta -:--:--",
                                           "step 2/100 (2%) elapsed 0:01:02 eta -:--:--"]
    clock.t += 4.0
    p.update(3, {})                         # (2 + 4) s over steps 2..3 -> 3 s/step, 97 left
    assert out.getvalue().splitlines()[-1] == "step 3/100 (3%) elapsed 0:01:06 eta 0:04:51"
    # the case: a long first step no longer gives "0:00:01" at step 3
    assert p.eta_s() == 3.0 * 97


def test_eta_with_resume_counts_only_this_process_and_record_times():
    clock = FakeClock()
    out = io.StringIO()
    p = ProgressReporter(100, mode="plain", stream=out, start_step=50, clock=clock,
                         plain_every=5)
    assert p.eta_s() != p.eta_s()  # NaN before the first step of this process
    p.update(51, {}, at=1000.0)    # record times (the launcher reads records in bursts)
    p.update(55, {}, at=1008.0)    # 4 steps in 8 s -> 2 s/step, 45 left -> 90 s
    assert out.getvalue() == "step 55/100 (55%) elapsed 0:00:00 eta 0:01:30\n"
    p.update(100, {}, at=1098.0)
    assert out.getvalue().splitlines()[-1].endswith("eta 0:00:00")


def test_bar_appears_at_the_first_step_below_earlier_lines():
    tty = FakeTTY()
    p = ProgressReporter(5, mode="bar", stream=tty)
    p.message("rlflow train: run folder /r/demo (logs in /r/demo/logs)")
    assert "0/5" not in plain_text(tty.getvalue())       # no bar frame during start-up
    p.update(1, METRICS)
    p.update(2, METRICS)
    p.close()
    visible = plain_text(tty.getvalue())
    assert visible.startswith("rlflow train: run folder /r/demo (logs in /r/demo/logs)\n")
    assert "0/5" not in visible and "2/5" in visible
    assert "eta -:--:--" in visible                      # one timed step only


def test_use_bar_modes(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert use_bar("auto", FakeTTY()) and not use_bar("auto", io.StringIO())
    assert use_bar("bar", io.StringIO()) and not use_bar("plain", FakeTTY())
    monkeypatch.setenv("TERM", "dumb")
    assert not use_bar("auto", FakeTTY())
    with pytest.raises(ValueError, match="metrics.progress must be"):
        use_bar("fancy", io.StringIO())


def test_formatting_helpers():
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(float("nan")) == "-:--:--" and format_duration(-1) == "-:--:--"
    assert format_status({"reward/mean": float("nan"), "buffer/fill": 1.0}) == \
        "reward nan | buf 100%"
    assert format_status({"unrelated": 1.0}) == ""
    assert plain_text("a\x1b]0;title\x07b\x1b[2Kc\r\n") == "abc \n"


def test_status_shows_non_zero_reward_failure_counts():
    counts = {"reward/errors/math_verify": 2.0, "reward/errors/math_format": 1.0,
              "reward/timeouts/math_verify": 0.0, "sampler/dropped_bad_reward_groups": 4.0,
              "batch/dropped_bad_reward_groups": 9.0}
    assert format_status({"reward/mean": 0.5, **counts}) == (
        "reward 0.500 | reward errors 3 | bad-reward groups dropped 4")
    assert format_status({"reward/errors/math_verify": 0.0}) == ""


def test_watcher_keeps_showing_counts_from_earlier_records(tmp_path):
    import json

    from rlflow import config as C
    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="demo", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=2),
                             metrics=C.MetricsConfig(progress="plain"))
    os.makedirs(cfg.run_path)
    with open(os.path.join(cfg.run_path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "learner/step_time_s": 1.0,
                            "reward/timeouts/slow": 5}) + "\n")
        f.write(json.dumps({"step": 2, "learner/step_time_s": 1.0}) + "\n")
    out = io.StringIO()
    watcher = RunWatcher(cfg, cfg.run_path, stream=out)
    watcher.progress.plain_every = 1
    watcher.poll()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(x.endswith("| reward timeouts 5") for x in lines), lines


def test_watcher_says_when_the_learner_declares_a_replica_lost(tmp_path):
    import json

    from rlflow import config as C
    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="demo", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=4),
                             runtime=C.RuntimeConfig(replica_timeout_s=7.0),
                             metrics=C.MetricsConfig(progress="plain"))
    os.makedirs(os.path.join(cfg.run_path, "logs"))
    with open(os.path.join(cfg.run_path, "logs", "sampler-1.log"), "w") as f:
        f.write("started\nwaiting for version 3\n")
    recs = [{"step": 1}, {"step": 2, "replica/1/lost": 1}, {"step": 3, "replica/1/lost": 1},
            {"step": 4, "replica/1/lost": 2, "replica/0/lost": 1, "sampler/replicas_lost": 3}]
    with open(os.path.join(cfg.run_path, "metrics.jsonl"), "w") as f:
        for r in recs:
            f.write(json.dumps({**r, "learner/step_time_s": 1.0}) + "\n")
    out = io.StringIO()
    watcher = RunWatcher(cfg, cfg.run_path, stream=out)
    watcher.progress.plain_every = 100
    watcher.poll()
    lost = [x for x in out.getvalue().splitlines() if "lost" in x]
    assert len(lost) == 3, lost          # step 2 (sampler-1), step 4 (sampler-0, sampler-1)
    assert "declared sampler-1 lost" in lost[0] and "replica_timeout_s=7 s" in lost[0]
    assert lost[0].endswith("the last line of its log: waiting for version 3")
    assert "declared sampler-0 lost" in lost[1] and "its log" not in lost[1]
    assert "declared sampler-1 lost" in lost[2]
    assert watcher.counts["sampler/replicas_lost"] == 3.0
    # a replica whose death the launcher printed already: counted, not told again
    out = io.StringIO()
    watcher = RunWatcher(cfg, cfg.run_path, stream=out)
    watcher.progress.plain_every = 100
    watcher.reported_dead.add("sampler-1")
    watcher.poll()
    lost = [x for x in out.getvalue().splitlines() if "lost" in x]
    assert len(lost) == 1 and "declared sampler-0 lost" in lost[0], lost


@pytest.mark.parametrize("kwargs", [dict(total_steps=0), dict(total_steps=5, start_step=6),
                                    dict(total_steps=5, plain_every=0),
                                    dict(total_steps=5, mode="quiet")])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        ProgressReporter(stream=io.StringIO(), **kwargs)


def test_summary_counts_the_held_out_evaluations_reward_failures(tmp_path):
    """Issue 49, fault 8: a reward timeout during a held-out evaluation (the replicas'
    ``eval/reward_timeouts/<fn>``) is counted in summary.json and on the counts line, apart
    from training's, and does not make the run unhealthy by itself."""
    import json

    from rlflow import config as C
    from rlflow.launcher.run_watch import RunWatcher
    from rlflow.run.summary import counts_line

    cfg = C.ExperimentConfig(name="demo", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=2),
                             metrics=C.MetricsConfig(progress="plain"))
    os.makedirs(cfg.run_path)
    with open(os.path.join(cfg.run_path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "learner/step_time_s": 1.0, "reward/mean": 0.5,
                            "sampler/groups_delivered": 4,
                            "eval/reward_timeouts/slow": 1, "eval/reward_errors/slow": 0}) + "\n")
        f.write(json.dumps({"step": 2, "learner/step_time_s": 1.0, "reward/mean": 0.5,
                            "sampler/groups_delivered": 8,
                            "eval/reward_timeouts/slow": 3, "eval/pass@1": 0.5}) + "\n")
    watcher = RunWatcher(cfg, cfg.run_path, stream=io.StringIO())
    watcher.poll()
    summary = watcher.summary(True)
    assert summary["counts"]["eval/reward_timeouts/slow"] == 3.0     # the newest value
    assert summary["counts"]["eval/reward_errors/slow"] == 0.0
    assert "eval/pass@1" not in summary["counts"]
    assert summary["healthy"], summary["unhealthy_reasons"]
    assert counts_line(summary["counts"]) == (
        "counts: 3 held-out evaluation reward timeouts in slow")
    assert counts_line({"eval/reward_errors/f": 1.0}) == (
        "counts: 1 held-out evaluation reward error in f")
