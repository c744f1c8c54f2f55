"""GRPO on GSM8K with gpt-oss-20b on Cloud TPU v5p slices (issue 51).

gpt-oss-20b (its config.json): 24 layers alternating sliding-window attention (128 keys,
learned attention sinks) and full attention, 64 query / 8 KV heads of 64, hidden 2,880,
YaRN RoPE (factor 32); every MLP 32 experts of width 2,880 with biases and the clamped
SwiGLU, top-4; vocabulary 201,088: 20.9B parameters.

The run is ``configs/gsm8k_qwen3_5_35b_a3b.py``'s (:func:`pod_config`: 64 prompts x 8
samples of <= 1,024 new tokens, float32 master weights, bf16 compute and sampler, remat
"full"): the learner on a v5p-32 (4 hosts, 16 chips, mesh fsdp=2 x expert=8, the experts
split over ``expert``; a v5p-16 does not fit), samplers on v5p-8 (mesh expert=4). The
sliding-window layers hold the slot's whole length in the contiguous cache today
(``rlflow.sampler.memory.SLIDING_HOLDS_WINDOW``), so the memory model counts them at full
length. Memory per chip:
``python -m rlflow.console.fit --config configs/gsm8k_gpt_oss_20b.py --tpu v5p,v6e``
(docs/tpu.md, "Reference configs").

``model.path``: ``config(model_path=...)``, else ``$RLFLOW_MODEL_PATH`` (the gpt-oss-20b
Hugging Face folder; its MXFP4 experts dequantized to bf16 / float32, as transformers
``save_pretrained`` writes them); without one (or a stand-in whose config.json names no
``model_type``) ``configs/models/gpt_oss_20b``: the config.json alone, for dry runs and the
memory check only.
"""

import os

from rlflow.config import MeshConfig, config_module

SIZES_ONLY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "gpt_oss_20b")


def config(model_path=None):
    pods = config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "gsm8k_qwen3_5_35b_a3b.py"))
    return pods.pod_config("gsm8k_gpt_oss_20b", SIZES_ONLY, model_path,
                           learner_mesh=MeshConfig(fsdp=2, expert=8),
                           sampler_mesh=MeshConfig(expert=4), shared_prefix=True)
