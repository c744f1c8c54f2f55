"""Sampler throughput: rlflow's engine + continuous batching vs ``transformers`` generate.

Both sides run the same random model (rlflow builds it, exports it as a HF folder,
``transformers`` loads that folder), the same batch (16 prompts of 32 tokens), the same
output length (64 new tokens, no early stop), sampling at temperature 1 (no top-k/top-p),
and the same CPU thread count (torch ``set_num_threads`` and XLA's intra-op threads).
Timings are end to end (prefill + decode), after one warm-up run of each side, then
best of SAMPLER_BENCH_REPEATS runs of each, interleaved.

Figures (``RESULT`` lines, see benchmarks/README.md):
  decode_tokens_per_s / decode_tokens_per_s_transformers / decode_speedup (target >= 3x);
  slot_occupancy under mixed output lengths (target >= 0.9), and the occupancy static
  batching would get on the same requests. With k = sampler.decode_steps_per_call > 1 also
  decode_tokens_per_s_k1 (one step per call, same run) and its speedup; occupancy counts the
  steps of a call after a slot finished as idle.

Sizes come from environment variables (defaults in brackets): SAMPLER_BENCH_HIDDEN [64],
SAMPLER_BENCH_LAYERS [2], SAMPLER_BENCH_VOCAB [512], SAMPLER_BENCH_BATCH [16],
SAMPLER_BENCH_PROMPT [32], SAMPLER_BENCH_NEW [64], SAMPLER_BENCH_THREADS [all cores],
SAMPLER_BENCH_REPEATS [3], SAMPLER_BENCH_OCC_REQUESTS [32 x batch], SAMPLER_BENCH_STEPS_PER_CALL
[4: the multi-step option; k = 1, sampler.decode_steps_per_call's default, is always measured too].
"""

from __future__ import annotations

import os
import sys

THREADS = int(os.environ.get("SAMPLER_BENCH_THREADS", os.cpu_count() or 1))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=true"
                           f" intra_op_parallelism_threads={THREADS}").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tempfile  # noqa: E402

import numpy as np  # noqa: E402

from _timing import best_of  # noqa: E402  (benchmarks/ is the script's folder)


def env(name, default):
    return int(os.environ.get(f"SAMPLER_BENCH_{name}", default))


HIDDEN, LAYERS, VOCAB = env("HIDDEN", 64), env("LAYERS", 2), env("VOCAB", 512)
BATCH, PROMPT, NEW, REPEATS = env("BATCH", 16), env("PROMPT", 32), env("NEW", 64), env("REPEATS", 3)
OCC_REQUESTS = env("OCC_REQUESTS", 32 * BATCH)


