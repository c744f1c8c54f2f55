"""Sampler throughput: rlflow's engine + continuous batching vs ``transformers`` generate.

Two sizes, each measured against its own baseline in the same run:

* headline (``gsm8k``): the Qwen2-architecture model of ``benchmarks/_gsm8k_model.py``
  (4.46M parameters: hidden 256, 4 layers, byte-level BPE vocabulary of 2048 trained here
  on GSM8K), 16 GSM8K questions cut to 64 tokens, 128 new tokens: compute-bound, so the
  ratio measures the decode loop, not Python overhead;
* ``tiny``: hidden 64, 2 layers, vocab 512, 16 random prompts of 32 tokens, 64 new tokens
  (second line: at this size per-token overhead dominates both sides).

Both sides run the same random weights (rlflow builds the model, exports it as a HF folder,
``transformers`` loads that folder), the same prompts, the same output length (no early
stop), sampling at temperature 1 (no top-k/top-p), and the same CPU thread count (torch
``set_num_threads`` and XLA's intra-op threads). Timings are end to end (prefill +
decode), after one warm-up run of each side, then the best run of SAMPLER_BENCH_REPEATS
interleaved bursts of 3 back-to-back runs per side (other load on the machine only ever
slows a run down).

Figures (``RESULT`` lines, see benchmarks/README.md), per size (suffix ``_tiny`` for the
second): ``decode_tokens_per_s`` (the default engine, ``sampler.decode_steps_per_call``),
``decode_tokens_per_s_transformers``, ``decode_speedup`` (target >= 3x at the headline
size; both sides float32); ``decode_speedup_bf16`` (``sampler.dtype="bfloat16"``: the same
weights rounded to bf16, bf16 KV cache) against transformers at whichever of float32 and
bfloat16 ran faster for it in this run (``decode_tokens_per_s_transformers_bf16`` is its
bf16 figure); ``decode_speedup_k1`` (one decode step per call, the old default); and where the
time of a token goes: ``decode_device_ms_per_step`` (the jitted decode calls alone, all
slots busy, back to back) against ``decode_loop_ms_per_step`` (the whole loop: prefill,
insert, host bookkeeping, copies), their difference being the prefill and insert calls
plus the host's bookkeeping. Then
``slot_occupancy`` under mixed output lengths (target >= 0.9) for the default k, and the
occupancy static batching would get on the same requests.
``decode_tokens_per_s_lanes<L>`` / ``decode_speedup_lanes<L>`` / ``decode_loop_ms_per_step_lanes<L>``:
the default engine split into ``sampler.decode_lanes = L`` batchers of ``batch / L`` slots
whose decode calls run at once on L threads (``rlflow.sampler.lanes``), float32, same
requests and baseline. ``decode_lanes_default`` is the lane count ``sampler.decode_lanes=0``
(the default) resolves to for this model on this host (``rlflow.sampler.lanes.lane_count``),
and ``decode_speedup_default`` the speedup of that configuration (the one-lane or the
``_lanes<L>`` figure); the ``target>=3`` mark sits on the line of the default.
``decode_tokens_per_s_bf16_lanes<L>`` / ``decode_speedup_bf16_lanes<L>``: the same lane split
with ``sampler.dtype="bfloat16"``, against transformers at its faster dtype (as ``_bf16``).
``decode_tokens_per_s_in_out`` / ``decode_device_ms_per_step_in_out``: the default engine with
``sampler.kernel_layout="in_out"`` (wide kernels as the model holds them; the default resolves
to "out_in" on CPU, ``rlflow.sampler.kernel_layout``), and ``kernel_layout_default_over_in_out``
the device-step ratio.
``decode_bytes_per_step``, ``decode_read_bound_ms_per_step``, ``decode_device_over_read_bound``
and ``decode_speedup_at_read_bound`` (float32, and ``_bf16``): the decode step against the time a jitted read of the
same bytes (weights + KV cache) takes here, and the speedup a loop at that bound would have.
Last, ``decode_gemm_xla_over_blas``: the decode step's MLP matmuls (``[slots, hidden] @
[hidden, mlp] @ [mlp, hidden]``) jitted by XLA:CPU against numpy's BLAS on the same
arrays: the share of the gap to an eager loop that lies in the compiler's small-M dot.

Then the int8 lines (``sampler.quantization="int8"`` against float32 on the headline model
and the real SmolLM2-135M checkpoint: tokens/s, the decode step over its read bound, where
XLA:CPU dequantizes, the behaviour - learner logprob gap): ``benchmarks/_sampler_int8.py``.

Sizes come from environment variables (defaults in brackets): SAMPLER_BENCH_BATCH [16],
SAMPLER_BENCH_THREADS [all cores], SAMPLER_BENCH_REPEATS [3], SAMPLER_BENCH_BURST [3], SAMPLER_BENCH_OCC_REQUESTS
[8 x batch], SAMPLER_BENCH_SIZES [gsm8k,tiny], SAMPLER_BENCH_LANES [2],
SAMPLER_BENCH_INT8_SIZES [gsm8k,smollm2], SAMPLER_BENCH_INT8_NEW [64] (an empty list skips).
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

import dataclasses  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import _gsm8k_model  # noqa: E402  (benchmarks/ is the script's folder)
from _timing import best_of, decode_step_seconds  # noqa: E402


def env(name, default):
    return int(os.environ.get(f"SAMPLER_BENCH_{name}", default))


BATCH, REPEATS = env("BATCH", 16), env("REPEATS", 3)
OCC_REQUESTS = env("OCC_REQUESTS", 8 * BATCH)
SIZES = [s for s in os.environ.get("SAMPLER_BENCH_SIZES", "gsm8k,tiny").split(",") if s]
# sampler.quantization="int8" against float32 (benchmarks/_sampler_int8.py)
INT8_SIZES = [s for s in os.environ.get("SAMPLER_BENCH_INT8_SIZES", "gsm8k,smollm2").split(",")
              if s]
INT8_NEW = env("INT8_NEW", 64)
PAUSE_S, BURST = 0.5, env("BURST", 3)   # pause, timed runs per burst (see measure)
LANES = env("LANES", 2)                 # sampler.decode_lanes of the _lanes lines


def size_setup(name: str, tmp: str):
    """(model config, prompts int32 [BATCH, P], new tokens, description) of a size."""
    from rlflow.config import ModelConfig
    rng = np.random.default_rng(0)
    if name == "gsm8k":
        tok = _gsm8k_model.build_tokenizer(os.path.join(tmp, "tok"))
        cfg = _gsm8k_model.model_config(len(tok))
        prompts = np.asarray(_gsm8k_model.gsm8k_prompts(tok, BATCH, 64), np.int32)
        return cfg, prompts, 128, "qwen2 hidden=256 layers=4 BPE vocab=2048 (GSM8K)"
    if name == "tiny":
        cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16)
        prompts = rng.integers(4, 512, size=(BATCH, 32)).astype(np.int32)
        return cfg, prompts, 64, "llama hidden=64 layers=2 vocab=512 (random prompts)"
    raise SystemExit(f"SAMPLER_BENCH_SIZES: unknown size {name!r} (gsm8k, tiny)")


def measure(size: str, suffix: str, tmp: str) -> None:
    import jax
    import torch
    import transformers as tf
    from flax import nnx

    from rlflow.config import MeshConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.models import build_model, save_hf
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.lanes import DecodeLanes, available_cpus, lane_count
    from rlflow.sampler.sampling import SamplingParams

    model_cfg, prompts, new, what = size_setup(size, tmp)
    model, cfg = build_model(model_cfg)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    batch, plen = prompts.shape
    config = (f"{what}, {n_params / 1e6:.2f}M params, batch={batch} prompt={plen} new={new} "
              f"threads={THREADS}")
    print(f"# {size}: {config}; devices: {jax.devices()}", flush=True)

    default_k = SamplerConfig.decode_steps_per_call
    # what sampler.decode_lanes=0 (the default) picks for this model here
    auto_lanes = lane_count(SamplerConfig.decode_lanes, batch, hidden_size=model_cfg.hidden_size,
                            backend=jax.default_backend(), cpus=available_cpus(),
                            multi_turn=False)
    headline = size == "gsm8k"
    # variants: (decode steps per call, dtype); bf16 = sampler.dtype="bfloat16" (the same
    # weights rounded once, KV cache in bf16), at the default k only
    ks = sorted({(default_k, "float32"), (1, "float32"), (default_k, "bfloat16")})
    bf16_model, _ = build_model(dataclasses.replace(model_cfg, dtype="bfloat16",
                                                    param_dtype="bfloat16"))
    engines = {(k, dt): RlflowEngine(model if dt == "float32" else bf16_model, SamplerConfig(
        num_slots=batch, max_prefill_length=plen, prefill_buckets=(plen,), max_tokens=new,
        temperature=1.0, group_size=1, decode_steps_per_call=k),
        mesh=make_mesh(MeshConfig(), jax.devices()[:1])) for k, dt in ks}
    # the wide kernels as the model holds them, [in, out] (the default here resolves to
    # sampler.kernel_layout="out_in" on CPU, rlflow.sampler.kernel_layout)
    engines["in_out"] = RlflowEngine(model, dataclasses.replace(
        engines[(default_k, "float32")].sampler_cfg, kernel_layout="in_out"),
        mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    sampling = SamplingParams(temperature=1.0, max_tokens=new, stop_token_ids=())
    # One batcher per engine, made once (it places the weights on the engine's mesh, as
    # loading the model does for transformers); each timed run submits the requests.
    batchers = {k: ContinuousBatcher(e) for k, e in engines.items()}
    # the lane split in both dtypes (bf16: sampler.dtype="bfloat16", as the _bf16 line)
    lanes = {dt: DecodeLanes(RlflowEngine(m, dataclasses.replace(
        engines[(default_k, "float32")].sampler_cfg, num_slots=batch // LANES),
        mesh=make_mesh(MeshConfig(), jax.devices()[:1])), lanes=LANES)
        for dt, m in (("float32", model), ("bfloat16", bf16_model))}

    def run_all(batcher, seed=0):
        groups = batcher.run([Request(i, prompts[i], 1, sampling.replace(seed=seed + i))
                              for i in range(batch)])
        n = sum(len(c.tokens) for g in groups for c in g.completions)
        assert n == batch * new, n

    def ours(k):
        run_all(batchers[k])

    def ours_lanes(dt):
        run_all(lanes[dt])

    def device_only(k):
        """The decode calls alone: every slot busy, calls back to back, one copy each."""
        return decode_step_seconds(engines[k], prompts[0], sampling, batch, new)

    hf_dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, cfg, d)
        hfs = {name: tf.AutoModelForCausalLM.from_pretrained(d, dtype=dt).eval()
               for name, dt in hf_dtypes.items()}
    inputs = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(inputs)

    def theirs(dt):
        with torch.no_grad():
            out = hfs[dt].generate(inputs, attention_mask=mask, do_sample=True,
                                   temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                   min_new_tokens=new, pad_token_id=0)
        assert out.shape == (batch, plen + new), out.shape

    for k in ks + ["in_out"]:
        ours(k)                                              # compile
        device_only(k)
    for dt in lanes:
        ours_lanes(dt)
    for dt in hfs:
        theirs(dt)                                           # warm-up
    # Interleaved bursts, REPEATS of each side: both sides see the same machine load. A
    # burst starts after a pause (torch's OpenMP workers spin-wait for a while after a
    # parallel region; the other side would share the cores with them) and times BURST
    # back-to-back runs, keeping the best: each side runs warm, as a sampler in a loop does.
    def timed(fn):
        time.sleep(PAUSE_S)
        return best_of(fn, BURST)

    t_ours = {k: float("inf") for k in ks}
    t_dev = {k: float("inf") for k in ks}
    t_hfs = {dt: float("inf") for dt in hfs}
    t_lanes = {dt: float("inf") for dt in lanes}
    t_ours["in_out"] = t_dev["in_out"] = float("inf")
    for _ in range(REPEATS):
        for k in ks + ["in_out"]:
            t_ours[k] = min(t_ours[k], timed(lambda: ours(k)))
            t_dev[k] = min(t_dev[k], min(device_only(k) for _ in range(BURST)))
        for dt in lanes:
            t_lanes[dt] = min(t_lanes[dt], timed(lambda: ours_lanes(dt)))
        for dt in hfs:
            t_hfs[dt] = min(t_hfs[dt], timed(lambda: theirs(dt)))
    t_hf = t_hfs["float32"]
    hf_tps = batch * new / t_hf
    hf_best = min(t_hfs, key=t_hfs.get)                  # transformers' faster dtype here
    for k in ks:
        steps, dt = k
        tps = batch * new / t_ours[k]
        sfx = suffix if k == (default_k, "float32") else (
            f"_bf16{suffix}" if dt == "bfloat16" else f"_k{steps}{suffix}")
        target = "target>=3 " if (headline and steps == default_k and dt == "float32"
                                  and auto_lanes == 1) else ""
        base = hf_tps if dt == "float32" else batch * new / t_hfs[hf_best]
        vs = ("vs transformers generate (float32)" if dt == "float32" else
              f"vs transformers generate at its faster dtype here ({hf_best})")
        print(f"RESULT decode_tokens_per_s{sfx} {tps:.1f} tokens/s rlflow engine + "
              f"continuous batching, decode_steps_per_call={steps}"
              f"{' (default)' if steps == default_k else ''}, {dt}, {config}")
        print(f"RESULT decode_speedup{sfx} {tps / base:.2f} x {target}{vs}, "
              f"decode_steps_per_call={steps}, rlflow {dt}")
        print(f"RESULT decode_loop_ms_per_step{sfx} {t_ours[k] / new * 1e3:.2f} ms whole loop "
              f"per decode step of {batch} slots (prefill, insert, host bookkeeping, copies)")
        print(f"RESULT decode_device_ms_per_step{sfx} {t_dev[k] * 1e3:.2f} ms jitted decode "
              f"calls alone per step, all slots busy, one host copy per call")
    default_layout = engines[(default_k, "float32")].sampler_cfg.kernel_layout
    print(f"RESULT decode_tokens_per_s_in_out{suffix} {batch * new / t_ours['in_out']:.1f} "
          f"tokens/s as decode_tokens_per_s{suffix} with sampler.kernel_layout=in_out (wide "
          f"kernels stored [in, out]; default {default_layout!r})")
    print(f"RESULT decode_device_ms_per_step_in_out{suffix} {t_dev['in_out'] * 1e3:.2f} ms "
          f"jitted decode calls alone per step, kernel_layout=in_out")
    print(f"RESULT kernel_layout_default_over_in_out{suffix} "
          f"{t_dev['in_out'] / t_dev[(default_k, 'float32')]:.2f} x device step, "
          f"kernel_layout={default_layout!r} over 'in_out' (>1: the default is faster)")
    sfx, tps = f"_lanes{LANES}{suffix}", batch * new / t_lanes["float32"]
    speedups = {1: batch * new / t_ours[(default_k, "float32")] / hf_tps, LANES: tps / hf_tps}
    print(f"RESULT decode_tokens_per_s{sfx} {tps:.1f} tokens/s rlflow engine, "
          f"sampler.decode_lanes={LANES} ({LANES} batchers of {batch // LANES} slots decoding at "
          f"once), decode_steps_per_call={default_k}, float32, {config}")
    print(f"RESULT decode_speedup{sfx} {tps / hf_tps:.2f} x "
          f"{'target>=3 ' if headline and auto_lanes == LANES else ''}vs transformers generate "
          f"(float32), sampler.decode_lanes={LANES}")
    print(f"RESULT decode_loop_ms_per_step{sfx} {t_lanes['float32'] / new * 1e3:.2f} ms whole "
          f"loop per decode step of {batch} slots in {LANES} lanes")
    sfx, tps = f"_bf16_lanes{LANES}{suffix}", batch * new / t_lanes["bfloat16"]
    print(f"RESULT decode_tokens_per_s{sfx} {tps:.1f} tokens/s rlflow engine, "
          f"sampler.decode_lanes={LANES}, sampler.dtype=bfloat16, {config}")
    print(f"RESULT decode_speedup{sfx} {tps * t_hfs[hf_best] / (batch * new):.2f} x vs "
          f"transformers generate at its faster dtype here ({hf_best}), "
          f"sampler.decode_lanes={LANES}, rlflow bfloat16")
    for one in lanes.values():
        one.close()
    print(f"RESULT decode_lanes_default{suffix} {auto_lanes} lanes sampler.decode_lanes=0 (the "
          f"default) here: backend {jax.default_backend()}, {available_cpus()} CPUs, hidden "
          f"{model_cfg.hidden_size}, {batch} slots")
    if auto_lanes in speedups:
        print(f"RESULT decode_speedup_default{suffix} {speedups[auto_lanes]:.2f} x vs "
              f"transformers generate (float32), the default configuration ({auto_lanes} "
              f"lane(s), decode_steps_per_call={default_k})")
    for dt in hfs:
        sfx = suffix if dt == "float32" else f"_bf16{suffix}"
        print(f"RESULT decode_tokens_per_s_transformers{sfx} {batch * new / t_hfs[dt]:.1f} "
              f"tokens/s transformers {tf.__version__} generate (torch CPU), {dt}, same model "
              f"and sizes")
    for dt in ("float32", "bfloat16"):
        read_roofline(engines[(default_k, dt)], t_dev[(default_k, dt)], t_hf / new,
                      suffix if dt == "float32" else f"_bf16{suffix}")

    # ---------------------------------------------------------------- occupancy
    # A stream of OCC_REQUESTS requests with output lengths uniform in [new/8, new]; the
    # figure includes the final drain (slots emptying with nothing queued), whose share
    # shrinks as the stream gets longer. Baseline: static batches of `batch` requests,
    # each batch running until its longest member ends (the pre-continuous-batching scheme).
    rng = np.random.default_rng(1)
    lengths = rng.integers(new // 8, new + 1, size=OCC_REQUESTS)
    batcher = ContinuousBatcher(engines[(default_k, "float32")])
    batcher.run([Request(i, prompts[i % batch], 1, SamplingParams(
        temperature=1.0, max_tokens=int(n), seed=i, stop_token_ids=()))
        for i, n in enumerate(lengths)])
    c = batcher.counters
    assert c.slot_steps_used == lengths.sum(), c
    print(f"RESULT slot_occupancy{suffix} {c.occupancy:.3f} fraction target>=0.9; "
          f"{len(lengths)} requests, output lengths {lengths.min()}-{lengths.max()}, "
          f"{batch} slots, {c.decode_steps} steps ({default_k} per call) incl. final drain, "
          f"idle-while-queued {c.idle_slot_steps_while_queued}")
    static = lengths.sum() / sum(batch * lengths[i:i + batch].max()
                                 for i in range(0, len(lengths), batch))
    print(f"RESULT slot_occupancy_static_batching{suffix} {static:.3f} fraction baseline: "
          f"same requests in static batches of {batch}", flush=True)
    small_gemm(batch, model_cfg.hidden_size, model_cfg.intermediate_size, suffix)


def read_roofline(engine, t_step: float, t_hf_step: float, suffix: str) -> None:
    """How far the decode step is from the memory-read bound of this machine.

    A decode step must read every weight and (as the engine attends the whole cache) every
    KV-cache entry once: ``bytes`` = parameter bytes + cache bytes. The baseline is a jitted
    ``jnp.sum`` over a float32 array of the same bytes, measured here (same cache regime,
    same threads): its time is the least a step that reads those bytes can take. Figures:
    the bytes, that bound per step, the device step over it, and the speedup over
    ``transformers`` that a loop at the bound would reach (``t_hf_step`` / bound).
    """
    import jax
    import jax.numpy as jnp
    params = engine.load_params()
    state = engine.init_decode_state()
    n_param = sum(x.nbytes for x in jax.tree.leaves(params.leaves))   # int8: values + scales
    n_cache = sum(x.nbytes for x in (*state.cache.k, *state.cache.v))
    n = n_param + n_cache
    x = jnp.ones((n // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    t_read = best_of(lambda: total(x).block_until_ready(), 30)
    print(f"RESULT decode_bytes_per_step{suffix} {n / 1e6:.1f} MB weights {n_param / 1e6:.1f} + "
          f"KV cache {n_cache / 1e6:.1f} (every slot, every position), read once per step")
    print(f"RESULT decode_read_bound_ms_per_step{suffix} {t_read * 1e3:.2f} ms jitted jnp.sum "
          f"over the same bytes ({n / t_read / 1e9:.1f} GB/s, baseline)")
    print(f"RESULT decode_device_over_read_bound{suffix} {t_step / t_read:.2f} x device step "
          f"{t_step * 1e3:.2f} ms over the read bound")
    if t_hf_step is not None:
        print(f"RESULT decode_speedup_at_read_bound{suffix} {t_hf_step / t_read:.1f} x the "
              f"speedup over transformers ({t_hf_step * 1e3:.2f} ms per step) of a loop at "
              f"the read bound", flush=True)


def small_gemm(m: int, k: int, n: int, suffix: str) -> None:
    """The decode step's MLP matmuls, ``[slots, hidden] @ [hidden, mlp]`` then ``@ [mlp,
    hidden]`` float32: XLA:CPU's dots (jitted, as in the decode step) against numpy's BLAS on
    the same arrays. At M = slots a decode step is a chain of such dots, so this ratio bounds
    what the compiled loop can gain over an eager torch loop whose matmuls run at BLAS speed."""
    import jax
    import jax.numpy as jnp
    reps = 8                                     # up/down pairs per jitted call (amortises dispatch)
    rng = np.random.default_rng(0)
    x = rng.random((m, k), np.float32)
    up, down = rng.random((k, n), np.float32) / k, rng.random((n, k), np.float32) / n

    @jax.jit
    def chain(x, up, down):
        for _ in range(reps):
            x = (x @ up) @ down
        return x

    def blas():
        y = x
        for _ in range(reps):
            y = (y @ up) @ down
        return y
    args = [jnp.asarray(a) for a in (x, up, down)]
    t_xla = best_of(lambda: chain(*args).block_until_ready(), 30) / reps
    t_np = best_of(blas, 30) / reps
    print(f"RESULT decode_gemm_xla_over_blas{suffix} {t_xla / t_np:.2f} x XLA:CPU "
          f"{t_xla * 1e6:.0f} us vs numpy BLAS {t_np * 1e6:.0f} us per [{m},{k}] @ [{k},{n}] "
          f"@ [{n},{k}] float32 pair (the decode step's MLP shapes)", flush=True)


def main() -> int:
    import torch
    from _sampler_int8 import measure_int8
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        for size in SIZES:
            measure(size, "" if size == SIZES[0] else f"_{size}", tmp)
        for size in INT8_SIZES:
            measure_int8(size, tmp, batch=BATCH, plen=64, new=INT8_NEW, repeats=REPEATS,
                         read_bound=read_roofline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
