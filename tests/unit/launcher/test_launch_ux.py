"""Launcher UX: a finished run is not re-run, a resume says so and counts only its own steps,
and a program that fails puts its exception line before its log tail (no JAX programs run:
the children here are small Python processes)."""

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from rlflow import config as C
from rlflow.launcher import child_logs, supervisor
from rlflow.control import programs_common as pc
from rlflow.run.summary import latest_checkpoint_step


def _cfg(tmp_path, num_steps, resume="auto"):
    return C.ExperimentConfig(name="demo", run_dir=str(tmp_path),
                              learner=C.LearnerConfig(num_steps=num_steps),
                              checkpoint=C.CheckpointConfig(resume=resume),
                              metrics=C.MetricsConfig(progress="plain"))


def _no_spawn(self, role, instance=0):
    raise AssertionError(f"the launcher started the {role}")


def test_latest_checkpoint_step_agrees_with_orbax(tmp_path):
    import jax.numpy as jnp

    from rlflow.checkpoint import Checkpointer, LearnerCheckpoint, checkpoint_dir

    assert latest_checkpoint_step(str(tmp_path)) is None          # no checkpoints folder
    with Checkpointer(checkpoint_dir(str(tmp_path)), async_save=False) as ckpt:
        for step in (1, 3):
            ckpt.save(LearnerCheckpoint(step=step, params={"w": jnp.zeros(2)}), force=True)
    ckdir = tmp_path / "checkpoints"
    (ckdir / "5.orbax-checkpoint-tmp-1700000000").mkdir()          # a save killed mid-write
    (ckdir / "7").write_text("not a checkpoint folder")
    expected = Checkpointer(checkpoint_dir(str(tmp_path)), read_only=True).latest_step()
    assert expected == 3
    assert latest_checkpoint_step(str(tmp_path)) == expected


def test_unusable_run_folder_is_a_clear_error_before_any_program(tmp_path, monkeypatch,
                                                                 capsys):
    """A file where the run folder goes: exit 2 naming the folder, no traceback, nothing
    started (a read-only mount takes the same path; not testable as root)."""
    (tmp_path / "demo").write_text("a file, not a folder")
    monkeypatch.setattr(supervisor.Supervisor, "start", _no_spawn)
    assert supervisor.run_train(_cfg(tmp_path, num_steps=3)) == 2
    err = capsys.readouterr().err
    assert f"rlflow train: cannot use the run folder {tmp_path / 'demo'}" in err
    assert "Traceback" not in err
    assert (tmp_path / "demo").read_text() == "a file, not a folder"


def test_a_second_launcher_on_a_run_folder_in_use_is_refused(tmp_path, monkeypatch, capsys):
    """Another process holds runs/demo (as a running rlflow train does): exit 2 naming its
    pid, nothing started or written; once it is killed (-9), the same call goes ahead."""
    from rlflow.run.run_lock import lock_path

    (tmp_path / "demo" / "checkpoints" / "3").mkdir(parents=True)       # a finished run
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from rlflow.run.run_lock import RunLock; "
         f"RunLock({str(tmp_path / 'demo')!r}).acquire(); print('held', flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(supervisor.Supervisor, "start", _no_spawn)
        assert supervisor.run_train(_cfg(tmp_path, num_steps=3)) == 2
        err = capsys.readouterr().err
        assert (f"rlflow train: run folder {tmp_path / 'demo'} is in use by another rlflow "
                f"train (pid {holder.pid}, lock {lock_path(str(tmp_path / 'demo'))})") in err
        assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == ["checkpoints"]
    finally:
        holder.kill()
        holder.wait()
    assert supervisor.run_train(_cfg(tmp_path, num_steps=3)) == 0       # the lock went with it
    assert "already complete" in capsys.readouterr().out


def test_finished_run_exits_at_once_without_touching_the_run(tmp_path, monkeypatch, capsys):
    run = tmp_path / "demo"
    (run / "checkpoints" / "300").mkdir(parents=True)
    (run / "summary.json").write_text('{"steps_completed": 300}')
    monkeypatch.setattr(supervisor.Supervisor, "start", _no_spawn)
    assert supervisor.run_train(_cfg(tmp_path, num_steps=300)) == 0
    assert capsys.readouterr().out.splitlines() == [
        "rlflow train: run demo is already complete (step 300 of 300); "
        "use a new --name, or --checkpoint.resume never --checkpoint.overwrite true to "
        "start over"]
    assert (run / "summary.json").read_text() == '{"steps_completed": 300}'
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "summary.json"]


