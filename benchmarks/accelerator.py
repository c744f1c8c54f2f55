"""Accelerator check: rlflow's learner step and sampler decode at real architectures.

Run by ``scripts/accelerator_check.sh`` on a GPU or TPU host (it installs the accelerator
build of jax first), or directly::

    python benchmarks/accelerator.py                  # the real sizes (an accelerator)
    python benchmarks/accelerator.py --tiny --steps 1 # a tiny model, short rows: CPU smoke test

Models: random weights at the Qwen2.5-0.5B and Qwen2.5-1.5B architectures (``qwen05b``,
``qwen15b``: ``model_type="qwen2"``, tied embeddings, vocabulary 151,936, RoPE base 1e6;
float32 master weights, ``learner.compute_dtype="bfloat16"``).

1. **Learner** (``--parts learner``): rlflow's real :class:`rlflow.learner.trainer.Learner`
   on one device, one group of ``--rows`` samples per step, each a row of exactly ``T``
   tokens (``--prompt`` prompt tokens, the rest completion with loss; packing off, so a row
   is one sequence and ``learner.attention="auto"`` picks the backend's kernel), for ``T`` in
   ``--lengths``; ``learner.remat``, ``learner.attention`` and ``learner.logprob_chunk`` from
   the flags (defaults "full", "auto", the config's). One compile-and-warm-up step, then
   ``--steps`` timed steps; the fastest is reported. Figures per ``<arch>_<T>`` label:

   - ``accel_learner_step_s_<label>`` (s): wall time of the step (host batch to metrics back);
   - ``accel_learner_tokens_per_s_<label>`` (tokens/s, per chip);
   - ``accel_learner_mfu_<label>`` (fraction): model FLOPs (:func:`rlflow.run.perf.train_flops`,
     PaLM's ``6 N + 12 L H D T`` per token; remat's recompute not counted) over step time x
     :func:`rlflow.run.perf.peak_flops_per_chip` (the data-sheet bf16 peak; on CPU a measured
     ``jnp.dot``);
   - ``accel_learner_hbm_step_gib_<label>`` (GiB): the compiled step's ``memory_analysis()``,
     arguments (parameters, optimiser state, batch) + outputs + temporaries - aliased: this
     size's own figure;
   - ``accel_learner_temp_gib_<label>`` (GiB): the compiled step's temporaries alone;
   - ``accel_learner_hbm_peak_gib_<label>`` (GiB), where the backend reports it (GPU, TPU):
     the device's ``memory_stats()["peak_bytes_in_use"]``, the process's running maximum so
     far (jax cannot reset it; lengths run shortest first within an architecture);
   - ``accel_learner_compile_s_<label>`` (s): the first step's compile and run.

   An out-of-memory error at a size prints ``RESULT accel_learner_oom_<label> 1 oom <error>``
   and the script goes on with the next size; any other error is raised.
2. **Sampler** (``--parts sampler``): :class:`rlflow.sampler.engine.RlflowEngine` at the
   ``--sampler-arch`` shape (bfloat16 weights and KV cache), ``--slots`` slots each holding
   a ``--sampler-prompt``-token prompt, ``--sampler-new`` tokens decoded by back-to-back
   decode calls (every slot busy, one host copy per call, as ``sampler_throughput.py``'s
   device-only figure): ``accel_decode_tokens_per_s_<arch>`` (tokens/s, all slots),
   ``accel_decode_ms_per_step_<arch>`` (ms per decode step), ``accel_sampler_hbm_peak_gib_<arch>``.
   Out of memory: ``RESULT accel_sampler_oom_<arch> 1 oom``.

Without an accelerator (jax's default backend is CPU) and without ``--real-on-cpu`` the
script runs the ``--tiny`` sizes (a note says so), so ``scripts/bench.sh`` stays minutes long.

On a GPU the script sets ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.90`` unless it is set (XLA's
allocator otherwise stops at 75% of the chip's memory).

Exit status: 0 (also when a size ran out of memory); non-zero on any other error.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# GPU: let XLA's allocator take 90% of the memory instead of its default 75%, so a size that
# fits the chip is not reported out of memory (set the variable to override)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

GIB = 2.0 ** 30
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, rope_theta=1e6, tie_word_embeddings=True)
ARCHS = {   # Hugging Face config.json of Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B
    "qwen05b": dict(_QWEN25, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                    head_dim=64, intermediate_size=4864),
    "qwen15b": dict(_QWEN25, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                    head_dim=128, intermediate_size=8960),
    "tiny": dict(model_type="qwen2", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=True),
}
REAL = dict(archs="qwen05b,qwen15b", lengths="4096,8192,16384", prompt=1024,
            sampler_arch="qwen05b", slots=64, sampler_prompt=1024, sampler_new=256)
TINY = dict(archs="tiny", lengths="64,128", prompt=16, sampler_arch="tiny", slots=4,
            sampler_prompt=32, sampler_new=16)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help=f"tiny sizes for a CPU smoke test: {TINY}")
    p.add_argument("--real-on-cpu", action="store_true",
                   help="keep the real sizes even when jax's backend is CPU")
    p.add_argument("--parts", default="learner,sampler",
                   help="comma-separated: learner, sampler (default: both)")
    p.add_argument("--archs", help=f"learner architectures, of {sorted(ARCHS)} "
                                   f"(default {REAL['archs']})")
    p.add_argument("--lengths", help=f"tokens per row (default {REAL['lengths']})")
    p.add_argument("--rows", type=int, default=2, help="rows (samples of one group) per step")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
    p.add_argument("--prompt", type=int, help="prompt tokens per row, at most half the row "
                                              f"(default {REAL['prompt']})")
    p.add_argument("--remat", default="full", help="learner.remat")
    p.add_argument("--attention", default="auto", help="learner.attention")
    p.add_argument("--logprob-chunk", type=int, default=None,
                   help="learner.logprob_chunk (default: the config's)")
    p.add_argument("--sampler-arch", help=f"default {REAL['sampler_arch']}")
    p.add_argument("--slots", type=int, help=f"decode slots (default {REAL['slots']})")
    p.add_argument("--sampler-prompt", type=int,
                   help=f"prompt tokens per slot (default {REAL['sampler_prompt']})")
    p.add_argument("--sampler-new", type=int,
                   help=f"decoded tokens per slot (default {REAL['sampler_new']})")
    return p.parse_args(argv)


def resolve_sizes(args: argparse.Namespace, backend: str) -> str:
    """Fill the size flags left unset from :data:`TINY` (``--tiny``, or a CPU backend without
    ``--real-on-cpu``) or :data:`REAL`; returns a note on the choice."""
    tiny = args.tiny or (backend == "cpu" and not args.real_on_cpu)
    for key, value in (TINY if tiny else REAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if tiny and not args.tiny:
        return "no accelerator (jax backend cpu): tiny sizes (--real-on-cpu for the real ones)"
    return "tiny sizes" if tiny else "real sizes"


def model_config(arch: str, dtype: str = "float32"):
    """The :class:`rlflow.config.ModelConfig` of ``arch`` (a key of :data:`ARCHS`), random
    weights, ``dtype`` parameters and activations."""
    from rlflow.config import ModelConfig

    return ModelConfig(dtype=dtype, param_dtype=dtype, **ARCHS[arch])


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is XLA's out-of-memory error (``RESOURCE_EXHAUSTED``)."""
    text = f"{type(err).__name__}: {err}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def short(err: BaseException) -> str:
    return " ".join(str(err).split())[:200]


