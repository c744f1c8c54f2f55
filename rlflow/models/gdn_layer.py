"""The GatedDeltaNet (linear attention) layer of Qwen3-Next and Qwen3.5 as a flax NNX module,
with its decode state and the bytes that state takes per slot.

The layer (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks", sec. 3.4 and fig. 1; as
transformers 5.25's ``Qwen3_5GatedDeltaNet``)::

    x = x * attention_mask                                  (padding positions zeroed)
    q, k, v = silu(causal_conv(x W_q)), ... (x W_k), ... (x W_v)   (kernel K, depthwise)
    z = x W_z;  beta = sigmoid(x W_b);  g = -exp(A_log) * softplus(x W_a + dt_bias)
    o = gated_delta_rule(q, k, v, g, beta)                  (rlflow.models.gated_delta)
    y = (rmsnorm(o) * norm_scale * silu(z)) W_out           (per value head, over d_v)

Parameters (kernels ``[in, out...]`` like :mod:`rlflow.models.blocks`): ``q_kernel, k_kernel
[E, Hk, dk]``, ``v_kernel, z_kernel [E, Hv, dv]``, ``b_kernel, a_kernel [E, Hv]``,
``conv_q, conv_k [K, Hk, dk]``, ``conv_v [K, Hv, dv]``, ``A_log, dt_bias [Hv]``,
``norm_scale [dv]``, ``o_kernel [Hv, dv, E]``. transformers' fused ``in_proj_qkv`` and
``conv1d`` (channels ``q | k | v``) are split per part so that each, and its conv state, is
sharded along its heads (logical axes ``kv_heads`` for the key heads, ``q_heads`` for the
value heads; the depthwise conv is per channel, so the split is exact);
:func:`hf_to_params` converts Qwen3.5's and Qwen3-Next's tensors (Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba`` interleave the parts per key head).

Decode state per slot (:class:`GDNState`): the convs' last ``K - 1`` inputs (``conv_dim``
channels in all) in the activation dtype and the recurrent matrix ``[Hv, dk, dv]`` in
float32; neither grows with the sequence (:func:`decode_state_bytes` vs
:func:`kv_cache_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlflow.models import causal_conv, gated_delta
from rlflow.models.linear import _dense, _normal, _param


@dataclasses.dataclass(frozen=True)
class GDNSpec:
    """Shapes and settings of one GatedDeltaNet layer (transformers' ``linear_*`` fields).

    ``conv_kernel`` K (``linear_conv_kernel_dim``), ``chunk_size`` of the chunked rule,
    ``impl`` a name of :data:`rlflow.models.gated_delta.IMPLEMENTATIONS`; ``precision`` of
    the rule's float32 contractions (None, ``"default"``, ``"high"``, ``"highest"``: a
    ``jax.lax.Precision``); dtypes as names.
    """
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    chunk_size: int = gated_delta.DEFAULT_CHUNK
    impl: str = "auto"
    precision: str | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"GDNSpec: num_v_heads ({self.num_v_heads}) must be a multiple of "
                             f"num_k_heads ({self.num_k_heads})")
        if self.conv_kernel < 1:
            raise ValueError(f"GDNSpec: conv_kernel must be >= 1, got {self.conv_kernel}")
        gated_delta.resolve(self.impl)
        if self.precision not in (None, "default", "high", "highest"):
            raise ValueError(f"GDNSpec: precision must be None, 'default', 'high' or "
                             f"'highest', got {self.precision!r}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: ``q | k | v``."""
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_hf(cls, config, **overrides) -> "GDNSpec":
        """From a transformers ``Qwen3_5TextConfig`` / ``Qwen3NextConfig`` (its
        ``linear_*`` fields, ``hidden_size``, ``rms_norm_eps``; ``hidden_act`` must be silu).

        Raises:
          ValueError: ``hidden_act`` is not ``silu`` (names it).
        """
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"GatedDeltaNet: hidden_act {act!r} of the config is not "
                             f"supported; expected 'silu'")
        fields = dict(hidden_size=config.hidden_size, num_k_heads=config.linear_num_key_heads,
                      num_v_heads=config.linear_num_value_heads,
                      head_k_dim=config.linear_key_head_dim,
                      head_v_dim=config.linear_value_head_dim,
                      conv_kernel=config.linear_conv_kernel_dim,
                      rms_norm_eps=config.rms_norm_eps)
        fields.update(overrides)
        return cls(**fields)


