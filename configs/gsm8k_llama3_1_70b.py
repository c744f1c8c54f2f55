"""GRPO on GSM8K with Llama-3.1-70B-Instruct: the large reference (a multi-host learner slice).

The 0.5B reference (``configs/gsm8k_qwen2_5_0_5b.py``: data, reward, algorithm, schedule)
with the sizes of a 70B model. Topology: learner on a v5p-64 (8 hosts x 4 chips of 95 GB,
mesh fsdp=16 x tensor=2), sampler on a v5p-32 (4 hosts x 4 chips, mesh data=2 x tensor=8:
two bfloat16 replicas of 141 GB, 8 KV heads over tensor).

    scripts/tpu/up.sh --zone ZONE --learner-type v5p-64 --sampler-type v5p-32 \\
        --config configs/gsm8k_llama3_1_70b.py --model-gcs gs://BUCKET/Llama-3.1-70B-Instruct \\
        --model-dir /home/$USER/Llama-3.1-70B-Instruct --run-dir gs://BUCKET/runs

Memory per learner chip (:mod:`rlflow.learner.memory`, printed when this file is loaded):
70.6B parameters with float32 master weights, AdamW moments, a float32 gradient
accumulator and the micro-batch's gradient are 20 bytes each, 1.41 TB over fsdp x tensor = 32
chips = 44.1 GB per chip; the published version the step keeps beside its new params (weights
go by transfer) 8.8 GB; activations of one micro-batch (64 prompts x G=8 = 512 rows in 32
micro-batches: 1 row of 768 tokens per chip, ``learner.remat="full"``) add 1.6 GB (50.8 GiB
of 88.5 in all). Too few chips for that is a
``LearnerDoesNotFit`` (a ``ConfigError`` naming ``learner.mesh``) here, before any host
starts. No reference model (kl_coef 0).

The learner runs as ``learner.num_hosts`` = 8 processes, one per host of the slice, joined by
``jax.distributed`` (:mod:`rlflow.launcher.learner_hosts`, docs/tpu.md).

``model.path``: ``config(model_path=...)``, else ``$RLFLOW_MODEL_PATH``, else
``~/models/Llama-3.1-70B-Instruct``.
"""

import dataclasses
import os
import sys

from rlflow.config import MeshConfig, config_module
from rlflow.learner.memory import Architecture, check_fits

DEFAULT_MODEL = "~/models/Llama-3.1-70B-Instruct"
# meta-llama/Llama-3.1-70B-Instruct config.json
LLAMA_3_1_70B = Architecture(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                             num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                             tie_word_embeddings=False)
V5P_CHIP_GIB = 95.0 * 1e9 / 2 ** 30     # v5p: 95 GB of HBM per chip


def _base():
    return config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "gsm8k_qwen2_5_0_5b.py"))


def config(model_path=None, learner_mesh=MeshConfig(fsdp=16, tensor=2), micro_batches=32,
           chip_gib=V5P_CHIP_GIB):
    path = model_path or os.environ.get("RLFLOW_MODEL_PATH") or DEFAULT_MODEL
    cfg = _base().config(model_path=path)
    replace = dataclasses.replace
    cfg = replace(
        cfg,
        name="gsm8k_llama3_1_70b",
        sampler=replace(cfg.sampler, num_slots=256, num_devices=16,
                        mesh=MeshConfig(data=2, tensor=8)),
        learner=replace(cfg.learner, lr=3e-7, micro_batches=micro_batches, weight_decay=0.01,
                        compute_dtype="bfloat16", num_devices=learner_mesh.num_devices,
                        mesh=learner_mesh, num_hosts=8),    # v5p-64: 8 hosts x 4 chips
        checkpoint=replace(cfg.checkpoint, every_steps=25),
    )
    mem = check_fits(LLAMA_3_1_70B, cfg, chip_gib)
    print(f"{cfg.name}: learner memory per chip ({learner_mesh.num_devices} chips): "
          f"{mem.describe()} of {chip_gib:.1f} GiB", file=sys.stderr)
    return cfg
