"""``config.json`` of the families with layers of several kinds: Gemma 3 text
(``gemma3_text``) and gpt-oss (``gpt_oss``), read into and written from a
:class:`rlflow.models.config.DecoderConfig` (``DecoderConfig.from_hf_dict`` /
``to_hf_dict`` delegate here).

Both name each layer's kind in ``layer_types`` (``"sliding_attention"`` /
``"full_attention"``); without it, HF's defaults: Gemma 3 one full layer after every five
sliding ones (``sliding_window_pattern`` 6), gpt-oss alternating, sliding first.

Gemma 3 (transformers ``Gemma3TextConfig``): ``rope_parameters`` holds one dict per layer
kind (5.x layout; 4.x: ``rope_theta`` + ``rope_scaling`` for the full layers and
``rope_local_base_freq`` for the sliding ones); the sliding layers take plain RoPE
(``rope_local_theta``), the full ones ``default`` or ``linear`` scaling.
``attn_logit_softcapping`` is not read: transformers' Gemma 3 attention never applies it
(``final_logit_softcapping`` it does). Refused:
``use_bidirectional_attention`` and activations other than ``gelu_pytorch_tanh``.

gpt-oss (``GptOssConfig``): ``intermediate_size`` is each expert's width; the router is a
softmax over the top-k logits (rlflow: softmax then top-k renormalised, the same gates);
RoPE ``yarn`` (or ``default``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from rlflow.models import hf_qwen35
from rlflow.models.format_error import ModelFormatError, eos_token_ids

GEMMA_ACTIVATION = "gelu_pytorch_tanh"
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _need(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ModelFormatError(f"{where}: {msg}")


def _layer_types(d: Mapping, n: int, every: int, where: str) -> tuple[str, ...]:
    """``layer_types`` of the file, or HF's default: a full layer at each ``every``-th."""
    types = d.get("layer_types")
    if types is None:
        types = [_SLIDING if (i + 1) % every else _FULL for i in range(n)]
    _need(isinstance(types, (list, tuple)), f"{where}: layer_types",
          f"must be a list of layer kinds, got {types!r}")
    return tuple(types)