class GDNState(NamedTuple):
    """Decode state of one GatedDeltaNet layer: the conv windows ``conv_q, conv_k [B, K - 1,
    Hk, dk]``, ``conv_v [B, K - 1, Hv, dv]`` (activation dtype) and ``recurrent [B, Hv, dk,
    dv]`` float32. Zeros for a slot starting a sequence. Logical axes: :data:`STATE_AXES`."""
    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    recurrent: jax.Array


STATE_AXES = GDNState(conv_q=("cache_batch", None, "kv_heads", "head_dim"),
                      conv_k=("cache_batch", None, "kv_heads", "head_dim"),
                      conv_v=("cache_batch", None, "q_heads", "head_dim"),
                      recurrent=("cache_batch", "q_heads", "head_dim", None))
"""Logical axes of a :class:`GDNState` (:func:`rlflow.mesh.logical_sharding`): slots over
the batch axes, heads over ``tensor``."""


def init_state(spec: GDNSpec, batch: int) -> GDNState:
    """Zero decode state for ``batch`` slots."""
    s, dt = spec, jnp.dtype(spec.dtype)
    return GDNState(
        jnp.zeros((batch, s.conv_kernel - 1, s.num_k_heads, s.head_k_dim), dt),
        jnp.zeros((batch, s.conv_kernel - 1, s.num_k_heads, s.head_k_dim), dt),
        jnp.zeros((batch, s.conv_kernel - 1, s.num_v_heads, s.head_v_dim), dt),
        jnp.zeros((batch, s.num_v_heads, s.head_k_dim, s.head_v_dim), jnp.float32))


