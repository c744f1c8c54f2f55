"""GRPO on GSM8K episodes with a sandboxed Python calculator: ``--model.path`` is required.

    rlflow train --config configs/gsm8k_calculator.py --model.path ~/models/Qwen2.5-0.5B-Instruct

Environment ``gsm8k_calculator`` (``rlflow.envs.gsm8k_calculator``): a system prompt describes
the ``python`` tool and the Hermes/Qwen call format (``<tool_call>{"name": "python",
"arguments": {"code": ...}}</tool_call>``); each tool call runs in the sandbox (own process, CPU
time, memory and wall-clock limits, no network) and its output comes back as a ``tool``
message; a reply without a tool call is the final answer, rewarded by math-verify against
the GSM8K answer (1 or 0). Up to 4 tool calls and 5 assistant turns per episode, 1024 tokens
per episode after the prompt (sampled and tool tokens together; the loss covers the sampled
ones only).

Data: GSM8K JSONL (``question``; ``answer`` ending ``#### <number>``), by default
``<repo>/../shared/data/gsm8k/train.jsonl``. The record the environment gets is
``{"prompt": <question>, "answer": ...}`` (``data.chat_template="plain"`` with
``"{prompt}"`` keeps the question as is; the environment renders the conversation with the
model's own chat template, which must be able to render ``system``, ``user``, ``assistant``
and ``tool`` messages).

Sizes are for one accelerator host; a laptop run of a tiny model overrides them (see
``tests/e2e/test_episodes_e2e.py``).
"""

import os

from rlflow.config import (DataConfig, EnvConfig, ExperimentConfig, LearnerConfig,
                           RuntimeConfig, SamplerConfig)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "gsm8k", "train.jsonl"))


def config() -> ExperimentConfig:
    return ExperimentConfig(
        name="gsm8k_calculator",
        data=DataConfig(source="jsonl", path=DEFAULT_DATA, prompt_field="question",
                        answer_field="answer", chat_template="plain",
                        plain_template="{prompt}", max_prompt_tokens=512),
        env=EnvConfig(name="gsm8k_calculator",
                      options=("max_tool_calls=4", "timeout_s=10", "cpu_s=5", "memory_mb=512"),
                      max_turns=5, max_episode_tokens=1024, step_timeout_s=60.0,
                      num_workers=8),
        sampler=SamplerConfig(num_slots=64, max_prefill_length=512,
                              prefill_buckets=(128, 256, 512), max_tokens=1024, group_size=8,
                              temperature=1.0),
        learner=LearnerConfig(num_steps=200, groups_per_step=8, lr=1e-6, warmup_steps=10,
                              advantage="grpo", loss_agg="token-mean", clip_low=0.2,
                              clip_high=0.28, max_grad_norm=1.0),
        runtime=RuntimeConfig(mode="async", max_staleness=1),
    )
