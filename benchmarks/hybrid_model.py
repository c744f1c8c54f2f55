"""Qwen3.5-shaped hybrids (gated DeltaNet + gated full attention, issue 51): the learner's
compile time against depth, and the sampler's decode state against a dense model's.

Figures (``RESULT`` lines, benchmarks/README.md):

* ``hybrid_train_step_compile_24_over_4``: compile time of the learner's whole train step
  (:meth:`rlflow.learner.trainer.Learner.compiled_step`: forward, loss, backward, clipping
  and the optax update; ``learner.micro_batches`` 2) of a tiny Qwen3.5-shaped model (hidden
  64, ``[linear x3, full]`` cycles: 2 DeltaNet key heads / 4 value heads of 16, conv 4; 4
  attention heads / 2 KV heads of 16 with the output gate and partial RoPE), 24 layers over 4
  layers, one row of 128 tokens (target <= 1.5: the cycle of layer kinds runs under one scan,
  :mod:`rlflow.models.layer_pattern`; 6 = compile time linear in depth), with
  ``hybrid_train_step_compile_s_<L>_layers`` the seconds of each (best of two, interleaved:
  a process's first compile pays one-time costs). ``hybrid_train_step_compile_24_over_8``:
  the same against 8 layers. The 4-layer model is one cycle: its scan has one step, which
  XLA's while-loop simplifier removes (the optimised HLO of its grad step is half the size
  of the 8- and 24-layer ones, which are the same size), so 24 over 4 also measures a loop
  against no loop; 24 over 8 is the depth alone. Random weights written as Hugging Face
  folders in a temporary directory.
* ``hybrid_state_mib_<T>`` / ``dense_state_mib_<T>`` / ``hybrid_state_over_dense_<T>``: the
  sampler's decode state of one slot holding ``T`` tokens (2K, 8K, 32K), in bfloat16, of the
  Qwen3.5-35B-A3B shape (transformers' ``Qwen3_5MoeTextConfig`` defaults: 40 layers, 30 gated
  DeltaNet, 10 full attention of 2 KV heads x 256) against a dense model of the same depth
  (the same attention in all 40 layers): the bytes of the arrays the sampler allocates,
  ``jax.eval_shape`` of :func:`rlflow.models.kv_cache.init_cache` (what
  :class:`rlflow.sampler.engine.RlflowEngine` builds its contiguous cache with; nothing is
  allocated). ``hybrid_state_growth_over_dense`` = (32K - 2K bytes) of the hybrid over the
  dense model's: only the full-attention layers grow (10 / 40 = 0.25 expected), a DeltaNet
  layer's state (conv window + ``[32, 128, 128]`` float32 matrix) is the same at every
  length.

Measured on the shared 2-core host (2026-12-08, branch h-fam2; the compile figures move with
the load of other sessions, best of two each): 24 over 4 layers 1.35x at load ~2-4 (17.2 /
23.2 s; 8 layers 32.3 s), 1.62x at load ~7 (29.5 / 47.8 s), 1.94x at load ~8 (37.6 / 73.1 s,
4 and 24 only). Decode state of a slot, hybrid over dense: 0.634x at 2K (101.4 / 160.0 MiB),
0.346x at 8K (221.4 / 640.0 MiB), 0.274x at 32K (701.4 / 2560.0 MiB); growth 0.250x.

Usage: ``.venv/bin/python benchmarks/hybrid_model.py [--state-only | --compile-only]``
(the compiles take one to a few minutes on 2 shared cores; the state lines a few seconds).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2 ** 20
LENGTHS = (2048, 8192, 32768)
#: the tiny model of the compile lines (DecoderConfig fields; ``configs/hybrid_demo.py``'s)
TINY = dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128,
            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
            partial_rotary_factor=0.25, tie_word_embeddings=True, qk_norm=True,
            attn_output_gate=True,
            gdn=dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                     conv_kernel=4))


def qwen35_layer_types(n: int) -> tuple[str, ...]:
    """Qwen3.5's pattern: every fourth layer full attention, the others gated DeltaNet."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))


def write_tiny(out_dir: str, layers: int) -> str:
    """A random tiny Qwen3.5-shaped model of ``layers`` layers as a HF folder."""
    from flax import nnx

    from rlflow.models import Decoder, DecoderConfig, save_hf

    cfg = DecoderConfig(num_layers=layers, layer_types=qwen35_layer_types(layers),
                        bos_token_id=1, eos_token_ids=(2,), pad_token_id=0, **TINY)
    save_hf(Decoder(cfg, rngs=nnx.Rngs(params=0)), cfg, out_dir)
    return out_dir


