"""Start-up phases told on the console (issue 49, fault 9): a SmolLM2 run showed no status
line for 5.5 minutes, ``rlflow eval`` nothing for 2; and every ``rlflow`` command printed
transformers' "PyTorch was not found" advisory.

The phase lines of a real ``rlflow train`` run are checked in tests/test_run_outputs_e2e.py,
those of ``rlflow eval`` in tests/test_eval_offline.py; here the pieces, on log lines written
with the programs' own log format.
"""

import io
import json
import logging
import os
import subprocess
import sys

from rlflow.run.phases import PHASE_LOGGER, PhaseTail, parse_phase, report_phase

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

# torch made absent for a child interpreter: not found by the import system, as if it were
# not installed
NO_TORCH = '''
import importlib.machinery
import sys


class _PathFinderWithoutTorch(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None                       # not found, as if not installed
        return super().find_spec(name, path, target)


sys.meta_path[:] = [_PathFinderWithoutTorch if f is importlib.machinery.PathFinder else f
                    for f in sys.meta_path]
'''


def no_torch_env(folder):
    """An environment whose Python cannot import torch (a ``sitecustomize`` in ``folder``)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(NO_TORCH)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), REPO, env.get("PYTHONPATH", "")])
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    return env


def _program_log(path, role):
    """A handler writing as a program does (rlflow.control.programs_common.setup_logging)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [{role}] %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(PHASE_LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def test_phase_lines_are_read_from_the_logs_written_after_the_tail_starts(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "learner.log").write_text("old line\n")
    handler = _program_log(logs / "learner.log", "learner")
    try:
        report_phase("loading the model (an earlier run)")
        tail = PhaseTail(str(logs))            # made after that line: not shown
        assert tail.new_phases() == []
        report_phase("loading the model (m)")
        logging.getLogger("rlflow.learner").info("not a phase")
        report_phase("compiling the train step")
    finally:
        logging.getLogger(PHASE_LOGGER).removeHandler(handler)
        handler.close()
    assert tail.new_phases() == [("learner", "loading the model (m)"),
                                 ("learner", "compiling the train step")]
    assert tail.new_phases() == []               # each once
    # a log made after the tail (a sampler started later) is read from its start; a partial
    # last line waits for its end
    (logs / "sampler-0.log").write_text(
        "2026-12-07 10:00:00,000 [sampler-0] INFO rlflow.phase: waiting for weights\n"
        "2026-12-07 10:00:01,000 [sampler-0] INFO rlflow.phase: compil")
    assert tail.new_phases() == [("sampler-0", "waiting for weights")]
    with open(logs / "sampler-0.log", "a") as f:
        f.write("ing\n")
    assert tail.new_phases() == [("sampler-0", "compiling")]
    assert parse_phase("x [learner] WARNING rlflow.phase: y") is None


def test_the_watcher_prints_phases_until_the_first_step(tmp_path):
    from rlflow import config as C
    from rlflow.launcher.run_watch import RunWatcher

    cfg = C.ExperimentConfig(name="demo", run_dir=str(tmp_path),
                             learner=C.LearnerConfig(num_steps=2),
                             metrics=C.MetricsConfig(progress="plain"))
    logs = os.path.join(cfg.run_path, "logs")
    os.makedirs(logs)
    out = io.StringIO()
    watcher = RunWatcher(cfg, cfg.run_path, stream=out)
    line = "2026-12-07 10:00:00,000 [{}] INFO rlflow.phase: {}\n"
    with open(os.path.join(logs, "learner.log"), "w") as f:
        f.write(line.format("learner", "loading the model (x)"))
    with open(os.path.join(logs, "sampler-0.log"), "w") as f:
        f.write(line.format("sampler-0", "waiting for the learner's first weights"))
    watcher.poll()
    assert out.getvalue().splitlines() == [
        "rlflow train: [learner] loading the model (x)",
        "rlflow train: [sampler-0] waiting for the learner's first weights"]
    with open(os.path.join(cfg.run_path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "learner/step_time_s": 1.0}) + "\n")
    watcher.poll()
    with open(os.path.join(logs, "learner.log"), "a") as f:
        f.write(line.format("learner", "a phase after step 1"))
    watcher.poll()
    assert "a phase after step 1" not in out.getvalue()


def test_the_cli_silences_transformers_torch_advisory(tmp_path):
    """Without torch, importing transformers prints "[transformers] PyTorch was not found";
    the rlflow console script's module sets what silences it before anything imports
    transformers (a real `rlflow train` without torch: tests/test_run_outputs_e2e.py)."""
    env = no_torch_env(tmp_path / "site")
    probe = ("{}\n"
             "import transformers\n"
             "from transformers import PreTrainedTokenizerFast\n"
             "print('imported', transformers.__version__)\n")
    bare = subprocess.run([sys.executable, "-c", probe.format("")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert bare.returncode == 0, bare.stderr
    # the check can fail: without rlflow's CLI the advisory is printed
    assert "PyTorch was not found" in bare.stderr, bare.stderr
    cli = subprocess.run([sys.executable, "-c", probe.format("import rlflow.console.cli")],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert "PyTorch was not found" not in cli.stderr, cli.stderr
