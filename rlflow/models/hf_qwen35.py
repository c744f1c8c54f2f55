"""Qwen3.5 text (``qwen3_5_text``, transformers 5.x ``Qwen3_5TextConfig`` /
``Qwen3_5ForCausalLM``): its ``config.json`` fields and its per-layer HF tensors.

The decoder (transformers' ``modeling_qwen3_5.py``): layers of two kinds in ``layer_types``
(default: three ``"linear_attention"`` per ``"full_attention"``, HF's
``full_attention_interval`` 4). Linear-attention layers are gated DeltaNets
(:mod:`rlflow.models.gdn_layer`, shapes from the ``linear_*`` fields); full-attention layers
are Qwen3 attention with an output gate (``q_proj`` twice as wide, per head ``[query |
gate]``, output times ``sigmoid(gate)``), per-head q/k norms and RoPE on the first
``partial_rotary_factor`` of each head (default 0.25; the multimodal RoPE sections reduce to
plain RoPE for text positions). Every RMSNorm but the DeltaNet's gated one stores an offset
(``1 + w``). Refused: RoPE scaling other than ``default``, activations other than silu,
``mrope_interleaved``.

HF tensors of a linear-attention layer (``model.layers.{i}.linear_attn.``): ``in_proj_qkv
[2 Hk dk + Hv dv, E]`` (rows ``q | k | v``) and ``conv1d.weight [conv_dim, 1, K]`` split
into three rlflow kernels each (:class:`RowSlice` kinds of :mod:`rlflow.models.hf`),
``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``A_log``, ``dt_bias``, ``norm.weight``,
``out_proj``.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

from rlflow.models.format_error import ModelFormatError, eos_token_ids

_LINEAR, _FULL = "linear_attention", "full_attention"


class RowSlice(NamedTuple):
    """A kind of HF tensor that several rlflow parameters share by rows: rows ``[start,
    stop)`` of a tensor of ``total`` rows are the parameter, converted as ``base``
    (``"in_heads"``: ``[N*d, E] -> [E, N, d]``; ``"conv"``: ``[N*d, 1, K] -> [K, N, d]``)."""
    base: str
    start: int
    stop: int
    total: int


def _need(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ModelFormatError(f"{where}: {msg}")


def config_fields(d: Mapping, where: str, req: Callable) -> dict:
    """The :class:`rlflow.models.config.DecoderConfig` fields (without the dtypes) of a
    ``qwen3_5_text`` config.json ``d`` (module doc).

    Raises:
      ModelFormatError: an unsupported setting (names ``where`` and the field).
    """
    act = d.get("hidden_act", "silu")
    _need(act == "silu", f"{where}: hidden_act", f"only 'silu' is supported, got {act!r}")
    rope = {**dict(d.get("rope_scaling") or {}), **dict(d.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _need(rope_type == "default", f"{where}: rope_parameters.rope_type",
          f"only 'default' is supported for qwen3_5_text, got {rope_type!r}")
    _need(not rope.get("mrope_interleaved"), f"{where}: rope_parameters.mrope_interleaved",
          "interleaved multimodal RoPE is not supported")
    n = int(req("num_hidden_layers"))
    types = d.get("layer_types")
    if types is None:
        every = int(d.get("full_attention_interval") or 4)
        types = [_LINEAR if (i + 1) % every else _FULL for i in range(n)]
    _need(isinstance(types, (list, tuple)), f"{where}: layer_types",
          f"must be a list of layer kinds, got {types!r}")
    heads, hidden = int(req("num_attention_heads")), int(req("hidden_size"))
    factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    gdn = dict(num_k_heads=int(req("linear_num_key_heads")),
               num_v_heads=int(req("linear_num_value_heads")),
               head_k_dim=int(req("linear_key_head_dim")),
               head_v_dim=int(req("linear_value_head_dim")),
               conv_kernel=int(d.get("linear_conv_kernel_dim", 4)))
    moe = {}
    if d["model_type"] == "qwen3_5_moe_text":      # every layer's MLP: experts + shared one
        moe = dict(num_experts=int(req("num_experts")),
                   num_experts_per_tok=int(req("num_experts_per_tok")),
                   moe_intermediate_size=int(req("moe_intermediate_size")),
                   shared_expert_intermediate_size=int(req("shared_expert_intermediate_size")),
                   norm_topk_prob=True,
                   router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0) or 0.0))
    # a Qwen3.5-MoE config.json has no intermediate_size (no dense MLP): the experts' width
    inter = d.get("intermediate_size") if moe else req("intermediate_size")
    return dict(model_type=d["model_type"], vocab_size=int(req("vocab_size")), hidden_size=hidden,
                intermediate_size=int(inter or moe.get("moe_intermediate_size")), num_layers=n,
                num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                bos_token_id=d.get("bos_token_id"), pad_token_id=d.get("pad_token_id"),
                eos_token_ids=eos_token_ids(d.get("eos_token_id")), layer_types=tuple(types),
                rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                partial_rotary_factor=float(factor),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)), qk_norm=True,
                attn_output_gate=True, gdn=gdn, **moe)


def to_hf_dict(cfg, torch_dtype: str) -> dict:
    """The HF ``config.json`` object of a ``qwen3_5_text`` config (what
    ``Qwen3_5ForCausalLM`` loads)."""
    eos = list(cfg.eos_token_ids)
    g = cfg.gdn
    moe = {} if not cfg.is_moe else {
        "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": cfg.model_type,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.attention_bias, "attention_dropout": 0.0,
            "layer_types": list(cfg.kinds),
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                "partial_rotary_factor": cfg.partial_rotary_factor},
            "linear_num_key_heads": g["num_k_heads"], "linear_num_value_heads": g["num_v_heads"],
            "linear_key_head_dim": g["head_k_dim"], "linear_value_head_dim": g["head_v_dim"],
            "linear_conv_kernel_dim": g["conv_kernel"],
            "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
            "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
            "torch_dtype": torch_dtype, "use_cache": True, **moe}


def linear_layer_tensors(cfg) -> list[tuple[str, tuple, object]]:
    """``(hf name inside model.layers.{i}., path inside a Block, kind)`` of a
    linear-attention layer's DeltaNet (module doc)."""
    g = cfg.gdn
    kd, vd = g["num_k_heads"] * g["head_k_dim"], g["num_v_heads"] * g["head_v_dim"]
    total = 2 * kd + vd
    cuts = {"q": (0, kd), "k": (kd, 2 * kd), "v": (2 * kd, total)}
    pre, attn = "linear_attn.", "attn"
    m = [(pre + "in_proj_qkv.weight", (attn, f"{p}_kernel"), RowSlice("in_heads", a, b, total))
         for p, (a, b) in cuts.items()]
    m += [(pre + "conv1d.weight", (attn, f"conv_{p}"), RowSlice("conv", a, b, total))
          for p, (a, b) in cuts.items()]
    return m + [(pre + "in_proj_z.weight", (attn, "z_kernel"), "in_heads"),
                (pre + "in_proj_b.weight", (attn, "b_kernel"), "linear"),
                (pre + "in_proj_a.weight", (attn, "a_kernel"), "linear"),
                (pre + "A_log", (attn, "A_log"), "copy"),
                (pre + "dt_bias", (attn, "dt_bias"), "copy"),
                (pre + "norm.weight", (attn, "norm_scale"), "copy"),
                (pre + "out_proj.weight", (attn, "o_kernel"), "out_heads")]


