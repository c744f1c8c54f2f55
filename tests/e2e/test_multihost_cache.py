"""Programs that span CPU learner hosts (rlflow/learner/multihost.py): with jax 0.12.1 a
cross-process (gloo) program hangs in its first collective when it was loaded from the
persistent compilation cache (no_cached_executables_across_processes: a CPU host turns the cache
off after joining), or when the hosts lowered it from different call sites, the Python call
stack being part of the program (same_program_on_every_host: locations without frames)."""

import os

import pytest

from rlflow.launcher.local_hosts import run_processes

TESTS = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@pytest.mark.slow
def test_a_program_compiled_twice_with_a_persistent_cache_runs_on_two_hosts(tmp_path):
    """2 processes x 2 CPU devices, a cache folder given: the sharded sum jitted twice (the
    second compile would be a cache hit) gives 140 both times on both hosts, and the hosts
    run with the cache off; then host 0 sends two commands that host 1 receives. Before the
    fixes the second sum, and the first command, hung (the group then times out)."""
    results = run_processes("mp_jobs:sharded_sum_twice", num_processes=2, devices_per_process=2,
                            work_dir=tmp_path / "procs", extra_paths=[TESTS], timeout_s=600,
                            env={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla-cache"),
                                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    assert [r["outs"] for r in results] == [[140.0, 140.0]] * 2
    assert [r["cache"] for r in results] == [False, False]
    # host 0 sends, host 1 receives (two call sites of one cross-host program): both hosts
    # see the same commands and addresses, and lowered the programs without call stacks
    assert [r["commands"] for r in results] == [[[2, 7], [1, 0]]] * 2
    assert [r["addresses"] for r in results] == [["", "host1:1001"]] * 2
    assert [r["locations"] for r in results] == [0, 0]
