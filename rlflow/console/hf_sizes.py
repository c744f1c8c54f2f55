"""A model's sizes from a Hugging Face folder's ``config.json``, read with ``json`` only (no
jax: the TPU scripts evaluate the memory model where they are started), for the memory model
(:class:`rlflow.learner.memory.Architecture`) and the fit check (:mod:`rlflow.console.fit`).

Families (the ``model_type`` s :mod:`rlflow.models.config` reads): Llama / Qwen2 / Qwen3,
Qwen3-MoE and gpt-oss (experts), Gemma 3 text and gpt-oss (``layer_types`` with
``"sliding_attention"`` layers and their ``sliding_window``), Qwen3.5 and Qwen3.5-MoE
(``"linear_attention"`` gated DeltaNet layers, ``linear_*`` fields; the attention's output
gate; the MoE's shared expert). The programs' full reader,
:func:`rlflow.models.hf.read_decoder_config`, reports a bad file.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from rlflow.learner.memory import Architecture

_QWEN35 = ("qwen3_5_text", "qwen3_5_moe_text")


def _moe_sizes(d: dict) -> dict:
    """The expert sizes of a ``qwen3_moe``, ``qwen3_5_moe_text`` or ``gpt_oss`` config.json
    (``num_experts``, 5.x / gpt-oss ``num_local_experts``; gpt-oss's experts are its
    ``intermediate_size`` wide), or none for a dense model."""
    kind = d.get("model_type")
    if kind not in ("qwen3_moe", "qwen3_5_moe_text", "gpt_oss"):
        return {}
    width = d["intermediate_size"] if kind == "gpt_oss" else d["moe_intermediate_size"]
    out = dict(num_experts=int(d.get("num_experts") or d["num_local_experts"]),
               num_experts_per_tok=int(d.get("num_experts_per_tok")
                                       or d["experts_per_token"]),
               moe_intermediate_size=int(width))
    if kind == "qwen3_5_moe_text":
        out["shared_expert_intermediate_size"] = int(d["shared_expert_intermediate_size"])
    return out


def _kind_sizes(d: dict, layers: int) -> dict:
    """``layer_types``, ``sliding_window`` and the gated DeltaNet shapes of ``d``."""
    kind = d.get("model_type")
    types = d.get("layer_types")
    if types is None and kind in _QWEN35:
        every = int(d.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(layers)]
    out = dict(layer_types=tuple(types or ()))
    if "sliding_attention" in out["layer_types"]:
        out["sliding_window"] = int(d["sliding_window"])
    if "linear_attention" in out["layer_types"]:
        out["gdn"] = dict(num_k_heads=int(d["linear_num_key_heads"]),
                          num_v_heads=int(d["linear_num_value_heads"]),
                          head_k_dim=int(d["linear_key_head_dim"]),
                          head_v_dim=int(d["linear_value_head_dim"]),
                          conv_kernel=int(d.get("linear_conv_kernel_dim", 4)))
    return out


def hf_architecture(path: str) -> Optional[Architecture]:
    """The sizes in a Hugging Face folder's ``config.json`` (Llama / Qwen2 / Qwen3 names:
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``
    defaulting to ``hidden_size / num_attention_heads``; the families' own fields, module
    doc); None when it lacks them. Not counted in the parameters: Gemma's two extra norms a
    layer and gpt-oss's biases and attention sinks (vectors, well under 0.1%)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            d = json.load(f)
        kind = d.get("model_type")
        heads, layers = int(d["num_attention_heads"]), int(d["num_hidden_layers"])
        moe = _moe_sizes(d)
        inter = d.get("intermediate_size") or moe.get("moe_intermediate_size")
        return Architecture(
            vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            intermediate_size=int(inter), num_layers=layers, num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text") + _QWEN35,
            attn_output_gate=kind in _QWEN35, **moe, **_kind_sizes(d, layers))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