def row_slice_hf_shape(kind: RowSlice, shape: tuple) -> tuple:
    """The whole HF tensor's shape for a parameter of ``shape`` (``[E, N, d]`` or ``[K, N,
    d]``)."""
    return (kind.total, shape[0]) if kind.base == "in_heads" else (kind.total, 1, shape[0])


def row_slice_to_ours(kind: RowSlice, a, shape: tuple):
    """The parameter held in rows ``[start, stop)`` of the HF tensor ``a``."""
    a = a[kind.start:kind.stop]
    return (a.T if kind.base == "in_heads" else a[:, 0, :].T).reshape(shape)


def row_slice_to_hf(kind: RowSlice, a):
    """The rows of the HF tensor that parameter ``a`` fills (:func:`join_rows` joins them)."""
    rows = a.reshape(a.shape[0], -1).T
    return rows if kind.base == "in_heads" else rows[:, None, :]


def join_rows(parts: dict, kind: RowSlice, rows):
    """Collects ``rows`` (of :func:`row_slice_to_hf`) at ``kind.start`` in ``parts``; returns
    the whole tensor once its ``total`` rows are in, else None."""
    import numpy as np

    parts[kind.start] = rows
    if sum(p.shape[0] for p in parts.values()) < kind.total:
        return None
    return np.ascontiguousarray(np.concatenate([parts[s] for s in sorted(parts)], 0))


def shared_expert_tensors() -> list[tuple[str, tuple, str]]:
    """Qwen3.5-MoE's shared expert in a layer's MLP: ``mlp.shared_expert.{gate,up,down}_proj``
    and ``mlp.shared_expert_gate.weight [1, E]`` (as :func:`linear_layer_tensors`)."""
    return [(f"mlp.shared_expert.{p}_proj.weight", ("mlp", f"shared_{p}_kernel"), "linear")
            for p in ("gate", "up", "down")] + [
        ("mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate"), "linear")]
