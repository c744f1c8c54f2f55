"""The gateway demo: an agent program written only against the ``openai`` client
(``configs/agents/gateway_demo_agent.py``: ``guess_digit`` with a ``guess`` tool) trains
through the sampler's OpenAI-compatible gateway on CPU, no download.

Each leased prompt (a hidden digit 0-4) becomes 8 agent sessions; the agent runner process
runs the agent function for each (64 at a time), the agent calls
``/s/<session>/v1/chat/completions`` with its whole history each turn, and the gateway
records each session's episode (the ids the sampler generated, their behaviour logprobs and
policy versions; the tool results and the prompt are not in the loss). The 8 sessions of a
prompt are its GRPO group; the reward is what the agent function returns.

Model: the demo's tiny Llama (``configs/demo.py``: hidden 64, 2 layers) with random weights,
the ``guess_digit_tools`` task's 20-token character tokenizer (its chat template renders tool
results as user turns), written once into ``$RLFLOW_CACHE_DIR/gateway-demo-model-<hash>``.
Settings as ``configs/multiturn_demo.py`` (8 prompts x 8 sessions per step, at most 16 tokens
per episode after the prompt, async with staleness 2, 300 steps, lr 2e-3).

Measured on 2 shared CPU cores (load average about 35 from other jobs): 1,505 s wall clock;
mean reward of the first 10% of steps 0.145, of the last 10% 0.462 (rise +0.32; one run).
46,522 gateway calls in 19,227 sessions (2.4 per session, each re-sending its history): every
recorded id reused, 0 branches, 0 failed or expired sessions; 879 calls refused with
``context_length_exceeded`` (the episode's 16 tokens used up: reward 0, as the multi-turn
demo's episodes cut at the token limit).
"""

import hashlib
import json
import os

from rlflow.config import (BufferConfig, CheckpointConfig, DataConfig, ExperimentConfig,
                           GatewayConfig, LearnerConfig, MetricsConfig, ModelConfig,
                           RuntimeConfig, SamplerConfig, config_module)

TASK = "guess_digit_tools"
HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "agents", "gateway_demo_agent.py")


def _demo():
    return config_module(os.path.join(HERE, "demo.py"))


def model_path() -> str:
    """The cached model folder (built on first use)."""
    demo = _demo()
    key = hashlib.sha256(json.dumps([TASK, demo.ARCH, demo.INIT_SEED], sort_keys=True).encode())
    path = os.path.join(demo.cache_dir(), f"gateway-demo-model-{key.hexdigest()[:12]}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        demo.build_model_folder(path, task=TASK)
    return path


def config() -> ExperimentConfig:
    group_size, groups, episode_tokens = 8, 8, 16
    return ExperimentConfig(
        name="gateway_demo",
        run_dir="runs",
        model=ModelConfig(path=model_path()),
        data=DataConfig(source="builtin", task=TASK, chat_template="none",
                        max_prompt_tokens=8),
        gateway=GatewayConfig(agent=f"{AGENT}:agent", agent_threads=64,
                              tool_parser=f"{AGENT}:parse_guess", session_timeout_s=120.0),
        sampler=SamplerConfig(num_slots=32, max_prefill_length=32, prefill_buckets=(16, 32),
                              max_tokens=episode_tokens, group_size=group_size,
                              temperature=1.0),
        learner=LearnerConfig(num_steps=300, groups_per_step=groups, lr=2e-3,
                              advantage="grpo", loss_agg="token-mean", max_grad_norm=1.0,
                              seq_buckets=(24,)),
        buffer=BufferConfig(capacity=64, timeout_s=300.0),
        runtime=RuntimeConfig(mode="async", max_staleness=2, stale_policy="drop"),
        checkpoint=CheckpointConfig(every_steps=100, keep_last=1),
        metrics=MetricsConfig(samples_every=25, num_samples=8),
    )
