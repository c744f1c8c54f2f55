"""Rotary position embeddings (Su et al. 2021, "RoFormer", eq. 34; HF "rotate-half" layout,
Llama-3 frequency scaling) and the positions of a padded batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rlflow.models.config import DecoderConfig


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Positions of a left/right-padded batch: ``cumsum(mask) - 1`` clipped at 0.

    Args:
      attention_mask: ``[B, T]`` bool/int, False/0 on padding.

    Returns:
      ``[B, T]`` int32; the real tokens of a row get 0, 1, 2, ... (pads get 0 before the
      first real token, and repeat the last position after it).
    """
    mask = jnp.asarray(attention_mask).astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)


def rope_table(cfg: DecoderConfig, kind: str = "full_attention") -> tuple[np.ndarray, float]:
    """RoPE of the layers of one kind: ``(inv_freq [D/2] float32, attention_scaling)``.

    ``"sliding_attention"`` layers with ``cfg.rope_local_theta`` set take plain RoPE of that
    base (Gemma 3's local layers); every other layer :func:`rope_inv_freq` with
    ``cfg.rope_scaling``. ``attention_scaling`` multiplies cos and sin (YaRN's
    ``0.1 ln(factor) + 1``, Peng et al. 2023, eq. 21 / transformers'
    ``_compute_yarn_parameters``; 1.0 otherwise).
    """
    if kind == "sliding_attention" and cfg.rope_local_theta is not None:
        return _default_inv_freq(cfg.head_dim, cfg.rope_local_theta), 1.0
    scale = 1.0
    if cfg.rope_type == "yarn":
        s = cfg.rope_scaling
        scale = s.get("attention_factor")
        if scale is None:
            factor = float(s["factor"])
            scale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return rope_inv_freq(cfg), float(scale)


def _default_inv_freq(d: int, theta: float) -> np.ndarray:
    exps = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


def _yarn_inv_freq(d: int, theta: float, s: dict) -> np.ndarray:
    """YaRN's blend of interpolated and extrapolated frequencies (Peng et al. 2023, "YaRN",
    sec. 3.2 "NTK-by-parts"), as transformers' ``_compute_yarn_parameters``."""
    factor = float(s["factor"])
    old = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations):
        return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    pos = (np.float32(theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d)))
    extra = (np.float32(1.0) / pos).astype(np.float32)
    inter = (np.float32(1.0) / (np.float32(factor) * pos)).astype(np.float32)
    keep = (np.float32(1.0) - ramp).astype(np.float32)
    return (inter * (1 - keep) + extra * keep).astype(np.float32)


def rope_inv_freq(cfg: DecoderConfig) -> np.ndarray:
    """Inverse RoPE frequencies ``[D/2]`` float32 of the full-attention layers, with
    ``cfg.rope_scaling`` (Llama-3, linear or YaRN) when configured.

    Matches transformers' ``_compute_default_rope_parameters``,
    ``_compute_llama3_parameters`` (Llama 3.1 report, sec. 3.1.3 / Meta reference code),
    ``_compute_linear_scaling_rope_parameters`` and ``_compute_yarn_parameters``.
    """
    d = cfg.rotary_dim              # head_dim, or its rotated part (partial_rotary_factor)
    inv = _default_inv_freq(d, cfg.rope_theta)
    if cfg.rope_type == "linear":
        return (inv / np.float32(cfg.rope_scaling["factor"])).astype(np.float32)
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(d, cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_type == "llama3":
        s = cfg.rope_scaling
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = (2 * math.pi / inv).astype(np.float32)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
        smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               scale: float = 1.0) -> jax.Array:
    """Rotate ``x`` ``[B, T, N, D]`` by ``positions`` ``[B, T]`` (HF rotate-half layout);
    cos and sin are multiplied by ``scale`` (YaRN's attention scaling, :func:`rope_table`).
    ``inv_freq [R/2]`` with ``R < D`` (partial rotary, Qwen3.5): the first ``R`` dims of each
    head are rotated, the rest pass (transformers' ``apply_rotary_pos_emb``)."""
    rot = 2 * len(inv_freq)
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], positions, inv_freq, scale),
                                x[..., rot:]], axis=-1)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos = jnp.concatenate([cos] * 2, axis=-1)[:, :, None, :].astype(x.dtype)
    sin = jnp.concatenate([sin] * 2, axis=-1)[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
