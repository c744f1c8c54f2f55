"""Timing helper shared by the benchmarks (not a benchmark itself: bench.sh runs only
files without a leading underscore)."""

import time


def best_of(fn, repeats: int) -> float:
    """Shortest wall time of ``repeats`` calls of ``fn()``, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run_like_rlflow_train() -> str:
    """Re-execute this benchmark with the malloc settings ``rlflow train`` starts its
    learner with (``rlflow.system.host_memory``; glibc reads them only at process start),
    unless they are in place or ``BENCH_SYSTEM_MALLOC=1``. The baseline measured in the same
    process gets them too. Call it before importing jax, with the repository on
    ``sys.path``. Returns a note for the results."""
    import os
    import sys

    from rlflow.system import host_memory

    if os.environ.get("BENCH_SYSTEM_MALLOC") == "1":
        return "system malloc settings (BENCH_SYSTEM_MALLOC=1)"
    env = host_memory.allocator_env(os.environ)
    if env != dict(os.environ):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if host_memory.keeps_freed_memory(os.environ):
        return "malloc keeps freed memory, as in rlflow train's learner (both sides)"
    return "the environment's own malloc settings"


def decode_step_seconds(engine, prompt, sampling, batch: int, new: int) -> float:
    """Seconds per decode step of ``engine`` (an :class:`rlflow.sampler.engine.RlflowEngine`)
    with ``batch`` slots all decoding ``prompt``'s continuation: one prefill inserted into
    every slot, then ``new // k`` calls of ``k = engine.decode_steps_per_call`` steps back
    to back, each call's packed output copied to the host (as the batcher does). Warm it up
    once for a steady-state figure (the first call compiles)."""
    import jax                      # after run_like_rlflow_train's re-exec
    import numpy as np

    params = engine.load_params()
    padded, n = engine.pad_prompt(prompt)
    prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n,
                            sampling=sampling)
    state = engine.insert_batch(prefix, engine.init_decode_state(), [0] * batch,
                                list(range(batch)), list(range(batch)))
    jax.block_until_ready(state)
    k = engine.decode_steps_per_call
    t0 = time.perf_counter()
    for _ in range(new // k):
        state, out = engine.generate_packed(params, state)
        np.asarray(out)
    return (time.perf_counter() - t0) / (new // k * k)
