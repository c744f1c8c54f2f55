"""Sampler memory, computed from the architecture and the config (before any run): the
sums :mod:`rlflow.console.fit` and :mod:`rlflow.console.checks` compare with a device's memory,
beside the learner's (:mod:`rlflow.learner.memory`). Pure arithmetic, no JAX.

``arch`` below is a :class:`rlflow.learner.memory.Architecture` (its ``num_params()``,
``expert_params()`` and sizes); ``m`` a model's :class:`rlflow.models.config.DecoderConfig`
(or an ``Architecture``: the same size fields).
"""

from __future__ import annotations


def _kinds(m) -> tuple:
    """Each layer's kind of ``m`` (a ``DecoderConfig`` or an ``Architecture``)."""
    return tuple(getattr(m, "kinds", ())) or ("full_attention",) * m.num_layers


def gdn_state_bytes(m, dtype_bytes: int) -> int:
    """One slot's decode state of one gated DeltaNet layer of ``m``
    (:func:`rlflow.models.gdn_layer.init_state`): conv windows ``(K - 1) (2 Hk dk + Hv dv)``
    in the sampler dtype and the float32 ``[Hv, dk, dv]`` matrix; 0 without ``m.gdn``."""
    g = getattr(m, "gdn", None)
    if not g:
        return 0
    conv = (g["conv_kernel"] - 1) * (2 * g["num_k_heads"] * g["head_k_dim"] +
                                     g["num_v_heads"] * g["head_v_dim"])
    return conv * dtype_bytes + 4 * g["num_v_heads"] * g["head_k_dim"] * g["head_v_dim"]


def kv_cache_bytes(cfg, m) -> int:
    """Bytes of one sampler replica's decode state, counted per kind of layer (``m``: the
    model's ``DecoderConfig`` or an ``Architecture``; the slots' masks and page tables, a
    byte or an int per position or page, are left out):

    * contiguous (:func:`rlflow.models.kv_cache.init_cache`): per slot ``S =
      max_prefill_length + max_tokens`` positions of keys and values, ``2 x num_kv_heads x
      head_dim`` values of the sampler dtype each, for every full-attention layer; a
      sliding-window layer holds only its window, a ring of ``min(S, sliding_window)``
      positions per slot (:mod:`rlflow.models.window_cache`);
    * ``sampler.kv_cache = "paged"``: ``pool_pages x page_size`` positions of keys and
      values per full-attention layer (:mod:`rlflow.models.paged_kv_cache`), and the same
      per-slot rings for the sliding-window layers (never paged);
    * every gated DeltaNet (``"linear_attention"``) layer: ``num_slots`` states of
      :func:`gdn_state_bytes`, whatever the length (in both layouts).
    """
    sp = cfg.sampler
    dtype = sp.dtype or cfg.model.dtype
    per = 2 if dtype == "bfloat16" else 4
    kinds = _kinds(m)
    slot_len = sp.max_prefill_length + sp.max_tokens
    window = getattr(m, "sliding_window", None) or slot_len
    ring = min(window, slot_len)
    rings = sp.num_slots * ring * sum(1 for k in kinds if k == "sliding_attention")
    full = sum(1 for k in kinds if k == "full_attention")
    if sp.kv_cache == "paged":
        positions = sp.pool_pages * sp.page_size * full + rings
    else:
        positions = sp.num_slots * slot_len * full + rings
    linear = sum(1 for k in kinds if k == "linear_attention")
    return (positions * 2 * m.num_kv_heads * m.head_dim * per
            + sp.num_slots * linear * gdn_state_bytes(m, per))


def sampler_weight_bytes(arch, dtype_bytes: int, quantization: str = "none") -> float:
    """Bytes of one copy of the sampler's weights: every parameter in the sampler dtype
    (``dtype_bytes`` a value), or with ``sampler.quantization="int8"`` the projection
    kernels (attention q/k/v/o, MLP gate/up/down, an untied LM head) at 1 byte a value plus
    one scale in the sampler dtype per output channel, the rest (embeddings, norms,
    biases) in the sampler dtype (:mod:`rlflow.sampler.quantization`)."""
    total = arch.num_params() * dtype_bytes
    if quantization != "int8":
        return total
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    kernels = arch.num_layers * (2 * h * q + 2 * h * kv + 3 * h * i)
    channels = arch.num_layers * (q + 2 * kv + h + 2 * i + h)
    if not arch.tie_word_embeddings:
        kernels, channels = kernels + h * arch.vocab_size, channels + arch.vocab_size
    return total - kernels * dtype_bytes + kernels + channels * dtype_bytes


def sampler_bytes(cfg, arch, accelerator: bool = True) -> float:
    """Bytes of one sampler replica over all its devices: ``sampler.mesh.data`` copies of
    the weights in the sampler's dtype (with ``sampler.quantization="int8"`` on an
    ``accelerator``, int8 projection kernels and their scales, :func:`sampler_weight_bytes`;
    the CPU backend holds them dequantized, :func:`rlflow.sampler.quantization.holds_float`;
    the weights outside a mixture-of-experts model's experts once more for every device of
    ``sampler.mesh.expert``, which splits only the experts), and its KV cache."""
    sp = cfg.sampler
    per = 2 if (sp.dtype or cfg.model.dtype) == "bfloat16" else 4
    expert = getattr(sp.mesh, "expert", 1)
    weights = sampler_weight_bytes(arch, per, sp.quantization if accelerator else "none")
    weights += (expert - 1) * (arch.num_params() - arch.expert_params()) * per
    return sp.mesh.data * weights + kv_cache_bytes(cfg, arch)
