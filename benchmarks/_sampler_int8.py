"""The int8 lines of benchmarks/sampler_throughput.py (``sampler.quantization="int8"``
against float32, rlflow's engine on both sides; not a benchmark itself).

Per size (``gsm8k``: the headline model of ``_gsm8k_model.py``, 4.46M parameters, GSM8K
prompts; ``smollm2``: the real SmolLM2-135M-Instruct checkpoint,
``rlflow.models.smollm2.smollm2_model_path()``, random prompts of its vocabulary), one
device, BATCH slots, prompts of PROMPT tokens, NEW new tokens at temperature 1, the default
``decode_steps_per_call``:

* ``int8_decode_tokens_per_s_<size>`` / ``float32_...``: the whole loop (prefill,
  insert, decode, host bookkeeping), best of REPEATS after a warm-up, and
  ``int8_over_float32_decode_tokens_per_s_<size>`` the decode tokens/s ratio of the device
  steps below (target >= 1.5 at the 135M size; the whole loop's ratio on the same line).
  ``int8`` is what the CPU backend runs: kernels quantized at the swap and held dequantized
  (``rlflow.sampler.quantization.holds_float``); ``int8_in_call_...`` is the accelerator
  path on this CPU (int8 + scales held, dequantized inside each jitted decode call), and
  ``int8_in_call_over_float32_decode_tokens_per_s_<size>`` its ratio: the measured reason
  the CPU does not take it;
* ``<variant>_device_ms_per_step_<size>``: the jitted decode calls alone, all slots busy,
  back to back;
* ``decode_device_over_read_bound_<variant>_<size>``: that step over the time a jitted
  ``jnp.sum`` reads the step's bytes here (the engine's own weights, int8 + scales for
  ``int8_in_call``, plus its KV cache);
* ``int8_dequant_ms_per_call_<size>``: a jitted ``qwix.dequantize`` of all the int8 kernels
  alone (what XLA:CPU does once per decode call, see below), and
  ``int8_kernels_read_as_float_<size>``: how many of the int8 kernels the compiled decode
  call's ``while`` loop carries as float copies (from the optimized HLO): all of them means
  XLA hoisted the dequantize out of the loop, writes a float copy of every kernel each call
  and the k steps read float32 weights, so int8 reads no fewer bytes per step;
* ``int8_dot_speedup_<size>``: what int8 activations too (qwix's ``act_qtype``, dynamic
  per-row scales; not built) could gain per projection: XLA:CPU's ``s8 x s8 -> s32`` dot
  against its float32 dot at the decode step's MLP shape ``[slots, hidden] @ [hidden,
  mlp]`` (jitted, 8 chained), and ``int8_weight_only_dot_speedup_<size>`` the float32 x
  dequantized-int8 dot in one jit;
* ``int8_logprob_gap_<size>``: mean ``|behaviour - learner|`` logprob over the int8
  sampler's sampled tokens, the learner being the float32 model (full forward), and
  ``float32_logprob_gap_<size>`` the same for the float32 sampler (rounding only).
"""

from __future__ import annotations

import os
import re

import numpy as np

from _timing import best_of, decode_step_seconds


def _model_and_prompts(size: str, tmp: str, batch: int, plen: int):
    """(float32 Decoder, int32 prompts [batch, plen], description)."""
    import _gsm8k_model
    from rlflow.models import build_model, load_hf
    if size == "gsm8k":
        tok = _gsm8k_model.build_tokenizer(os.path.join(tmp, "tok"))
        model = build_model(_gsm8k_model.model_config(len(tok)))[0]
        prompts = np.asarray(_gsm8k_model.gsm8k_prompts(tok, batch, plen), np.int32)
        return model, prompts, "qwen2 hidden=256 layers=4 vocab=2048, 4.46M params (GSM8K)"
    if size == "smollm2":
        from rlflow.models.smollm2 import smollm2_model_path
        model = load_hf(smollm2_model_path())[0]
        rng = np.random.default_rng(0)
        prompts = rng.integers(4, model.cfg.vocab_size, size=(batch, plen)).astype(np.int32)
        return model, prompts, "SmolLM2-135M-Instruct (real checkpoint), random prompts"
    raise SystemExit(f"SAMPLER_BENCH_INT8_SIZES: unknown size {size!r} (gsm8k, smollm2)")


