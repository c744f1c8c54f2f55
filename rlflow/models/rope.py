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


def rope_inv_freq(cfg: DecoderConfig) -> np.ndarray:
    """Inverse RoPE frequencies ``[D/2]`` float32, with Llama-3 scaling when configured.

    Matches transformers' ``_compute_default_rope_parameters`` and
    ``_compute_llama3_parameters`` (Llama 3.1 report, sec. 3.1.3 / Meta reference code).
    """
    d = cfg.head_dim
    exps = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exps)).astype(np.float32)
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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x`` ``[B, T, N, D]`` by ``positions`` ``[B, T]`` (HF rotate-half layout)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