def test_rerun_with_fewer_steps_than_the_checkpoint_says_so(tmp_path, monkeypatch, capsys):
    (tmp_path / "demo" / "checkpoints" / "80").mkdir(parents=True)
    monkeypatch.setattr(supervisor.Supervisor, "start", _no_spawn)
    assert supervisor.run_train(_cfg(tmp_path, num_steps=40)) == 0
    assert ("run demo is already complete (its checkpoint is at step 80, past "
            "--learner.num_steps 40)") in capsys.readouterr().out


def test_overwrite_without_resume_never_warns_that_it_resumes(tmp_path, monkeypatch, capsys):
    (tmp_path / "demo" / "checkpoints" / "2").mkdir(parents=True)
    monkeypatch.setattr(supervisor.Supervisor, "start", _no_spawn)
    cfg = C.replace(_cfg(tmp_path, num_steps=5),
                    checkpoint=C.CheckpointConfig(resume="auto", overwrite=True))
    with pytest.raises(AssertionError, match="started the learner"):
        supervisor.run_train(cfg)
    out = capsys.readouterr().out
    assert "resuming run demo from step 2" in out
    assert "--checkpoint.overwrite is ignored with --checkpoint.resume auto" in out


def test_rerun_of_a_run_stopped_after_its_final_checkpoint_marks_it_complete(tmp_path,
                                                                              monkeypatch,
                                                                              capsys):
    """The last invocation was stopped after its final checkpoint was committed, so its
    summary says success false and there is no report; the re-run finds the run complete,
    starts nothing, marks the summary successful and writes the report."""
    run = tmp_path / "demo"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "learner/step_time_s": 0.1, "reward/mean": s / 4}) + "\n"
        for s in (1, 2, 3)))
    (run / "summary.json").write_text(json.dumps(
        {"success": False, "steps_completed": 2, "reward_first": 0.25}))
    monkeypatch.setattr(supervisor.Supervisor, "start", _no_spawn)
    assert supervisor.run_train(_cfg(tmp_path, num_steps=3)) == 0
    out = capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary == {"success": True, "steps_completed": 3, "reward_first": 0.25}
    assert "marked successful" in out
    page = out.splitlines()[-1].removeprefix("rlflow train: report ")
    assert os.path.isfile(page) and os.path.dirname(page).startswith(str(run))
    assert supervisor.run_train(_cfg(tmp_path, num_steps=3)) == 0     # a second re-run: as is
    assert "marked successful" not in capsys.readouterr().out


def test_resume_never_with_overwrite_on_a_finished_run_does_start_the_programs(tmp_path,
                                                                               monkeypatch):
    (tmp_path / "demo" / "checkpoints" / "300").mkdir(parents=True)
    monkeypatch.setattr(supervisor.Supervisor, "start", _no_spawn)
    cfg = _cfg(tmp_path, num_steps=300, resume="never")
    cfg = C.replace(cfg, checkpoint=C.CheckpointConfig(resume="never", overwrite=True))
    with pytest.raises(AssertionError, match="started the learner"):
        supervisor.run_train(cfg)


LEARNER = """
import json, sys
with open(sys.argv[1], "a") as f:
    for step in (3, 4, 5):
        f.write(json.dumps({"step": step, "learner/step_time_s": 0.1,
                            "reward/mean": step / 4}) + "\\n")
"""