def compile_s(path: str, seq: int) -> float:
    """Seconds the one-device learner of the model at ``path`` takes to compile its whole
    train step for a ``[2, seq]`` batch."""
    import jax

    from rlflow.config import (ExperimentConfig, LearnerConfig, MeshConfig, ModelConfig,
                               RuntimeConfig, SamplerConfig)
    from rlflow.learner.trainer import Learner
    from rlflow.mesh import make_mesh

    half = seq // 2
    cfg = ExperimentConfig(
        model=ModelConfig(path=path),
        sampler=SamplerConfig(group_size=2, max_prefill_length=half, prefill_buckets=(half,),
                              max_tokens=seq - half),
        learner=LearnerConfig(groups_per_step=1, micro_batches=2, seq_buckets=(seq,),
                              packing=False, shared_prefix=False),
        runtime=RuntimeConfig(max_staleness=1000))
    learner = Learner(cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    learner.compiled_step(2, seq)
    return learner.last_compile_s


def compile_lines() -> None:
    seq, secs = 128, {4: float("inf"), 8: float("inf"), 24: float("inf")}
    with tempfile.TemporaryDirectory(prefix="hybrid-bench-") as tmp:
        paths = {n: write_tiny(os.path.join(tmp, f"l{n}"), n) for n in secs}
        for layers in (4, 8, 24) * 2:       # best of two, interleaved
            secs[layers] = min(secs[layers], compile_s(paths[layers], seq))
    for layers in secs:
        print(f"RESULT hybrid_train_step_compile_s_{layers}_layers {secs[layers]:.2f} s whole "
              f"train step, tiny Qwen3.5 shape (hidden 64, [linear x3, full]), one row of "
              f"{seq} tokens", flush=True)
    print(f"RESULT hybrid_train_step_compile_24_over_4 {secs[24] / secs[4]:.2f} x target<=1.5 "
          f"(the cycle of layer kinds under one scan); 6 = linear in depth", flush=True)
    print(f"RESULT hybrid_train_step_compile_24_over_8 {secs[24] / secs[8]:.2f} x 3 = linear "
          f"in depth; 4 layers are one cycle, a scan of one step that XLA unrolls (no loop), "
          f"8 and 24 layers a loop of 2 and 6 steps", flush=True)


def state_bytes(cfg, tokens: int) -> int:
    """Bytes of one slot's decode state of ``cfg`` at ``tokens`` positions: the arrays of
    :func:`rlflow.models.kv_cache.init_cache` (``jax.eval_shape``: shapes only)."""
    import jax
    import numpy as np

    from rlflow.models.kv_cache import init_cache

    shapes = jax.eval_shape(lambda: init_cache(cfg, 1, tokens))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(shapes))


def state_lines() -> None:
    import transformers

    from rlflow.models.config import DecoderConfig

    hf = transformers.Qwen3_5MoeTextConfig().to_dict()          # Qwen3.5-35B-A3B's shape
    hybrid = DecoderConfig.from_hf_dict(hf, dtype="bfloat16", param_dtype="bfloat16")
    dense = hybrid.replace(layer_types=("full_attention",) * hybrid.num_layers)
    full = hybrid.kinds.count("full_attention")
    shape = (f"Qwen3.5-35B-A3B shape, {hybrid.num_layers} layers ({full} full attention, "
             f"{hybrid.num_layers - full} gated DeltaNet), one slot, bfloat16")
    got = {}
    for t in LENGTHS:
        h, d = state_bytes(hybrid, t), state_bytes(dense, t)
        got[t] = (h, d)
        print(f"RESULT hybrid_state_mib_{t} {h / MIB:.2f} MiB {shape}", flush=True)
        print(f"RESULT dense_state_mib_{t} {d / MIB:.2f} MiB the same depth, every layer "
              f"full attention", flush=True)
        print(f"RESULT hybrid_state_over_dense_{t} {h / d:.3f} x", flush=True)
    lo, hi = LENGTHS[0], LENGTHS[-1]
    growth = (got[hi][0] - got[lo][0]) / (got[hi][1] - got[lo][1])
    print(f"RESULT hybrid_state_growth_over_dense {growth:.3f} x {lo} -> {hi} tokens; "
          f"expected {full}/{hybrid.num_layers} = {full / hybrid.num_layers:.3f} (only the "
          f"full-attention layers grow)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-only", action="store_true")
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if not args.compile_only:
        state_lines()
    if not args.state_only:
        compile_lines()
    return 0


if __name__ == "__main__":
    sys.exit(main())
