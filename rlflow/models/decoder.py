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

Beside this module: the layers (norm, attention, MLP, block) in :mod:`rlflow.models.blocks`,
the forward result in :mod:`rlflow.models.forward_output`, RoPE in :mod:`rlflow.models.rope`,
the projections' matmul and init in :mod:`rlflow.models.linear`, the KV-cached forward in
:mod:`rlflow.models.cached_forward`, the MoE extras of the full forward in
:mod:`rlflow.models.moe_scan`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlflow.mesh import activation_sharding, sequence_size
from rlflow.models import cached_forward, context_parallel, expert_parallel
from rlflow.models.attention import SequenceMask
from rlflow.models.blocks import MLP, Attention, Block, RMSNorm
from rlflow.models.cached_forward import write_cache
from rlflow.models.config import DecoderConfig
from rlflow.models.forward_output import ForwardOutput
from rlflow.models.kv_cache import KVCache
from rlflow.models.paged_kv_cache import PagedKVCache
from rlflow.models.layer_pattern import LayerKinds, layer_pattern, scan_pattern
from rlflow.models.layer_scan import scan_layers, stack_modules
from rlflow.models.linear import INIT_STD, _dense, _normal
from rlflow.models.lora import LoraSpec
from rlflow.models.moe_replay import layer_major
from rlflow.models.moe_scan import finish_routed, scan_routed
from rlflow.models.rope import apply_rope, positions_from_mask, rope_inv_freq

# Defined in the modules above and imported from here too (the one import path callers use).
__all__ = ["Attention", "Block", "Decoder", "ForwardOutput", "INIT_STD", "MLP", "RMSNorm",
           "TokenRangeError",
           "apply_rope", "positions_from_mask", "rope_inv_freq", "validate_tokens",
           "write_cache"]


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


