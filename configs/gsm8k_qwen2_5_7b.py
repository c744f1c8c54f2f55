"""GRPO on GSM8K with Qwen2.5-7B-Instruct on a Cloud TPU v5e slice pair.

Topology (scripts/tpu, docs/tpu.md): learner on a v5litepod-32 (8 hosts x 4 chips, mesh
fsdp=8 x tensor=4), sampler on a v5litepod-16 (4 hosts x 4 chips, mesh data=4 x tensor=4:
four bfloat16 replicas of 15 GB, each over 4 chips; 4 KV heads over tensor). On v6e
(32 GB per chip) a v6e-16 learner (fsdp=4 x tensor=4) and a v6e-8 sampler (data=2 x
tensor=4) hold the same model.

    scripts/tpu/up.sh --zone ZONE --learner-type v5litepod-32 --sampler-type v5litepod-16 \\
        --config configs/gsm8k_qwen2_5_7b.py --model-gcs gs://BUCKET/Qwen2.5-7B-Instruct \\
        --model-dir /home/$USER/Qwen2.5-7B-Instruct --run-dir gs://BUCKET/runs

The learner has 8 hosts, so its run folder (checkpoints) must be shared storage: pass
``--run-dir gs://...``. Sizes: 64 prompts x G=8 = 512 completions per step, 16
micro-batches of 32 (4 sequences per fsdp shard). Master weights float32 with AdamW:
7.6B x 16 bytes = 122 GB over 32 chips (3.8 GB each); no reference model (kl_coef 0).

``model.path``: ``config(model_path=...)``, else ``$RLFLOW_MODEL_PATH``, else
``~/models/Qwen2.5-7B-Instruct``; a missing folder is a ``ConfigError`` naming
``model.path``. Data: ``$RLFLOW_DATA_PATH`` or ``~/data/gsm8k/train.jsonl``.
"""

import os

from rlflow.config import (CheckpointConfig, ConfigError, DataConfig, ExperimentConfig,
                           LearnerConfig, MeshConfig, ModelConfig, RewardConfig, RuntimeConfig,
                           SamplerConfig)

DEFAULT_MODEL = "~/models/Qwen2.5-7B-Instruct"


def config(model_path=None) -> ExperimentConfig:
    path = os.path.expanduser(model_path or os.environ.get("RLFLOW_MODEL_PATH") or DEFAULT_MODEL)
    if not os.path.isdir(path):
        raise ConfigError(f"model.path: must be an existing Hugging Face folder, got {path!r} "
                          "(set RLFLOW_MODEL_PATH or call config(model_path=...))")
    return ExperimentConfig(
        name="gsm8k_qwen2_5_7b",
        model=ModelConfig(path=path, dtype="bfloat16", param_dtype="float32"),
        data=DataConfig(source="jsonl",
                        path=os.path.expanduser(os.environ.get("RLFLOW_DATA_PATH",
                                                               "~/data/gsm8k/train.jsonl")),
                        prompt_field="question", answer_field="answer", chat_template="hf",
                        max_prompt_tokens=256, num_epochs=4, on_bad_record="skip"),
        reward=RewardConfig(functions=("math_verify",), weights=(1.0,), timeout_s=5.0),
        sampler=SamplerConfig(num_slots=256, max_prefill_length=256,
                              prefill_buckets=(64, 128, 256), max_tokens=512, group_size=8,
                              temperature=1.0, on_long_prompt="truncate", num_devices=16,
                              mesh=MeshConfig(data=4, tensor=4)),
        learner=LearnerConfig(num_steps=400, groups_per_step=64, micro_batches=16, lr=5e-7,
                              warmup_steps=10, schedule="constant", weight_decay=0.01,
                              max_grad_norm=1.0, advantage="grpo", loss_agg="token-mean",
                              clip_low=0.2, clip_high=0.28, kl_coef=0.0, num_devices=32,
                              mesh=MeshConfig(fsdp=8, tensor=4), compute_dtype="bfloat16"),
        runtime=RuntimeConfig(mode="async", max_staleness=1, stale_policy="correct",
                              publish_every=1),
        checkpoint=CheckpointConfig(every_steps=25, keep_last=3),
    )