def oom_figure(err: BaseException, name: str, what: str) -> None:
    """Print ``RESULT <name> 1 oom <what>: <error>`` when ``err`` is XLA's out-of-memory
    error (the size is a figure: it does not fit); re-raise any other error."""
    if not is_oom(err):
        raise err
    print(f"RESULT {name} 1 oom {what}: {short(err)}", flush=True)


def label(arch: str, t: int) -> str:
    return f"{arch}_{t // 1024}k" if t % 1024 == 0 else f"{arch}_{t}"


def hbm_peak(device) -> float | None:
    """Bytes of device memory at peak: ``memory_stats()["peak_bytes_in_use"]``, the running
    maximum over the process; None where the backend does not report it (CPU)."""
    stats = device.memory_stats() or {}
    return float(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None


def compiled_bytes(compiled) -> tuple[float, float] | None:
    """``(total, temporaries)`` bytes of a compiled program's ``memory_analysis()``: total =
    arguments + outputs + temporaries - aliased (donated) bytes; None where the backend gives
    no analysis."""
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    total = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
             - ma.alias_size_in_bytes)
    return float(total), float(ma.temp_size_in_bytes)


def group_record(rng, *, vocab: int, rows: int, prompt: int, completion: int) -> dict:
    """One rollout group record (docs/interfaces.md): a ``prompt``-token prompt and ``rows``
    full-length ``completion``-token completions of random tokens, behaviour logprobs near
    uniform, random rewards, policy version 0."""
    return dict(prompt_id=np.int64(0),
                prompt_tokens=rng.integers(1, vocab, size=prompt).astype(np.int32),
                completion_tokens=rng.integers(1, vocab, size=(rows, completion)).astype(np.int32),
                completion_lengths=np.full(rows, completion, np.int32),
                behaviour_logprobs=(-np.log(vocab) + rng.normal(scale=0.3, size=(rows, completion))
                                    ).astype(np.float32),
                policy_versions=np.zeros((rows, completion), np.int32),
                rewards=rng.normal(size=rows).astype(np.float32),
                truncated=np.zeros(rows, bool))