def _float_kernels_in_loop(engine, params, state) -> tuple[int, int]:
    """(float arrays of an int8 kernel's shape carried by the compiled decode call's while
    loop, int8 kernels): equal counts mean XLA dequantized every kernel once before the
    loop (hoisted) and the loop's steps read float copies."""
    import qwix
    kernels = [x for x in params.leaves if isinstance(x, qwix.QArray)]
    text = engine._generate_packed.lower(params, state).compile().as_text()
    loop = next(line for line in text.splitlines() if " while(" in line)
    carried = loop.split(" while(")[0]
    shapes = {",".join(map(str, x.qvalue.shape)) for x in kernels}
    found = sum(len(re.findall(rf"(?:f32|bf16)\[{re.escape(sh)}\]", carried)) for sh in shapes)
    return found, len(kernels)


def _dot_speedups(m: int, k: int, n: int) -> tuple[float, float]:
    """(float32 dot time / s8 x s8 -> s32 dot time, float32 / float32 x convert(s8) dot
    time) at ``[m, k] @ [k, n]``, 8 chained dots per jitted call, best of 30."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.random((m, k)), jnp.float32)
    w = [jnp.asarray(rng.random((k, n)), jnp.float32) for _ in range(8)]
    xq = jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
    wq = [jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8) for _ in range(8)]
    dims = (((1,), (0,)), ((), ()))

    def chain(dot):        # 8 separate weight arrays (slices of one would add copies)
        return jax.jit(lambda a, bs: sum(dot(a, b) for b in bs))
    f32 = chain(lambda a, b: jax.lax.dot_general(a, b, dims))
    s8 = chain(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.int32))
    w8 = chain(lambda a, b: jax.lax.dot_general(a, b.astype(jnp.float32), dims))
    t = {name: best_of(lambda: f(*args).block_until_ready(), 30) for name, f, args in
         (("f32", f32, (x, w)), ("s8", s8, (xq, wq)), ("w8", w8, (x, wq)))}
    return t["f32"] / t["s8"], t["f32"] / t["w8"]


def measure_int8(size: str, tmp: str, *, batch: int, plen: int, new: int, repeats: int,
                 read_bound) -> None:
    import jax
    import jax.numpy as jnp
    import qwix
    from flax import nnx

    from rlflow.config import MeshConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.models import positions_from_mask
    from rlflow.models.logprobs import token_logprobs
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler import quantization
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.sampling import SamplingParams

    model, prompts, what = _model_and_prompts(size, tmp, batch, plen)
    print(f"# int8 {size}: {what}, batch={batch} prompt={plen} new={new}", flush=True)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    engines = {q: RlflowEngine(model, SamplerConfig(
        num_slots=batch, max_prefill_length=plen, prefill_buckets=(plen,), max_tokens=new,
        temperature=1.0, group_size=1, quantization=q.split("_")[0]), mesh=mesh)
        for q in ("none", "int8", "int8_in_call")}
    # the accelerator path on this CPU: int8 QArrays held, dequantized inside each call
    in_call = engines["int8_in_call"]
    in_call._quant = quantization.QuantizedKernels(in_call._default_state, "int8", "tpu")
    sampling = SamplingParams(temperature=1.0, max_tokens=new, stop_token_ids=())
    batchers = {q: ContinuousBatcher(e) for q, e in engines.items()}
    reqs = [Request(i, prompts[i], 1, sampling.replace(seed=i)) for i in range(batch)]

    def loop(q):
        return batchers[q].run(reqs)

    def device(q):
        return decode_step_seconds(engines[q], prompts[0], sampling, batch, new)

    groups = {q: loop(q) for q in engines}                      # compile + the gap's samples
    t_loop = {q: float("inf") for q in engines}
    t_dev = {q: float("inf") for q in engines}
    for q in engines:
        device(q)
    for _ in range(repeats):                                   # interleaved
        for q in engines:
            t_loop[q] = min(t_loop[q], best_of(lambda: loop(q), 1))
            t_dev[q] = min(t_dev[q], device(q))
    names = {"none": "float32", "int8": "int8", "int8_in_call": "int8_in_call"}
    for q in engines:
        print(f"RESULT {names[q]}_decode_tokens_per_s_{size} {batch * new / t_loop[q]:.1f} "
              f"tokens/s whole loop, sampler.quantization={q!r}, {what}")
        print(f"RESULT {names[q]}_device_ms_per_step_{size} {t_dev[q] * 1e3:.2f} ms jitted "
              f"decode calls alone per step of {batch} slots")
    target = "target>=1.5 " if size == "smollm2" else ""
    for q, what in (("int8", "the CPU backend's int8: dequantized once per version"),
                    ("int8_in_call", "the accelerator path on this CPU: int8 + scales held, "
                                     "dequantized inside each decode call")):
        print(f"RESULT {q}_over_float32_decode_tokens_per_s_{size} "
              f"{t_dev['none'] / t_dev[q]:.2f} x {target if q == 'int8' else ''}decode "
              f"tokens/s (device step), {what}; whole loop "
              f"{t_loop['none'] / t_loop[q]:.2f} x", flush=True)
    for q in engines:
        read_bound(engines[q], t_dev[q], None, f"_{names[q]}_{size}")

    # what XLA:CPU does with the int8 kernels inside a decode call
    int8 = in_call
    params = int8.load_params()
    kernels = [x for x in params.leaves if isinstance(x, qwix.QArray)]
    deq = jax.jit(lambda ks: [qwix.dequantize(x) for x in ks])
    t_deq = best_of(lambda: jax.block_until_ready(deq(kernels)), 10)
    print(f"RESULT int8_dequant_ms_per_call_{size} {t_deq * 1e3:.2f} ms a jitted "
          f"qwix.dequantize of the {len(kernels)} int8 kernels alone (per decode call of "
          f"{int8.decode_steps_per_call} steps when hoisted)")
    found, n = _float_kernels_in_loop(int8, params, int8.init_decode_state())
    print(f"RESULT int8_kernels_read_as_float_{size} {found} of {n} int8 kernels: float "
          f"copies carried by the compiled decode call's while loop (XLA:CPU dequantizes "
          f"before the loop; its steps read float weights)", flush=True)

    cfg = model.cfg
    s8, w8 = _dot_speedups(batch, cfg.hidden_size, cfg.intermediate_size)
    print(f"RESULT int8_dot_speedup_{size} {s8:.2f} x XLA:CPU s8 x s8 -> s32 dot over float32 "
          f"at [{batch},{cfg.hidden_size}] @ [{cfg.hidden_size},{cfg.intermediate_size}] "
          f"(what int8 activations could gain per projection)")
    print(f"RESULT int8_weight_only_dot_speedup_{size} {w8:.2f} x float32 x convert(s8) dot "
          f"over float32, same shape (the dequantize in front of the dot)", flush=True)

    # behaviour (sampler) vs learner (float32 full forward) logprobs of the sampled tokens
    graphdef, state = nnx.split(model, nnx.Param)
    rest = nnx.state(model, nnx.Not(nnx.Param))
    forward = jax.jit(lambda t, m: nnx.merge(graphdef, state, rest)(
        t, positions_from_mask(m), m))
    for q in ("none", "int8"):
        gaps = []
        for g in groups[q]:
            c = g.completions[0]
            seq = np.concatenate([np.asarray(g.request.prompt_tokens), c.tokens])[None]
            logits = forward(jnp.asarray(seq, jnp.int32), jnp.ones(seq.shape, bool))
            lp = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(seq[:, 1:]), 1.0))[0]
            gaps.append(np.abs(c.logprobs - lp[plen - 1:]))
        gap = float(np.mean(np.concatenate(gaps)))
        print(f"RESULT {names[q]}_logprob_gap_{size} {gap:.2e} nats mean |behaviour - "
              f"learner| over {sum(len(x) for x in gaps)} sampled tokens "
              f"(sampler.quantization={q!r}, learner float32)", flush=True)
