"""The end-to-end runs many tests assert on, each started once per session (tests/conftest.py
exposes them as session fixtures): separate ``rlflow train`` processes stay only for the
tests that inject faults or need a run of their own.

``sync_run``: the demo config in sync mode (k = 0) for ``SYNC_STEPS`` steps, the learner on 2
fake devices (fsdp=2) and the sampler on 1 with weights through jax.experimental.transfer
gathered on one device, a sampler that frees its KV cache whenever it waits
(``runtime.sampler_sleep``), its slots in two decode lanes; default host-memory settings;
every sample of every step logged; the held-out "next digit" prompts (``write_held_out``)
evaluated every ``EVAL_EVERY`` steps (tests/e2e/test_runtime_e2e.py and
tests/e2e/test_eval_e2e.py assert on it).
"""

from __future__ import annotations

import os
import shutil
import json
import subprocess
import sys

from repo_paths import REPO

HANG_GUARD_S = 300          # a run that takes longer than this is a hang (the test fails)
# the shared sync run does what two runs did (train and evaluate), and as a session's first
# run it builds the demo model folder and compiles with a cold cache: on a loaded 2-core
# machine it took over 300 s of wall time (a complete, successful run)
SHARED_RUN_GUARD_S = 2 * HANG_GUARD_S
SYNC_STEPS = 4
DEMO_GROUPS, DEMO_GROUP_SIZE = 8, 8       # configs/demo.py: groups per step, samples per group
EVAL_EVERY, HELD_OUT = 2, 10              # an evaluation every 2 steps of 10 held-out prompts
SYNC_FLAGS = ("--learner.num_steps", str(SYNC_STEPS),
              "--runtime.mode", "sync", "--runtime.max_staleness", "0",
              "--runtime.sampler_sleep", "True", "--learner.num_devices", "2",
              "--learner.mesh.fsdp", "2", "--runtime.transfer_layout", "single_device",
              "--sampler.decode_lanes", "2")


def eval_flags(held_out_path) -> tuple[str, ...]:
    """Every sample of every step logged; ``held_out_path`` evaluated every ``EVAL_EVERY``
    steps, all its prompts, all of them logged to eval_samples.jsonl."""
    return ("--metrics.samples-every", "1",
            "--metrics.num-samples", str(DEMO_GROUPS * DEMO_GROUP_SIZE),
            "--eval.every-steps", str(EVAL_EVERY), "--eval.source", "jsonl",
            "--eval.path", str(held_out_path), "--eval.num-prompts", "0",
            "--eval.num-logged-samples", str(HELD_OUT))


def write_held_out(path) -> str:
    """``HELD_OUT`` two-digit "next digit" prompts ("37>", answer "8") as JSONL at ``path``:
    the demo's training prompts have one digit, so a held-out prompt in a learner batch shows
    in samples.jsonl. Returns ``str(path)``."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(HELD_OUT):
            tens, d = (3 * i + 1) % 10, i % 10
            f.write(json.dumps({"question": f"{tens}{d}>", "answer": str((d + 1) % 10)}) + "\n")
    return str(path)


def rlflow_argv() -> list[str]:
    """The console script beside this interpreter, else ``python -m rlflow.console.cli``."""
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]


def demo_train_cmd(run_dir, name, *overrides, config: str = "demo.py") -> list[str]:
    """``rlflow train`` on configs/demo.py (or ``configs/<config>``, e.g. the multi-turn demo
    ``multiturn_demo.py``, whose model folder is built beside the demo's) into
    ``run_dir/name``, plain progress lines, no periodic checkpoints, no report at the end
    (``metrics.report``: about 4 CPU s of plots a run; tests/e2e/test_run_outputs_e2e.py
    writes one with ``rlflow report``), a 120 s buffer timeout; ``overrides`` are further
    flags."""
    return rlflow_argv() + ["train", "--config", os.path.join(REPO, "configs", config),
                            "--run_dir", str(run_dir), "--name", name,
                            "--metrics.progress", "plain", "--metrics.report", "False",
                            "--buffer.timeout_s", "120",
                            "--checkpoint.every_steps", "0", *overrides]


def demo_env(cache_dir=None) -> dict:
    """This process's environment; the demo model folder in ``cache_dir``, by default in
    conftest's session-wide ``RLFLOW_CACHE_DIR`` (built once, by the first run: configs/demo.py
    writes it into a temporary sibling and renames it, so runs only read it; building it cost
    about 5 CPU s a run). Compiled programs are shared through conftest's session-wide
    JAX_COMPILATION_CACHE_DIR."""
    env = dict(os.environ)
    if cache_dir is not None:
        env["RLFLOW_CACHE_DIR"] = str(cache_dir)
    assert env.get("RLFLOW_CACHE_DIR"), "tests/conftest.py sets the session's cache folder"
    assert env.get("JAX_COMPILATION_CACHE_DIR"), "tests/conftest.py sets the session's XLA cache"
    return env


def start_sync_run(root) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``sync_run`` (module docstring) under ``root``: ``(completed process, run folder)``."""
    held = write_held_out(root / "held_out.jsonl")
    cmd = demo_train_cmd(root / "runs", "sync", *SYNC_FLAGS, *eval_flags(held))
    proc = subprocess.run(cmd, env=demo_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=SHARED_RUN_GUARD_S)
    return proc, str(root / "runs" / "sync")
