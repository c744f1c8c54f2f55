"""A learner over several hosts (real processes, jax.distributed on 127.0.0.1, gloo)."""

import os

import numpy as np
import pytest

from rlflow.learner import multihost
from rlflow.system.ports import free_port
import mp_jobs
from mp_jobs import SHARED_RUN_TIMEOUT_S

TESTS = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EPS32 = np.finfo(np.float32).eps


def test_unreachable_coordinator_is_a_named_error_within_the_timeout():
    """Host 1 pointed at a port nobody listens on: CoordinatorUnreachable naming the host and
    the address after the timeout (jax.distributed alone would abort the process)."""
    port = free_port()
    cfg = multihost.DistributedConfig(f"127.0.0.1:{port}", num_processes=2, process_id=1,
                                      init_timeout_s=1.5)
    with pytest.raises(multihost.CoordinatorUnreachable,
                       match=rf"learner host 1: coordinator 127.0.0.1:{port} .* within 1.5 s"):
        multihost.initialize(cfg)


def test_distributed_config_names_bad_fields():
    with pytest.raises(ValueError, match="coordinator_address"):
        multihost.DistributedConfig("nohost", 2, 0)
    with pytest.raises(ValueError, match="process_id"):
        multihost.DistributedConfig("127.0.0.1:1234", 2, 2)


@pytest.fixture(scope="module")
def two_hosts(two_learner_hosts):
    """tests/conftest.py's one 2-host run (shared with tests/e2e/test_host_shards.py)."""
    return two_learner_hosts


@pytest.mark.slow
@pytest.mark.timeout(SHARED_RUN_TIMEOUT_S)   # the first test pays the shared 2-host run
def test_two_hosts_train_like_one_host(two_hosts):
    """Sync steps on 2 hosts x 2 devices vs 1 host x 4 devices (this process), same mesh
    fsdp=2 x tensor=2, same records: equal metrics and parameters after 3 steps.

    Tolerance: the two programs run the same partitioned HLO; a cross-device sum of two
    operands is exact in any order (a + b = b + a), but the global gradient norm sums 4 shards
    and the collectives (gloo vs in-process) may order them differently: relative error
    <= 3 eps in the clip scale, so <= 2 * 3 eps in each Adam update (|update| <= ~2 lr while
    t <= 3), plus one ulp of the parameter when p + update rounds differently. Over 3 steps:
    |dp| <= 3 * eps * (|p| + 12 lr).
    """
    from rlflow.learner.trainer import Learner
    from learner_fixtures import flat

    cfg = mp_jobs.experiment()
    ref = Learner(cfg)                                   # 1 process x 4 devices
    init = flat(ref.params)
    want_metrics = [ref.train_on(mp_jobs.step_records(s)) for s in range(mp_jobs.STEPS)]
    want = flat(ref.params)
    for r in two_hosts["results"]:
        assert r["process_count"] == 2 and r["version"] == ref.version == mp_jobs.STEPS
        for m, w in zip(r["metrics"], want_metrics):
            for key in ("learner/loss", "learner/grad_norm", "policy/kl"):
                # token sums of B x L = 128 terms: relative error <= 128 eps
                np.testing.assert_allclose(m[key], w[key], rtol=128 * EPS32, err_msg=key)
        for k in want:
            tol = mp_jobs.STEPS * EPS32 * (np.abs(want[k]) + 12 * mp_jobs.LR)
            err = np.abs(r["params"][k] - want[k])
            assert (err <= tol).all(), (k, float(err.max()))
            moved = np.abs(want[k] - init[k]).max()
            assert moved > 100 * tol.max(), (k, moved)       # the check has resolution
    info = two_hosts["results"][0]["infos"][0]
    rows, seq = int(info["batch/rows"]), int(info["batch/seq"])
    # packed rows (learner.packing is on, each group's prompt once): at most one row per
    # sample of 2 groups, no longer than twice the unpacked bucket of 16 (room for a group,
    # ExperimentConfig.pack_length), and a whole number of rows per host
    assert 1 <= rows <= 2 * mp_jobs.G and 1 <= seq <= 2 * 16 and rows % 2 == 0
    # the broadcast buffer is the 12 TrainBatch fields (with the rollout correction's group
    # ids and policy lags) as int32 [12, B, L]
    assert info["batch/broadcast_bytes"] == 12 * rows * seq * 4
    # each host keeps its half of the rows: 7 int32 (incl. segment and prefix ids, group ids
    # and policy lags) + 3 float32 fields (4 B) + 2 bool (1 B)
    assert info["batch/local_bytes"] == rows // 2 * seq * (10 * 4 + 2 * 1)