def test_resume_is_announced_and_summary_counts_this_invocation(tmp_path, monkeypatch, capsys):
    run = tmp_path / "demo"
    (run / "checkpoints" / "2").mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:      # steps 1 and 2 from the first invocation
        for step in (1, 2):
            f.write(json.dumps({"step": step, "learner/step_time_s": 0.1,
                                "reward/mean": (step - 1) / 4}) + "\n")

    def fake_start(self, role, instance=0):          # stand-in programs, no JAX
        code = LEARNER if role == "learner" else "pass"
        proc = subprocess.Popen([sys.executable, "-c", code, str(run / "metrics.jsonl")])
        proc.wait()                                  # the learner's steps land before polling
        self.children[role] = supervisor.Child(role, proc, str(run / f"{role}.log"))
        return self.children[role]

    monkeypatch.setattr(supervisor.Supervisor, "start", fake_start)
    monkeypatch.setattr("rlflow.run.report.make_report", lambda run_dir: "report.html")
    assert supervisor.run_train(_cfg(tmp_path, num_steps=5)) == 0
    out, err = capsys.readouterr()
    assert "rlflow train: resuming run demo from step 2 (of 5)" in out.splitlines()
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps_completed"], summary["resumed_from_step"],
            summary["steps_this_run"]) == (5, 2, 3)
    assert summary["reward_first"] == 0.0 and summary["reward_last"] == 1.25   # whole run
    line = next(x for x in err.splitlines() if "steps in" in x)
    assert line.startswith("rlflow train: 3 steps in ")
    assert "(resumed from step 2, now at step 5)" in line
    plain = [x.split()[1] for x in err.splitlines() if x.startswith("step ")]
    assert plain == ["3/5", "4/5", "5/5"]



@pytest.mark.parametrize("report", [True, False])
def test_the_report_is_written_at_the_end_unless_metrics_report_is_off(tmp_path, monkeypatch,
                                                                       capsys, report):
    run = tmp_path / "demo"
    run.mkdir()

    def fake_start(self, role, instance=0):          # stand-in programs, no JAX
        code = LEARNER if role == "learner" else "pass"
        proc = subprocess.Popen([sys.executable, "-c", code, str(run / "metrics.jsonl")])
        proc.wait()
        self.children[role] = supervisor.Child(role, proc, str(run / f"{role}.log"))
        return self.children[role]

    made = []
    monkeypatch.setattr(supervisor.Supervisor, "start", fake_start)
    monkeypatch.setattr("rlflow.run.report.make_report",
                        lambda run_dir: made.append(run_dir) or "report.html")
    cfg = C.replace(_cfg(tmp_path, num_steps=5, resume="never"),
                    metrics=C.MetricsConfig(progress="plain", report=report))
    assert supervisor.run_train(cfg) == 0
    err = capsys.readouterr().err
    assert made == ([str(run)] if report else [])
    assert ("rlflow train: report report.html" in err) == report
    assert (run / "summary.json").is_file()          # the summary is written either way


APPENDING_LEARNER = """
import json, sys
with open(sys.argv[1], "a") as f:          # appends without truncating (the launcher must)
    for step in ARGS:
        f.write(json.dumps({"step": step, "learner/step_time_s": 0.1,
                            "reward/mean": 10 + step}) + "\\n")
sys.exit(0 if ARGS else 1)                 # () = killed at start-up, before any step
"""


@pytest.mark.parametrize("new_steps", [(3, 4, 5), ()])
def test_records_after_the_resumed_checkpoint_are_discarded_before_the_programs_start(
        tmp_path, monkeypatch, capsys, new_steps):
    run = tmp_path / "demo"
    (run / "checkpoints" / "2").mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:      # 3 and 4 were written after checkpoint 2
        for step in (1, 2, 3, 4):
            f.write(json.dumps({"step": step, "learner/step_time_s": 0.1,
                                "reward/mean": step}) + "\n")
    (run / "samples.jsonl").write_text("".join(
        json.dumps({"step": s, "completion": "x"}) + "\n" for s in (2, 4)))
    code = APPENDING_LEARNER.replace("ARGS", repr(new_steps))

    def fake_start(self, role, instance=0):
        proc = subprocess.Popen([sys.executable, "-c", code if role == "learner" else "pass",
                                 str(run / "metrics.jsonl")])
        proc.wait()
        self.children[role] = supervisor.Child(role, proc, str(run / f"{role}.log"))
        return self.children[role]

    monkeypatch.setattr(supervisor.Supervisor, "start", fake_start)
    monkeypatch.setattr("rlflow.run.report.make_report", lambda run_dir: "report.html")
    supervisor.run_train(_cfg(tmp_path, num_steps=5))
    out, err = capsys.readouterr()
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == (
        [(1, 1), (2, 2)] + [(s, 10 + s) for s in new_steps])
    assert [json.loads(x)["step"] for x in (run / "samples.jsonl").read_text().splitlines()] \
        == [2]
    plain = [x.split()[1] for x in err.splitlines() if x.startswith("step ")]
    assert plain == [f"{s}/5" for s in new_steps]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps_completed"], summary["steps_this_run"]) == (
        2 + len(new_steps), len(new_steps))
    assert "metrics.jsonl: removed 2 record(s) of steps after 2" in out


