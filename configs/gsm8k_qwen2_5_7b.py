"""GRPO on GSM8K with Qwen2.5-7B-Instruct on a Cloud TPU v6e slice pair.

The 0.5B reference (``configs/gsm8k_qwen2_5_0_5b.py``: data, reward, algorithm, schedule)
with the sizes of a 7B model. Topology (scripts/tpu, docs/tpu.md): learner on a v6e-8
(1 host, 8 chips of 32 GB, mesh fsdp=4 x tensor=2), sampler on a v6e-8 (1 host, mesh
data=2 x tensor=4: two bfloat16 replicas of 15 GB, 4 KV heads over tensor).

    scripts/tpu/up.sh --zone ZONE --learner-type v6e-8 --sampler-type v6e-8 \\
        --config configs/gsm8k_qwen2_5_7b.py --model-gcs gs://BUCKET/Qwen2.5-7B-Instruct \\
        --model-dir /home/$USER/Qwen2.5-7B-Instruct

Sizes: 64 prompts x G=8 = 512 completions per step, 32 micro-batches of 16 (2 sequences
per fsdp shard). Master weights float32 with AdamW: 7.6B x 16 bytes = 122 GB over 8 chips
(15 GB each of 32 GB), compute bfloat16; no reference model (kl_coef 0). Both programs run
on one host each: multi-host slices are not supported by the programs yet (docs/tpu.md).

``model.path``: ``config(model_path=...)``, else ``$RLFLOW_MODEL_PATH``, else
``~/models/Qwen2.5-7B-Instruct``; a missing folder is a ``ConfigError`` naming
``model.path``. Data: ``$RLFLOW_DATA_PATH`` or ``~/data/gsm8k/train.jsonl``.
"""

import dataclasses
import os

from rlflow.config import MeshConfig, config_module

DEFAULT_MODEL = "~/models/Qwen2.5-7B-Instruct"


def _base():
    return config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "gsm8k_qwen2_5_0_5b.py"))


def config(model_path=None):
    path = model_path or os.environ.get("RLFLOW_MODEL_PATH") or DEFAULT_MODEL
    cfg = _base().config(model_path=path)
    replace = dataclasses.replace
    return replace(
        cfg,
        name="gsm8k_qwen2_5_7b",
        sampler=replace(cfg.sampler, num_slots=256, num_devices=8,
                        mesh=MeshConfig(data=2, tensor=4)),
        learner=replace(cfg.learner, lr=5e-7, micro_batches=32, weight_decay=0.01,
                        num_devices=8, mesh=MeshConfig(fsdp=4, tensor=2)),
        checkpoint=replace(cfg.checkpoint, every_steps=25),
    )
