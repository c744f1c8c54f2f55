"""Sampler memory, computed from the architecture and the config (before any run): the
sums :mod:`rlflow.console.fit` and :mod:`rlflow.console.checks` compare with a device's memory,
beside the learner's (:mod:`rlflow.learner.memory`). Pure arithmetic, no JAX.

``arch`` below is a :class:`rlflow.learner.memory.Architecture` (its ``num_params()``,
``expert_params()`` and sizes); ``m`` a model's :class:`rlflow.models.config.DecoderConfig`
(or an ``Architecture``: the same size fields).
"""

from __future__ import annotations


def kv_cache_bytes(cfg, m) -> int:
    """Bytes of one sampler replica's KV cache (``rlflow.models.kv_cache.init_cache``):
    ``num_slots x (max_prefill_length + max_tokens)`` positions (``sampler.kv_cache =
    "paged"``: ``pool_pages x page_size``, :mod:`rlflow.models.paged_kv_cache`) x layers x
    keys and values x ``num_kv_heads x head_dim`` x the sampler dtype's bytes (``m``: the
    model's ``DecoderConfig``)."""
    sp = cfg.sampler
    dtype = sp.dtype or cfg.model.dtype
    per = 2 if dtype == "bfloat16" else 4
    positions = (sp.pool_pages * sp.page_size if sp.kv_cache == "paged" else
                 sp.num_slots * (sp.max_prefill_length + sp.max_tokens))
    return positions * m.num_layers * 2 * m.num_kv_heads * m.head_dim * per


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