def logit_tol(logits):
    """Same parameters on another mesh: only the order of the dot-product sums changes. Each
    logit goes through 2 layers of contractions of length <= 64 (MLP width): relative error
    <= 2 * 64 eps of the logits' scale."""
    return 2 * 64 * EPS32 * max(1.0, float(np.abs(logits).max()))


@pytest.mark.slow
@pytest.mark.timeout(SHARED_RUN_TIMEOUT_S)   # the first test pays the shared 2-host run
def test_checkpoint_of_two_hosts_restores_on_one_host_and_back(two_hosts):
    """A checkpoint written by 2 hosts x 2 devices (fsdp=2 x tensor=2) restores on 1 host x 2
    devices (fsdp=2) with equal logits and step; one written there restores on the 2 hosts."""
    from rlflow.checkpoint import Checkpointer

    r0, r1 = two_hosts["results"]
    one = two_hosts["one"]                   # 1 host x 2 devices, after its one step
    before = two_hosts["one_logits"]
    with Checkpointer(two_hosts["ckpt_2h"], read_only=True) as ck:
        assert ck.all_steps() == [mp_jobs.STEPS]
        restored = one.resume(ck)
    assert restored.step == one.version == mp_jobs.STEPS
    got = mp_jobs.logits(one)
    assert np.abs(got - before).max() > 100 * logit_tol(got)      # restore changed something
    np.testing.assert_allclose(got, r0["logits"], rtol=0, atol=logit_tol(got))
    np.testing.assert_allclose(r0["logits"], r1["logits"], rtol=0, atol=0)   # replicated
    # and back: written by 1 host x 2 devices after 1 step, restored on 2 hosts x 2 devices
    for r in (r0, r1):
        assert r["restored_step"] == r["restored_version"] == 1
        np.testing.assert_allclose(r["restored_logits"], two_hosts["one_logits"], rtol=0,
                                   atol=logit_tol(r["restored_logits"]))
    assert np.abs(r0["restored_logits"] - r0["logits"]).max() > 100 * logit_tol(got)


@pytest.mark.slow
def test_a_killed_learner_host_stops_the_others_naming_it(tmp_path):
    """kill -9 of learner host 1 while both run collectives: host 0 does not hang; it exits
    by itself (not killed by the harness) within the heartbeat timeout, and its log names
    task 1."""
    import signal
    import time

    from rlflow.launcher.local_hosts import start_processes, wait_processes

    procs = start_processes("mp_jobs:collectives_until_killed", num_processes=2,
                            devices_per_process=1, work_dir=tmp_path, extra_paths=[TESTS],
                            heartbeat_timeout_s=10)
    try:
        deadline = time.monotonic() + 600
        while not all((tmp_path / f"ready_{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.poll() for p in procs]
            time.sleep(0.5)
        os.killpg(procs[1].pid, signal.SIGKILL)
    finally:
        codes = wait_processes(procs, tmp_path, timeout_s=400, grace_s=400, expect_failure=True)
    assert codes[1] == -signal.SIGKILL
    assert codes[0] not in (0, -signal.SIGKILL), codes     # -9 would mean the harness killed it
    log = (tmp_path / "log_0.txt").read_text(errors="replace")
    assert "Task 1 heartbeat timeout" in log, log[-2000:]
