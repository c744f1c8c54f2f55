"""Llama / Qwen2 / Qwen3 decoder in Flax NNX, with a full-sequence forward (learner) and a
KV-cached forward (sampler prefill + decode) that share every layer.

Architecture (Touvron et al. 2023, "Llama 2"; Qwen2 / Qwen3 technical reports): pre-norm
blocks of RMSNorm (Zhang & Sennrich 2019, eq. 4) -> grouped-query attention (Ainslie et
al. 2023) with rotary position embeddings (Su et al. 2021, eq. 34; HF "rotate-half"
layout; Llama-3 frequency scaling) -> residual -> RMSNorm -> SwiGLU MLP (Shazeer 2020,
eq. 6) -> residual. Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on q and k.

Every parameter is an ``nnx.Param`` whose ``out_sharding`` metadata holds its *logical*
axes (``("embed", "mlp")``); ``rlflow.mesh`` maps them to mesh axes. Creation never
shards eagerly (``eager_sharding=False``); placement is ``rlflow.mesh.shard_params``.

Numerics: parameters are stored in ``cfg.param_dtype`` and cast to ``cfg.dtype`` at use;
RMSNorm statistics, RoPE angles, attention logits and softmax, and output logits are
float32. Masked attention entries get a large negative logit (not -inf), so a query
whose keys are all masked (a padding row) gives a finite uniform average, never NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlflow.mesh import activation_sharding, sequence_size
from rlflow.models import context_parallel, expert_parallel
from rlflow.models.attention import MASK_VALUE, SequenceMask, attention
from rlflow.models.config import DecoderConfig
from rlflow.models.kv_cache import KVCache
from rlflow.models.paged_kv_cache import PagedKVCache, layer_attention_inputs
from rlflow.models.layer_scan import layer_modules, scan_layers, stack_modules
from rlflow.models.lora import LoraAdapter, LoraSpec
from rlflow.models import moe as moe_lib
from rlflow.models.moe import MoE
from rlflow.models.moe_replay import agreement_sums, layer_major

INIT_STD = 0.02      # normal init of kernels / embedding of a random model (HF default)


class TokenRangeError(ValueError):
    """A token id is negative or >= vocab_size (a gather inside jit would not notice)."""


def validate_tokens(tokens, vocab_size: int, *, where: str = "tokens") -> None:
    """Host-side check that every id is in ``[0, vocab_size)``.

    Call it on host arrays before they enter a jitted function: out-of-range gathers in
    XLA are clamped silently. ``Decoder`` calls it itself when run eagerly.

    Args:
      tokens: int array-like of any shape.
      vocab_size: V.
      where: name used in the message (e.g. ``"prompt 17"``).

    Raises:
      TokenRangeError: naming the first bad id, its index and the vocab size.
    """
    arr = np.asarray(tokens)
    if arr.size == 0:
        return
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise TokenRangeError(
            f"{where}: token id {int(arr[idx])} at index {idx} is out of range for vocab_size "
            f"{vocab_size} ({int(bad.sum())} ids out of range; expected 0 <= id < {vocab_size})")


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


def _dense(x: jax.Array, kernel: jax.Array, preferred_element_type=None,
           out_in: bool = False) -> jax.Array:
    """``x [..., I] @ kernel [I, O...] -> [..., O...]`` as one 2-D matmul ``[N, I] @ [I, O]``;
    with ``out_in`` the kernel is 2-D and stored transposed, ``[O, I]``, and the dot
    contracts its second axis (the sampler engine's CPU layout,
    :mod:`rlflow.sampler.kernel_layout`).

    One contracting dimension in the backward too: the weight gradient of an einsum over
    ``[B, T, I]`` contracts two dimensions (b, t), and XLA:CPU then copies the output
    gradient into a transposed layout (a strided ``[O, B * T]`` write per projection, 1.6x
    the whole MLP step at 16 x 192 x 896); flattened, it multiplies in place.

    Products of bfloat16 operands accumulate in float32 and the result is rounded once to
    the operands' dtype (``preferred_element_type=None``). On the CPU backend the dot is
    asked for the float32 result and rounded after it: asked for a bfloat16 result, XLA:CPU
    upcasts both operands to float32 before the dot, and inside a decode loop hoists that
    upcast of the weights out of the loop, so every step streams float32 weights, twice the
    bytes of its native bf16 x bf16 -> f32 dot (benchmarks/sampler_throughput.py). TPU and
    GPU dots accumulate bfloat16 products in float32 anyway, and there a float32 result
    would make the backward's dots mixed-precision (float32 cotangents), so they keep it.
    """
    lead, out = x.shape[:-1], (kernel.shape[:1] if out_in else kernel.shape[1:])
    widen = (preferred_element_type is None and x.dtype == kernel.dtype
             and jnp.dtype(x.dtype).itemsize < 4 and jax.default_backend() == "cpu")
    rows = x.reshape(-1, x.shape[-1])
    want = jnp.float32 if widen else preferred_element_type
    if out_in:      # explicit: XLA:CPU copied a transposed kernel back rather than fold it
        y = jax.lax.dot_general(rows, kernel, (((1,), (1,)), ((), ())),
                                preferred_element_type=want)
    else:
        y = jnp.matmul(rows, kernel.reshape(kernel.shape[0], -1), preferred_element_type=want)
    if widen:
        y = y.astype(x.dtype)
    return y.reshape(lead + out)


def write_cache(cache: jax.Array, new: jax.Array, cols: jax.Array, seq_axis: int) -> jax.Array:
    """One layer's keys or values with ``T`` new entries per row written in.

    Args:
      cache: ``[B, K, D, S]`` keys (``seq_axis`` 3) or ``[B, K, S, D]`` values (2).
      new: ``[B, T, K, D]`` new keys or values (any float dtype; rounded to the cache's).
      cols: int32 ``[B, T]`` cache positions; positions ``>= S`` are dropped.

    Returns:
      The cache with ``new[b, t]`` at position ``cols[b, t]`` of row ``b``, in its dtype.

    How (same bits either way): a scatter, done in place, except for a 2-byte cache
    (bfloat16) at ``T == 1`` (the decode step), which takes a one-hot select: one pass over
    the cache. XLA:CPU upcasts a bfloat16 scatter to float32, converting the whole cache
    there and back on every step (benchmarks/sampler_throughput.py). A prefill (``T > 1``,
    once per prompt) keeps the scatter.
    """
    b, t = cols.shape
    new = new.astype(cache.dtype)
    two_byte = jnp.dtype(cache.dtype).itemsize == 2
    if two_byte and t == 1:
        shape = [b, 1, 1, 1]
        shape[seq_axis] = cache.shape[seq_axis]
        hit = jnp.arange(cache.shape[seq_axis], dtype=jnp.int32)[None, :] == cols   # [B, S]
        at = new.transpose(0, 2, 3, 1) if seq_axis == 3 else new.swapaxes(1, 2)
        return jnp.where(hit.reshape(shape), at, cache)
    # Index arrays around a slice: the indexed shape is [B, T, K, D], new's.
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    index = (rows, slice(None), slice(None), cols) if seq_axis == 3 else (rows, slice(None), cols)
    return cache.at[index].set(new, mode="drop")


def _cpu_dot_operands(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Operands of a batched dot with a float32 result: on the CPU backend, bfloat16 ones
    are upcast to float32 (XLA:CPU's batched dot has no BF16 x BF16 = F32 kernel: "Unsupported
    element type for DotThunk::Execute"); elsewhere (TPU, GPU) they stay as they are."""
    if jax.default_backend() == "cpu" and jnp.dtype(a.dtype).itemsize < 4:
        return a.astype(jnp.float32), b.astype(jnp.float32)
    return a, b


def _param(value, axes: tuple) -> nnx.Param:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape, dtype, axes) -> nnx.Param:
    return _param((INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype),
                  axes)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis, statistics in float32."""

    def __init__(self, dim: int, eps: float, param_dtype, dtype):
        self.scale = _param(jnp.ones((dim,), param_dtype), ("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * self.scale[...].astype(self.dtype)


class Attention(nnx.Module):
    """Grouped-query attention; kernels ``q [E, H, D]``, ``k, v [E, K, D]``, ``o [H, D, E]``;
    with ``lora``, adapters ``{q,k,v,o}_lora`` on the targeted projections (else None)."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pdt, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        self.num_kv_heads, self.head_dim = k, d
        self.q_kernel = _normal(rngs, (e, h, d), pdt, ("embed", "q_heads", "head_dim"))
        self.k_kernel = _normal(rngs, (e, k, d), pdt, ("embed", "kv_heads", "head_dim"))
        self.v_kernel = _normal(rngs, (e, k, d), pdt, ("embed", "kv_heads", "head_dim"))
        self.o_kernel = _normal(rngs, (h, d, e), pdt, ("q_heads", "head_dim", "embed"))
        if cfg.attention_bias:
            self.q_bias = _param(jnp.zeros((h, d), pdt), ("q_heads", "head_dim"))
            self.k_bias = _param(jnp.zeros((k, d), pdt), ("kv_heads", "head_dim"))
            self.v_bias = _param(jnp.zeros((k, d), pdt), ("kv_heads", "head_dim"))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = _param(jnp.zeros((e,), pdt), ("embed",)) if cfg.o_bias else None
        shapes = {"q": ((e,), (h, d), ("embed",), ("q_heads", "head_dim")),
                  "k": ((e,), (k, d), ("embed",), ("kv_heads", "head_dim")),
                  "v": ((e,), (k, d), ("embed",), ("kv_heads", "head_dim")),
                  "o": ((h, d), (e,), ("q_heads", "head_dim"), ("embed",))}
        for name, (ins, outs, in_axes, out_axes) in shapes.items():
            setattr(self, f"{name}_lora", LoraAdapter(ins, outs, in_axes, out_axes, lora,
                                                      jnp.float32, self.dtype, rngs=rngs)
                    if lora is not None and lora.targets(name) else None)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, pdt, self.dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, pdt, self.dtype)
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
        bool over the keys that ``kv_hook`` returns: ``kv_hook(k [B, T, K, D], v) ->
        (keys [B, K, D, S], values [B, K, S, D])``, or a function ``q [B, T, H, D] -> out
        [B, T, H, D]`` when the cache runs the attention itself (a paged-attention kernel)."""
        q = self._proj(x, self.q_kernel, self.q_bias, self.q_lora)
        k = self._proj(x, self.k_kernel, self.k_bias, self.k_lora)
        v = self._proj(x, self.v_kernel, self.v_bias, self.v_lora)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        b, t, h, d = q.shape
        if isinstance(attend_mask, SequenceMask):
            kw = attend_mask._asdict()
            mesh = kw.pop("mesh")
            if sequence_size(mesh) > 1:   # q, k, v in the folded view (hidden_states)
                return self._out(context_parallel.folded_attention(q, k, v, mesh=mesh, **kw))
            return self._out(attention(q, k, v, **kw))
        read = kv_hook(k, v)
        if callable(read):                  # the cache runs attention itself (a paged kernel)
            return self._out(read(q))
        keys, values = read
        q = q.reshape(b, t, self.num_kv_heads, h // self.num_kv_heads, d)
        if t == 1:
            # One query per row (decode): multiply-and-reduce over the cache's second-minor
            # axis (D of the keys [B, K, D, S], S of the values [B, K, S, D]) reads each
            # layer's cache once, in place, with vector loads along its minor axis. As dot
            # products these are G x D by D x S matrices batched over B x K, which XLA:CPU
            # runs several times slower (benchmarks/sampler_throughput.py, 4.46M size).
            qf = q[:, 0].astype(jnp.float32)                                   # [B, K, G, D]
            scores = jnp.sum(qf[..., None] * keys[:, :, None].astype(jnp.float32),
                             axis=3)[:, :, :, None, :] * (d ** -0.5)           # [B, K, G, 1, S]
        else:
            qs, ks_ = _cpu_dot_operands(q, keys)
            scores = jnp.einsum("btkgd,bkds->bkgts", qs, ks_,
                                preferred_element_type=jnp.float32) * (d ** -0.5)
        scores = jnp.where(attend_mask[:, None, None, :, :], scores, MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        if t == 1:
            out = jnp.sum(probs[:, :, :, 0, :, None] * values[:, :, None], axis=3,
                          dtype=jnp.float32).astype(self.dtype)[:, None]      # [B, 1, K, G, D]
            out = out.reshape(b, t, h, d)
        else:
            out = jnp.einsum("bkgts,bksd->btkgd", probs, values).reshape(b, t, h, d)
        return self._out(out)

    def _out(self, out):
        """Attention output ``[B, T, H, D]`` -> ``[B, T, E]`` (output projection)."""
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
        gate = jax.nn.silu(self._lin(x, "gate"))
        return self._lin(gate * self._lin(x, "up"), "down")


class Block(nnx.Module):
    """One pre-norm decoder layer; ``mlp`` is a :class:`rlflow.models.moe.MoE` when the
    config has experts (``cfg.is_moe``), else an :class:`MLP`. The decoder stores its ``L``
    blocks as one stacked module of this structure
    (:func:`rlflow.models.layer_scan.stack_modules`: every variable ``[L, ...]``); what a
    block holds does not matter to it."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        pdt, dt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt, dt)
        self.attn = Attention(cfg, rngs=rngs, lora=lora)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt, dt)
        self.mlp = (MoE if cfg.is_moe else MLP)(cfg, rngs=rngs, lora=lora)

    def __call__(self, x, positions, inv_freq, attend_mask, kv_hook=None, *,
                 replay_ids=None, return_routing: bool = False):
        """``x [B, T, E]`` -> ``[B, T, E]``; with ``return_routing`` the pair ``(x, routing)``,
        ``routing`` the MoE layer's :class:`rlflow.models.moe.Routing` over the ``B * T``
        tokens (None for a dense layer). ``replay_ids``: ``[B, T, k]`` expert ids to replay
        (MoE layers only; :func:`rlflow.models.moe.route`)."""
        x = x + self.attn(self.input_norm(x), positions, inv_freq, attend_mask, kv_hook)
        h = self.post_attn_norm(x)
        if isinstance(self.mlp, MoE):
            y, routing = self.mlp(h, replay_ids)
        else:
            if replay_ids is not None:
                raise ValueError("replay_ids given to a dense layer (the model has no experts)")
            y, routing = self.mlp(h), None
        return (x + y, routing) if return_routing else x + y


