"""The layers of the decoder (:mod:`rlflow.models.decoder`): RMSNorm (Zhang & Sennrich 2019,
eq. 4), grouped-query attention (Ainslie et al. 2023) with rotary position embeddings (Su et
al. 2021, eq. 34), the SwiGLU MLP (Shazeer 2020, eq. 6), and the pre-norm block that chains
them (Touvron et al. 2023, "Llama 2"; Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on q
and k). A block's MLP is a :class:`rlflow.models.moe.MoE` for a mixture-of-experts config.

Numerics: parameters are cast from ``cfg.param_dtype`` to ``cfg.dtype`` at use; RMSNorm
statistics, RoPE angles, attention logits and softmax are float32 (see the decoder's module
docstring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlflow.mesh import sequence_size
from rlflow.models import context_parallel
from rlflow.models.attention import (MASK_VALUE, SequenceMask, Variant, attention,
                                     sink_softmax, softcap_scores)
from rlflow.models.config import DecoderConfig
from rlflow.models.gdn_layer import GatedDeltaNet, GDNSpec
from rlflow.models.linear import _cpu_dot_operands, _dense, _normal, _param
from rlflow.models.lora import LoraAdapter, LoraSpec
from rlflow.models.moe import MoE
from rlflow.models.rope import apply_rope, rope_table


def layer_variant(cfg: DecoderConfig, kind: str) -> Variant:
    """The attention settings of ``cfg``'s layers of ``kind``
    (:class:`rlflow.models.attention.Variant`): the sliding window on
    ``"sliding_attention"`` layers, the family's sinks, softcap and score scale."""
    scalar = cfg.query_pre_attn_scalar
    return Variant(window=cfg.sliding_window if kind == "sliding_attention" else None,
                   softcap=cfg.attn_logit_softcapping,
                   scale=None if scalar is None else float(scalar) ** -0.5,
                   sinks=cfg.attention_sinks)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis, statistics in float32.

    ``offset`` (Gemma): the stored scale ``w`` is an offset, the factor is ``1 + w`` (stored
    zeros: the identity scale), applied in float32 before the cast (HF ``Gemma3RMSNorm``)."""

    def __init__(self, dim: int, eps: float, param_dtype, dtype, offset: bool = False):
        init = jnp.zeros if offset else jnp.ones
        self.scale = _param(init((dim,), param_dtype), ("norm",))
        self.eps = eps
        self.dtype = dtype
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype)
        return y.astype(self.dtype) * self.scale[...].astype(self.dtype)


class Attention(nnx.Module):
    """Grouped-query attention; kernels ``q [E, H, D]``, ``k, v [E, K, D]``, ``o [H, D, E]``;
    with ``lora``, adapters ``{q,k,v,o}_lora`` on the targeted projections (else None).

    ``kind`` (a layer kind of ``cfg.kinds``) fixes the static settings: ``variant`` (sliding
    window, softcap, score scale, sinks: :func:`layer_variant`) and the RoPE table
    (``rope_freqs``, ``rope_scale``: :func:`rlflow.models.rope.rope_table`); ``sinks [H]``
    float is the learned sink logit per query head (gpt-oss) or None."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None,
                 kind: str = "full_attention"):
        e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pdt, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        self.num_kv_heads, self.head_dim = k, d
        self.variant = layer_variant(cfg, kind)
        self.gated = cfg.attn_output_gate      # Qwen3.5: q_kernel [E, H, 2D], [query | gate]
        qd = 2 * d if self.gated else d
        inv_freq, self.rope_scale = rope_table(cfg, kind)
        self.rope_freqs = tuple(float(f) for f in inv_freq)   # static: one table per kind
        self.sinks = (_param(jnp.zeros((h,), pdt), ("q_heads",)) if self.variant.sinks
                      else None)
        self.q_kernel = _normal(rngs, (e, h, qd), pdt, ("embed", "q_heads", "head_dim"))
        self.k_kernel = _normal(rngs, (e, k, d), pdt, ("embed", "kv_heads", "head_dim"))
        self.v_kernel = _normal(rngs, (e, k, d), pdt, ("embed", "kv_heads", "head_dim"))
        self.o_kernel = _normal(rngs, (h, d, e), pdt, ("q_heads", "head_dim", "embed"))
        if cfg.attention_bias:
            self.q_bias = _param(jnp.zeros((h, qd), pdt), ("q_heads", "head_dim"))
            self.k_bias = _param(jnp.zeros((k, d), pdt), ("kv_heads", "head_dim"))
            self.v_bias = _param(jnp.zeros((k, d), pdt), ("kv_heads", "head_dim"))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = _param(jnp.zeros((e,), pdt), ("embed",)) if cfg.o_bias else None
        shapes = {"q": ((e,), (h, qd), ("embed",), ("q_heads", "head_dim")),
                  "k": ((e,), (k, d), ("embed",), ("kv_heads", "head_dim")),
                  "v": ((e,), (k, d), ("embed",), ("kv_heads", "head_dim")),
                  "o": ((h, d), (e,), ("q_heads", "head_dim"), ("embed",))}
        for name, (ins, outs, in_axes, out_axes) in shapes.items():
            setattr(self, f"{name}_lora", LoraAdapter(ins, outs, in_axes, out_axes, lora,
                                                      jnp.float32, self.dtype, rngs=rngs)
                    if lora is not None and lora.targets(name) else None)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, pdt, self.dtype, cfg.offset_norms)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, pdt, self.dtype, cfg.offset_norms)
        else:
            self.q_norm = self.k_norm = None

    def _proj(self, x, kernel, bias, lora):
        y = _dense(x, kernel[...].astype(self.dtype))
        if lora is not None:
            y = y + lora(x)
        return y if bias is None else y + bias[...].astype(self.dtype)

    def __call__(self, x, positions, inv_freq, attend_mask, kv_hook=None):
        """x ``[B, T, E]``. Full sequence (learner): ``attend_mask`` a
        :class:`rlflow.models.attention.SequenceMask` (``kv_hook`` unused), attention by
        :func:`rlflow.models.attention.attention`. Cached (sampler): ``attend_mask [B, T, S]``
        bool over the keys that ``kv_hook`` returns (the window of a sliding layer already
        applied by the caller): ``kv_hook(k [B, T, K, D], v) -> (keys [B, K, D, S], values
        [B, K, S, D])``, or a function ``q [B, T, H, D] -> out [B, T, H, D]`` when the cache
        runs the attention itself (a paged-attention kernel, plain attention only).
        ``inv_freq``: the RoPE frequencies ``[D/2]``, or None: the layer kind's own
        (:func:`rlflow.models.rope.rope_table`)."""
        q = self._proj(x, self.q_kernel, self.q_bias, self.q_lora)
        gate = None
        if self.gated:                      # per head [query | gate] (Qwen3.5)
            q, gate = jnp.split(q, 2, axis=-1)
        k = self._proj(x, self.k_kernel, self.k_bias, self.k_lora)
        v = self._proj(x, self.v_kernel, self.v_bias, self.v_lora)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if inv_freq is None:
            inv_freq = np.asarray(self.rope_freqs, np.float32)
        q = apply_rope(q, positions, inv_freq, self.rope_scale)
        k = apply_rope(k, positions, inv_freq, self.rope_scale)
        b, t, h, d = q.shape
        sinks = None if self.sinks is None else self.sinks[...]
        if isinstance(attend_mask, SequenceMask):
            kw = attend_mask._asdict()
            mesh = kw.pop("mesh")
            if sequence_size(mesh) > 1:   # q, k, v in the folded view (hidden_states)
                if not self.variant.plain:
                    raise ValueError("learner.mesh.sequence > 1 (context parallelism) does not "
                                     "run sliding-window, attention-sink or softcapped layers "
                                     "yet; set learner.mesh.sequence=1")
                return self._out(context_parallel.folded_attention(q, k, v, mesh=mesh, **kw),
                                 gate)
            return self._out(attention(q, k, v, **kw, positions=positions,
                                       variant=self.variant, sinks=sinks), gate)
        read = kv_hook(k, v)
        if callable(read):                  # the cache runs attention itself (a paged kernel)
            return self._out(read(q), gate)
        return self._out(self._cached(q, read, attend_mask, sinks), gate)

    def _cached(self, q, read, attend_mask, sinks):
        """Attention of ``q [B, T, H, D]`` over the cache's ``(keys, values)`` under
        ``attend_mask [B, T, S]``: ``[B, T, H, D]``."""
        keys, values = read
        b, t, h, d = q.shape
        var = self.variant
        scale = d ** -0.5 if var.scale is None else var.scale
        q = q.reshape(b, t, self.num_kv_heads, h // self.num_kv_heads, d)
        if t == 1:
            # One query per row (decode): multiply-and-reduce over the cache's second-minor
            # axis (D of the keys [B, K, D, S], S of the values [B, K, S, D]) reads each
            # layer's cache once, in place, with vector loads along its minor axis. As dot
            # products these are G x D by D x S matrices batched over B x K, which XLA:CPU
            # runs several times slower (benchmarks/sampler_throughput.py, 4.46M size).
            qf = q[:, 0].astype(jnp.float32)                                   # [B, K, G, D]
            scores = jnp.sum(qf[..., None] * keys[:, :, None].astype(jnp.float32),
                             axis=3)[:, :, :, None, :] * scale                 # [B, K, G, 1, S]
        else:
            qs, ks_ = _cpu_dot_operands(q, keys)
            scores = jnp.einsum("btkgd,bkds->bkgts", qs, ks_,
                                preferred_element_type=jnp.float32) * scale
        scores = softcap_scores(scores, var.softcap)
        scores = jnp.where(attend_mask[:, None, None, :, :], scores, MASK_VALUE)
        kh = self.num_kv_heads
        probs = sink_softmax(scores, None if sinks is None else sinks.reshape(kh, h // kh))
        probs = probs.astype(self.dtype)
        if t == 1:
            out = jnp.sum(probs[:, :, :, 0, :, None] * values[:, :, None], axis=3,
                          dtype=jnp.float32).astype(self.dtype)[:, None]      # [B, 1, K, G, D]
            out = out.reshape(b, t, h, d)
        else:
            out = jnp.einsum("bkgts,bksd->btkgd", probs, values).reshape(b, t, h, d)
        return out

    def _out(self, out, gate=None):
        """Attention output ``[B, T, H, D]`` -> ``[B, T, E]`` (output projection); times
        ``sigmoid(gate [B, T, H, D])`` first when given (Qwen3.5's output gate)."""
        if gate is not None:
            out = out.astype(self.dtype) * jax.nn.sigmoid(gate)
        b, t, h, d = out.shape
        o = self.o_kernel[...].astype(self.dtype)
        y = _dense(out.reshape(b, t, h * d), o.reshape(h * d, o.shape[-1]))
        if self.o_lora is not None:
            y = y + self.o_lora(out)
        return y if self.o_bias is None else y + self.o_bias[...].astype(self.dtype)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(x @ gate) * (x @ up))``; gate/up ``[E, F]``, down ``[F, E]``;
    with ``lora``, adapters ``{gate,up,down}_lora`` on the targeted projections (else None).
    ``out_in``: names of the kernels held transposed, ``[out, in]`` (set by the sampler
    engine on the model it merges inside its jitted calls, :mod:`rlflow.sampler.kernel_layout`).
    """

    out_in: frozenset = frozenset()

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        e, f = cfg.hidden_size, cfg.intermediate_size
        pdt, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        self.gelu = cfg.gemma_norms       # Gemma: GELU, tanh approximation (gelu_pytorch_tanh)
        self.gate_kernel = _normal(rngs, (e, f), pdt, ("embed", "mlp"))
        self.up_kernel = _normal(rngs, (e, f), pdt, ("embed", "mlp"))
        self.down_kernel = _normal(rngs, (f, e), pdt, ("mlp", "embed"))
        shapes = {"gate": ((e,), (f,), ("embed",), ("mlp",)),
                  "up": ((e,), (f,), ("embed",), ("mlp",)),
                  "down": ((f,), (e,), ("mlp",), ("embed",))}
        for name, (ins, outs, in_axes, out_axes) in shapes.items():
            setattr(self, f"{name}_lora", LoraAdapter(ins, outs, in_axes, out_axes, lora,
                                                      jnp.float32, self.dtype, rngs=rngs)
                    if lora is not None and lora.targets(name) else None)

    def _lin(self, x, name):
        y = _dense(x, getattr(self, f"{name}_kernel")[...].astype(self.dtype),
                   out_in=f"{name}_kernel" in self.out_in)
        adapter = getattr(self, f"{name}_lora")
        return y if adapter is None else y + adapter(x)

    def __call__(self, x):
        g = self._lin(x, "gate")
        gate = jax.nn.gelu(g, approximate=True) if self.gelu else jax.nn.silu(g)
        return self._lin(gate * self._lin(x, "up"), "down")


class Block(nnx.Module):
    """One pre-norm decoder layer of layer kind ``kind`` (static; its attention's settings);
    ``mlp`` is a :class:`rlflow.models.moe.MoE` when the config has experts (``cfg.is_moe``),
    else an :class:`MLP`. Gemma (``cfg.gemma_norms``): ``post_attn_norm`` normalises the
    attention output, ``pre_mlp_norm`` / ``post_mlp_norm`` the MLP's input and output (HF
    ``pre_`` / ``post_feedforward_layernorm``); else both are None. The decoder stores its ``L``
    blocks as one stacked module of this structure
    (:func:`rlflow.models.layer_scan.stack_modules`: every variable ``[L, ...]``); what a
    block holds does not matter to it."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None,
                 kind: str = "full_attention"):
        pdt, dt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt, dt,  # noqa: E731
                               cfg.offset_norms)
        self.kind = kind
        self.input_norm = norm()
        if kind == "linear_attention":      # a gated DeltaNet (rlflow.models.gdn_layer)
            if lora is not None:
                raise ValueError("learner.lora: adapters on linear_attention (gated DeltaNet) "
                                 "layers are not supported; train without LoRA")
            self.attn = GatedDeltaNet(gdn_spec(cfg), rngs=rngs)
        else:
            self.attn = Attention(cfg, rngs=rngs, lora=lora, kind=kind)
        self.post_attn_norm = norm()
        self.mlp = (MoE if cfg.is_moe else MLP)(cfg, rngs=rngs, lora=lora)
        # Gemma's sandwich: post_attn_norm normalises the attention output, and the MLP has
        # its own norms before and after (HF pre_ / post_feedforward_layernorm)
        self.pre_mlp_norm = norm() if cfg.gemma_norms else None
        self.post_mlp_norm = norm() if cfg.gemma_norms else None

    def __call__(self, x, positions, inv_freq, attend_mask, kv_hook=None, *,
                 replay_ids=None, return_routing: bool = False):
        """``x [B, T, E]`` -> ``[B, T, E]``; with ``return_routing`` the pair ``(x, routing)``,
        ``routing`` the MoE layer's :class:`rlflow.models.moe.Routing` over the ``B * T``
        tokens (None for a dense layer). ``replay_ids``: ``[B, T, k]`` expert ids to replay
        (MoE layers only; :func:`rlflow.models.moe.route`)."""
        if self.kind == "linear_attention":
            y = linear_mix(self.attn, self.input_norm(x), attend_mask, kv_hook)
        else:
            y = self.attn(self.input_norm(x), positions, inv_freq, attend_mask, kv_hook)
        if self.pre_mlp_norm is not None:          # Gemma's sandwich norms
            x = x + self.post_attn_norm(y)
            h = self.pre_mlp_norm(x)
        else:
            x = x + y
            h = self.post_attn_norm(x)
        if isinstance(self.mlp, MoE):
            y, routing = self.mlp(h, replay_ids)
        else:
            if replay_ids is not None:
                raise ValueError("replay_ids given to a dense layer (the model has no experts)")
            y, routing = self.mlp(h), None
        if self.post_mlp_norm is not None:
            y = self.post_mlp_norm(y)
        return (x + y, routing) if return_routing else x + y


