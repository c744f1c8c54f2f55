"""GRPO on GSM8K with Gemma 3 27B (text) on Cloud TPU v5p slices (issue 51).

Gemma 3 27B's text model: 62 layers, five sliding-window layers (1,024 keys, RoPE base 10^4)
to each global one (RoPE base 10^6, linear scaling 8), 32 query / 16 KV heads of 128,
hidden 5,376, MLP 21,504, Gemma's sandwich norms and scaled embeddings, tied embeddings,
vocabulary 262,208: 27.0B parameters.

The run is ``configs/gsm8k_qwen3_5_35b_a3b.py``'s (:func:`pod_config`: 64 prompts x 8
samples of <= 1,024 new tokens, float32 master weights, bf16 compute and sampler, remat
"full"): the learner on a v5p-16 (2 hosts, 8 chips, fsdp=8), samplers on v5p-8 (mesh
tensor=4). The sliding-window layers hold the slot's whole length in the contiguous cache
today (``rlflow.sampler.memory.SLIDING_HOLDS_WINDOW``), so the memory model counts them at
full length. Memory per chip: ``python -m rlflow.console.fit --config
configs/gsm8k_gemma3_27b.py --tpu v5p,v6e`` (docs/tpu.md, "Reference configs").

``model.path``: ``config(model_path=...)``, else ``$RLFLOW_MODEL_PATH``: a Hugging Face
folder of the text model (``model_type`` ``gemma3_text``; a released multimodal checkpoint,
``gemma3`` with a ``text_config``, needs its text part saved on its own); without one (or a
stand-in whose config.json names no ``model_type``) ``configs/models/gemma3_27b``: the
config.json alone, for dry runs and the memory check only.
"""

import os

from rlflow.config import MeshConfig, config_module

SIZES_ONLY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "gemma3_27b")


def config(model_path=None):
    pods = config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "gsm8k_qwen3_5_35b_a3b.py"))
    return pods.pod_config("gsm8k_gemma3_27b", SIZES_ONLY, model_path,
                           learner_mesh=MeshConfig(fsdp=8),
                           sampler_mesh=MeshConfig(tensor=4), shared_prefix=True)