FAILING_PROGRAM = """
import json, logging, sys
logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                    format="%(asctime)s [sampler] %(levelname)s %(name)s: %(message)s")
for i in range(5):
    logging.getLogger("rlflow.sampler").info("start-up %d", i)
def read():
    try:
        json.loads("{not json")
    except ValueError as e:
        raise ValueError("/data/bad.jsonl:7: malformed JSON (expected a JSON object)") from e
""" + "".join(f"def f{i}():\n    return f{i + 1}()\n" for i in range(20)) + """
def f20():
    return read()
f0()
"""


def _supervisor_with(tmp_path, code):
    log = tmp_path / "sampler.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=f,
                                stderr=subprocess.STDOUT)
        proc.wait()
    sup = supervisor.Supervisor(cfg=None, run_path=str(tmp_path), config_path="",
                            endpoints=pc.Endpoints("127.0.0.1:1", "127.0.0.1:2"))
    sup.children["sampler"] = supervisor.Child("sampler", proc, str(log))
    return sup, log


def test_failure_report_puts_the_exception_line_first_then_the_log_tail(tmp_path):
    sup, log = _supervisor_with(tmp_path, FAILING_PROGRAM)
    lines = sup.failure("sampler").splitlines()
    assert lines[0] == ("rlflow train: the sampler failed: ValueError: /data/bad.jsonl:7: "
                        "malformed JSON (expected a JSON object)")
    assert lines[1] == (f"rlflow train: the sampler process died (exit code 1); stopping the "
                        f"run. Last lines of {log}:")
    log_lines = log.read_text().splitlines()
    assert len(log_lines) > child_logs.LOG_TAIL_LINES      # a traceback longer than the tail
    assert lines[2:] == [f"  [sampler] {x}" for x in log_lines[-child_logs.LOG_TAIL_LINES:]]


BAD_RECORD_PROGRAM = """
from rlflow.data.sources import BadRecordError
def read():
    raise BadRecordError("/data/bad.jsonl:2: malformed JSON (set data.on_bad_record='skip')")
read()
"""


def test_failure_report_of_bad_input_is_its_message_without_the_traceback(tmp_path):
    sup, log = _supervisor_with(tmp_path, BAD_RECORD_PROGRAM)
    assert "Traceback" in log.read_text()
    report = sup.failure("sampler")
    assert report.splitlines() == [
        "rlflow train: the sampler failed: rlflow.data.sources.BadRecordError: "
        "/data/bad.jsonl:2: malformed JSON (set data.on_bad_record='skip')",
        f"rlflow train: the sampler stopped on bad input (exit code 1); stopping the run. "
        f"Its traceback is in {log}"]
    assert child_logs.is_input_error("rlflow.config.validation.ConfigError: learner.lr: ...")
    assert child_logs.is_input_error("rlflow.data.rewards.RewardFunctionError: reward ...")
    assert child_logs.is_input_error("rlflow.data.rewards.NonFiniteRewardError: reward ...")
    assert not child_logs.is_input_error("ValueError: /data/bad.jsonl:7: malformed JSON")
    assert not child_logs.is_input_error("rlflow.exchange.transfer.WeightTransferError: x")
    assert not child_logs.is_input_error("rlflow.no_such_module.Error: x")


RELAYED_PROGRAM = """
from rlflow.exchange.ring import ProducerError
raise ProducerError("producer failed: sampler-0: RewardFunctionError: reward function 'f' ...")
"""


def test_a_learner_stopped_by_a_samplers_reported_error_is_one_line(tmp_path):
    """The sampler's own report comes first; the learner's relay of it (``ProducerError``)
    adds one line with its log, not its traceback through the buffer."""
    log = tmp_path / "learner.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", RELAYED_PROGRAM], stdout=f,
                                stderr=subprocess.STDOUT)
        proc.wait()
    cfg = types.SimpleNamespace(learner=types.SimpleNamespace(num_hosts=1))
    sup = supervisor.Supervisor(cfg=cfg, run_path=str(tmp_path), config_path="",
                                endpoints=pc.Endpoints("127.0.0.1:1", "127.0.0.1:2"))
    sup.children["learner"] = supervisor.Child("learner", proc, str(log))
    assert "Traceback" in log.read_text()
    assert sup.failure("learner").splitlines() == [
        f"rlflow train: the learner stopped because a sampler failed (above; exit code 1); "
        f"its log is {log}"]