def main() -> int:
    import jax
    import torch
    import transformers as tf

    from rlflow.config import MeshConfig, ModelConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.models import build_model, save_hf
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.sampling import SamplingParams

    torch.set_num_threads(THREADS)
    model_cfg = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                            num_layers=LAYERS, num_heads=4, num_kv_heads=2,
                            head_dim=HIDDEN // 4)
    model, cfg = build_model(model_cfg)
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, VOCAB, size=(BATCH, PROMPT)).astype(np.int32)
    config = (f"hidden={HIDDEN} layers={LAYERS} vocab={VOCAB} batch={BATCH} prompt={PROMPT} "
              f"new={NEW} threads={THREADS}")
    print(f"# {config}; devices: {jax.devices()}", flush=True)

    # ---------------------------------------------------------------- rlflow
    k = env("STEPS_PER_CALL", 4)
    config += f" decode_steps_per_call={k}"
    engines = {}
    for steps in sorted({k, 1}):
        scfg = SamplerConfig(num_slots=BATCH, max_prefill_length=PROMPT,
                             prefill_buckets=(PROMPT,), max_tokens=NEW, temperature=1.0,
                             decode_steps_per_call=steps)
        engines[steps] = RlflowEngine(model, scfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    engine = engines[k]
    sampling = SamplingParams(temperature=1.0, max_tokens=NEW, stop_token_ids=())

    def ours(seed=0, engine=engine):
        batcher = ContinuousBatcher(engine)
        groups = batcher.run([Request(i, prompts[i], 1, sampling.replace(seed=seed + i))
                              for i in range(BATCH)])
        n = sum(len(c.tokens) for g in groups for c in g.completions)
        assert n == BATCH * NEW, n
        return batcher


    # ---------------------------------------------------------------- transformers
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, cfg, d)
        hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    inputs = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(inputs)

    def theirs():
        with torch.no_grad():
            out = hf.generate(inputs, attention_mask=mask, do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=NEW, min_new_tokens=NEW,
                              pad_token_id=0)
        assert out.shape == (BATCH, PROMPT + NEW), out.shape

    ours_k1 = lambda: ours(engine=engines[1])                # noqa: E731
    ours()                                                   # compile
    ours_k1()
    theirs()                                                 # warm-up
    # Interleaved, best of REPEATS each: both sides see the same machine load.
    t_ours, t_hf, t_k1 = float("inf"), float("inf"), float("inf")
    for _ in range(REPEATS):
        t_ours = min(t_ours, best_of(ours, 1))
        t_hf = min(t_hf, best_of(theirs, 1))
        if k != 1:
            t_k1 = min(t_k1, best_of(ours_k1, 1))
    ours_tps, hf_tps = BATCH * NEW / t_ours, BATCH * NEW / t_hf

    print(f"RESULT decode_tokens_per_s {ours_tps:.1f} tokens/s rlflow engine + continuous "
          f"batching, {config}")
    print(f"RESULT decode_tokens_per_s_transformers {hf_tps:.1f} tokens/s transformers "
          f"{tf.__version__} generate (torch CPU), same model and sizes")
    print(f"RESULT decode_speedup {ours_tps / hf_tps:.2f} x target>=3 vs transformers generate")
    if k != 1:
        k1_tps = BATCH * NEW / t_k1
        print(f"RESULT decode_tokens_per_s_k1 {k1_tps:.1f} tokens/s same engine, one decode "
              f"step per call")
        print(f"RESULT decode_speedup_k1 {k1_tps / hf_tps:.2f} x vs transformers generate")

    # ---------------------------------------------------------------- occupancy
    # A stream of OCC_REQUESTS requests with output lengths uniform in [NEW/8, NEW]; the
    # figure includes the final drain (slots emptying with nothing queued), whose share
    # shrinks as the stream gets longer. Baseline: static batches of BATCH requests, each
    # batch running until its longest member ends (the pre-continuous-batching scheme).
    lengths = rng.integers(NEW // 8, NEW + 1, size=OCC_REQUESTS)
    for steps in sorted({1, k}):
        batcher = ContinuousBatcher(engines[steps])
        batcher.run([Request(i, prompts[i % BATCH], 1, SamplingParams(
            temperature=1.0, max_tokens=int(n), seed=i, stop_token_ids=()))
            for i, n in enumerate(lengths)])
        c = batcher.counters
        assert steps > 1 or c.idle_slot_steps_while_queued == 0, c
        assert c.slot_steps_used == lengths.sum(), c
        suffix = "" if steps == 1 else f"_k{steps}"
        print(f"RESULT slot_occupancy{suffix} {c.occupancy:.3f} fraction target>=0.9; "
              f"{len(lengths)} requests, output lengths {lengths.min()}-{lengths.max()}, "
              f"{BATCH} slots, {c.decode_steps} steps ({steps} per call) incl. final drain, "
              f"idle-while-queued {c.idle_slot_steps_while_queued}")
    static = lengths.sum() / sum(BATCH * lengths[i:i + BATCH].max()
                                 for i in range(0, len(lengths), BATCH))
    print(f"RESULT slot_occupancy_static_batching {static:.3f} fraction baseline: same "
          f"requests in static batches of {BATCH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
