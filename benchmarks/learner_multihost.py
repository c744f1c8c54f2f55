"""Multi-host learner on CPU: train-step time of 2 hosts x 1 device over 1 host x 2 devices
(the same mesh, fsdp=2), and the per-step batch distribution against the step.

Both sides are real processes started by :mod:`rlflow.launcher.local_hosts` (the 2-host side
joined by ``jax.distributed`` on 127.0.0.1 with gloo collectives); both run
:func:`rlflow.learner.multihost.train_step`'s pieces: host 0 builds the batch,
``distribute_batch`` broadcasts it and each host keeps its rows, then the compiled step. On
the 1-host side the broadcast has no peer. Times are the best of ``repeats`` steps, the
slowest host's.

Figures (``RESULT`` lines): learner_multihost_step_vs_one_host (2 hosts x 1 device step time /
1 host x 2 devices step time), learner_multihost_distribute_vs_step (batch distribution time /
step time, 2 hosts), learner_multihost_batch_mb (MB broadcast per step) and
learner_multihost_batch_vs_params (batch bytes / parameter bytes).

Sizes from environment variables (defaults in brackets): MH_BENCH_HIDDEN [256],
MH_BENCH_LAYERS [4], MH_BENCH_VOCAB [4096], MH_BENCH_GROUPS [4], MH_BENCH_GROUP_SIZE [4],
MH_BENCH_SEQ [128], MH_BENCH_REPEATS [3].
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def env(name, default):
    return int(os.environ.get(f"MH_BENCH_{name}", default))


def experiment():
    from rlflow.config import (ExperimentConfig, LearnerConfig, MeshConfig, ModelConfig,
                               SamplerConfig)
    h = env("HIDDEN", 256)
    model = ModelConfig(vocab_size=env("VOCAB", 4096), hidden_size=h, intermediate_size=3 * h,
                        num_layers=env("LAYERS", 4), num_heads=4, num_kv_heads=2,
                        head_dim=h // 4)
    seq = env("SEQ", 128)
    return ExperimentConfig(
        model=model,
        sampler=SamplerConfig(group_size=env("GROUP_SIZE", 4), max_tokens=seq - 16,
                              max_prefill_length=16, prefill_buckets=(16,)),
        learner=LearnerConfig(groups_per_step=env("GROUPS", 4), seq_buckets=(seq,), lr=1e-5,
                              num_devices=2, mesh=MeshConfig(fsdp=2)))


def records(cfg, seed=0):
    """Rollout group records (docs/interfaces.md) with random tokens of full length."""
    import numpy as np

    rng = np.random.default_rng(seed)
    g, t, v = cfg.sampler.group_size, cfg.sampler.max_tokens, cfg.model.vocab_size
    out = []
    for i in range(cfg.learner.groups_per_step):
        out.append(dict(prompt_id=np.int64(i),
                        prompt_tokens=rng.integers(1, v, size=16).astype(np.int32),
                        completion_tokens=rng.integers(1, v, size=(g, t)).astype(np.int32),
                        completion_lengths=np.full(g, t, np.int32),
                        behaviour_logprobs=np.full((g, t), -np.log(v), np.float32),
                        policy_versions=np.zeros((g, t), np.int32),
                        rewards=rng.normal(size=g).astype(np.float32),
                        truncated=np.zeros(g, bool)))
    return out


def bench_job(ctx):
    """In every process: best step time and best distribution time over the repeats."""
    import time

    import jax

    from rlflow.learner import multihost
    from rlflow.learner.trainer import Learner

    cfg = experiment()
    learner = Learner(cfg, mesh=multihost.global_mesh(cfg.learner.mesh))
    recs = records(cfg)
    steps, dists, info = [], [], {}
    for r in range(1 + env("REPEATS", 3)):                 # the first one compiles
        batch = learner.build_batch(recs)[0] if jax.process_index() == 0 else None
        t0 = time.perf_counter()
        dev, info = multihost.distribute_batch(
            batch, learner.mesh, check=learner.check_batch)
        jax.block_until_ready(dev)
        t1 = time.perf_counter()
        learner.step_on_device(dev)                       # metrics pulled: the step is done
        jax.block_until_ready(learner.state)
        t2 = time.perf_counter()
        if r:
            dists.append(t1 - t0)
            steps.append(t2 - t1)
    n_params = sum(x.size for x in jax.tree.leaves(learner.params))
    return dict(step=min(steps), dist=min(dists), batch_bytes=info["batch/broadcast_bytes"],
                param_bytes=4 * n_params)


def main():
    from rlflow.launcher.local_hosts import run_processes

    with tempfile.TemporaryDirectory() as tmp:
        one = run_processes("learner_multihost:bench_job", num_processes=1,
                            devices_per_process=2, work_dir=os.path.join(tmp, "one"),
                            extra_paths=[HERE], timeout_s=1500)
        two = run_processes("learner_multihost:bench_job", num_processes=2,
                            devices_per_process=1, work_dir=os.path.join(tmp, "two"),
                            extra_paths=[HERE], timeout_s=1500)
    step1 = max(r["step"] for r in one)
    step2 = max(r["step"] for r in two)
    dist2 = max(r["dist"] for r in two)
    b = two[0]["batch_bytes"]
    print(f"RESULT learner_multihost_step_vs_one_host {step2 / step1:.3g} x "
          f"2 hosts x 1 device {step2 * 1e3:.1f} ms, 1 host x 2 devices {step1 * 1e3:.1f} ms")
    print(f"RESULT learner_multihost_distribute_vs_step {dist2 / step2:.3g} x "
          f"distribution {dist2 * 1e3:.2f} ms per step (1 host: "
          f"{max(r['dist'] for r in one) * 1e3:.2f} ms)")
    print(f"RESULT learner_multihost_batch_mb {b / 1e6:.3g} MB broadcast per step")
    print(f"RESULT learner_multihost_batch_vs_params {b / two[0]['param_bytes']:.3g} x "
          f"batch bytes / float32 parameter bytes ({two[0]['param_bytes'] / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
