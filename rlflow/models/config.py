"""Decoder architecture: one frozen dataclass read from / written to a HF ``config.json``.

Supported families (``model_type``):

* ``llama``: Llama 2/3.x (GQA, RoPE with ``rope_theta`` and optional Llama-3 ``rope_scaling``).
* ``qwen2``: Qwen2 / Qwen2.5 (q/k/v projection biases, usually tied embeddings).
* ``qwen3``: Qwen3 dense (per-head RMSNorm on q and k before RoPE).
* ``qwen3_moe``: Qwen3-MoE (Qwen3 attention; every layer's MLP a top-k mixture of experts,
  :mod:`rlflow.models.moe`).
* ``gemma3_text``: Gemma 3 text (sliding-window and global layers with their own RoPE, the
  ``(1 + w)`` RMSNorm before and after attention and MLP, scaled embeddings, q/k norms,
  GELU-tanh MLP; :mod:`rlflow.models.hf_families`).
* ``gpt_oss``: gpt-oss (sliding-window and full layers, learned attention sinks, YaRN RoPE,
  q/k/v/o biases, MoE with router and expert biases and the clamped SwiGLU).
* ``qwen3_5_text``: Qwen3.5 text (gated DeltaNet ``"linear_attention"`` layers and gated
  full-attention layers with partial RoPE, ``(1 + w)`` RMSNorms;
  :mod:`rlflow.models.hf_qwen35`).

Layers of several kinds (``layer_types``, HF's field: ``"full_attention"``,
``"sliding_attention"``) run as a repeating cycle (:mod:`rlflow.models.layer_pattern`).

Both config.json layouts are read: the transformers 4.x one (``rope_theta`` and
``rope_scaling`` at top level) and the 5.x one (``rope_parameters`` holding both).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from rlflow.models import hf_families
from rlflow.models.format_error import ModelFormatError, eos_token_ids  # noqa: F401 (re-export)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gpt_oss",
                         "qwen3_5_text", "qwen3_5_moe_text")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
DTYPES = ("float32", "bfloat16")
MOE_MODEL_TYPES = ("qwen3_moe", "gpt_oss", "qwen3_5_moe_text")
FAMILY_MODEL_TYPES = ("gemma3_text", "gpt_oss",   # config fields in rlflow.models.hf_families
                      "qwen3_5_text", "qwen3_5_moe_text")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
ROPE_KEYS = {"llama3": LLAMA3_ROPE_KEYS, "linear": ("factor",),
             "yarn": ("factor", "original_max_position_embeddings")}
#: optional keys of a scaling dict (kept when present)
ROPE_OPTIONAL_KEYS = {"yarn": ("beta_fast", "beta_slow", "truncate", "attention_factor")}
#: the kinds of layer ``layer_types`` may name (``"linear_attention"``: gated DeltaNet
#: layers, :mod:`rlflow.models.gdn_layer`, with ``DecoderConfig.gdn`` set)
LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention")
#: keys of ``DecoderConfig.gdn`` (fields of :class:`rlflow.models.gdn_layer.GDNSpec`)
GDN_KEYS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel")


def _need(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ModelFormatError(f"{where}: {msg}")



def _moe_fields(d: Mapping[str, Any], where: str) -> dict:
    """The MoE fields of a HF ``qwen3_moe`` config.json (transformers 4.x names experts
    ``num_experts``, 5.x ``num_local_experts``).

    Raises:
      ModelFormatError: the two expert-count names disagree, or a layout rlflow does not
        run: dense layers among the sparse ones
        (``mlp_only_layers``, ``decoder_sparse_step`` > 1: the layers run under one scan of
        one structure) or a shared expert (``shared_expert_intermediate_size``); names the
        field.
    """
    n = d.get("num_experts", d.get("num_local_experts"))
    _need(n is not None, f"{where}: num_experts", "required field is missing (also looked "
          "for num_local_experts)")
    local = d.get("num_local_experts")
    _need(local is None or local == n, f"{where}: num_local_experts",
          f"disagrees with num_experts={n} (both name the expert count), got {local}")
    _need(not d.get("mlp_only_layers"), f"{where}: mlp_only_layers",
          f"dense layers among the MoE layers are not supported (every layer must be sparse, "
          f"so that the layers share one structure), got {d.get('mlp_only_layers')}")
    step = d.get("decoder_sparse_step", 1)
    _need(step in (None, 1), f"{where}: decoder_sparse_step",
          f"only 1 (every layer sparse) is supported, got {step}")
    _need(not d.get("shared_expert_intermediate_size"), f"{where}: shared_expert_intermediate_size",
          "a shared expert (Qwen2-MoE style) is not supported")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        _need(d.get(key) is not None, f"{where}: {key}", "required field is missing")
    return dict(num_experts=int(n), num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0) or 0.0))


@dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder.

    Attributes:
      model_type: "llama" | "qwen2" | "qwen3" | "qwen3_moe".
      vocab_size: V, rows of the embedding.
      hidden_size: E, the residual width.
      intermediate_size: F, SwiGLU MLP width.
      num_layers: L.
      num_heads / num_kv_heads: H query heads, K key/value heads (GQA; K divides H).
      head_dim: D.
      rope_theta: RoPE base frequency.
      rope_scaling: None, or a Llama-3 dict ``{"rope_type": "llama3", "factor",
        "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``.
      rms_norm_eps: epsilon of every RMSNorm.
      tie_word_embeddings: output projection is the transposed input embedding.
      attention_bias: q/k/v projections carry a bias (always on for Qwen2; for llama /
        qwen3 the HF flag also adds an o_proj bias, which rlflow mirrors).
      qk_norm: per-head RMSNorm on q and k (Qwen3).
      max_position_embeddings: longest position the model was trained for.
      bos_token_id / eos_token_ids / pad_token_id: special ids (``eos_token_ids`` holds
        every end-of-sequence id).
      dtype: activation / compute dtype; param_dtype: stored parameter dtype.
      num_experts: n, experts per MoE layer (``qwen3_moe`` only; 0 for dense models).
      num_experts_per_tok: k, experts each token is routed to (top-k).
      moe_intermediate_size: each expert's SwiGLU width (``intermediate_size`` is then the
        dense MLP width of HF's config, unused since every layer is sparse).
      norm_topk_prob: the k gates are divided by their sum (HF flag).
      router_aux_loss_coef: HF's load-balancing loss weight (the default of
        ``learner.moe_aux_loss_coef``).
      layer_types: the kind of each layer (one of :data:`LAYER_KINDS` each, ``L`` of them),
        or ``()``: every layer ``"full_attention"``.
      sliding_window: ``W``, keys a ``"sliding_attention"`` query sees: the ``W`` positions
        ending at its own (HF: ``k > q - W``); None without sliding layers.
      rope_local_theta: RoPE base of the sliding layers (plain RoPE, Gemma 3's
        ``rope_local_base_freq``); None: the sliding layers share ``rope_theta`` and
        ``rope_scaling``.
      query_pre_attn_scalar: attention scale ``s^-1/2`` (Gemma); None: ``D^-1/2``.
      attn_logit_softcapping / final_logit_softcapping: ``c * tanh(x / c)`` on the
        attention scores / output logits (Gemma 2 style); None: off.
      swiglu_alpha / swiglu_limit: gpt-oss's clamped SwiGLU of the experts (module doc of
        :mod:`rlflow.models.moe`); None for other families.
      attn_output_gate: (Qwen3.5) q_proj is twice as wide, per head ``[query | gate]``
        (``q_kernel [E, H, 2D]``); the attention output is multiplied by ``sigmoid(gate)``
        before o_proj.
      partial_rotary_factor: RoPE rotates the first ``int(D * factor)`` dims of each head
        (Qwen3.5: 0.25); 1.0: all.
      shared_expert_intermediate_size: (Qwen3.5-MoE) width of the shared SwiGLU expert every
        token also goes through, scaled by ``sigmoid(x w)``; 0: none.
      gdn: the gated DeltaNet shapes of ``"linear_attention"`` layers, a dict of
        :data:`GDN_KEYS` (transformers' ``linear_*`` fields), or None without them.

    Raises:
      ModelFormatError: on an unsupported family or inconsistent shape (names the field).
    """

    model_type: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    gdn: dict | None = None
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        _need(self.model_type in SUPPORTED_MODEL_TYPES, "model_type",
              f"unsupported model_type {self.model_type!r}; supported: "
              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _need(isinstance(value, int) and value > 0, name, f"must be a positive int, got {value!r}")
        _need(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
              f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
        _need(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        _need(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        _need(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        _need(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _need(self.param_dtype in DTYPES, "param_dtype",
              f"must be one of {DTYPES}, got {self.param_dtype!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            _need(rope_type in SUPPORTED_ROPE_TYPES, "rope_scaling.rope_type",
                  f"unsupported {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
            missing = [k for k in ROPE_KEYS.get(rope_type, ()) if k not in self.rope_scaling]
            _need(not missing, "rope_scaling", f"{rope_type} scaling is missing {missing}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._check_layer_kinds()
        moe = self.model_type in MOE_MODEL_TYPES
        _need(moe == (self.num_experts > 0), "num_experts",
              f"must be > 0 exactly for model_type in {MOE_MODEL_TYPES}, got "
              f"{self.num_experts} for {self.model_type!r}")
        if moe:
            _need(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                  f"must be in [1, num_experts={self.num_experts}], got "
                  f"{self.num_experts_per_tok}")
            _need(self.moe_intermediate_size > 0, "moe_intermediate_size",
                  f"must be a positive int, got {self.moe_intermediate_size!r}")
            _need(self.router_aux_loss_coef >= 0, "router_aux_loss_coef",
                  f"must be >= 0, got {self.router_aux_loss_coef}")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    def _check_layer_kinds(self) -> None:
        types = self.layer_types
        _need(not types or len(types) == self.num_layers, "layer_types",
              f"must name the kind of each of the num_layers={self.num_layers} layers, got "
              f"{len(types)}")
        bad = sorted({t for t in types if t not in LAYER_KINDS})
        _need(not bad, "layer_types", f"unsupported layer kinds {bad}; supported: "
              f"{', '.join(LAYER_KINDS)}")
        if "sliding_attention" in types:
            w = self.sliding_window
            _need(isinstance(w, int) and w > 0, "sliding_window",
                  f"must be a positive int with sliding_attention layers, got {w!r}")
        if "linear_attention" in types:
            _need(self.model_type.startswith("qwen3_5"), "layer_types",
                  f"unsupported layer kinds ['linear_attention'] for model_type "
                  f"{self.model_type!r} (gated DeltaNet layers come with qwen3_5_text and "
                  f"qwen3_5_moe_text)")
            g = self.gdn or {}
            bad = [k for k in GDN_KEYS if not (isinstance(g.get(k), int) and g[k] > 0)]
            _need(not bad, "gdn", f"linear_attention layers need positive ints {list(GDN_KEYS)}, "
                  f"got {self.gdn!r}")
            _need(g["num_v_heads"] % g["num_k_heads"] == 0, "gdn.num_v_heads",
                  f"must be a multiple of num_k_heads={g['num_k_heads']}, got {g['num_v_heads']}")
        rot = self.rotary_dim
        _need(0 < self.partial_rotary_factor <= 1 and rot % 2 == 0 and rot > 0,
              "partial_rotary_factor", f"must be in (0, 1] with an even head_dim * factor, got "
              f"{self.partial_rotary_factor} (head_dim={self.head_dim})")
        for name in ("attn_logit_softcapping", "final_logit_softcapping",
                     "query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            _need(value is None or value > 0, name, f"must be > 0 or None, got {value!r}")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kind of each of the ``L`` layers (``layer_types``, or all full attention)."""
        return self.layer_types or ("full_attention",) * self.num_layers

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates: ``int(D * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def offset_norms(self) -> bool:
        """RMSNorm scales stored as offsets, factor ``1 + w`` (Gemma 3; Qwen3.5's
        zero-centred ``Qwen3_5RMSNorm``)."""
        return self.gemma_norms or self.model_type.startswith("qwen3_5")

    @property
    def gemma_norms(self) -> bool:
        """Gemma's normalisation: ``(1 + w)`` RMSNorm scales, norms before and after both
        attention and MLP, embeddings times ``sqrt(E)``, GELU-tanh MLP."""
        return self.model_type == "gemma3_text"

    @property
    def attention_sinks(self) -> bool:
        """Each attention head has a learned sink logit (gpt-oss)."""
        return self.model_type == "gpt_oss"

    @property
    def expert_biases(self) -> bool:
        """The router and the experts' projections carry biases (gpt-oss)."""
        return self.model_type == "gpt_oss"

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP is a mixture of experts (:class:`rlflow.models.moe.MoE`)."""
        return self.num_experts > 0

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def o_bias(self) -> bool:
        """o_proj carries a bias (HF llama / qwen3 with ``attention_bias``; never qwen2)."""
        return self.attention_bias and self.model_type != "qwen2"

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, where: str = "config.json",
                     dtype: str = "float32", param_dtype: str = "float32") -> "DecoderConfig":
        """Build from a parsed HF ``config.json``.

        Args:
          d: the parsed JSON object.
          where: file name used in error messages.
          dtype / param_dtype: rlflow's compute / parameter dtypes (not stored by HF).

        Raises:
          ModelFormatError: unsupported ``model_type`` (lists the supported ones), a missing
            required field, or an unsupported feature (sliding window, MLP bias, other
            activations or RoPE types); the message names ``where`` and the field.
        """
        model_type = d.get("model_type")
        _need(model_type in SUPPORTED_MODEL_TYPES, f"{where}: model_type",
              f"unsupported model_type {model_type!r}; supported: "
              f"{', '.join(SUPPORTED_MODEL_TYPES)}")

        def req(key):
            _need(key in d and d[key] is not None, f"{where}: {key}", "required field is missing")
            return d[key]

        if model_type in FAMILY_MODEL_TYPES:        # Gemma 3, gpt-oss: their own fields
            return cls._checked(where, lambda: cls(**hf_families.config_fields(d, where, req),
                                                   dtype=dtype, param_dtype=param_dtype))
        act = d.get("hidden_act", "silu")
        _need(act == "silu", f"{where}: hidden_act", f"only 'silu' is supported, got {act!r}")
        _need(not d.get("mlp_bias", False), f"{where}: mlp_bias", "MLP biases are not supported")
        _need(not d.get("use_sliding_window", False), f"{where}: use_sliding_window",
              "sliding-window attention is not supported")
        heads = int(req("num_attention_heads"))
        hidden = int(req("hidden_size"))
        rope_params = dict(d.get("rope_parameters") or {})
        legacy = d.get("rope_scaling")
        if legacy:
            rope_params = {**dict(legacy), **rope_params}
        theta = rope_params.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope_params.pop("rope_type", rope_params.pop("type", "default"))
        _need(rope_type in ("default", "llama3"), f"{where}: rope_type",
              f"unsupported {rope_type!r} for model_type {model_type!r}; supported: default, "
              f"llama3")
        max_pos = int(d.get("max_position_embeddings", 4096))
        scaling = None
        if rope_type == "llama3":
            rope_params.setdefault("original_max_position_embeddings", max_pos)
            scaling = {"rope_type": "llama3", **{k: rope_params.get(k) for k in LLAMA3_ROPE_KEYS}}
        eos_ids = eos_token_ids(d.get("eos_token_id"))
        moe = _moe_fields(d, where) if model_type in MOE_MODEL_TYPES else {}
        return cls._checked(where, lambda: cls(
                model_type=model_type,
                vocab_size=int(req("vocab_size")),
                hidden_size=hidden,
                intermediate_size=int(req("intermediate_size")),
                num_layers=int(req("num_hidden_layers")),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rope_theta=float(theta),
                rope_scaling=scaling,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),   # HF's default
                attention_bias=(True if model_type == "qwen2"
                                else bool(d.get("attention_bias", False))),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                max_position_embeddings=max_pos,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                pad_token_id=d.get("pad_token_id"),
                dtype=dtype,
                param_dtype=param_dtype,
                **moe,
            ))

    @staticmethod
    def _checked(where: str, build):
        """``build()``, its errors prefixed with ``where`` (the config file)."""
        try:
            return build()
        except ModelFormatError as e:
            if str(e).startswith(where):     # req()'s: names the file already
                raise
            raise ModelFormatError(f"{where}: {e}") from None   # __post_init__'s: the field only
        except (TypeError, ValueError) as e:                 # int() / float() of a wrong type
            raise ModelFormatError(f"{where}: a numeric field holds a value of the wrong type "
                                   f"({e})") from None

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict:
        """A HF ``config.json`` object: ``model_type``, every RoPE field and the tie flag at
        top level (4.x layout) plus ``rope_parameters`` (5.x layout)."""
        if self.model_type in FAMILY_MODEL_TYPES:
            return hf_families.to_hf_dict(self, torch_dtype or self.param_dtype)
        rope_parameters = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update({k: self.rope_scaling[k] for k in LLAMA3_ROPE_KEYS})
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[self.model_type]
        eos = list(self.eos_token_ids)
        d = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling is not None else None,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": torch_dtype or self.param_dtype,
            "use_cache": True,
        }
        if self.model_type == "llama":
            d["mlp_bias"] = False
        else:
            d.update(use_sliding_window=False, sliding_window=None,
                     max_window_layers=self.num_layers)
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                     mlp_only_layers=[], router_aux_loss_coef=self.router_aux_loss_coef,
                     output_router_logits=False)
        return d

    @classmethod
    def from_model_config(cls, model_cfg) -> "DecoderConfig":
        """The random-model architecture of an :class:`rlflow.config.ModelConfig`."""
        return cls(
            model_type=model_cfg.model_type,
            vocab_size=model_cfg.vocab_size,
            hidden_size=model_cfg.hidden_size,
            intermediate_size=model_cfg.intermediate_size,
            num_layers=model_cfg.num_layers,
            num_heads=model_cfg.num_heads,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            rope_theta=float(model_cfg.rope_theta),
            tie_word_embeddings=model_cfg.tie_word_embeddings,
            attention_bias=model_cfg.model_type == "qwen2",
            qk_norm=model_cfg.model_type in ("qwen3", "qwen3_moe"),
            dtype=model_cfg.dtype,
            param_dtype=model_cfg.param_dtype,
            **({} if model_cfg.model_type not in MOE_MODEL_TYPES else dict(
                num_experts=model_cfg.num_experts,
                num_experts_per_tok=model_cfg.num_experts_per_tok,
                moe_intermediate_size=model_cfg.moe_intermediate_size,
                norm_topk_prob=model_cfg.norm_topk_prob,
                router_aux_loss_coef=float(model_cfg.router_aux_loss_coef))),
        )

    def __hash__(self):  # rope_scaling is a dict: hash a frozen view (jit static args)
        values = [getattr(self, f.name) for f in dataclasses.fields(self)]
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v
                          for v in values))

    def replace(self, **changes) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)
