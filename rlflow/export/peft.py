"""Export of a LoRA run: a Hugging Face PEFT adapter folder, or the merged full model.

PEFT layout (``peft`` 0.21, ``PeftModel.from_pretrained(base, folder)``):

* ``adapter_config.json``: ``peft_type "LORA"``, ``task_type "CAUSAL_LM"``, ``r``,
  ``lora_alpha`` (PEFT scales by ``lora_alpha / r``, as rlflow does), ``target_modules``
  (HF projection names), ``base_model_name_or_path``, ``bias "none"``, no dropout.
* ``adapter_model.safetensors``: per adapted projection
  ``base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` ``[r, in]`` and
  ``...lora_B.weight`` ``[out, r]`` (``nn.Linear`` layout, so PEFT's delta ``B_hf @ A_hf *
  alpha / r`` is the transpose of rlflow's ``A @ B * alpha / r`` on ``[in, out]`` kernels;
  head axes are flattened like :mod:`rlflow.models.hf` flattens the kernels).

Modules trained whole (``learner.lora.train_final_norm`` / ``train_embeddings``) are PEFT
``modules_to_save`` (``model.norm``, ``embed_tokens``, an untied ``lm_head``), saved under the
module's name (``base_model.model.model.embed_tokens.weight``); a trained embedding of a
tied base sets ``ensure_weight_tying`` so PEFT ties its output projection to it (PEFT then
loads an ``lm_head`` copy as well: the same tensor is written under both names).

The merged export writes ``W + (alpha / r) A @ B`` for every adapted kernel through
:func:`rlflow.models.hf.write_hf` (the same files as a full-weight run's export).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from rlflow.models.hf import save_safetensors
from rlflow.models.lora import LoraSpec, adapter_pairs, full_trained

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_tensors(adapters, dtype=np.float32) -> dict[str, np.ndarray]:
    """PEFT tensor name -> array (``lora_A [r, in]``, ``lora_B [out, r]``) of an adapter tree
    (``nnx.State`` or pure dict; rlflow ``A [L, in..., r]``, ``B [L, r, out...]``, stacked
    over the layers: PEFT's names are per layer)."""
    out = {}
    for _, name, a_all, b_all in adapter_pairs(adapters):      # stacked: [L, ...] factors
        a_all = np.asarray(jax.device_get(a_all[...] if hasattr(a_all, "get_value") else a_all),
                           np.float32)
        b_all = np.asarray(jax.device_get(b_all[...] if hasattr(b_all, "get_value") else b_all),
                           np.float32)
        for i, (a, b) in enumerate(zip(a_all, b_all)):      # PEFT names them per layer
            r = a.shape[-1]
            prefix = f"base_model.model.model.layers.{i}.{_MODULE[name]}.{name}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(
                a.reshape(-1, r).T.astype(dtype))
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(
                b.reshape(r, -1).T.astype(dtype))
    # modules_to_save: saved under the module's own name, in HF layout
    whole = full_trained(adapters)
    host = lambda x: np.asarray(jax.device_get(x), np.float32)      # noqa: E731
    if "final_norm" in whole:
        out["base_model.model.model.norm.weight"] = host(whole["final_norm"]["scale"]).astype(dtype)
    if "embed" in whole:                                     # [V, E] both sides
        out["base_model.model.model.embed_tokens.weight"] = host(whole["embed"]).astype(dtype)
    if "lm_head" in whole:                                   # rlflow [E, V] -> nn.Linear [V, E]
        out["base_model.model.lm_head.weight"] = np.ascontiguousarray(
            host(whole["lm_head"]).T.astype(dtype))
    elif "embed" in whole:     # tied: PEFT's ensure_weight_tying wraps lm_head and loads its copy
        out["base_model.model.lm_head.weight"] = out["base_model.model.model.embed_tokens.weight"]
    return out


def modules_to_save(adapters) -> list[str] | None:
    """PEFT ``modules_to_save`` of a trained tree: ``model.norm`` (trained final norm),
    ``embed_tokens`` and an untied ``lm_head`` (trained embeddings); None when none."""
    whole = full_trained(adapters)
    names = ((["model.norm"] if "final_norm" in whole else [])
             + (["embed_tokens"] if "embed" in whole else [])
             + (["lm_head"] if "lm_head" in whole else []))
    return names or None


def adapter_config(spec: LoraSpec, base_model: str, adapters=None) -> dict:
    """The ``adapter_config.json`` fields of ``spec`` (PEFT ``LoraConfig``) for the trained
    tree ``adapters`` (its whole-trained modules: ``modules_to_save``; a trained embedding
    without its own ``lm_head``, i.e. tied: ``ensure_weight_tying``, so that PEFT's output
    projection uses the trained embedding too)."""
    if adapters is None:
        saved = ["model.norm"] if spec.train_final_norm else None
        tied = False
    else:
        saved = modules_to_save(adapters)
        whole = full_trained(adapters)
        tied = "embed" in whole and "lm_head" not in whole
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(spec.rank),
            "lora_alpha": float(spec.alpha), "lora_dropout": 0.0,
            "target_modules": sorted(spec.projections), "bias": "none",
            "base_model_name_or_path": base_model, "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": saved, "ensure_weight_tying": tied}


def write_peft_adapter(adapters, spec: LoraSpec, out: str, *, base_model: str,
                       dtype: str = "float32") -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``out`` (created).

    Args:
      adapters: the adapter tree (``nnx.State`` or nested dict of arrays).
      spec: the run's :class:`LoraSpec`.
      out: output folder.
      base_model: recorded as ``base_model_name_or_path`` (the base HF folder).
      dtype: "float32" or "bfloat16".

    Raises: ValueError for another dtype or an adapter tree without adapters.
    """
    import ml_dtypes

    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"dtype: must be one of {sorted(dtypes)}, got {dtype!r}")
    tensors = peft_tensors(adapters, dtypes[dtype])
    if not tensors:
        raise ValueError("the adapter tree holds no adapters")
    os.makedirs(out, exist_ok=True)
    save_safetensors(tensors, os.path.join(out, ADAPTER_WEIGHTS), {"format": "pt"})
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        json.dump(adapter_config(spec, base_model, adapters), f, indent=2, sort_keys=True)
