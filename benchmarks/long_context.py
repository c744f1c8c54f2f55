"""Long rows in the learner: XLA's compiled memory of the train step against the memory
model, from 2K to 32K tokens per row, and compile time against depth (issue 43).

Compiles only (``lower().compile()``: nothing runs, nothing is allocated) the learner's grad
step (:func:`rlflow.learner.step.make_grad_fn` with ``StepSettings.from_config`` of an
``ExperimentConfig``, as :class:`rlflow.learner.trainer.Learner` builds it, so
``learner.remat`` and any other learner field given on the command line reach it) for one
row of ``T`` tokens per micro-batch, on one device, and reads
``compiled.memory_analysis()``: ``temp_size_in_bytes`` is what the step needs beyond its
arguments and outputs (activations kept for the backward, gradient accumulators, the layers'
stacked parameters, ...).

Models: the GSM8K headline model (4.46M: hidden 256, 4 layers, ``benchmarks/_gsm8k_model.py``)
and a hidden-512 / 8-layer one of the same family, at 2K, 4K, 8K, 16K and 32K tokens per
row. The memory model's estimate of the same figure is
``learner_memory(...).activations + .grads`` (:mod:`rlflow.learner.memory`).

Figures (``RESULT`` lines, benchmarks/README.md):

* ``learner_temp_bytes_16k_over_2k``: compiled temporaries at 16K over 2K tokens, 4.46M model
  (target <= 9: linear in T; the ``[T, T]`` attention scores make it quadratic);
* ``learner_temp_mib_<model>_<T>`` and ``memory_model_over_compiled_<model>_<T>`` per length
  (target within 25%: 0.75..1.25);
* ``train_step_compile_28_over_4``: compile time of the learner's whole train step
  (:meth:`rlflow.learner.trainer.Learner.compiled_step`: forward, loss, backward, micro-batch
  accumulation, clipping and the optax update) of a tiny-width model of the same family
  (hidden 64, one row of 128 tokens) with 28 layers over 4 layers (target ~1: the layers are
  stored stacked and run under one scan, so neither the layer body nor the optimiser's
  per-parameter work is repeated per layer; 7 = compile time linear in depth), with
  ``train_step_compile_s_<L>_layers`` the seconds of each (best of two compiles, interleaved:
  a process's first compile also pays one-time costs).

Usage: ``.venv/bin/python benchmarks/long_context.py [--remat full] [--attention ...]
[--lengths 2048,4096,...] [--depth-only]``; ``--remat`` / ``--attention`` set
``learner.remat`` / ``learner.attention`` when the config has the field (an unknown field is
an error); ``--depth-only`` prints the compile-time lines alone (about a minute).
``LONG_CONTEXT_BIG_MAX`` (default 32768): the longest row compiled for the hidden-512 model
(lower it if a compile takes too long on a slow machine; each took 5-45 s on 2 shared cores,
the whole script about 6 minutes under load).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

LENGTHS = (2048, 4096, 8192, 16384, 32768)
MIB = 2 ** 20


def experiment(model, seq: int, learner_overrides: dict):
    """A one-device experiment whose only bucket is ``seq`` tokens, a step of one group of 2
    samples in 2 micro-batches: one row per micro-batch (GRPO needs 2 samples a group)."""
    from rlflow.config import ExperimentConfig, LearnerConfig, RuntimeConfig, SamplerConfig

    half = seq // 2
    return ExperimentConfig(
        model=model,
        sampler=SamplerConfig(group_size=2, max_prefill_length=half, prefill_buckets=(half,),
                              max_tokens=seq - half),
        learner=LearnerConfig(groups_per_step=1, micro_batches=2, seq_buckets=(seq,),
                              packing=False, **learner_overrides),
        runtime=RuntimeConfig(max_staleness=1000))


def compile_step(cfg, seq: int):
    """``(compiled grad step, compile seconds)`` of ``cfg``'s learner for a ``[2, seq]``
    batch: :func:`rlflow.learner.step.make_grad_fn` with ``StepSettings.from_config(cfg)``
    (the learner's forward, loss, backward and micro-batch accumulation; the optimiser update
    adds only parameter-sized buffers), on abstract parameters (nothing is initialised)."""
    import jax
    from flax import nnx

    from rlflow.config import MeshConfig, replace
    from rlflow.learner.step import StepSettings, make_grad_fn
    from rlflow.learner.step_jit import abstract_batch
    from rlflow.mesh import make_mesh
    from rlflow.models.config import DecoderConfig
    from rlflow.models.decoder import Decoder

    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    dcfg = DecoderConfig.from_model_config(replace(cfg.model, dtype=cfg.learner.compute_dtype))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(dcfg, rngs=nnx.Rngs(0))),
                                 nnx.Param)
    grad_fn = make_grad_fn(graphdef, StepSettings.from_config(cfg), mesh)
    t0 = time.perf_counter()
    compiled = jax.jit(grad_fn).lower(params, abstract_batch(2, seq, mesh), None).compile()
    return compiled, time.perf_counter() - t0


def train_step_compile_s(cfg, seq: int) -> float:
    """Seconds the learner of ``cfg`` (one device) takes to compile its whole train step for
    a ``[2, seq]`` batch (:meth:`rlflow.learner.trainer.Learner.compiled_step`)."""
    import jax

    from rlflow.config import MeshConfig
    from rlflow.learner.trainer import Learner
    from rlflow.mesh import make_mesh

    learner = Learner(cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    learner.compiled_step(2, seq)
    return learner.last_compile_s


def depth_lines(model_config, overrides: dict, note: str) -> None:
    """The ``train_step_compile_*`` lines (module doc): 4 and 28 layers, same width."""
    seq, secs = 128, {4: float("inf"), 28: float("inf")}
    # best of two, interleaved: the first compile of a process also pays one-time costs
    for layers in (4, 28, 4, 28):
        cfg = experiment(model_config(hidden=64, layers=layers), seq, overrides)
        secs[layers] = min(secs[layers], train_step_compile_s(cfg, seq))
    for layers in (4, 28):
        print(f"RESULT train_step_compile_s_{layers}_layers {secs[layers]:.2f} s whole train "
              f"step, hidden 64, one row of {seq} tokens, {note}", flush=True)
    print(f"RESULT train_step_compile_28_over_4 {secs[28] / secs[4]:.2f} x target ~1 (stacked "
          f"layers under one scan); 7 = compile time linear in depth", flush=True)


def model_estimate(cfg) -> float:
    """The memory model's figure comparable to compiled temporaries: activations + the
    float32 gradient accumulator (bytes)."""
    from rlflow.learner.memory import Architecture, learner_memory

    mem = learner_memory(Architecture.from_model_config(cfg.model), cfg)
    return mem.activations + mem.grads


def learner_overrides(args) -> dict:
    from rlflow.config import LearnerConfig

    fields = {f.name for f in dataclasses.fields(LearnerConfig)}
    out = {}
    for name in ("remat", "attention"):
        value = getattr(args, name)
        if value is None:
            continue
        if name not in fields:
            raise SystemExit(f"--{name}: this rlflow's LearnerConfig has no field "
                             f"learner.{name} (fields: {', '.join(sorted(fields))})")
        out[name] = value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remat", default=None, help="learner.remat (default: the config's)")
    parser.add_argument("--attention", default=None,
                        help="learner.attention, when the config has the field")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="tokens per row, comma-separated")
    parser.add_argument("--depth-only", action="store_true",
                        help="only the compile time at 4 vs 28 layers")
    args = parser.parse_args()
    from _gsm8k_model import model_config

    overrides = learner_overrides(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    big_max = int(os.environ.get("LONG_CONTEXT_BIG_MAX", "32768"))
    settings = experiment(model_config(), lengths[0], overrides).learner
    note = f"remat={settings.remat}" + (
        f" attention={settings.attention}" if hasattr(settings, "attention") else "")
    if args.depth_only:
        depth_lines(model_config, overrides, note)
        return 0
    temps: dict[tuple[str, int], float] = {}
    for name, model in (("4m", model_config()), ("h512l8", model_config(hidden=512, layers=8))):
        for seq in lengths:
            if name == "h512l8" and seq > big_max:
                print(f"# skipped {name} at {seq} tokens: above LONG_CONTEXT_BIG_MAX={big_max} "
                      f"(set to bound the compile time on a slow machine)", flush=True)
                continue
            cfg = experiment(model, seq, overrides)
            compiled, secs = compile_step(cfg, seq)
            temp = float(compiled.memory_analysis().temp_size_in_bytes)
            est = model_estimate(cfg)
            temps[(name, seq)] = temp
            print(f"RESULT learner_temp_mib_{name}_{seq} {temp / MIB:.1f} MiB compiled "
                  f"temporaries, one row, {note}; compile {secs:.1f} s", flush=True)
            print(f"RESULT memory_model_over_compiled_{name}_{seq} {est / temp:.3f} x "
                  f"target 0.75..1.25; estimate {est / MIB:.1f} MiB (activations + grads)",
                  flush=True)
    if ("4m", 2048) in temps and ("4m", 16384) in temps:
        ratio = temps[("4m", 16384)] / temps[("4m", 2048)]
        print(f"RESULT learner_temp_bytes_16k_over_2k {ratio:.2f} x target<=9 (linear in T); "
              f"4.46M GSM8K model, one row, {note}")
    depth_lines(model_config, overrides, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