LEFT_SLICE_PROGRAM = """
import logging
from rlflow.launcher import learner_hosts
logging.basicConfig()
for i in range(60):
    print("step", i, "of the learner's own log")
learner_hosts._leave_slice("the launcher reports that another host of the learner slice died")
"""


def test_a_learner_host_that_left_after_another_died_is_one_line(tmp_path):
    """Learner host 0 leaves its slice when host 1 dies (a failed collective, or the
    launcher's signal): the report of host 1 comes first, host 0 adds one line with its
    log, not its log's tail (the same story a second time)."""
    log = tmp_path / "learner.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", LEFT_SLICE_PROGRAM], stdout=f,
                                stderr=subprocess.STDOUT)
        proc.wait()
    assert proc.returncode == 1
    cfg = types.SimpleNamespace(learner=types.SimpleNamespace(num_hosts=2))
    sup = supervisor.Supervisor(cfg=cfg, run_path=str(tmp_path), config_path="",
                                endpoints=pc.Endpoints("127.0.0.1:1", "127.0.0.1:2"))
    sup.children["learner"] = supervisor.Child("learner", proc, str(log))
    assert sup.failure("learner").splitlines() == [
        f"rlflow train: the learner host 0 (pid {proc.pid}) stopped because another learner "
        f"host died (above; exit code 1); its log is {log}"]


def test_failure_report_ignores_a_traceback_of_an_earlier_start(tmp_path):
    sup, log = _supervisor_with(tmp_path, "import os, signal; os.kill(os.getpid(), 9)")
    log.write_text("--- rlflow sampler start #0 ---\nTraceback (most recent call last):\n"
                   "OSError: old\n--- rlflow sampler start #1 ---\nstarting\n")
    assert "failed:" not in sup.failure("sampler")
    with open(log, "a") as f:
        f.write("Traceback (most recent call last):\nOSError: new\n")
    assert sup.failure("sampler").startswith("rlflow train: the sampler failed: OSError: new\n")


