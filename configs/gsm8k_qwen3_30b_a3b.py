"""GRPO on GSM8K with Qwen3-30B-A3B (mixture of experts) on Cloud TPU v5p slices (issue 40).

Qwen3-30B-A3B (its config.json): 48 layers of Qwen3 attention (32 query / 4 KV heads of 128,
hidden 2,048) and a mixture-of-experts MLP of 128 experts of width 768, each token routed to
8 of them (top-8, gates renormalised): 30.5B parameters, 29.0B of them in the experts, 3.3B
active a token.

Topology: the experts are split over the ``expert`` mesh axis (``rlflow.models.expert_parallel``:
each device holds 128 / expert experts of every layer; the tokens are gathered over the axis,
run through the local experts and reduce-scattered back); the weights outside the experts are
split over ``fsdp`` only. ``expert=8``: with top-8 routing the gather's bytes equal those of a
ragged all-to-all of the routed rows. Learner: the slice the memory model picks
(``rlflow.console.fit.smallest_slice`` with the config's one row of 1,280 tokens a chip per
micro-batch), a **v5p-32** (4 hosts, 16 chips of 95 GB, mesh fsdp=2 x expert=8,
``learner.num_hosts`` 4 set by the scripts): per chip float32 parameters (the 1.5B outside
the experts over fsdp=2, the experts over all 16 chips) 9.6 GiB, AdamW moments 19.2,
gradients 19.2, the published version (cast to the bf16 sampler's dtype) 4.8 and activations 2.0 (remat "full", the experts'
dropless rows for 8 x 8 (token, expert) pairs a token) = 54.9 GiB of 88.5 (printed by
``python -m rlflow.console.fit --config configs/gsm8k_qwen3_30b_a3b.py --tpu v5p,v6e``; a
v5p-16 is refused: 117.4 GiB a chip; on v6e the pick is a v6e-64, fsdp=8 x expert=8).
Sampler replicas on v5p-8 (1 host, 4 chips, mesh expert=4: attention data-parallel over the
slots, 32 experts a chip; bfloat16 weights 16.4 GiB and a KV cache of 64 slots x 1,280
positions, 7.5 GiB, a chip).

    scripts/tpu/up.sh --zone ZONE --learner-type v5p-32 --sampler-type v5p-8 \\
        --sampler-slices 2 --config configs/gsm8k_qwen3_30b_a3b.py \\
        --model-gcs gs://BUCKET/Qwen3-30B-A3B --model-dir /home/$USER/Qwen3-30B-A3B \\
        --run-dir gs://BUCKET/runs

Sizes: 64 prompts x G=8 = 512 completions per step (<= 1,024 new tokens each), 32
micro-batches of 16 rows (one a chip).

``model.path``: ``config(model_path=...)``, else ``$RLFLOW_MODEL_PATH``: the user's
Qwen3-30B-A3B Hugging Face folder (weights are not part of the repository). Without one the
config builds a randomly initialised model of Qwen3-30B-A3B's published architecture
(``QWEN3_30B_A3B``): for dry runs and the memory check only. Data: ``$RLFLOW_DATA_PATH`` or
``~/data/gsm8k/train.jsonl`` (GSM8K JSONL: ``question``, ``answer`` with ``#### <number>``).
"""

import os

from rlflow.config import (CheckpointConfig, ConfigError, DataConfig, ExperimentConfig,
                           LearnerConfig, MeshConfig, ModelConfig, RewardConfig, RuntimeConfig,
                           SamplerConfig)

# Qwen/Qwen3-30B-A3B config.json
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
                     head_dim=128, rope_theta=1000000.0, tie_word_embeddings=False,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     norm_topk_prob=True, router_aux_loss_coef=0.001)

PROMPT_TOKENS = 256
RESPONSE_TOKENS = 1024
EXPERT = 8                  # the learner's expert axis
LEARNER_CHIPS = 16          # v5p-32: 4 hosts x 4 chips
SAMPLER_CHIPS = 4           # v5p-8, one replica per slice


def config(model_path=None) -> ExperimentConfig:
    path = os.path.expanduser(model_path or os.environ.get("RLFLOW_MODEL_PATH") or "")
    if path and not os.path.isdir(path):
        raise ConfigError(f"model.path: must be an existing Hugging Face folder, got {path!r} "
                          "(set RLFLOW_MODEL_PATH or call config(model_path=...))")
    group_size, groups = 8, 64
    return ExperimentConfig(
        name="gsm8k_qwen3_30b_a3b",
        model=ModelConfig(path=path, dtype="bfloat16", param_dtype="float32", **QWEN3_30B_A3B),
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
                              num_devices=SAMPLER_CHIPS, mesh=MeshConfig(expert=SAMPLER_CHIPS)),
        learner=LearnerConfig(num_steps=400, groups_per_step=groups,
                              micro_batches=groups * group_size // LEARNER_CHIPS, lr=1e-6,
                              warmup_steps=10, schedule="constant", weight_decay=0.01,
                              max_grad_norm=1.0, advantage="grpo", loss_agg="token-mean",
                              clip_low=0.2, clip_high=0.28, kl_coef=0.0,
                              num_devices=LEARNER_CHIPS,
                              mesh=MeshConfig(fsdp=LEARNER_CHIPS // EXPERT, expert=EXPERT),
                              compute_dtype="bfloat16", remat="full", logprob_chunk=1024),
        runtime=RuntimeConfig(mode="async", max_staleness=1, stale_policy="correct"),
        checkpoint=CheckpointConfig(every_steps=25, keep_last=3),
    )
