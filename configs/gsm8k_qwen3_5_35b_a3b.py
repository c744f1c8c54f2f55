"""GRPO on GSM8K with Qwen3.5-35B-A3B (gated DeltaNet hybrid, mixture of experts) on Cloud
TPU v5p slices (issue 51).

Qwen3.5-35B-A3B's text model (transformers' ``Qwen3_5MoeTextConfig``): 40 layers in cycles
of three gated DeltaNet layers (16 key / 32 value heads of 128, conv kernel 4) and one gated
full-attention layer (16 query / 2 KV heads of 256, RoPE on a quarter of each head); every
MLP 256 experts of width 512, top-8, plus a shared expert of width 512 with its sigmoid
gate; hidden 2,048, vocabulary 248,320.

Topology as ``configs/gsm8k_qwen3_30b_a3b.py``'s: the experts over the ``expert`` mesh axis
(``expert=8``), the rest over ``fsdp``; the learner on the slice the memory model picks, the
samplers on v5p-8 (mesh expert=4). The sampler's decode state is the 10 attention layers' KV
cache and, for each of the 30 DeltaNet layers, a state per slot that does not grow with the
length (``rlflow.sampler.memory.kv_cache_bytes``); the contiguous cache (the paged one
refuses DeltaNet layers); no shared-prefix packing (a DeltaNet state is one sequence's).
Memory per chip: ``python -m rlflow.console.fit --config configs/gsm8k_qwen3_5_35b_a3b.py
--tpu v5p,v6e`` (docs/tpu.md, "Reference configs").

``model.path``: ``config(model_path=...)``, else ``$RLFLOW_MODEL_PATH``: a Hugging Face
folder of the text model (``model_type`` ``qwen3_5_moe_text``; rlflow reads the text model
only, so a released checkpoint whose config.json wraps it as ``text_config`` of a
``qwen3_5_moe`` model needs its text part saved on its own). Without one, or with a folder
whose config.json names no ``model_type`` (the TPU scripts' slice check loads the config
against such a stand-in: the model lives on the hosts), the config points at
``configs/models/qwen3_5_35b_a3b``: the config.json alone (no weights), for dry runs and the
memory check only. Data: ``$RLFLOW_DATA_PATH`` or ``~/data/gsm8k/train.jsonl``.

    scripts/tpu/up.sh --zone ZONE --learner-type v5p-32 --sampler-type v5p-8 \\
        --sampler-slices 2 --config configs/gsm8k_qwen3_5_35b_a3b.py \\
        --model-gcs gs://BUCKET/Qwen3.5-35B-A3B-text --model-dir /home/$USER/Qwen3.5-35B-A3B \\
        --run-dir gs://BUCKET/runs
"""

import json
import os

from rlflow.config import (CheckpointConfig, ConfigError, DataConfig, ExperimentConfig,
                           LearnerConfig, MeshConfig, ModelConfig, RewardConfig, RuntimeConfig,
                           SamplerConfig)

SIZES_ONLY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models",
                          "qwen3_5_35b_a3b")
PROMPT_TOKENS = 256
RESPONSE_TOKENS = 1024
EXPERT = 8                  # the learner's expert axis
LEARNER_CHIPS = 16          # v5p-32: 4 hosts x 4 chips
SAMPLER_CHIPS = 4           # v5p-8, one replica per slice


def _names_a_model(path: str) -> bool:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("model_type"))
    except (OSError, ValueError, AttributeError):
        return False


def pod_config(name: str, sizes_only: str, model_path, *, learner_mesh: MeshConfig,
               sampler_mesh: MeshConfig, shared_prefix: bool) -> ExperimentConfig:
    """The GSM8K GRPO run of this module (64 prompts x 8 samples of <= 1,024 new tokens, one
    row a chip per micro-batch) for a model folder, or ``sizes_only`` (module doc); also
    the pod configs of gpt-oss-20b and Gemma 3 27B."""
    path = os.path.expanduser(model_path or os.environ.get("RLFLOW_MODEL_PATH") or "")
    if path and not os.path.isdir(path):
        raise ConfigError(f"model.path: must be an existing Hugging Face folder, got {path!r} "
                          "(set RLFLOW_MODEL_PATH or call config(model_path=...))")
    group_size, groups = 8, 64
    chips = learner_mesh.num_devices
    return ExperimentConfig(
        name=name,
        model=ModelConfig(path=path if _names_a_model(path) else sizes_only, dtype="bfloat16",
                          param_dtype="float32"),
        data=DataConfig(source="jsonl",
                        path=os.path.expanduser(os.environ.get("RLFLOW_DATA_PATH",
                                                               "~/data/gsm8k/train.jsonl")),
                        prompt_field="question", answer_field="answer", chat_template="hf",
                        max_prompt_tokens=PROMPT_TOKENS, num_epochs=4, on_bad_record="skip"),
        reward=RewardConfig(functions=("math_verify",), weights=(1.0,), timeout_s=5.0),
        sampler=SamplerConfig(num_slots=256, max_prefill_length=PROMPT_TOKENS,
                              prefill_buckets=(64, 128, PROMPT_TOKENS),
                              max_tokens=RESPONSE_TOKENS, group_size=group_size,
                              temperature=1.0, on_long_prompt="truncate", dtype="bfloat16",
                              num_devices=sampler_mesh.num_devices, mesh=sampler_mesh),
        learner=LearnerConfig(num_steps=400, groups_per_step=groups,
                              micro_batches=groups * group_size // chips, lr=1e-6,
                              warmup_steps=10, schedule="constant", weight_decay=0.01,
                              max_grad_norm=1.0, advantage="grpo", loss_agg="token-mean",
                              clip_low=0.2, clip_high=0.28, kl_coef=0.0, num_devices=chips,
                              mesh=learner_mesh, compute_dtype="bfloat16", remat="full",
                              logprob_chunk=1024, shared_prefix=shared_prefix),
        runtime=RuntimeConfig(mode="async", max_staleness=1, stale_policy="correct"),
        checkpoint=CheckpointConfig(every_steps=25, keep_last=3),
    )


def config(model_path=None) -> ExperimentConfig:
    return pod_config("gsm8k_qwen3_5_35b_a3b", SIZES_ONLY, model_path,
                      learner_mesh=MeshConfig(fsdp=LEARNER_CHIPS // EXPERT, expert=EXPERT),
                      sampler_mesh=MeshConfig(expert=SAMPLER_CHIPS), shared_prefix=False)
