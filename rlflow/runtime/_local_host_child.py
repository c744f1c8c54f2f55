"""One child of rlflow/runtime/local_hosts.py: ``python _local_host_child.py SPEC.pkl ID``.

XLA_FLAGS (fake device count) and JAX_PLATFORMS come from the parent's environment and are
read when jax is imported, below.
"""

import importlib
import os
import pickle
import sys


def main() -> None:
    spec = pickle.loads(open(sys.argv[1], "rb").read())
    pid = int(sys.argv[2])
    import jax

    from rlflow.learner import multihost
    if spec["distributed"]:
        multihost.initialize(multihost.DistributedConfig(
            coordinator_address=spec["coordinator"], num_processes=spec["num_processes"],
            process_id=pid, init_timeout_s=spec["init_timeout_s"],
            heartbeat_timeout_s=spec["heartbeat_timeout_s"]))
    else:
        multihost.use_gloo_collectives()
    assert jax.local_device_count() == spec["devices_per_process"], jax.local_devices()
    from rlflow.runtime.local_hosts import Context
    module, fn = spec["target"].split(":")
    ctx = Context(process_id=pid, num_processes=spec["num_processes"],
                  devices_per_process=spec["devices_per_process"], work_dir=spec["work_dir"],
                  args=spec["args"])
    result = getattr(importlib.import_module(module), fn)(ctx)
    path = os.path.join(spec["work_dir"], f"result_{pid}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    if spec["distributed"]:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