class Decoder(nnx.Module):
    """Causal LM: ``embed [V, E]``, ``layers``, ``final_norm``, ``lm_head [E, V]`` (None when
    ``tie_word_embeddings``: logits use ``embed``).

    ``layers``: the ``L`` :class:`Block` s stored stacked, as one module of a block's
    structure whose every parameter has a leading ``[L, ...]`` axis (logical axis
    ``"layers"``: :mod:`rlflow.models.layer_scan`), e.g. ``layers.attn.q_kernel [L, E, H,
    D]``; the blocks are drawn one after the other from ``rngs`` (layer 0 first), then
    stacked.

    ``lora``: a :class:`rlflow.models.lora.LoraSpec` adds LoRA adapters (``nnx.LoRAParam``)
    to the targeted projections of every layer. They draw from ``rngs`` too, so the base
    weights of a random LoRA decoder differ from those of the plain one with the same seed:
    build the base plainly and add adapters with :func:`rlflow.models.lora_decoder.lora_model_parts`.

    ``out_in``: ``{"lm_head"}`` when the LM head is held transposed, ``[V, E]`` (as
    :class:`MLP`'s).
    """

    out_in: frozenset = frozenset()

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        self.cfg = cfg
        self.lora = lora
        pdt, dt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        self.embed = _normal(rngs, (cfg.vocab_size, cfg.hidden_size), pdt, ("vocab", "embed"))
        self.layers = stack_modules([Block(cfg, rngs=rngs, lora=lora)
                                     for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt, dt)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        _normal(rngs, (cfg.hidden_size, cfg.vocab_size), pdt, ("embed", "vocab")))

    def _check_tokens(self, tokens):
        if not isinstance(tokens, jax.core.Tracer):
            validate_tokens(tokens, self.cfg.vocab_size)

    def _logits(self, x) -> jax.Array:
        return self.project(self.final_norm(x))

    def project(self, x) -> jax.Array:
        """Final-normed hidden states ``[..., E]`` -> float32 logits ``[..., V]``."""
        dt = jnp.dtype(self.cfg.dtype)
        w = self.embed[...].astype(dt).T if self.lm_head is None else self.lm_head[...].astype(dt)
        return _dense(x, w, preferred_element_type=jnp.float32, out_in="lm_head" in self.out_in)

    def _embed(self, tokens) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0).astype(jnp.dtype(self.cfg.dtype))

    def __call__(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                 *, return_hidden: bool = False, segment_ids: jax.Array | None = None,
                 prefix_ids: jax.Array | None = None, attention_impl: str = "auto"):
        """Full-sequence forward.

        Args:
          tokens: ``[B, T]`` int32 ids in ``[0, V)`` (checked when called outside jit).
          positions: ``[B, T]`` int32 RoPE positions (see :func:`positions_from_mask`).
          attention_mask: ``[B, T]`` bool, False on padding (left padding allowed).
            Query ``t`` attends keys ``s <= t`` with ``attention_mask[b, s]``.
          segment_ids: ``[B, T]`` int (optional; sequence packing): query ``t`` attends
            only keys with ``segment_ids[b, s] == segment_ids[b, t]``, so several sequences
            share a row without seeing each other (give each its own positions restarting
            at 0: RoPE then makes every segment's logits those of the sequence alone).
          prefix_ids: ``[B, T]`` int (optional, with ``segment_ids``; shared-prefix packing):
            query ``t`` also attends keys of segment ``prefix_ids[b, t]``, a prompt packed
            once before the completions that continue it (Prefix Grouper, Liu et al.
            2025); equal to ``segment_ids`` where a position sees its own segment only.
          return_hidden: also return the final hidden states (the same forward; e.g. for a
            value head).
          attention_impl: the attention implementation (``learner.attention``; one of
            :data:`rlflow.models.attention.IMPLEMENTATIONS`, see
            :func:`rlflow.models.attention.resolve`); ``"auto"`` never materialises
            ``[T, T]`` scores on CPU and takes the Pallas kernels on TPU / GPU.

        Returns:
          ``[B, T, V]`` float32 logits (rows at padding are finite but meaningless); with
          ``return_hidden`` the pair ``(logits, hidden)``, ``hidden [B, T, E]`` in
          ``cfg.dtype``: the last layer's output after the final RMSNorm (the input of the
          output projection).

        Raises:
          TokenRangeError: an id is out of range (eager calls only).
          ValueError: unknown ``attention_impl``, or a kernel asked for ``prefix_ids``.
        """
        hidden = self.hidden_states(tokens, positions, attention_mask, segment_ids=segment_ids,
                                    prefix_ids=prefix_ids, attention_impl=attention_impl)
        logits = self.project(hidden)
        return (logits, hidden) if return_hidden else logits

    def hidden_states(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                      *, segment_ids: jax.Array | None = None,
                      prefix_ids: jax.Array | None = None,
                      attention_impl: str = "auto", remat: str = "none",
                      mesh=None, moe_aux: bool = False,
                      routing_ids: jax.Array | None = None, replay_routing: bool = False):
        """The full forward without the output projection: ``[B, T, E]`` in ``cfg.dtype``,
        the last layer's output after the final RMSNorm (arguments and errors as
        :meth:`__call__`); :meth:`project` maps (a subset of) them to logits.

        The layers run under one ``jax.lax.scan`` over their stored stacked parameters
        (:func:`rlflow.models.layer_scan.scan_layers`: one compiled layer body whatever the
        depth); ``remat`` is its rematerialisation policy (``"none"``, ``"full"``, ``"dots"``,
        ``"offload"``; :data:`rlflow.models.layer_scan.REMAT_POLICIES`), which changes what
        the backward pass keeps, never the values.

        ``mesh``: the learner's mesh, or None. With a ``sequence`` axis of ``s > 1`` devices
        (context parallelism, :mod:`rlflow.models.context_parallel`) the layers run on the
        folded view ``[s * B, T / s, E]`` of the residual stream
        (:func:`rlflow.models.context_parallel.fold`), constrained to one block per device of
        ``sequence x data x fsdp`` at the embedding and at every layer boundary inside the
        scan; attention takes it as it is and all-gathers keys and values over the axis; the result
        is unfolded to ``[B, T, E]`` (its positions stay on their devices; a constraint
        there made XLA's partitioner replicate the cotangent in the backward). ``T`` must
        be a multiple of ``s``. Values do not change. With an ``expert`` axis of more than
        one device, mixture-of-experts layers split their experts over it
        (:mod:`rlflow.models.expert_parallel`).

        ``moe_aux`` (mixture-of-experts models only): also return the load-balancing loss
        of this forward, the pair ``(hidden, aux)`` with ``aux`` float32 ``[]``
        (:func:`rlflow.models.moe.balance_loss` over every layer and the tokens where
        ``attention_mask`` is True, as HF's ``load_balancing_loss_func``).

        ``routing_ids`` (mixture-of-experts models; rollout routing replay,
        :mod:`rlflow.models.moe_replay`): ``[B, T, L, k]`` int expert ids the sampler chose for
        each token and layer, -1 where it recorded none. With ``replay_routing`` every MoE
        layer routes the tokens with recorded ids to those experts (gates from its own
        router: :func:`rlflow.models.moe.route`), the others by its own top-k; without, the
        ids are only compared. The result then ends with ``agreement`` float32 ``[L, 2]``:
        per layer, the token-layers whose own top-k set equals the recorded one, and those
        with a recorded choice (:func:`rlflow.models.moe_replay.agreement_sums`). With both
        ``moe_aux`` and ``routing_ids``: ``(hidden, aux, agreement)``.

        Raises (beside :meth:`__call__`'s):
          LayerScanError: ``remat`` is unknown or unsupported on this backend.
          ValueError: ``T`` is not a multiple of the ``sequence`` axis (names
            ``learner.mesh.sequence`` and ``T``); ``moe_aux`` or ``routing_ids`` for a dense
            model.
        """
        with expert_parallel.mesh_context(mesh):
            return self._hidden_states(tokens, positions, attention_mask, segment_ids,
                                       prefix_ids, attention_impl, remat, mesh, moe_aux,
                                       routing_ids, replay_routing)

    def _hidden_states(self, tokens, positions, attention_mask, segment_ids, prefix_ids,
                       attention_impl, remat, mesh, moe_aux, routing_ids, replay_routing):
        self._check_tokens(tokens)
        if moe_aux and not self.cfg.is_moe:
            raise ValueError("moe_aux=True needs a mixture-of-experts model (cfg.num_experts > 0)")
        if routing_ids is not None and not self.cfg.is_moe:
            raise ValueError("routing_ids given to a dense model (it has no experts to route; "
                             "learner.routing_replay is for mixture-of-experts models)")
        routed = moe_aux or routing_ids is not None       # the layers report their routing
        n = sequence_size(mesh)
        attend = SequenceMask(jnp.asarray(attention_mask, bool), segment_ids, prefix_ids,
                              attention_impl, mesh if n > 1 else None)  # never a [B, T, T] array
        inv_freq = rope_inv_freq(self.cfg)
        replay = replay_routing and routing_ids is not None
        if n == 1:
            x = self._scan(self._embed(tokens), lambda block, h, ids: block(
                h, positions, inv_freq, attend, replay_ids=ids if replay else None,
                return_routing=routed), remat, attention_mask if moe_aux else None,
                None if routing_ids is None else layer_major(routing_ids))
            return self._finish(x, attention_mask, moe_aux, lambda h: self.final_norm(h))
        # context parallelism: the layers see the folded view [s * B, T / s, E], one block
        # of it per device (context_parallel.fold), constrained at every layer boundary
        context_parallel.check_length(tokens.shape[1], n)

        def constrain(h):
            return jax.lax.with_sharding_constraint(
                h, activation_sharding(mesh, h.shape, folded=True))

        folded_positions = context_parallel.fold(positions, n)
        x = constrain(self._embed(context_parallel.fold(tokens, n)))

        def layer(block, h, ids):
            out = block(constrain(h), folded_positions, inv_freq, attend,
                        replay_ids=ids if replay else None, return_routing=routed)
            return (constrain(out[0]), out[1]) if routed else constrain(out)

        x = self._scan(x, layer, remat,
                       context_parallel.fold(attention_mask, n) if moe_aux else None,
                       None if routing_ids is None else
                       layer_major(context_parallel.fold(routing_ids, n)))
        return self._finish(x, attention_mask, moe_aux,
                            lambda h: self.final_norm(context_parallel.unfold(h, n)))

    def _scan(self, x, layer, remat, token_mask, per_layer_ids):
        """The layers under :func:`scan_layers`; ``layer(block, h, ids) -> h``, or ``(h,
        routing)`` when either of the two is given. With ``token_mask`` (the MoE
        load-balancing loss) the carry holds ``sums [2, n]``, the layers'
        :func:`rlflow.models.moe.balance_sums` over the tokens where ``token_mask``; with
        ``per_layer_ids`` (``[L, ...tokens, k]`` recorded ids, scanned with the layers) each
        layer also outputs its :func:`rlflow.models.moe_replay.agreement_sums`.

        Returns: ``x``, or ``(x, sums or None, agreement [L, 2] or None)``."""
        if token_mask is None and per_layer_ids is None:
            return scan_layers(self.layers, x, lambda block, h: layer(block, h, None), remat)
        weights = None if token_mask is None else jnp.asarray(token_mask, jnp.float32).reshape(-1)

        def apply(block, carry, ids=None):
            h, sums = carry
            h, routing = layer(block, h, ids)
            if weights is not None:
                sums = sums + moe_lib.balance_sums(routing, weights)
            if per_layer_ids is None:
                return h, sums
            return (h, sums), agreement_sums(routing, ids)

        sums = None if weights is None else jnp.zeros((2, self.cfg.num_experts), jnp.float32)
        out = scan_layers(self.layers, (x, sums), apply, remat, per_layer_ids)
        (x, sums), agreement = out if per_layer_ids is not None else (out, None)
        return x, sums, agreement

    def _finish(self, x, attention_mask, moe_aux, finish):
        """``finish(x)``, or (``x`` the triple of :meth:`_scan`) ``(finish(x), *extras)``:
        the load-balancing loss with ``moe_aux``, then the router agreement when recorded
        ids were given."""
        if not isinstance(x, tuple):
            return finish(x)
        x, sums, agreement = x
        out = (finish(x),)
        if moe_aux:
            rows = self.cfg.num_layers * jnp.sum(jnp.asarray(attention_mask, jnp.float32))
            out += (moe_lib.balance_loss(sums, rows),)
        return out + (() if agreement is None else (agreement,))

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                       cache: KVCache | PagedKVCache, cache_index: jax.Array, *, mesh=None,
                       return_routing: bool = False):
        """Forward over ``T`` new tokens per row against a KV cache (prefill / decode).

        Row ``b``'s new keys/values go to cache positions
        ``[cache_index[b], cache_index[b] + T)``; those entries' mask becomes
        ``attention_mask[b]`` (other entries keep theirs). Query ``t`` attends entries
        ``j`` with ``new_mask[b, j]`` and ``j <= cache_index[b] + t``. Writes past the
        cache end (``S``) are dropped, so callers must keep ``cache_index + T <= S``.
        Static shapes: jit-compiles once per ``(B, T, S)``.

        Args:
          tokens: ``[B, T]`` int32; positions: ``[B, T]`` int32; attention_mask: ``[B, T]``
            bool (False on padding).
          cache: :class:`KVCache`: ``L`` arrays each of keys ``[B, K, D, S]`` and values
            ``[B, K, S, D]``, ``mask [B, S]``; or a
            :class:`rlflow.models.paged_kv_cache.PagedKVCache` (pools ``[K, N, P, D]``, a
            page table per row, ``S = M * P`` logical positions): the same function, the
            entries written into the rows' pages (pages the host allocated).
          cache_index: ``[B]`` int32 first cache position written for each row.
          mesh: the sampler's mesh, or None: with an ``expert`` axis of more than one device,
            mixture-of-experts layers split their experts over it
            (:mod:`rlflow.models.expert_parallel`).

          return_routing: (mixture-of-experts models) also return the expert ids each
            layer's router chose for each new token: what the sampler records for rollout
            routing replay (:mod:`rlflow.exchange.routing`).

        Returns:
          ``(logits [B, T, V] float32, new cache)``; with ``return_routing`` the triple
          ``(logits, new cache, expert ids int32 [B, T, L, k])``.

        The layers run as a Python loop here (one cache array per layer, written through
        ``kv_hook``), unlike :meth:`hidden_states`' scan: over static slices of the stacked
        parameters (:func:`rlflow.models.layer_scan.layer_modules`), or over the blocks of
        a model whose ``layers`` is an ``nnx.List`` (the sampler engine's view, weights
        sliced once per version: :mod:`rlflow.sampler.layer_storage`).

        Raises:
          TokenRangeError: an id is out of range (eager calls only).
          ValueError: ``return_routing`` for a dense model.
        """
        with expert_parallel.mesh_context(mesh):
            return self._forward_cached(tokens, positions, attention_mask, cache, cache_index,
                                        return_routing)

    def _forward_cached(self, tokens, positions, attention_mask, cache, cache_index,
                        return_routing):
        self._check_tokens(tokens)
        if return_routing and not self.cfg.is_moe:
            raise ValueError("return_routing: a dense model has no experts to report")
        b, t = tokens.shape
        s = cache.max_len
        cache_index = jnp.asarray(cache_index, jnp.int32).reshape(b)
        cols = cache_index[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]     # [B, T]
        rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        new_mask = cache.mask.at[rows, cols].set(jnp.asarray(attention_mask, bool), mode="drop")
        attend = new_mask[:, None, :] & (jnp.arange(s)[None, None, :] <= cols[:, :, None])
        inv_freq = rope_inv_freq(self.cfg)
        ks, vs = list(cache.k), list(cache.v)
        paged = isinstance(cache, PagedKVCache)
        x = self._embed(tokens)
        blocks = self.layers if isinstance(self.layers, nnx.List) else layer_modules(self.layers)
        chosen = []                                         # [B, T, k] per layer
        for layer, block in enumerate(blocks):
            def hook(k, v, layer=layer):
                if paged:
                    ks[layer], vs[layer], read = layer_attention_inputs(
                        cache, ks[layer], vs[layer], k, v, cols)
                    return read
                ks[layer] = write_cache(ks[layer], k, cols, seq_axis=3)
                vs[layer] = write_cache(vs[layer], v, cols, seq_axis=2)
                return ks[layer].astype(k.dtype), vs[layer].astype(v.dtype)
            x, routing = block(x, positions, inv_freq, attend, hook, return_routing=True)
            if return_routing:
                chosen.append(routing.expert_ids.reshape(b, t, -1))
        if paged:
            out = self._logits(x), cache.replace(k=tuple(ks), v=tuple(vs), mask=new_mask)
        else:
            out = self._logits(x), KVCache(k=tuple(ks), v=tuple(vs), mask=new_mask)
        return out + (jnp.stack(chosen, axis=2),) if return_routing else out
