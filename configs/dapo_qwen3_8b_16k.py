"""DAPO with Qwen3-8B on long rollouts: 1K-token prompts, 15K-token responses (issue 43).

DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):
clip-higher (``clip_low`` 0.2, ``clip_high`` 0.28, sec. 3.1), dynamic sampling (groups whose
G samples all score the same are dropped, sec. 3.2), the token-level policy-gradient loss
(``loss_agg="token-mean"``, sec. 3.3) and the soft overlong punishment over the last 4,096
tokens of ``sampler.max_tokens`` (eq. 13, sec. 3.4); no KL term; G = 16 samples a prompt.

Topology: the slices the memory model picks (``rlflow.console.fit.smallest_slice``, the
learner given one 16,384-token row per chip per micro-batch): learner on a v5p-8 (1 host, 4
chips of 95 GB, mesh fsdp=4), per chip float32 params 8.2 GB, AdamW moments 16.4,
gradients 16.4 (accumulator and micro-batch), the published version (cast to the bf16 sampler's dtype) 4.1 and activations 8.6
(remat "full", splash attention, logprobs in chunks of 1,024 positions) = 50.0 GiB of 88.5
(checked by ``rlflow.console.fit`` when the scripts start it; a fuller layout is refused
naming the setting). A v5p-8 is also where each sampler replica runs (4 chips,
mesh tensor=4: the 8 KV heads 2 a chip; bfloat16 weights 4.1 GB and a KV cache of 64 slots x
16,384 positions 38.7 GB a chip). On v6e (32 GB a chip) the smallest learner slice is a
v6e-16 (``python -m rlflow.console.fit --config configs/dapo_qwen3_8b_16k.py --tpu v5p,v6e``).

    scripts/tpu/up.sh --zone ZONE --learner-type v5p-8 --sampler-type v5p-8 \\
        --sampler-slices 4 --config configs/dapo_qwen3_8b_16k.py \\
        --model-gcs gs://BUCKET/Qwen3-8B --model-dir /home/$USER/Qwen3-8B \\
        --run-dir gs://BUCKET/runs

Sizes: 32 prompts x G=16 = 512 samples a step in 128 micro-batches of 4 rows (one a chip).

``model.path``: ``config(model_path=...)``, else ``$RLFLOW_MODEL_PATH``: the user's Qwen3-8B
Hugging Face folder (weights are not part of the repository). Without one the config builds
a randomly initialised model of Qwen3-8B's published architecture (``QWEN3_8B``, from its
config.json): for dry runs and the memory check only (``rlflow train`` refuses to run JSONL
data without a model folder's tokenizer). Data: ``$RLFLOW_DATA_PATH`` or
``~/data/dapo-math-17k/train.jsonl``, JSONL records with ``prompt`` (the question) and
``answer`` (the final answer, checked by ``math_verify``).
"""

import os

from rlflow.config import (CheckpointConfig, ConfigError, DataConfig, ExperimentConfig,
                           LearnerConfig, MeshConfig, ModelConfig, RewardConfig, RuntimeConfig,
                           SamplerConfig)

# Qwen/Qwen3-8B config.json
QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                head_dim=128, rope_theta=1000000.0, tie_word_embeddings=False)

PROMPT_TOKENS = 1024
RESPONSE_TOKENS = 15360
LEARNER_CHIPS = 4           # v5p-8
SAMPLER_CHIPS = 4           # v5p-8, one replica per host


def config(model_path=None) -> ExperimentConfig:
    path = os.path.expanduser(model_path or os.environ.get("RLFLOW_MODEL_PATH") or "")
    if path and not os.path.isdir(path):
        raise ConfigError(f"model.path: must be an existing Hugging Face folder, got {path!r} "
                          "(set RLFLOW_MODEL_PATH or call config(model_path=...))")
    group_size, groups = 16, 32
    return ExperimentConfig(
        name="dapo_qwen3_8b_16k",
        model=ModelConfig(path=path, dtype="bfloat16", param_dtype="float32", **QWEN3_8B),
        data=DataConfig(source="jsonl",
                        path=os.path.expanduser(os.environ.get(
                            "RLFLOW_DATA_PATH", "~/data/dapo-math-17k/train.jsonl")),
                        prompt_field="prompt", answer_field="answer", chat_template="hf",
                        max_prompt_tokens=PROMPT_TOKENS, on_bad_record="skip"),
        reward=RewardConfig(functions=("math_verify",), weights=(1.0,), timeout_s=10.0),
        sampler=SamplerConfig(num_slots=64, max_prefill_length=PROMPT_TOKENS,
                              prefill_buckets=(256, 512, PROMPT_TOKENS),
                              max_tokens=RESPONSE_TOKENS, group_size=group_size,
                              temperature=1.0, on_long_prompt="truncate", dtype="bfloat16",
                              num_devices=SAMPLER_CHIPS, mesh=MeshConfig(tensor=SAMPLER_CHIPS)),
        learner=LearnerConfig(num_steps=500, groups_per_step=groups,
                              micro_batches=groups * group_size // LEARNER_CHIPS, lr=1e-6,
                              warmup_steps=20, weight_decay=0.1, max_grad_norm=1.0,
                              advantage="grpo", loss_agg="token-mean", clip_low=0.2,
                              clip_high=0.28, kl_coef=0.0, dynamic_sampling=True,
                              overlong_buffer=4096, overlong_penalty=1.0,
                              num_devices=LEARNER_CHIPS, mesh=MeshConfig(fsdp=LEARNER_CHIPS),
                              compute_dtype="bfloat16", remat="full", attention="splash",
                              shared_prefix=False, logprob_chunk=1024),
        runtime=RuntimeConfig(mode="async", max_staleness=1, stale_policy="correct"),
        checkpoint=CheckpointConfig(every_steps=25, keep_last=3),
    )
