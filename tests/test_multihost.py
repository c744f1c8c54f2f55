"""A learner over several hosts (real processes, jax.distributed on 127.0.0.1, gloo)."""

import numpy as np
import pytest

from rlflow.learner import multihost
from multiproc import free_port, run_processes
import mp_jobs

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
def two_hosts(tmp_path_factory):
    """2 processes x 2 fake devices: 3 train steps (one run shared by the tests below)."""
    work = tmp_path_factory.mktemp("two_hosts")
    return run_processes("mp_jobs:train_multihost", num_processes=2, devices_per_process=2,
                         work_dir=work, timeout_s=900)


@pytest.mark.slow
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
    for r in two_hosts:
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
    info = two_hosts[0]["infos"][0]
    rows, seq = 2 * mp_jobs.G, 16
    assert info["batch/broadcast_bytes"] == 8 * rows * seq * 4
    # each host keeps its half of the rows: 3 int32 + 3 float32 fields (4 B) + 2 bool (1 B)
    assert info["batch/local_bytes"] == rows // 2 * seq * (6 * 4 + 2 * 1)