class GatedDeltaNet(nnx.Module):
    """One GatedDeltaNet layer (module docstring); :meth:`__call__` for a sequence (the
    learner, prefill), :meth:`step` for one decode token."""

    def __init__(self, spec: GDNSpec, *, rngs: nnx.Rngs):
        s, pdt = spec, jnp.dtype(spec.param_dtype)
        self.spec, self.dtype = spec, jnp.dtype(spec.dtype)
        e, hk, hv, dk, dv, kern = (s.hidden_size, s.num_k_heads, s.num_v_heads, s.head_k_dim,
                                   s.head_v_dim, s.conv_kernel)
        kh, vh = ("embed", "kv_heads", "head_dim"), ("embed", "q_heads", "head_dim")
        self.q_kernel = _normal(rngs, (e, hk, dk), pdt, kh)
        self.k_kernel = _normal(rngs, (e, hk, dk), pdt, kh)
        self.v_kernel = _normal(rngs, (e, hv, dv), pdt, vh)
        self.z_kernel = _normal(rngs, (e, hv, dv), pdt, vh)
        self.b_kernel = _normal(rngs, (e, hv), pdt, ("embed", "q_heads"))
        self.a_kernel = _normal(rngs, (e, hv), pdt, ("embed", "q_heads"))
        conv_std = kern ** -0.5    # torch Conv1d's fan-in scale (fan_in = K, depthwise)
        self.conv_q = _param(conv_std * jax.random.normal(rngs.params(), (kern, hk, dk), pdt),
                             (None, "kv_heads", "head_dim"))
        self.conv_k = _param(conv_std * jax.random.normal(rngs.params(), (kern, hk, dk), pdt),
                             (None, "kv_heads", "head_dim"))
        self.conv_v = _param(conv_std * jax.random.normal(rngs.params(), (kern, hv, dv), pdt),
                             (None, "q_heads", "head_dim"))
        a = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 0.01, 16.0)   # as transformers
        self.A_log = _param(jnp.log(a).astype(pdt), ("q_heads",))
        self.dt_bias = _param(jnp.ones((hv,), pdt), ("q_heads",))
        self.norm_scale = _param(jnp.ones((dv,), pdt), ("norm",))
        self.o_kernel = _normal(rngs, (hv, dv, e), pdt, ("q_heads", "head_dim", "embed"))

    def _precision(self):
        p = self.spec.precision
        return None if p is None else jax.lax.Precision[p.upper()]

    def _project(self, x):
        """``x [..., E]`` -> ``(q, k [..., Hk, dk], v, z [..., Hv, dv], beta, g [..., Hv])``
        (``q, k, v`` before the conv)."""
        p = lambda w: w[...].astype(self.dtype)
        q, k, v = (_dense(x, p(w)) for w in (self.q_kernel, self.k_kernel, self.v_kernel))
        z = _dense(x, p(self.z_kernel))
        beta = jax.nn.sigmoid(_dense(x, p(self.b_kernel)).astype(jnp.float32))
        a = _dense(x, p(self.a_kernel)).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a + self.dt_bias[...].astype(jnp.float32))
        return (q, k, v), z, beta, g

    def _convs(self, parts, states, segment_ids=None):
        """Each of ``q, k, v`` (``[B, T, H, d]``, or ``[B, H, d]`` for one decode token)
        through its conv (channels ``H * d``) from its state ``[B, K - 1, H, d]`` (or None);
        returns the outputs and the new states."""
        outs, news = [], []
        for x, w, st in zip(parts, (self.conv_q, self.conv_k, self.conv_v), states):
            h, d = x.shape[-2:]
            lead = x.shape[:-2]
            flat_w = w[...].reshape(w.shape[0], h * d)
            flat_st = None if st is None else st.reshape(st.shape[:2] + (h * d,))
            if len(lead) == 1:     # decode
                y, new = causal_conv.causal_conv1d_step(x.reshape(lead + (h * d,)), flat_w,
                                                        flat_st)
            else:
                y, new = causal_conv.causal_conv1d(x.reshape(lead + (h * d,)), flat_w,
                                                   state=flat_st, segment_ids=segment_ids)
            outs.append(y.reshape(x.shape))
            news.append(new.reshape(new.shape[:2] + (h, d)))
        return outs, news

    def _out(self, o, z):
        """Gated RMSNorm per value head (statistics float32; transformers'
        ``Qwen3_5RMSNormGated``: norm, scale in the activation dtype, times ``silu(z)``
        in float32), then the output projection. ``o, z [..., Hv, dv]``."""
        o32 = o.astype(jnp.float32)
        o32 = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, -1, keepdims=True) + self.spec.rms_norm_eps)
        y = self.norm_scale[...].astype(self.dtype) * o32.astype(self.dtype)
        y = (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(self.dtype)
        lead = y.shape[:-2]
        return _dense(y.reshape(lead + (-1,)), self.o_kernel[...].astype(self.dtype).reshape(
            -1, self.spec.hidden_size))

    def __call__(self, x: jax.Array, *, attention_mask: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, state: GDNState | None = None
                 ) -> tuple[jax.Array, GDNState]:
        """The layer over a sequence (chunked rule, ``spec.impl`` / ``spec.chunk_size``).

        Args:
          x: ``[B, T, E]`` activations.
          attention_mask: ``[B, T]`` bool or None; False positions are zeroed before the
            projections (transformers' ``apply_mask_to_padding_states``), so left padding
            leaves a zero state zero.
          segment_ids: ``[B, T]`` int or None: packed rows; conv window and recurrent state
            restart where it changes.
          state: the :class:`GDNState` before ``x`` (a continued sequence) or None (zeros).

        Returns:
          ``(y [B, T, E] in spec.dtype, GDNState after the last position)``.
        """
        x = x.astype(self.dtype)
        if attention_mask is not None:
            x = x * attention_mask[..., None].astype(self.dtype)
        parts, z, beta, g = self._project(x)
        (q, k, v), convs = self._convs(parts, (None,) * 3 if state is None else state[:3],
                                       segment_ids)
        o, rec = gated_delta.gated_delta_rule(
            q, k, v, g, beta, impl=self.spec.impl, chunk_size=self.spec.chunk_size,
            initial_state=None if state is None else state.recurrent, segment_ids=segment_ids,
            precision=self._precision())
        return self._out(o, z), GDNState(*convs, rec)

    def step(self, x: jax.Array, state: GDNState) -> tuple[jax.Array, GDNState]:
        """One decode token per slot: ``x [B, E]``, ``state`` the slots' :class:`GDNState`.
        Returns ``(y [B, E], new state)``."""
        x = x.astype(self.dtype)
        parts, z, beta, g = self._project(x)
        (q, k, v), convs = self._convs(parts, state[:3])
        o, rec = gated_delta.gated_delta_step(q, k, v, g, beta, state.recurrent,
                                              precision=self._precision())
        return self._out(o, z), GDNState(*convs, rec)


def qwen3_next_to_qwen3_5(tensors: Mapping[str, np.ndarray], spec: GDNSpec
                          ) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused ``in_proj_qkvz.weight [conv_dim + value_dim, E]`` and
    ``in_proj_ba.weight [2 Hv, E]`` (per key head: ``q | k | v-group | z-group`` and
    ``b-group | a-group``, transformers' ``fix_query_key_value_ordering``) as Qwen3.5's
    ``in_proj_qkv / in_proj_z / in_proj_b / in_proj_a``; other tensors unchanged.

    Raises:
      KeyError: a fused tensor is missing (names it).
    """
    s = spec
    r = s.num_v_heads // s.num_k_heads
    out = {n: t for n, t in tensors.items() if n not in ("in_proj_qkvz.weight",
                                                        "in_proj_ba.weight")}
    qkvz = np.asarray(tensors["in_proj_qkvz.weight"]).reshape(
        s.num_k_heads, 2 * s.head_k_dim + 2 * r * s.head_v_dim, s.hidden_size)
    q, k, v, z = np.split(qkvz, np.cumsum([s.head_k_dim, s.head_k_dim, r * s.head_v_dim]), 1)
    flat = lambda t: t.reshape(-1, s.hidden_size)
    out["in_proj_qkv.weight"] = np.concatenate([flat(q), flat(k), flat(v)], 0)
    out["in_proj_z.weight"] = flat(z)
    ba = np.asarray(tensors["in_proj_ba.weight"]).reshape(s.num_k_heads, 2 * r, s.hidden_size)
    out["in_proj_b.weight"], out["in_proj_a.weight"] = flat(ba[:, :r]), flat(ba[:, r:])
    return out


def hf_to_params(layer: GatedDeltaNet, tensors: Mapping[str, np.ndarray]) -> None:
    """Loads a transformers Qwen3.5 GatedDeltaNet's tensors (names relative to the layer,
    ``in_proj_qkv.weight`` ...; Qwen3-Next's go through :func:`qwen3_next_to_qwen3_5`) into
    ``layer`` in place, cast to ``spec.param_dtype``.

    Raises:
      KeyError: a tensor is missing (names it). ValueError: a shape does not fit the spec.
    """
    s = layer.spec
    pdt = jnp.dtype(s.param_dtype)
    if "in_proj_qkvz.weight" in tensors:
        tensors = qwen3_next_to_qwen3_5(tensors, s)
    get = lambda n: np.asarray(tensors[n], np.float32)
    qkv, conv = get("in_proj_qkv.weight"), get("conv1d.weight")
    if qkv.shape != (s.conv_dim, s.hidden_size) or conv.shape != (s.conv_dim, 1, s.conv_kernel):
        raise ValueError(f"GatedDeltaNet: in_proj_qkv.weight {qkv.shape} / conv1d.weight "
                         f"{conv.shape} do not fit conv_dim={s.conv_dim}, hidden="
                         f"{s.hidden_size}, kernel={s.conv_kernel}")
    cut = [s.key_dim, 2 * s.key_dim]
    heads = {"q": (s.num_k_heads, s.head_k_dim), "k": (s.num_k_heads, s.head_k_dim),
             "v": (s.num_v_heads, s.head_v_dim)}
    for name, w, c in zip("qkv", np.split(qkv, cut, 0), np.split(conv[:, 0], cut, 0)):
        getattr(layer, f"{name}_kernel")[...] = jnp.asarray(
            w.T.reshape((s.hidden_size,) + heads[name]), pdt)
        getattr(layer, f"conv_{name}")[...] = jnp.asarray(
            c.T.reshape((s.conv_kernel,) + heads[name]), pdt)
    layer.z_kernel[...] = jnp.asarray(
        get("in_proj_z.weight").T.reshape(s.hidden_size, s.num_v_heads, s.head_v_dim), pdt)
    layer.b_kernel[...] = jnp.asarray(get("in_proj_b.weight").T, pdt)
    layer.a_kernel[...] = jnp.asarray(get("in_proj_a.weight").T, pdt)
    layer.A_log[...] = jnp.asarray(get("A_log"), pdt)
    layer.dt_bias[...] = jnp.asarray(get("dt_bias"), pdt)
    layer.norm_scale[...] = jnp.asarray(get("norm.weight"), pdt)
    layer.o_kernel[...] = jnp.asarray(
        get("out_proj.weight").T.reshape(s.num_v_heads, s.head_v_dim, s.hidden_size), pdt)


def params_to_hf(layer: GatedDeltaNet) -> dict[str, np.ndarray]:
    """The inverse of :func:`hf_to_params`: the layer's parameters as Qwen3.5's tensors
    (``in_proj_qkv.weight [conv_dim, E]``, ``conv1d.weight [conv_dim, 1, K]``, ...; float32
    numpy), for export."""
    s = layer.spec
    arr = lambda p: np.asarray(p[...], np.float32)
    rows = lambda p: arr(p).reshape(s.hidden_size, -1).T           # [E, H, d] -> [H*d, E]
    convs = [arr(w).reshape(s.conv_kernel, -1).T for w in (layer.conv_q, layer.conv_k,
                                                          layer.conv_v)]
    return {
        "in_proj_qkv.weight": np.concatenate([rows(layer.q_kernel), rows(layer.k_kernel),
                                              rows(layer.v_kernel)], 0),
        "in_proj_z.weight": rows(layer.z_kernel),
        "in_proj_b.weight": arr(layer.b_kernel).T, "in_proj_a.weight": arr(layer.a_kernel).T,
        "conv1d.weight": np.concatenate(convs, 0)[:, None, :],
        "A_log": arr(layer.A_log), "dt_bias": arr(layer.dt_bias),
        "norm.weight": arr(layer.norm_scale),
        "out_proj.weight": arr(layer.o_kernel).reshape(-1, s.hidden_size).T}


def decode_state_bytes(spec: GDNSpec) -> int:
    """Bytes of one slot's decode state of one GatedDeltaNet layer: the conv window
    ``(K - 1) * conv_dim`` in ``spec.dtype`` plus the recurrent matrix ``Hv * dk * dv``
    float32. Independent of the sequence length."""
    conv = (spec.conv_kernel - 1) * spec.conv_dim * jnp.dtype(spec.dtype).itemsize
    return conv + spec.num_v_heads * spec.head_k_dim * spec.head_v_dim * 4


def kv_cache_bytes(*, num_kv_heads: int, head_dim: int, tokens: int, dtype="bfloat16") -> int:
    """Bytes of one slot's KV cache of one full-attention layer at ``tokens`` tokens: keys
    and values, ``2 * num_kv_heads * head_dim * tokens`` elements of ``dtype``."""
    return 2 * num_kv_heads * head_dim * tokens * jnp.dtype(dtype).itemsize
