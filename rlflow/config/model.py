"""Model architecture and device-mesh sections."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Literal

from rlflow.config.validation import _check, _positive, _one_of, DTYPES, _finite_floats


@dataclass(frozen=True)
class ModelConfig:
    """The policy model.

    Attributes:
      path: local Hugging Face folder (config.json + safetensors). Empty: build a random
        model from the architecture fields below (used by the built-in demo and tests).
      model_type: architecture family when ``path`` is empty: "llama", "qwen2", "qwen3" or
        "qwen3_moe" (Qwen3 attention, every layer's MLP a top-k mixture of experts).
      vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim:
        architecture of the random model (ignored when ``path`` is set).
      rope_theta: RoPE base frequency of the random model.
      tie_word_embeddings: share input embedding and output projection (random model).
      dtype: activation/compute dtype.
      param_dtype: dtype of stored (master) parameters.
      init_seed: PRNG seed for a random model's initial parameters.
      num_experts: experts per layer of the random "qwen3_moe" model (HF ``qwen3_moe``
        names; this and the next four are ignored when ``path`` is set, where config.json
        gives them, and must keep their defaults for dense families).
      num_experts_per_tok: experts each token is routed to (top-k).
      moe_intermediate_size: each expert's SwiGLU width.
      norm_topk_prob: the k gates are renormalised to sum 1.
      router_aux_loss_coef: the model's load-balancing loss weight (the default of
        ``learner.moe_aux_loss_coef``).
    """

    path: str = ""
    model_type: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    init_seed: int = 0
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        _finite_floats(self, "model")
        _one_of(self.model_type, ("llama", "qwen2", "qwen3", "qwen3_moe"), "model.model_type")
        _one_of(self.dtype, DTYPES, "model.dtype")
        _one_of(self.param_dtype, DTYPES, "model.param_dtype")
        if self.path:
            _check(os.path.isdir(self.path), "model.path",
                   f"must be an existing Hugging Face folder, got {self.path!r}")
            _check(os.path.isfile(os.path.join(self.path, "config.json")), "model.path",
                   f"{self.path!r} has no config.json (expected a Hugging Face model folder "
                   "with config.json and *.safetensors)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            _positive(getattr(self, name), f"model.{name}")
        _check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
               f"must divide model.num_heads={self.num_heads}, got {self.num_kv_heads}")
        _positive(self.rope_theta, "model.rope_theta")
        if self.model_type != "qwen3_moe":
            for name in MOE_FIELDS:
                value, default = getattr(self, name), _MOE_DEFAULTS[name]
                _check(value == default, f"model.{name}",
                       f"is a mixture-of-experts field, and model.model_type is "
                       f"{self.model_type!r} (dense), so {value!r} would be ignored; leave it at "
                       f"{default!r}, or set model.model_type='qwen3_moe' for a random MoE "
                       f"model (a model.path folder's config.json gives its own)")
        if self.model_type == "qwen3_moe":
            _positive(self.num_experts, "model.num_experts")
            _positive(self.moe_intermediate_size, "model.moe_intermediate_size")
            _check(1 <= self.num_experts_per_tok <= self.num_experts, "model.num_experts_per_tok",
                   f"must be in [1, model.num_experts={self.num_experts}], got "
                   f"{self.num_experts_per_tok}")
            _check(self.router_aux_loss_coef >= 0, "model.router_aux_loss_coef",
                   f"must be >= 0, got {self.router_aux_loss_coef}")

    def expert_count(self) -> int:
        """Experts per layer of the policy, 0 for a dense model: ``path``'s config.json when
        it names a ``model_type`` (``num_experts`` / ``num_local_experts`` of a
        :data:`HF_MOE_TYPES` model), else the random model's fields (a stand-in folder, or
        none)."""
        d = {}
        if self.path:
            try:
                with open(os.path.join(self.path, "config.json"), encoding="utf-8") as f:
                    d = json.load(f)
            except (OSError, ValueError):
                d = {}
        if isinstance(d, dict) and d.get("model_type"):
            if d["model_type"] not in HF_MOE_TYPES:
                return 0
            return int(d.get("num_experts") or d.get("num_local_experts") or 0)
        return self.num_experts if self.model_type == "qwen3_moe" else 0


#: HF ``model_type`` s of mixture-of-experts models (rlflow.models.config.MOE_MODEL_TYPES;
#: this package does not import the models).
HF_MOE_TYPES = ("qwen3_moe", "gpt_oss", "qwen3_5_moe_text")

#: The mixture-of-experts fields of :class:`ModelConfig`: only with model_type "qwen3_moe".
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "router_aux_loss_coef")
_MOE_DEFAULTS = {f.name: f.default for f in fields(ModelConfig) if f.name in MOE_FIELDS}


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh of one program: sizes of the data, fsdp, expert, tensor and sequence axes.

    The product must equal the number of devices the program sees.

    Attributes:
      data: data-parallel axis size (batch split, parameters replicated).
      fsdp: fully-sharded data-parallel axis size (batch and parameters split).
      expert: expert-parallel axis size (mixture-of-experts models only): each device holds
        ``n_experts / expert`` of every MoE layer's experts (the expert weights
        ``[n_experts, ...]`` are split over it) and the batch is split over it as over
        ``data`` (the other parameters are replicated over it); every MoE layer gathers the
        tokens of the axis, runs its own experts on them and reduce-scatters the result
        (:mod:`rlflow.models.expert_parallel`). Must divide the model's expert count.
      tensor: tensor-parallel axis size (heads and MLP columns split).
      sequence: context-parallel axis size (learner only): every row's ``T`` positions are
        split into ``sequence`` contiguous chunks, one per device, parameters replicated
        over it (:mod:`rlflow.models.context_parallel`: each layer all-gathers keys and
        values over the axis, queries stay local). Activations per device shrink to
        ``T / sequence`` per row; training row lengths (``learner.seq_buckets``,
        ``learner.pack_length``) must be multiples of it. The sampler refuses values > 1.
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1

    def __post_init__(self):
        _finite_floats(self, "mesh")
        for name in ("data", "fsdp", "tensor", "sequence", "expert"):
            _positive(getattr(self, name), f"mesh.{name}")

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.sequence * self.expert

    @property
    def batch_shards(self) -> int:
        """Parts the batch's rows are split into: ``data x fsdp x expert``."""
        return self.data * self.fsdp * self.expert

    def describe(self) -> str:
        """``"data=1 x fsdp=4 x tensor=2"`` (`` x sequence=N`` when ``sequence > 1``,
        `` x expert=N`` when ``expert > 1``)."""
        out = f"data={self.data} x fsdp={self.fsdp} x tensor={self.tensor}"
        out += f" x sequence={self.sequence}" if self.sequence > 1 else ""
        return out + (f" x expert={self.expert}" if self.expert > 1 else "")
