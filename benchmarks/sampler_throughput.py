"""Sampler throughput: rlflow's engine + continuous batching vs ``transformers`` generate.

Both sides run the same random model (rlflow builds it, exports it as a HF folder,
``transformers`` loads that folder), the same batch (16 prompts of 32 tokens), the same
output length (64 new tokens, no early stop), sampling at temperature 1 (no top-k/top-p),
and the same CPU thread count (torch ``set_num_threads`` and XLA's intra-op threads).
Timings are end to end (prefill + decode), after one warm-up run of each side, then the
best run of SAMPLER_BENCH_REPEATS interleaved bursts of 3 back-to-back runs per side.

Figures (``RESULT`` lines, see benchmarks/README.md), for the default engine
(sampler.decode_steps_per_call = 1):
  decode_tokens_per_s / decode_tokens_per_s_transformers / decode_speedup (target >= 3x);
  slot_occupancy under mixed output lengths (target >= 0.9), and the occupancy static
  batching would get on the same requests. The same with a ``_k4`` suffix for the option of
  k = 4 decode steps per call (occupancy counts the steps of a call after a slot finished
  as idle).

Sizes come from environment variables (defaults in brackets): SAMPLER_BENCH_HIDDEN [64],
SAMPLER_BENCH_LAYERS [2], SAMPLER_BENCH_VOCAB [512], SAMPLER_BENCH_BATCH [16],
SAMPLER_BENCH_PROMPT [32], SAMPLER_BENCH_NEW [64], SAMPLER_BENCH_THREADS [all cores],
SAMPLER_BENCH_REPEATS [3], SAMPLER_BENCH_OCC_REQUESTS [32 x batch], SAMPLER_BENCH_STEPS_PER_CALL
[4: the multi-step option measured beside the default].
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
import time  # noqa: E402

import numpy as np  # noqa: E402

from _timing import best_of  # noqa: E402  (benchmarks/ is the script's folder)


def env(name, default):
    return int(os.environ.get(f"SAMPLER_BENCH_{name}", default))


HIDDEN, LAYERS, VOCAB = env("HIDDEN", 64), env("LAYERS", 2), env("VOCAB", 512)
BATCH, PROMPT, NEW, REPEATS = env("BATCH", 16), env("PROMPT", 32), env("NEW", 64), env("REPEATS", 3)
OCC_REQUESTS = env("OCC_REQUESTS", 32 * BATCH)
PAUSE_S, BURST = 0.5, 3   # pause before each burst of timed runs (see main)


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
    # The default engine (sampler.decode_steps_per_call = 1: every free slot refilled
    # before every step) is the headline; the k-steps-per-call option is reported beside.
    default_k = SamplerConfig.decode_steps_per_call
    k = env("STEPS_PER_CALL", 4)
    ks = sorted({default_k, k})
    engines = {}
    for steps in ks:
        scfg = SamplerConfig(num_slots=BATCH, max_prefill_length=PROMPT,
                             prefill_buckets=(PROMPT,), max_tokens=NEW, temperature=1.0,
                             group_size=1, decode_steps_per_call=steps)
        engines[steps] = RlflowEngine(model, scfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    sampling = SamplingParams(temperature=1.0, max_tokens=NEW, stop_token_ids=())

    # One batcher per engine, made once (it places the weights on the engine's mesh, as
    # loading the model does for transformers); each timed run submits the requests.
    batchers = {steps: ContinuousBatcher(e) for steps, e in engines.items()}

    def ours(steps, seed=0):
        groups = batchers[steps].run([Request(i, prompts[i], 1, sampling.replace(seed=seed + i))
                                      for i in range(BATCH)])
        n = sum(len(c.tokens) for g in groups for c in g.completions)
        assert n == BATCH * NEW, n

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

    for steps in ks:
        ours(steps)                                          # compile
    theirs()                                                 # warm-up
    # Interleaved bursts, REPEATS of each side: both sides see the same machine load. A
    # burst starts after a pause (torch's OpenMP workers spin-wait for a while after a
    # parallel region; the other side would share the cores with them) and times BURST
    # back-to-back runs, keeping the best: each side runs warm, as a sampler in a loop does.
    def timed(fn):
        time.sleep(PAUSE_S)
        return best_of(fn, BURST)

    t_ours = {steps: float("inf") for steps in ks}
    t_hf = float("inf")
    for _ in range(REPEATS):
        for steps in ks:
            t_ours[steps] = min(t_ours[steps], timed(lambda: ours(steps)))
        t_hf = min(t_hf, timed(theirs))
    hf_tps = BATCH * NEW / t_hf
    for steps in ks:
        tps = BATCH * NEW / t_ours[steps]
        suffix, what = ("", "default") if steps == default_k else (f"_k{steps}", "option")
        print(f"RESULT decode_tokens_per_s{suffix} {tps:.1f} tokens/s rlflow engine + "
              f"continuous batching, {config} decode_steps_per_call={steps} ({what})")
        print(f"RESULT decode_speedup{suffix} {tps / hf_tps:.2f} x "
              f"{'target>=3 ' if steps == default_k else ''}vs transformers generate")
    print(f"RESULT decode_tokens_per_s_transformers {hf_tps:.1f} tokens/s transformers "
          f"{tf.__version__} generate (torch CPU), same model and sizes")

    # ---------------------------------------------------------------- occupancy
    # A stream of OCC_REQUESTS requests with output lengths uniform in [NEW/8, NEW]; the
    # figure includes the final drain (slots emptying with nothing queued), whose share
    # shrinks as the stream gets longer. Baseline: static batches of BATCH requests, each
    # batch running until its longest member ends (the pre-continuous-batching scheme).
    lengths = rng.integers(NEW // 8, NEW + 1, size=OCC_REQUESTS)
    for steps in ks:
        batcher = ContinuousBatcher(engines[steps])
        batcher.run([Request(i, prompts[i % BATCH], 1, SamplingParams(
            temperature=1.0, max_tokens=int(n), seed=i, stop_token_ids=()))
            for i, n in enumerate(lengths)])
        c = batcher.counters
        assert steps > 1 or c.idle_slot_steps_while_queued == 0, c
        assert c.slot_steps_used == lengths.sum(), c
        suffix = "" if steps == default_k else f"_k{steps}"
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
