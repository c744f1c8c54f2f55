"""The short causal depthwise convolution of a GatedDeltaNet layer (kernel ``K = 4`` in
Qwen3-Next / Qwen3.5; the "short convolution" of Yang et al. 2024, "Gated Delta Networks",
sec. 3.4, after Mamba's, Gu & Dao 2023, sec. 3.4) with its decode-time state.

``y[t, c] = act(sum_{j<K} w[j, c] * x[t - K + 1 + j, c])`` with ``x`` zero before the row's
start (transformers' ``causal_conv1d_fn``: ``conv1d(padding=K-1)`` cut to ``T``, then SiLU).
The weight is stored time-major, ``w [K, C]`` (transformers' ``conv1d.weight [C, 1, K]``
transposed).

Decode state: the last ``K - 1`` inputs, ``[B, K - 1, C]`` (transformers keeps ``K``; the
oldest of them is never read). With packed rows (``segment_ids``) an input of another
segment counts as zero, so the window restarts at each segment boundary, and the state a
sequence leaves holds only inputs of its last segment. A ``state`` passed in belongs to the
first segment of its row (the prefix of a continued sequence).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlflow.models.gated_delta import segment_runs


def _check(x, weight, state):
    b, _, c = x.shape
    if weight.ndim != 2 or weight.shape[1] != c:
        raise ValueError(f"conv weight: expected [kernel, channels={c}], got {weight.shape}")
    want = (b, weight.shape[0] - 1, c)
    if state is not None and state.shape != want:
        raise ValueError(f"conv state: expected [batch, kernel - 1, channels] = {want}, got "
                         f"{state.shape}")


def causal_conv1d(x: jax.Array, weight: jax.Array, *, state: jax.Array | None = None,
                  segment_ids: jax.Array | None = None, activation=jax.nn.silu
                  ) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv over a sequence (prefill, the learner).

    Args:
      x: ``[B, T, C]``; weight: ``[K, C]``.
      state: ``[B, K - 1, C]``, the inputs before ``x`` (default zeros).
      segment_ids: ``[B, T]`` int or None; the window restarts where it changes.
      activation: applied to the float32 sum (default SiLU; None for none).

    Returns:
      ``(y [B, T, C] in x.dtype, state [B, K - 1, C] in x.dtype)``: the new state holds the
      last ``K - 1`` inputs of the row's last segment (zeros before it).

    Raises:
      ValueError: weight or state shapes do not fit ``x``.
    """
    _check(x, weight, state)
    b, t, c = x.shape
    kern = weight.shape[0]
    hist = jnp.zeros((b, kern - 1, c), x.dtype) if state is None else state.astype(x.dtype)
    xpad = jnp.concatenate([hist, x], axis=1)
    runs = segment_runs(segment_ids, b, t)
    rpad = jnp.concatenate([jnp.zeros((b, kern - 1), jnp.int32), runs], axis=1)
    w = weight.astype(jnp.float32)
    acc = jnp.zeros((b, t, c), jnp.float32)
    for j in range(kern):
        same = (rpad[:, j:j + t] == runs)[..., None]
        acc = acc + jnp.where(same, xpad[:, j:j + t].astype(jnp.float32), 0.0) * w[j]
    y = acc if activation is None else activation(acc)
    tail = slice(xpad.shape[1] - (kern - 1), None)
    keep = (rpad[:, tail] == runs[:, -1:])[..., None]
    return y.astype(x.dtype), jnp.where(keep, xpad[:, tail], jnp.zeros((), x.dtype))


def causal_conv1d_step(x: jax.Array, weight: jax.Array, state: jax.Array,
                       activation=jax.nn.silu) -> tuple[jax.Array, jax.Array]:
    """One decode token: ``x [B, C]``, ``weight [K, C]``, ``state [B, K - 1, C]`` (zeros for
    a slot starting a new sequence). Returns ``(y [B, C] in x.dtype, new state)``; the same
    arithmetic as :func:`causal_conv1d` at ``T = 1``.

    Raises:
      ValueError: weight or state shapes do not fit ``x``.
    """
    _check(x[:, None], weight, state)
    window = jnp.concatenate([state.astype(x.dtype), x[:, None]], axis=1)       # [B, K, C]
    acc = jnp.zeros(x.shape, jnp.float32)
    w = weight.astype(jnp.float32)
    for j in range(weight.shape[0]):
        acc = acc + window[:, j].astype(jnp.float32) * w[j]
    y = acc if activation is None else activation(acc)
    return y.astype(x.dtype), window[:, 1:]