@pytest.mark.parametrize("code", ["import sys; sys.exit('rlflow: plain message')",
                                  "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
def test_failure_report_without_traceback_has_no_exception_line(tmp_path, code):
    sup, _ = _supervisor_with(tmp_path, code)
    report = sup.failure("sampler")
    assert report.startswith("rlflow train: the sampler process died (")
    assert "failed:" not in report


def test_last_exception_line_takes_the_outermost_of_chained_tracebacks():
    log = textwrap.dedent("""\
        2024-01-01 [learner] INFO rlflow.learner: step 1
        Traceback (most recent call last):
          File "a.py", line 1, in <module>
        KeyError: 'x'

        The above exception was the direct cause of the following exception:

        Traceback (most recent call last):
          File "b.py", line 2, in <module>
            raise RuntimeError("buffer closed")
            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
        RuntimeError: buffer closed
        more detail on a second line
        """).splitlines()
    assert child_logs.last_exception_line(log) == "RuntimeError: buffer closed"
    assert child_logs.last_exception_line(log[:1]) is None


def test_the_programs_fatal_line_wins_over_errors_logged_after_it(tmp_path):
    """A program that dies prints its error as a fatal line after the traceback; tracebacks
    printed later (threads torn down at interpreter exit) do not become the headline. The
    line comes from the real entry point (a config file that does not exist)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "rlflow.launcher.launch", "--role", "learner",
                           "--config", str(tmp_path / "missing.json")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[-1] == (f"rlflow fatal: FileNotFoundError: [Errno 2] No such file or "
                         f"directory: '{tmp_path / 'missing.json'}'")
    noise = ["Traceback (most recent call last):", '  File "threading.py", line 1',
             "ImportError: sys.meta_path is None, Python is likely shutting down"]
    marker = "--- rlflow learner start"
    log = tmp_path / "learner.log"
    log.write_text("\n".join([marker + " #0 ---"] + lines + noise) + "\n")
    assert child_logs.program_error(str(log), marker) == lines[-1][len("rlflow fatal: "):]
    log.write_text("\n".join([marker + " #0 ---"] + noise) + "\n")
    assert child_logs.program_error(str(log), marker) == noise[-1]   # no fatal line: as before
    err = ValueError("first line\nsecond")
    assert child_logs.fatal_line(err) == "rlflow fatal: ValueError: first line"
    from rlflow.checkpoint.state import DamagedCheckpointError
    assert child_logs.fatal_line(DamagedCheckpointError("x")) == (
        "rlflow fatal: rlflow.checkpoint.state.DamagedCheckpointError: x")


def test_a_log_tail_shows_the_fatal_line_only_where_it_adds_something():
    tb_end = "rlflow.control.replicas.NoReplicaError: no sampler replica for 10 s"
    lines = ["Traceback (most recent call last):", '  File "x.py", line 1', tb_end,
             "rlflow fatal: " + tb_end, "rlflow fatal: ValueError: other", "after"]
    assert child_logs.without_repeated_fatal(lines) == (
        lines[:3] + ["rlflow fatal: ValueError: other", "after"])
    assert child_logs.without_repeated_fatal(["rlflow fatal: X"]) == ["rlflow fatal: X"]


def test_program_error_finds_the_fatal_line_under_any_amount_of_later_noise(tmp_path):
    """The fatal line of the latest start is found however many lines follow it (orbax's
    failed reads logged ~70 lines each at exit); an earlier start's fatal line never counts."""
    log = tmp_path / "learner.log"
    noise = ["Traceback (most recent call last):", '  File "x.py", line 1',
             "RuntimeError: Event loop is closed"] * 400
    log.write_text("\n".join(
        ["--- rlflow learner start #0 ---", "rlflow fatal: ValueError: old start"]
        + ["--- rlflow learner start #0 ---", "Traceback (most recent call last):",
           '  File "y.py", line 2', "rlflow.x.DamagedCheckpointError: the real one",
           "rlflow fatal: rlflow.x.DamagedCheckpointError: the real one"] + noise) + "\n")
    assert len(noise) > child_logs.ERROR_SCAN_LINES
    marker = "--- rlflow learner start"
    assert (child_logs.program_error(str(log), marker)
            == "rlflow.x.DamagedCheckpointError: the real one")
    log.write_text("--- rlflow learner start #0 ---\nrlflow fatal: ValueError: old start\n"
                   "--- rlflow learner start #1 ---\n" + "\n".join(noise[:3]) + "\n")
    assert child_logs.program_error(str(log), marker) == "RuntimeError: Event loop is closed"
    assert child_logs.program_error(str(tmp_path / "missing.log"), marker) is None


class _SharedTTY:
    """stdout and stderr of a terminal: one screen, both TTYs."""

    def __init__(self):
        import io

        self.buf = io.StringIO()

    def write(self, text):
        return self.buf.write(text)

    def flush(self):
        pass

    def isatty(self):
        return True


def test_on_a_tty_the_run_folder_line_comes_before_the_bar_and_no_0_of_n_frame(
        tmp_path, monkeypatch):
    from rlflow.launcher.progress import plain_text

    run = tmp_path / "demo"
    run.mkdir()

    def fake_start(self, role, instance=0):
        code = LEARNER.replace("(3, 4, 5)", "(1, 2, 3, 4, 5)") if role == "learner" else "pass"
        proc = subprocess.Popen([sys.executable, "-c", code, str(run / "metrics.jsonl")])
        proc.wait()
        self.children[role] = supervisor.Child(role, proc, str(run / f"{role}.log"))
        return self.children[role]

    screen = _SharedTTY()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setattr(supervisor.Supervisor, "start", fake_start)
    monkeypatch.setattr("rlflow.run.report.make_report", lambda run_dir: "report.html")
    cfg = C.replace(_cfg(tmp_path, num_steps=5), metrics=C.MetricsConfig(progress="bar"))
    assert supervisor.run_train(cfg) == 0
    text = screen.buf.getvalue()
    line = f"rlflow train: run folder {run} (logs in {run}/logs)\n"
    assert line in text and "\x1b" in text
    assert text.index(line) < text.index("\x1b")     # printed before the live display began
    visible = plain_text(text)
    assert "5/5" in visible and "0/5" not in visible  # no start-up frame left behind