def learner_config(arch: str, t: int, args: argparse.Namespace):
    """ExperimentConfig of a one-group step of ``args.rows`` rows of ``t`` tokens."""
    from rlflow.config import ExperimentConfig, LearnerConfig, RuntimeConfig, SamplerConfig

    prompt = min(args.prompt, t // 2)
    extra = {} if args.logprob_chunk is None else dict(logprob_chunk=args.logprob_chunk)
    return ExperimentConfig(
        model=model_config(arch),
        sampler=SamplerConfig(group_size=args.rows, num_slots=args.rows, max_tokens=t - prompt,
                              max_prefill_length=prompt, prefill_buckets=(prompt,)),
        learner=LearnerConfig(groups_per_step=1, seq_buckets=(t,), packing=False, lr=1e-5,
                              compute_dtype="bfloat16", remat=args.remat,
                              attention=args.attention, **extra),
        runtime=RuntimeConfig(max_staleness=10 ** 6)), prompt


def run_learner(arch: str, t: int, args: argparse.Namespace) -> None:
    """Print the learner figures of ``arch`` at ``t`` tokens per row (module docstring)."""
    import jax

    from rlflow.config import MeshConfig
    from rlflow.learner.trainer import Learner
    from rlflow.mesh import make_mesh

    name = label(arch, t)
    cfg, prompt = learner_config(arch, t, args)
    record = group_record(np.random.default_rng(0), vocab=cfg.model.vocab_size, rows=args.rows,
                          prompt=prompt, completion=t - prompt)
    device = jax.devices()[0]
    learner = None
    try:
        learner = Learner(cfg, mesh=make_mesh(MeshConfig(), [device]), keep_params=True)
        t0 = time.perf_counter()
        learner.train_on([record])                                     # compile + warm-up
        compile_s = time.perf_counter() - t0
        best = min((learner.train_on([record]) for _ in range(args.steps)),
                   key=lambda m: m["learner/step_time_s"])
        step_bytes = compiled_bytes(learner.compiled_step(args.rows, t))
        peak = hbm_peak(device)
    except Exception as e:  # noqa: BLE001 - only out-of-memory is caught, the rest re-raised
        oom_figure(e, f"accel_learner_oom_{name}", f"{args.rows} x {t} tokens")
        return
    finally:
        del learner
        gc.collect()
    what = (f"{arch}, {args.rows} rows x {t} tokens (prompt {prompt}), bf16 compute, remat "
            f"{args.remat}, attention {args.attention}, {device.device_kind}")
    print(f"RESULT accel_learner_step_s_{name} {best['learner/step_time_s']:.4f} s {what}")
    print(f"RESULT accel_learner_tokens_per_s_{name} {best['perf/tokens_per_s_per_chip']:.1f} "
          f"tokens/s per chip, {best['batch/tokens']:.0f} tokens a step")
    print(f"RESULT accel_learner_mfu_{name} {best['perf/mfu']:.4f} fraction model FLOPs "
          f"{best['batch/model_flops']:.3e} (rlflow.run.perf, remat recompute not counted)")
    if step_bytes is not None:
        print(f"RESULT accel_learner_hbm_step_gib_{name} {step_bytes[0] / GIB:.3f} GiB compiled "
              f"step: arguments + outputs + temporaries - aliased")
        print(f"RESULT accel_learner_temp_gib_{name} {step_bytes[1] / GIB:.3f} GiB compiled "
              f"step temporaries")
    if peak is not None:
        print(f"RESULT accel_learner_hbm_peak_gib_{name} {peak / GIB:.3f} GiB memory_stats "
              f"peak_bytes_in_use (the process's maximum so far)")
    print(f"RESULT accel_learner_compile_s_{name} {compile_s:.1f} s first step (compile + run)",
          flush=True)


def run_sampler(args: argparse.Namespace) -> None:
    """Print the decode figures of the engine at ``args.sampler_arch`` (module docstring)."""
    import jax

    from rlflow.config import MeshConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.models import build_model
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.sampling import SamplingParams

    arch, slots, plen, new = args.sampler_arch, args.slots, args.sampler_prompt, args.sampler_new
    device = jax.devices()[0]
    engine = state = params = None
    try:
        model, _ = build_model(model_config(arch, "bfloat16"))
        engine = RlflowEngine(model, SamplerConfig(
            num_slots=slots, max_prefill_length=plen, prefill_buckets=(plen,), max_tokens=new,
            group_size=1, temperature=1.0), mesh=make_mesh(MeshConfig(), [device]))
        del model
        sampling = SamplingParams(temperature=1.0, max_tokens=new, stop_token_ids=())
        prompt = np.random.default_rng(0).integers(1, ARCHS[arch]["vocab_size"], size=plen)
        params = engine.load_params()
        padded, n = engine.pad_prompt(prompt.astype(np.int32))
        prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n,
                                sampling=sampling)
        state = engine.insert_batch(prefix, engine.init_decode_state(), [0] * slots,
                                    list(range(slots)), list(range(slots)))
        steps = engine.decode_steps_per_call
        calls = max(1, new // steps - 1)
        state, out = engine.generate_packed(params, state)            # compile + warm-up
        np.asarray(out)
        t0 = time.perf_counter()
        for _ in range(calls):
            state, out = engine.generate_packed(params, state)
            np.asarray(out)
        per_step = (time.perf_counter() - t0) / (calls * steps)
        peak = hbm_peak(device)
    except Exception as e:  # noqa: BLE001 - only out-of-memory is caught, the rest re-raised
        oom_figure(e, f"accel_sampler_oom_{arch}", f"{slots} slots x {plen}+{new}")
        return
    finally:
        del engine, state, params
        gc.collect()
    what = (f"{arch} bf16, {slots} slots, {plen}-token prompts, {calls * steps} decode steps "
            f"timed ({steps} per call), {device.device_kind}")
    print(f"RESULT accel_decode_tokens_per_s_{arch} {slots / per_step:.1f} tokens/s {what}")
    print(f"RESULT accel_decode_ms_per_step_{arch} {per_step * 1e3:.3f} ms all slots, one step")
    if peak is not None:
        print(f"RESULT accel_sampler_hbm_peak_gib_{arch} {peak / GIB:.3f} GiB memory_stats "
              f"peak_bytes_in_use (the process's maximum so far)")
    sys.stdout.flush()


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = parse_args(argv)
    import jax

    note = resolve_sizes(args, jax.default_backend())
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"learner", "sampler"}
    archs = [a for a in args.archs.split(",") if a]
    if unknown or not set(archs) <= set(ARCHS) or args.sampler_arch not in ARCHS:
        raise SystemExit(f"unknown --parts {sorted(unknown)} or architecture in "
                         f"{archs + [args.sampler_arch]} (have {sorted(ARCHS)})")
    print(f"# jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}; "
          f"{note}", flush=True)
    if "learner" in parts:
        for arch in archs:
            for t in (int(x) for x in args.lengths.split(",") if x):
                run_learner(arch, t, args)
    if "sampler" in parts:
        run_sampler(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
