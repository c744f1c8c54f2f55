"""GRPO on GSM8K with any local Hugging Face model: ``--model.path`` is required.

    rlflow train --config configs/gsm8k.py --model.path ~/models/Qwen2.5-0.5B-Instruct

Data: GSM8K JSONL (``question``; ``answer`` ending ``#### <number>``), by default
``<repo>/../shared/data/gsm8k/train.jsonl``; point ``--data.path`` at another copy (or
``test.jsonl``). The question goes into the model's own chat template (``data.chat_template
"hf"``) as the user message, followed by the instruction below (the prompt of verl's GSM8K
recipe). Reward: ``math_verify`` (1 when the completion's final answer, after ``####`` or in
``\\boxed{}``, equals the reference number under math-verify, else 0).

Held-out evaluation (off by default): ``--eval.every-steps N`` evaluates the first 64 questions
of ``test.jsonl`` (next to the default training file; ``--eval.path`` another) greedily every N
steps, the same template and reward; ``rlflow eval --run runs/gsm8k`` evaluates a checkpoint.

Precision: the learner keeps float32 master weights and Adam state; the sampler runs in
bfloat16 (``sampler.dtype``), as verl's vLLM rollouts do. Each version is published already
rounded to bf16 (``ExperimentConfig.published_dtype``): half the bytes per weight sync, and
a version's delta against the previous one (``--runtime.weight-sync delta``) is ~4% of the
full model at this lr instead of ~44% for float32 (``benchmarks/weight_sync_delta.py``). A
decode step reads half the weight bytes. The behaviour logprobs are then those of the
bf16 policy; the learner recomputes the old policy's logprobs in float32
(``learner.off_policy="decoupled"``) and corrects the gap with its default rollout
correction (token-level truncated importance weight, cap 2), logging ``mismatch/*``.

Sizes are for one accelerator host; a laptop run of a tiny model overrides them, e.g.
``--learner.num-steps 3 --sampler.max-tokens 16 --learner.groups-per-step 2
--metrics.samples-every 1``.
"""

import os

from rlflow.config import (DataConfig, EvalConfig, ExperimentConfig, LearnerConfig,
                           RewardConfig, RuntimeConfig, SamplerConfig)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "gsm8k", "train.jsonl"))
DEFAULT_EVAL = os.path.join(os.path.dirname(DEFAULT_DATA), "test.jsonl")
INSTRUCTION = "{prompt} Let's think step by step and output the final answer after \"####\"."


def config() -> ExperimentConfig:
    return ExperimentConfig(
        name="gsm8k",
        data=DataConfig(source="jsonl", path=DEFAULT_DATA, prompt_field="question",
                        answer_field="answer", chat_template="hf", plain_template=INSTRUCTION,
                        max_prompt_tokens=256),
        reward=RewardConfig(functions=("math_verify",), weights=(1.0,), timeout_s=10.0),
        sampler=SamplerConfig(num_slots=64, max_prefill_length=256,
                              prefill_buckets=(64, 128, 256), max_tokens=512, group_size=8,
                              temperature=1.0, dtype="bfloat16"),
        learner=LearnerConfig(num_steps=200, groups_per_step=8, lr=1e-6, warmup_steps=10,
                              advantage="grpo", loss_agg="token-mean", clip_low=0.2,
                              clip_high=0.28, max_grad_norm=1.0),
        runtime=RuntimeConfig(mode="async", max_staleness=1),
        eval=EvalConfig(every_steps=0, path=DEFAULT_EVAL, num_prompts=64),
    )