def gdn_spec(cfg: DecoderConfig) -> GDNSpec:
    """The :class:`rlflow.models.gdn_layer.GDNSpec` of ``cfg``'s linear-attention layers
    (``cfg.gdn``, its dtypes and ``rms_norm_eps``)."""
    return GDNSpec(hidden_size=cfg.hidden_size, rms_norm_eps=cfg.rms_norm_eps,
                   param_dtype=cfg.param_dtype, dtype=cfg.dtype, **cfg.gdn)


def linear_mix(layer: GatedDeltaNet, x, attend_mask, kv_hook):
    """A linear-attention layer's token mixing of ``x [B, T, E]``. Full sequence (learner):
    ``attend_mask`` a :class:`rlflow.models.attention.SequenceMask` (its ``attention_mask``
    and ``segment_ids``; the state starts at zero). Cached (sampler): ``kv_hook(layer, x) ->
    y``, the cache runs the layer from the slot's carried state
    (:mod:`rlflow.models.cached_forward`).

    ``prefix_ids`` are not read: the learner always passes them (``segment_ids`` where no
    prompt is shared) and refuses shared-prefix packing of these models at start
    (:class:`rlflow.learner.trainer.Learner`).

    Raises:
      ValueError: context parallelism (a ``sequence`` mesh axis > 1).
    """
    if kv_hook is not None:
        return kv_hook(layer, x)
    if attend_mask.mesh is not None and sequence_size(attend_mask.mesh) > 1:
        raise ValueError("learner.mesh.sequence > 1 (context parallelism) does not run "
                         "linear_attention (gated DeltaNet) layers; set learner.mesh.sequence=1")
    y, _ = layer(x, attention_mask=attend_mask.attention_mask,
                 segment_ids=attend_mask.segment_ids)
    return y
