"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct on a Cloud TPU v5e slice pair.

Topology (scripts/tpu, docs/tpu.md): learner on a v5litepod-8 (1 host, 8 chips, mesh
fsdp=8), sampler on a v5litepod-8 (1 host, 8 chips, mesh data=4 x tensor=2: four model
replicas, KV heads over tensor). On v6e use v6e-8 slices with the same meshes.

    scripts/tpu/up.sh --zone ZONE --learner-type v5litepod-8 --sampler-type v5litepod-8 \\
        --config configs/gsm8k_qwen2_5_0_5b.py --model-gcs gs://BUCKET/Qwen2.5-0.5B-Instruct \\
        --model-dir /home/$USER/Qwen2.5-0.5B-Instruct

Sizes: 64 prompts x G=8 = 512 completions per step (<= 512 new tokens each). The learner
splits them into 16 micro-batches of 32 (4 sequences per chip, so [4, 768, 151936] float32
logits stay under 2 GB of a v5e chip's 16 GB). Master weights float32 (0.5B x 16 bytes with
AdamW = 8 GB over 8 chips), compute bfloat16.

Model weights are not part of the repository: ``model.path`` is the local Hugging Face folder
given by ``config(model_path=...)``, else ``$RLFLOW_MODEL_PATH``, else
``~/models/Qwen2.5-0.5B-Instruct``; a folder that does not exist is a ``ConfigError`` naming
``model.path`` when the file is loaded. Data: ``$RLFLOW_DATA_PATH`` or
``~/data/gsm8k/train.jsonl`` (GSM8K JSONL: ``question``, ``answer`` with ``#### <number>``).
"""

import os

from rlflow.config import (CheckpointConfig, ConfigError, DataConfig, ExperimentConfig,
                           LearnerConfig, MeshConfig, ModelConfig, RewardConfig, RuntimeConfig,
                           SamplerConfig)

DEFAULT_MODEL = "~/models/Qwen2.5-0.5B-Instruct"


def config(model_path=None) -> ExperimentConfig:
    path = os.path.expanduser(model_path or os.environ.get("RLFLOW_MODEL_PATH") or DEFAULT_MODEL)
    if not os.path.isdir(path):
        raise ConfigError(f"model.path: must be an existing Hugging Face folder, got {path!r} "
                          "(set RLFLOW_MODEL_PATH or call config(model_path=...))")
    return ExperimentConfig(
        name="gsm8k_qwen2_5_0_5b",
        model=ModelConfig(path=path, dtype="bfloat16", param_dtype="float32"),
        data=DataConfig(source="jsonl",
                        path=os.path.expanduser(os.environ.get("RLFLOW_DATA_PATH",
                                                               "~/data/gsm8k/train.jsonl")),
                        prompt_field="question", answer_field="answer", chat_template="hf",
                        max_prompt_tokens=256, num_epochs=4, on_bad_record="skip"),
        reward=RewardConfig(functions=("math_verify",), weights=(1.0,), timeout_s=5.0),
        sampler=SamplerConfig(num_slots=512, max_prefill_length=256,
                              prefill_buckets=(64, 128, 256), max_tokens=512, group_size=8,
                              temperature=1.0, on_long_prompt="truncate", num_devices=8,
                              mesh=MeshConfig(data=4, tensor=2)),
        learner=LearnerConfig(num_steps=400, groups_per_step=64, micro_batches=16, lr=1e-6,
                              warmup_steps=10, schedule="constant", weight_decay=0.01,
                              max_grad_norm=1.0, advantage="grpo", loss_agg="token-mean",
                              clip_low=0.2, clip_high=0.28, kl_coef=0.0, num_devices=8,
                              mesh=MeshConfig(fsdp=8), compute_dtype="bfloat16"),
        runtime=RuntimeConfig(mode="async", max_staleness=1, stale_policy="correct",
                              publish_every=1),
        checkpoint=CheckpointConfig(every_steps=50, keep_last=3),
    )
