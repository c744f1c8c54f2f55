"""LoRA adapter-only weight sync against full weights, on the same model, in the same run.

1. Bytes per version: the adapter tree vs the full parameter tree (``sync/bytes_per_version``).
2. Publish -> swap: a learner process (its own JAX runtime) publishes versions through
   ``WeightPublisher`` + coordinator over loopback; this process is the sampler: it polls,
   pulls, turns the pulled tree into engine parameters (LoRA: ``AdapterApplier``, in both
   swap modes) and places them (``engine.load_params``) until ready. Same-host clock.
3. Sampler decode step with the adapters in the forward vs merged into the kernels vs the
   plain model (``generate`` on all slots busy), i.e. what each swap mode costs per token.
4. Learner step time with and without LoRA (same batch, same model).

Printed (``<size>``: ``--size``; each ratio after the raw figures it comes from)::

    RESULT lora_bytes_ratio_<size> <x> x fewer bytes per version: adapters <B>, full <B>
    RESULT lora_publish_to_swap_<size>_{full,forward,merged} <ms> ms
    RESULT lora_publish_to_swap_speedup_<size>_{forward,merged} <x> x
    RESULT lora_decode_step_<size>_{plain,forward,merged} <ms> ms
    RESULT lora_decode_step_ratio_<size>_{forward,merged} <x> x
    RESULT lora_learner_step_<size>_{full,lora} <ms> ms
    RESULT lora_learner_step_ratio_<size> <x> x

The default size "medium" (vocab 8192, hidden 512, 6 layers, MLP 1536; learner batch 8 x 48
tokens) makes the learner step compute-bound on CPU (tens of GFLOP per step). Measured on 2
CPU cores shared with other jobs (load ~25, so only the ratios mean much): rank 8, 58.4 x
fewer bytes per version (1.87 MB vs 109 MB); learner step 8.5 s with LoRA vs 33.5 s full
(ratio 0.25: no kernel gradients, AdamW over the adapters only).

Usage: ``python benchmarks/lora_sync.py [--size demo|medium] [--rank 8] [--repeats 5]
[--parts bytes,swap,decode,step]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARTS = ("bytes", "swap", "decode", "step")
SIZES = {
    "demo": dict(vocab_size=16, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16),
    "medium": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=6,
                   num_heads=8, num_kv_heads=4, head_dim=64),
}


def _model_cfg(size):
    from rlflow.config import ModelConfig
    return ModelConfig(tie_word_embeddings=False, init_seed=0, **SIZES[size])


def _trees(size, rank):
    """(model, decoder cfg, spec, adapters, base) of the benchmark model."""
    from rlflow.models.hf import build_model
    from rlflow.models.lora import LoraSpec
    from rlflow.models.lora_decoder import lora_model_parts

    model, dcfg = build_model(_model_cfg(size))
    spec = LoraSpec(rank=rank, alpha=2.0 * rank)
    _, adapters, base = lora_model_parts(model, dcfg, spec)
    return model, dcfg, spec, adapters, base


def learner_peer(size: str, rank: int, what: str) -> None:
    """Peer: publish version v of the full tree or the adapters on "publish <v>"."""
    import jax
    from rlflow.exchange.coordinator import Coordinator
    from rlflow.exchange.transfer import WeightPublisher

    _, _, _, adapters, base = _trees(size, rank)
    tree = adapters if what == "lora" else base
    pub = WeightPublisher(pull_timeout_s=120, donated=False)   # new arrays every version
    coord = Coordinator(pub).start()
    print("READY", coord.address, flush=True)
    for line in sys.stdin:
        parts = line.split()
        if parts[:1] == ["publish"]:
            v = int(parts[1])
            new = jax.tree.map(lambda x: x + v * 1e-3, tree)      # a new version's values
            jax.block_until_ready(new)
            t0 = time.time()
            pub.publish(v, new)
            print("PUBLISHED", v, t0, flush=True)
        elif parts[:1] == ["quit"]:
            break
    coord.close()


def publish_to_swap(size, rank, what, mode, repeats, warmup=2) -> float:
    """Median publish -> engine-params-ready seconds over ``repeats`` versions."""
    import jax
    import numpy as np
    from rlflow.exchange.transfer import WeightSubscriber
    from rlflow.sampler.lora_swap import AdapterApplier

    model, dcfg, spec, adapters, base = _trees(size, rank)
    applier = AdapterApplier(model, dcfg, spec, mode) if what == "lora" else None
    target = applier.target if applier else base
    peer = subprocess.Popen([sys.executable, __file__, "peer", size, str(rank), what],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = peer.stdout.readline().split()
        assert line[:1] == ["READY"], line
        sub = WeightSubscriber(line[1], consumer_id="bench", target=target, timeout_s=120,
                               retries=0)
        times = []
        for v in range(1, warmup + repeats + 1):
            peer.stdin.write(f"publish {v}\n")
            peer.stdin.flush()
            _, _, t0 = peer.stdout.readline().split()
            got = None
            while got is None or got[0] != v:
                got = sub.poll()
            params = got[1] if applier is None else applier.engine_params(got[1])
            jax.block_until_ready(params)
            if v > warmup:
                times.append(time.time() - float(t0))
        sub.close()
        return float(np.median(times))
    finally:
        peer.stdin.write("quit\n")
        peer.stdin.flush()
        peer.wait(timeout=60)


def decode_step(size, rank, mode, repeats) -> float:
    """Best seconds of one ``generate`` call (all slots busy); mode "plain": no adapters."""
    import jax
    from _timing import best_of
    from rlflow.config import SamplerConfig
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.lora_swap import AdapterApplier

    model, dcfg, spec, adapters, _ = _trees(size, rank)
    cfg = SamplerConfig(num_slots=8, max_prefill_length=16, prefill_buckets=(16,),
                        max_tokens=64, decode_steps_per_call=1)
    if mode == "plain":
        engine = RlflowEngine(model, cfg)
        params = engine.load_params(None, 0)
    else:
        applier = AdapterApplier(model, dcfg, spec, mode)
        engine = RlflowEngine(applier.engine_model, cfg)
        params = engine.load_params(applier.engine_params(adapters), 0)
    state = engine.init_decode_state()

    def run():
        nonlocal state
        state, out = engine.generate(params, state)
        jax.block_until_ready(out)

    run()
    return best_of(run, repeats)


def learner_step(size, rank, repeats) -> float:
    """Best seconds of one learner step on a fixed batch (rank 0: full weights)."""
    from _timing import best_of
    from rlflow.config import (ExperimentConfig, LearnerConfig, LoraConfig, MeshConfig,
                               SamplerConfig)
    from rlflow.learner.trainer import Learner
    from rlflow.mesh import make_mesh
    import jax

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
    from learner_fixtures import make_group_records

    g, t = 4, 32
    cfg = ExperimentConfig(model=_model_cfg(size),
                           sampler=SamplerConfig(group_size=g, max_tokens=t,
                                                 max_prefill_length=16, prefill_buckets=(16,)),
                           learner=LearnerConfig(groups_per_step=2, seq_buckets=(48,),
                                                 lora=LoraConfig(rank=rank)))
    learner = Learner(cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    batch, _ = learner.build_batch(make_group_records(
        0, 2, vocab=cfg.model.vocab_size, group_size=g, max_tokens=t))
    learner.step(batch)
    return best_of(lambda: learner.step(batch), repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="medium")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated subset of {','.join(PARTS)} (default: all)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    bad = sorted(set(parts) - set(PARTS))
    if bad:
        ap.error(f"--parts: unknown {bad}; known: {', '.join(PARTS)}")
    from rlflow.models.lora import tree_bytes

    size = args.size
    if "bytes" in parts:
        _, _, _, adapters, base = _trees(size, args.rank)
        ab, fb = tree_bytes(adapters), tree_bytes(base)
        print(f"RESULT lora_bytes_ratio_{size} {fb / ab:.1f} x fewer bytes per version: "
              f"adapters {ab} B, full weights {fb} B", flush=True)
    if "swap" in parts:
        full = publish_to_swap(size, args.rank, "full", None, args.repeats)
        print(f"RESULT lora_publish_to_swap_{size}_full {full * 1e3:.1f} ms", flush=True)
        for mode in ("forward", "merged"):
            t = publish_to_swap(size, args.rank, "lora", mode, args.repeats)
            print(f"RESULT lora_publish_to_swap_{size}_{mode} {t * 1e3:.1f} ms", flush=True)
            print(f"RESULT lora_publish_to_swap_speedup_{size}_{mode} {full / t:.2f} x "
                  f"full weights / adapters", flush=True)
    if "decode" in parts:
        plain = decode_step(size, args.rank, "plain", args.repeats)
        print(f"RESULT lora_decode_step_{size}_plain {plain * 1e3:.2f} ms", flush=True)
        for mode in ("forward", "merged"):
            t = decode_step(size, args.rank, mode, args.repeats)
            print(f"RESULT lora_decode_step_{size}_{mode} {t * 1e3:.2f} ms", flush=True)
            print(f"RESULT lora_decode_step_ratio_{size}_{mode} {t / plain:.2f} x vs the plain "
                  f"model", flush=True)
    if "step" in parts:
        full_step = learner_step(size, 0, args.repeats)
        print(f"RESULT lora_learner_step_{size}_full {full_step * 1e3:.1f} ms", flush=True)
        lora_step = learner_step(size, args.rank, args.repeats)
        print(f"RESULT lora_learner_step_{size}_lora {lora_step * 1e3:.1f} ms rank "
              f"{args.rank}", flush=True)
        print(f"RESULT lora_learner_step_ratio_{size} {lora_step / full_step:.2f} x LoRA / full "
              f"weights, same batch", flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["peer"]:
    learner_peer(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    sys.exit(0)
if __name__ == "__main__":
    main()