class Decoder(nnx.Module):
    """Causal LM: ``embed [V, E]``, ``layers``, ``final_norm``, ``lm_head [E, V]`` (None when
    ``tie_word_embeddings``: logits use ``embed``).

    ``layers`` of a model with several layer kinds (``cfg.layer_types``): a
    :class:`rlflow.models.layer_pattern.LayerKinds`, one stack per kind
    (``layers.sliding_attention.attn.q_kernel [L_s, E, H, D]``), run as a cycle.

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
        pattern = layer_pattern(cfg.kinds)
        if len(pattern.kinds) > 1 and lora is not None:
            raise ValueError("learner.lora: LoRA adapters on a model with several layer kinds "
                             f"({', '.join(pattern.kinds)}) are not supported yet")
        blocks = [Block(cfg, rngs=rngs, lora=lora, kind=kind) for kind in cfg.kinds]
        if len(pattern.kinds) == 1:
            self.layers = stack_modules(blocks)
        else:
            self.layers = LayerKinds({k: stack_modules([b for b in blocks if b.kind == k])
                                      for k in pattern.kinds})
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt, dt, cfg.offset_norms)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        _normal(rngs, (cfg.hidden_size, cfg.vocab_size), pdt, ("embed", "vocab")))

    def _check_tokens(self, tokens):
        if not isinstance(tokens, jax.core.Tracer):
            validate_tokens(tokens, self.cfg.vocab_size)

    def _logits(self, x) -> jax.Array:
        return self.project(self.final_norm(x))

    def project(self, x) -> jax.Array:
        """Final-normed hidden states ``[..., E]`` -> float32 logits ``[..., V]`` (softcapped
        ``c tanh(z / c)`` with ``cfg.final_logit_softcapping``)."""
        dt = jnp.dtype(self.cfg.dtype)
        w = self.embed[...].astype(dt).T if self.lm_head is None else self.lm_head[...].astype(dt)
        z = _dense(x, w, preferred_element_type=jnp.float32, out_in="lm_head" in self.out_in)
        cap = self.cfg.final_logit_softcapping
        return z if cap is None else cap * jnp.tanh(z / cap)

    def lm_head_kernel(self) -> jax.Array:
        """The LM head :meth:`project` multiplies by, ``[E, V]`` in the compute dtype (the
        tied embedding transposed, or ``lm_head``; for the fused logprob kernels,
        :mod:`rlflow.models.kernels`)."""
        dt = jnp.dtype(self.cfg.dtype)
        if self.lm_head is None:
            return self.embed[...].astype(dt).T
        w = self.lm_head[...].astype(dt)
        return w.T if "lm_head" in self.out_in else w

    def _embed(self, tokens) -> jax.Array:
        """Token embeddings in ``cfg.dtype``; Gemma's times ``sqrt(E)`` rounded to the stored
        dtype (HF ``Gemma3TextScaledWordEmbedding``)."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.cfg.gemma_norms:
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, x.dtype)
        return x.astype(jnp.dtype(self.cfg.dtype))

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
                                    prefix_ids=prefix_ids, attention_impl=attention_impl).hidden
        logits = self.project(hidden)
        return (logits, hidden) if return_hidden else logits

    def hidden_states(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                      *, segment_ids: jax.Array | None = None,
                      prefix_ids: jax.Array | None = None,
                      attention_impl: str = "auto", remat: str = "none",
                      mesh=None, moe_aux: bool = False,
                      routing_ids: jax.Array | None = None,
                      replay_routing: bool = False) -> ForwardOutput:
        """The full forward without the output projection: a
        :class:`rlflow.models.forward_output.ForwardOutput` whose ``hidden`` ``[B, T, E]`` in
        ``cfg.dtype`` is the last layer's output after the final RMSNorm (arguments and errors
        as :meth:`__call__`); :meth:`project` maps (a subset of) it to logits. ``aux_loss`` and
        ``router_agreement`` are filled as below, the other parts are None.

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

        ``moe_aux`` (mixture-of-experts models only): also compute the load-balancing loss
        of this forward, ``aux_loss`` float32 ``[]`` (:func:`rlflow.models.moe.balance_loss`
        over every layer and the tokens where ``attention_mask`` is True, as HF's
        ``load_balancing_loss_func``).

        ``routing_ids`` (mixture-of-experts models; rollout routing replay,
        :mod:`rlflow.models.moe_replay`): ``[B, T, L, k]`` int expert ids the sampler chose for
        each token and layer, -1 where it recorded none. With ``replay_routing`` every MoE
        layer routes the tokens with recorded ids to those experts (gates from its own
        router: :func:`rlflow.models.moe.route`), the others by its own top-k; without, the
        ids are only compared. ``router_agreement`` float32 ``[L, 2]`` is then filled: per
        layer, the token-layers whose own top-k set equals the recorded one, and those with a
        recorded choice (:func:`rlflow.models.moe_replay.agreement_sums`).

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
        inv_freq = None                 # each layer its kind's RoPE (rope.rope_table)
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
        """The layers under :func:`rlflow.models.layer_pattern.scan_pattern` (one scan over
        the cycles of layer kinds); ``layer(block, h, ids) -> h``, or ``(h,
        routing)`` when ``token_mask`` (the MoE load-balancing loss) or ``per_layer_ids``
        (recorded expert ids) is given: then :func:`rlflow.models.moe_scan.scan_routed`.

        Returns: ``x``, or ``(x, sums or None, agreement [L, 2] or None)``."""
        pattern = layer_pattern(self.cfg.kinds)
        if token_mask is None and per_layer_ids is None:
            apply = lambda block, h: layer(block, h, None)   # noqa: E731
            if len(pattern.kinds) == 1:
                return scan_layers(self.layers, x, apply, remat)
            return scan_pattern(self.layers, pattern, x, apply, remat)
        return scan_routed(self.layers, x, layer, remat, token_mask, per_layer_ids,
                           self.cfg.num_experts, pattern)

    def _finish(self, x, attention_mask, moe_aux, finish) -> ForwardOutput:
        """``ForwardOutput(hidden=finish(x))``, or (``x`` the triple of :meth:`_scan`) with the
        MoE parts too (:func:`rlflow.models.moe_scan.finish_routed`)."""
        if not isinstance(x, tuple):
            return ForwardOutput(hidden=finish(x))
        return finish_routed(x, attention_mask, moe_aux, finish, self.cfg.num_layers)

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                       cache: KVCache | PagedKVCache, cache_index: jax.Array, *, mesh=None,
                       return_routing: bool = False) -> ForwardOutput:
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

          return_routing: (mixture-of-experts models) also report the expert ids each
            layer's router chose for each new token: what the sampler records for rollout
            routing replay (:mod:`rlflow.exchange.routing`).

        Returns:
          a :class:`rlflow.models.forward_output.ForwardOutput` with ``logits [B, T, V]``
          float32 and ``cache`` (the new cache); with ``return_routing`` also ``expert_ids``
          int32 ``[B, T, L, k]``; the other parts None.

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
            return cached_forward.forward_cached(self, tokens, positions, attention_mask,
                                                 cache, cache_index, return_routing)
