"""End to end: `rlflow train --learner.num-hosts 2` as real processes (2 learner hosts x 1
fake CPU device joined by jax.distributed on 127.0.0.1 with gloo, one sampler).

One scenario covers three acceptance lines of issue 13: kill -9 of learner host 1 mid-run
stops the run naming it; the rerun (same command) resumes from the last checkpoint and
finishes within the staleness bound; the sampler's weights, pulled from both learner hosts
inside the run, equal the learner's checkpointed parameters bitwise (sha256 digests,
``RLFLOW_WEIGHT_DIGESTS=1``). The sampler runs in bfloat16, so each host publishes its
shards of the float32 weights cast to bf16 (issue 41): the sampler's digest is that of the
checkpoint's parameters cast the same way.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from rlflow.run.folder import metrics_by_step, read_jsonl

pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HANG_GUARD_S = 600          # a run that takes longer than this is a hang (the test fails)
STEPS, EVERY, STALENESS = 6, 2, 2


def _cmd(run_dir):
    exe = shutil.which("rlflow", path=os.path.dirname(sys.executable))
    base = [exe] if exe else [sys.executable, "-m", "rlflow.console.cli"]
    return base + ["train", "--config", os.path.join(REPO, "configs", "demo.py"),
                   "--metrics.report", "False",
                   "--run_dir", str(run_dir), "--name", "hosts", "--metrics.progress", "plain",
                   "--buffer.timeout_s", "300", "--learner.num_steps", str(STEPS),
                   "--learner.num-hosts", "2", "--learner.num_devices", "2",
                   "--learner.mesh.fsdp", "2", "--checkpoint.every_steps", str(EVERY),
                   "--checkpoint.keep_last", "100", "--runtime.max_staleness", str(STALENESS),
                   "--sampler.dtype", "bfloat16"]


def _checkpoint_digest(run, step):
    """Digest of checkpoint ``step``'s parameters restored in this process (1 device), cast
    as the learner publishes them (``cfg.published_dtype``: bf16 for this bf16 sampler)."""
    import jax
    from flax import nnx

    from rlflow import checkpoint as ckpt_lib
    from rlflow.config import MeshConfig
    from rlflow.exchange.host_shards import weights_digest
    from rlflow.learner.publish import published_params
    from rlflow.mesh import make_mesh
    from rlflow.models.hf import build_model
    from rlflow.control.programs_common import load_config

    cfg = load_config(os.path.join(run, "config.json"))
    model, _ = build_model(cfg.model, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    target = ckpt_lib.abstract_target(nnx.state(model, nnx.Param))
    _, params, _ = ckpt_lib.restore_params(ckpt_lib.checkpoint_dir(run), step, target=target)
    assert cfg.published_dtype == "bfloat16" and cfg.model.param_dtype == "float32"
    return weights_digest(published_params(params, cfg.published_dtype))


def test_killed_learner_host_is_named_and_the_rerun_resumes_and_matches(tmp_path):
    env = dict(os.environ, RLFLOW_WEIGHT_DIGESTS="1")
    # the demo model folder: the session's (conftest's RLFLOW_CACHE_DIR, tests/e2e_runs.py)
    # the rerun compiles nothing (conftest's session-wide JAX_COMPILATION_CACHE_DIR)
    assert env.get("JAX_COMPILATION_CACHE_DIR"), "tests/conftest.py sets the session's XLA cache"
    run = str(tmp_path / "hosts")
    first = subprocess.Popen(_cmd(tmp_path), env=env, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not os.path.isdir(os.path.join(run, "checkpoints", str(EVERY))):
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint: the run hangs"
            time.sleep(0.1)
        pid = json.load(open(os.path.join(run, "processes.json")))["learner-1"]
        os.kill(pid, signal.SIGKILL)
        _, err = first.communicate(timeout=HANG_GUARD_S)      # stops: no hang
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 1, err[-3000:]
    assert f"the learner host 1 (pid {pid}) process died (killed by SIGKILL)" in err, err[-3000:]
    # host 0 left at once, not after the launcher's SIGKILL (its shutdown, or a checkpoint
    # barrier, would wait for host 1): by its failed collective (learner_hosts.run_learner),
    # or, waiting in a barrier, by the launcher's notice (learner_hosts.watch_for_lost_peer)
    log0 = open(os.path.join(run, "logs", "learner.log")).read()
    assert "a collective of the learner slice failed" in log0 or \
        "another host of the learner slice died" in log0, log0[-3000:]

    second = subprocess.run(_cmd(tmp_path), env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = int(re.search(r"resuming run hosts from step (\d+)", second.stdout).group(1))
    assert EVERY <= resumed < STEPS
    records, problems = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert not problems, problems
    by_step = metrics_by_step(records)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for step, m in by_step.items():
        assert m["learner/version"] == step
        assert m["staleness/max"] <= STALENESS, (step, m["staleness/max"])
        assert m["batch/broadcast_bytes"] > 0          # host 0 distributed the batch
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["resumed_from_step"] == resumed

    # The rerun's sampler (its own section of logs/sampler.log) logged the digest of every
    # version it pulled from the two learner hosts, starting with the resumed one.
    log = open(os.path.join(run, "logs", "sampler.log")).read()
    rerun = log.split("--- rlflow sampler start")[-1]
    pulled = {int(v): d for v, d in re.findall(r"weights version (\d+) digest ([0-9a-f]{64})",
                                                 rerun)}
    assert resumed in pulled, sorted(pulled)
    steps = sorted(int(n) for n in os.listdir(os.path.join(run, "checkpoints")) if n.isdigit())
    checked = [s for s in steps if s in pulled]
    assert resumed in checked and STEPS in steps
    for s in checked:
        assert pulled[s] == _checkpoint_digest(run, s), s
