"""One child of rlflow/launcher/local_hosts.py: ``python _local_host_child.py JOB.json ID``.

Reads the job (:class:`rlflow.launcher.local_host_files.Job`), runs its ``fn(ctx)`` and
writes the result as ``result_<ID>.json`` + ``.npz`` (no pickle). XLA_FLAGS (fake device
count) and JAX_PLATFORMS come from the parent's environment and are read when jax is
imported, below.
"""

import importlib
import sys


def main() -> None:
    from rlflow.launcher.local_host_files import read_job, result_path, write_value

    job = read_job(sys.argv[1])
    pid = int(sys.argv[2])
    import jax

    from rlflow.learner import multihost
    if job.distributed:
        multihost.initialize(multihost.DistributedConfig(
            coordinator_address=job.coordinator, num_processes=job.num_processes,
            process_id=pid, init_timeout_s=job.init_timeout_s,
            heartbeat_timeout_s=job.heartbeat_timeout_s))
    else:
        multihost.use_gloo_collectives()
    assert jax.local_device_count() == job.devices_per_process, jax.local_devices()
    from rlflow.launcher.local_hosts import Context
    module, fn = job.target.split(":")
    ctx = Context(process_id=pid, num_processes=job.num_processes,
                  devices_per_process=job.devices_per_process, work_dir=job.work_dir,
                  args=job.args)
    result = getattr(importlib.import_module(module), fn)(ctx)
    write_value(result_path(job.work_dir, pid), result, what=f"result of process {pid}")
    if job.distributed:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
