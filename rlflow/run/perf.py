"""Model FLOPs, per-chip peak FLOP/s and model FLOPs utilisation (MFU) of a learner step.

Model FLOPs of a dense decoder (Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", sec. 2.1 and table 1; Chowdhery et al. 2022, "PaLM", appendix B): a forward pass
costs ``2 N`` FLOPs per token for the matrix multiplies with ``N`` weights, plus the
attention scores ``Q K^T`` and the weighted sum ``A V``: ``2 * 2 * L * H * D * T`` per
token attending a sequence of ``T`` tokens (PaLM counts the full ``T x T`` matrix, not its
causal half, and so does this module). Training costs 3 forwards (the backward pass twice
the forward), PaLM's ``6 N + 12 L H D T`` per token.

``N`` counts every matrix multiply weight a token goes through: per layer the q, k, v and
o projections (``E H D + 2 E K D + H D E``) and the SwiGLU MLP (``3 E F``), and the LM
head (``E V``, tied or not). The embedding lookup is not a multiply; norms, RoPE, softmax
and the loss are left out (as in both papers). These are *model* FLOPs: what the step
would cost without recomputation (``learner.remat``), a frozen base (LoRA) or a logit
head computed on loss positions only; MFU is model FLOPs / (time x peak), so such choices
show as a higher or lower MFU, not as another count. The KL reference forward
(``learner.kl_coef > 0``) is not counted either.

Peak FLOP/s per chip: :data:`PEAK_FLOPS` (bf16 dense, the vendors' data sheets); on CPU a
``jnp.dot`` measured once per process (:func:`measured_cpu_peak`).
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np

logger = logging.getLogger("rlflow.run.perf")

# Dense bfloat16 peak FLOP/s per chip (no 2:4 sparsity), matched against
# ``jax.Device.device_kind`` (lower-cased substring, first match wins: "v5 lite" before "v5").
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("v6 lite", 918e12),      # TPU v6e (Trillium)
    ("v6e", 918e12),
    ("v5 lite", 197e12),      # TPU v5e
    ("v5e", 197e12),
    ("v5p", 459e12),          # TPU v5p
    ("v5", 459e12),
    ("v4", 275e12),           # TPU v4
    ("h200", 989e12),         # NVIDIA H200 SXM (same tensor cores as H100 SXM)
    ("h100", 989e12),         # NVIDIA H100 SXM
    ("a100", 312e12),         # NVIDIA A100
)


def matmul_params(cfg) -> int:
    """``N``: weights of the matrix multiplies one token goes through in a forward pass
    (module docstring). ``cfg``: a :class:`rlflow.models.config.DecoderConfig` (or any
    object with its field names). A mixture-of-experts layer counts its active weights:
    the router ``E x n`` and the ``k`` experts a token goes to, ``3 E F k``."""
    e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    n_exp = getattr(cfg, "num_experts", 0)
    mlp = (3 * e * cfg.moe_intermediate_size * cfg.num_experts_per_tok + e * n_exp if n_exp
           else 3 * e * cfg.intermediate_size)
    per_layer = e * h * d + 2 * e * k * d + h * d * e + mlp
    return cfg.num_layers * per_layer + e * cfg.vocab_size


def sequence_lengths(attention_mask: np.ndarray, positions: np.ndarray,
                     segment_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of each sequence of a train batch and the length ``T`` it attends.

    Args:
      attention_mask: bool ``[B, L]``, real tokens.
      positions: int ``[B, L]``, each token's position in its sequence.
      segment_ids: int ``[B, L]`` (packed batches, >= 1 on real tokens) or None (one
        sequence per row).

    Returns:
      ``(n, T)``: int64 ``[S]`` each, per sequence its token count in the batch and its
      length (largest position + 1: a completion packed after a shared prompt attends it).
    """
    mask = np.asarray(attention_mask, bool)
    pos = np.asarray(positions)
    if segment_ids is None:
        seg = (np.arange(mask.shape[0])[:, None] + 1) * mask
    else:
        seg = np.asarray(segment_ids)
    ids = seg[mask]
    _, inv = np.unique(ids, return_inverse=True)
    counts = np.bincount(inv).astype(np.int64)
    length = np.zeros(counts.shape, np.int64)
    np.maximum.at(length, inv, pos[mask].astype(np.int64) + 1)
    return counts, length


def train_flops(cfg, tokens: np.ndarray, lengths: np.ndarray) -> float:
    """Model FLOPs of one training step: ``sum_s 3 (2 N n_s + 4 L H D n_s T_s)`` over the
    batch's sequences (PaLM appendix B: ``6 N + 12 L H D T`` per token).

    Args:
      cfg: the model's DecoderConfig.
      tokens / lengths: int ``[S]`` per sequence (:func:`sequence_lengths`).
    """
    n = np.asarray(tokens, np.float64)
    t = np.asarray(lengths, np.float64)
    attn = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return float(3.0 * (2.0 * matmul_params(cfg) * n.sum() + attn * (n * t).sum()))


def peak_flops_from_table(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of one chip named ``device_kind`` (:data:`PEAK_FLOPS`), or
    None when it is not in the table."""
    kind = device_kind.lower()
    for key, flops in PEAK_FLOPS:
        if key in kind:
            return flops
    return None


@functools.lru_cache(maxsize=None)
def measured_cpu_peak(dtype: str = "float32", n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of a jitted ``jnp.dot`` of two ``[n, n]`` ``dtype`` matrices on the default
    CPU device: ``2 n^3`` over the fastest of ``repeats`` runs after a warm-up. Measured
    once per process (cached): ~0.1 s."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), dtype), cpu)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dot(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    flops = 2.0 * n ** 3 / best
    logger.info("measured CPU jnp.dot peak (%s, %dx%d): %.3g FLOP/s per device", dtype, n, n,
                flops)
    return flops


def peak_flops_per_chip(device, dtype: str = "float32") -> float:
    """Peak FLOP/s of one ``jax.Device``: the table for TPUs and GPUs; on CPU (or a chip not
    in the table, with a warning) :func:`measured_cpu_peak` of ``dtype``."""
    if device.platform != "cpu":
        flops = peak_flops_from_table(device.device_kind)
        if flops is not None:
            return flops
        logger.warning("no peak FLOP/s for device kind %r in rlflow.run.perf.PEAK_FLOPS; MFU "
                       "uses a measured CPU jnp.dot peak instead", device.device_kind)
    return measured_cpu_peak(dtype)


def learner_perf_metrics(flops: float, tokens: int, seconds: float, *, chips: int,
                         peak_per_chip: float) -> dict[str, float]:
    """``perf/*`` metrics of one learner step.

    Args:
      flops: the step's model FLOPs (:func:`train_flops`).
      tokens: real (not padding) tokens trained on.
      seconds: wall time of the step's compute (``learner/step_time_s``).
      chips: devices of the learner's mesh.
      peak_per_chip: FLOP/s (:func:`peak_flops_per_chip`).

    Returns:
      ``perf/model_flops`` (FLOPs), ``perf/model_flops_per_s_per_chip`` (FLOP/s),
      ``perf/mfu`` (fraction: flops / (seconds x chips x peak)) and
      ``perf/tokens_per_s_per_chip`` (tokens / s / chip).
    """
    seconds = max(float(seconds), 1e-9)
    per_chip = flops / seconds / chips
    return {"perf/model_flops": float(flops), "perf/model_flops_per_s_per_chip": per_chip,
            "perf/mfu": per_chip / peak_per_chip,
            "perf/tokens_per_s_per_chip": float(tokens) / seconds / chips}