def _scaling(params: Mapping, where: str, allowed: tuple[str, ...]) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling or None)`` of one RoPE parameter dict."""
    params = dict(params)
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    _need(rope_type in allowed, f"{where}: rope_type",
          f"unsupported {rope_type!r} here; supported: {', '.join(allowed)}")
    if rope_type == "default":
        return theta, None
    _need("mscale" not in params and "mscale_all_dim" not in params, f"{where}: mscale",
          "YaRN's mscale / mscale_all_dim (DeepSeek style) are not supported")
    return theta, {"rope_type": rope_type, **params}


def _common(d: Mapping, where: str, req: Callable) -> dict:
    heads = int(req("num_attention_heads"))
    hidden = int(req("hidden_size"))
    window = d.get("sliding_window")
    return dict(model_type=d["model_type"], vocab_size=int(req("vocab_size")),
                hidden_size=hidden, num_layers=int(req("num_hidden_layers")), num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                bos_token_id=d.get("bos_token_id"), pad_token_id=d.get("pad_token_id"),
                eos_token_ids=eos_token_ids(d.get("eos_token_id")),
                sliding_window=None if window is None else int(window))


def _gemma3(d: Mapping, where: str, req: Callable) -> dict:
    _need(not d.get("use_bidirectional_attention"), f"{where}: use_bidirectional_attention",
          "bidirectional attention (Gemma 3 embedding models) is not supported")
    act = d.get("hidden_activation", d.get("hidden_act", GEMMA_ACTIVATION))
    _need(act == GEMMA_ACTIVATION, f"{where}: hidden_activation",
          f"only {GEMMA_ACTIVATION!r} is supported, got {act!r}")
    fields = _common(d, where, req)
    rope = d.get("rope_parameters") or {}
    if _FULL in rope or _SLIDING in rope:          # transformers 5.x: one dict per kind
        full, local = dict(rope.get(_FULL) or {}), dict(rope.get(_SLIDING) or {})
    else:                                          # 4.x: top-level fields
        full = {**dict(d.get("rope_scaling") or {}), **dict(rope)}
        full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10000.0)
    theta, scaling = _scaling(full, f"{where}: rope_parameters.full_attention",
                              ("default", "linear"))
    local_theta, _ = _scaling(local, f"{where}: rope_parameters.sliding_attention",
                              ("default",))
    # attn_logit_softcapping: transformers' Gemma 3 reads it but never applies it (its
    # attention passes no softcap), so neither does rlflow; the final-logit cap it applies
    final_cap = d.get("final_logit_softcapping")
    soft = {"final_logit_softcapping": None if final_cap is None else float(final_cap)}
    return dict(fields, intermediate_size=int(req("intermediate_size")),
                layer_types=_layer_types(d, fields["num_layers"],
                                         int(d.get("sliding_window_pattern", 6)), where),
                rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
                attention_bias=bool(d.get("attention_bias", False)), qk_norm=True,
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)), **soft)


def _gpt_oss(d: Mapping, where: str, req: Callable) -> dict:
    act = d.get("hidden_act", "silu")
    _need(act == "silu", f"{where}: hidden_act", f"only 'silu' is supported, got {act!r}")
    fields = _common(d, where, req)
    n = d.get("num_local_experts", d.get("num_experts"))
    _need(n is not None, f"{where}: num_local_experts", "required field is missing")
    rope = {**dict(d.get("rope_scaling") or {}), **dict(d.get("rope_parameters") or {})}
    rope.setdefault("rope_theta", d.get("rope_theta", 150000.0))
    theta, scaling = _scaling(rope, f"{where}: rope_parameters", ("default", "yarn"))
    width = int(req("intermediate_size"))
    return dict(fields, intermediate_size=width, moe_intermediate_size=width,
                num_experts=int(n), num_experts_per_tok=int(req("num_experts_per_tok")),
                norm_topk_prob=True,
                router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0) or 0.0),
                layer_types=_layer_types(d, fields["num_layers"], 2, where),
                rope_theta=theta, rope_scaling=scaling,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", True)),
                swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(d.get("swiglu_limit", 7.0)))


def config_fields(d: Mapping[str, Any], where: str, req: Callable) -> dict:
    """The :class:`DecoderConfig` fields (without the dtypes) of a ``gemma3_text`` or
    ``gpt_oss`` config.json ``d``; ``req(key)`` returns a required field or raises.

    Raises:
      ModelFormatError: an unsupported setting (names ``where`` and the field).
    """
    if d["model_type"].startswith("qwen3_5"):
        return hf_qwen35.config_fields(d, where, req)
    return (_gemma3 if d["model_type"] == "gemma3_text" else _gpt_oss)(d, where, req)


def _rope_dict(theta: float, scaling: dict | None) -> dict:
    return {"rope_type": "default", "rope_theta": theta} if scaling is None else {
        **scaling, "rope_theta": theta}


def _int_if_whole(x):
    """``Gemma3TextConfig`` types ``query_pre_attn_scalar`` as an int."""
    return int(x) if x is not None and float(x).is_integer() else x


def to_hf_dict(cfg, torch_dtype: str) -> dict:
    """The HF ``config.json`` object of a ``gemma3_text`` / ``gpt_oss`` :class:`DecoderConfig`
    (what ``Gemma3ForCausalLM`` / ``GptOssForCausalLM`` load)."""
    if cfg.model_type.startswith("qwen3_5"):
        return hf_qwen35.to_hf_dict(cfg, torch_dtype)
    eos = list(cfg.eos_token_ids)
    d = {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
         "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
         "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
         "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
         "attention_bias": cfg.attention_bias, "attention_dropout": 0.0,
         "layer_types": list(cfg.kinds), "sliding_window": cfg.sliding_window,
         "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
         "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
         "torch_dtype": torch_dtype, "use_cache": True}
    if cfg.model_type == "gemma3_text":
        d.update(architectures=["Gemma3ForCausalLM"], intermediate_size=cfg.intermediate_size,
                 hidden_activation=GEMMA_ACTIVATION,
                 query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar),
                 attn_logit_softcapping=None,
                 final_logit_softcapping=cfg.final_logit_softcapping,
                 use_bidirectional_attention=False,
                 rope_parameters={_FULL: _rope_dict(cfg.rope_theta, cfg.rope_scaling),
                                  _SLIDING: _rope_dict(cfg.rope_local_theta or cfg.rope_theta,
                                                       None)})
    else:
        d.update(architectures=["GptOssForCausalLM"], intermediate_size=cfg.moe_intermediate_size,
                 hidden_act="silu", num_local_experts=cfg.num_experts,
                 num_experts_per_tok=cfg.num_experts_per_tok,
                 router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False,
                 swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
                 rope_parameters=_rope_dict(cfg.rope_theta, cfg.rope_scaling))
    return d
