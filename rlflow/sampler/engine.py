"""rlflow's decoder behind JetStream's ``Engine`` API (google-jetstream 0.2.2).

The engine is the device side of the sampler: a slot-based KV cache of fixed shape and
four jitted functions (the MaxText ``MaxEngine`` pattern):

* ``prefill(params, padded_tokens [P], true_length)``: runs the first ``true_length - 1``
  prompt tokens into a fresh cache (per layer keys ``[1, K, D, P]``, values ``[1, K, P, D]``). The last prompt token is not run
  here: it becomes the slot's first decode input, so every completion token (the first
  included) comes out of :meth:`generate`, under the weights current at that step and
  tagged with their version. (The 0.2.2 API's ``prefill`` returns only the prefix, no
  first token.) :meth:`RlflowEngine.prefill_batch` does up to ``sampler.max_prefill_batch``
  prompts of one bucket in one call (the batching loop's path; rows padded to a power of
  two, so at most ``log2(max_prefill_batch) + 1`` compiles per bucket).
* ``insert(prefix, decode_state, slot)``: copies a prefix into row ``slot`` of the decode
  state (donated). :meth:`RlflowEngine.insert_batch` inserts ``m`` (prefix row, slot,
  sample index) triples in calls of a fixed width per prefix size (as many compiles as
  prefill).
* ``generate(params, decode_state)``: one decode step for all slots (one compile):
  forward of each slot's current token, then sampling with the slot's own temperature /
  top-k / top-p / uniform (:mod:`rlflow.sampler.sampling`). A slot whose token is one of its
  stop ids, or whose completion reaches its ``max_tokens``, is marked inactive on device
  in the same step (its later tokens come back ``valid = 0``).
* ``generate_packed(params, decode_state)``: the batching loop's fast path:
  ``sampler.decode_steps_per_call`` (k) decode steps in one jitted ``lax.scan`` over the
  same step function, returning one int32 array ``[k, slots, 6]`` (:data:`PACKED_FIELDS`)
  so the host does one device->host copy per call. Each slot's uniforms are drawn at
  insert (:func:`rlflow.sampler.sampling.request_uniforms`) and token ``t`` uses entry
  ``t``, so the tokens do not depend on k; a slot that finishes
  mid-call emits nothing afterwards (``valid = 0``). Weights are fixed for the k steps:
  a weight swap takes effect between calls, and every token carries the version of the
  call that sampled it. k defaults to 8 (the fastest setting in
  ``benchmarks/sampler_throughput.py``: dispatch and host bookkeeping once per 8 tokens).

Params are :class:`EngineParams`: the model's ``nnx.State`` plus its policy version, so
the version that produced each token comes out of the same jitted step as the token.
``generate`` returns :class:`SampledTokens`: JetStream's ``ResultTokens`` (``data``
``[slots, 3]`` = token, valid, length) plus ``logprobs [slots]`` and ``versions
[slots]``, keyed by slot. These types live in :mod:`rlflow.sampler.decode_state` (and
are importable from here). Prefill is :mod:`rlflow.sampler.engine_prefill` (a mixin of the
engine).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rlflow.sampler.jetstream_api import engine_api, tokenizer_pb2

from rlflow.exchange.routing import routing_dtype
from rlflow.models.kv_cache import KVCache, init_cache
from rlflow.models.layer_pattern import layer_pattern
from rlflow.models.window_cache import insert_ring
from rlflow.sampler import kernel_layout, layer_storage, paged, quantization
from rlflow.sampler.decode_state import (MAX_STOP_IDS, PACKED_FIELDS, DecodeState,  # noqa: F401
                                         EngineParams, Prefix, PromptError, SampledTokens,
                                         pick_bucket)
from rlflow.sampler.engine_prefill import EnginePrefill
from rlflow.sampler.sampling import request_uniforms, sample_tokens


class RlflowEngine(EnginePrefill, engine_api.Engine):
    """JetStream engine for :class:`rlflow.models.decoder.Decoder`.

    Args:
      model: a ``Decoder`` (its graph is kept; its weights are the default params).
      sampler_cfg: :class:`rlflow.config.SamplerConfig` (slots, buckets, max_tokens).
      mesh: the sampler's mesh (axes ``data, fsdp, expert, tensor``); ``None``: built from
        ``sampler_cfg.mesh`` over ``jax.devices()`` (``rlflow.mesh.make_mesh``).
      tokenizer_path: HF tokenizer folder for ``get_tokenizer`` / ``build_tokenizer``.
      eos_token_ids: stop ids; ``None``: the model config's ``eos_token_ids`` (which
        ``load_hf`` fills from config.json and generation_config.json).
      keep_model_weights: keep ``model``'s weights as the default params
        (:meth:`load_params` with none given); False (the sampler program, whose weights
        come from the learner) keeps only their shapes, dtypes and shardings, so the
        engine does not hold a copy of the weights it never runs (0.5 GiB for
        SmolLM2-135M in float32).
    """

    def __init__(self, model, sampler_cfg, *, mesh=None, tokenizer_path: str = "",
                 eos_token_ids: Optional[Sequence[int]] = None,
                 keep_model_weights: bool = True):
        from rlflow import mesh as mesh_lib
        self._mesh_lib = mesh_lib
        self.cfg = model.cfg
        self.sampler_cfg = sampler_cfg
        self._mesh = mesh if mesh is not None else mesh_lib.make_mesh(sampler_cfg.mesh)
        model_state = nnx.state(model, nnx.Param)       # the model's tree: stacked
        # the default params (load_params(None)), or only their shapes (keep_model_weights)
        self._default_state = model_state if keep_model_weights else jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), model_state)
        # the engine runs a view with one array per layer (rlflow.sampler.layer_storage)
        self.graphdef, state = nnx.split(layer_storage.unstacked_view(model), nnx.Param)
        self._layers = layer_storage.LayerStorage(self._default_state, state,
                                                  layer_pattern(model.cfg.kinds))
        self._state_treedef = jax.tree_util.tree_structure(state)
        self._view_dtypes = [x.dtype for x in jax.tree_util.tree_leaves(state)]
        self._model_treedef = jax.tree_util.tree_structure(self._default_state)
        self._kernels = kernel_layout.StoredKernels(    # wide kernels held [out, in] or not
            kernel_layout.wide_kernels(state) if kernel_layout.stores_out_first(
                getattr(sampler_cfg, "kernel_layout", "auto"),
                self._mesh.devices.flat[0].platform) else ())
        self._quant = quantization.QuantizedKernels(     # int8 projection kernels or not
            state, getattr(sampler_cfg, "quantization", "none"),
            self._mesh.devices.flat[0].platform)
        self.tokenizer_path = tokenizer_path
        self.eos_token_ids = tuple(int(e) for e in (
            self.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids))
        self.buckets = tuple(int(b) for b in sampler_cfg.prefill_buckets)
        self.cache_len = sampler_cfg.max_prefill_length + sampler_cfg.max_tokens
        self.num_slots = sampler_cfg.num_slots
        self.paged = getattr(sampler_cfg, "kv_cache", "contiguous") == "paged"
        # rollout routing replay: a mixture-of-experts engine reports each token's experts
        self.records_routing = bool(getattr(self.cfg, "is_moe", False))
        self.routing_dtype = (routing_dtype(self.cfg.num_experts) if self.records_routing
                              else None)
        self._paged = (paged.paged_settings(sampler_cfg, self._mesh.devices.flat[0].platform)
                       if self.paged else None)
        self._state_sharding = self._decode_state_sharding()
        self._init_state = jax.jit(self._init_state_impl, out_shardings=self._state_sharding)
        self._prefill = jax.jit(self._prefill_impl)
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,),
                               out_shardings=self._state_sharding)
        self._generate = jax.jit(self._generate_impl, donate_argnums=(1,),
                                 out_shardings=(self._state_sharding, None))
        self.decode_steps_per_call = int(getattr(sampler_cfg, "decode_steps_per_call", 1))
        self._generate_packed = jax.jit(self._generate_packed_impl, donate_argnums=(1,),
                                        out_shardings=(self._state_sharding, None))
        self._release = jax.jit(self._release_impl, donate_argnums=(0,),
                                out_shardings=self._state_sharding)
        self._set_table = jax.jit(
            lambda st, t: st.replace(cache=st.cache.replace(page_table=t)),
            donate_argnums=(0,), out_shardings=self._state_sharding)

    # ------------------------------------------------------------------ layout
    def _decode_state_sharding(self) -> "DecodeState":
        """KV cache per ``rlflow.mesh`` (KV heads over ``tensor``, slots over ``data`` x
        ``fsdp``, each replicated where the size does not divide); per-slot vectors
        follow the slot axis; a paged cache's pools per ``rlflow.mesh.PAGE_POOL_AXES``."""
        shapes = jax.eval_shape(self._empty_cache)
        cache = (self._mesh_lib.paged_cache_sharding(self._mesh, shapes) if self.paged else
                 self._mesh_lib.cache_sharding(self._mesh, shapes))
        vec = self._mesh_lib.logical_sharding(self._mesh, ("cache_batch",), (self.num_slots,))
        return DecodeState(cache=cache, tokens=vec, index=vec, gen_len=vec, temperature=vec,
                           top_k=vec, top_p=vec, uniforms=vec, active=vec, max_len=vec,
                           stop_ids=vec)

    # ------------------------------------------------------------------ params
    def load_params(self, params=None, version: int = 0) -> EngineParams:
        """Place weights on the engine mesh and tag them with their policy version.

        Args:
          params: the model's ``nnx.State`` (``nnx.split(model, nnx.Param)[1]``), e.g. a
            new learner version; ``None``: the weights of the model given at construction.
          version: policy version (int >= 0).

        Each array is cast to the dtype of the model's own parameter (e.g. fp32 learner
        weights into a bf16 sampler), and with ``sampler.kernel_layout`` resolving to
        ``"out_in"`` (the CPU default) each wide kernel is stored transposed
        (:mod:`rlflow.sampler.kernel_layout`); the stacked layers are held one array per
        layer (:mod:`rlflow.sampler.layer_storage`); with ``sampler.quantization="int8"``
        each projection kernel is quantized to int8 once here, before the kernel layout
        (:mod:`rlflow.sampler.quantization`). :meth:`param_state` gives the model's tree.

        Raises:
          ValueError: the params' tree does not match the model's, or a parameter's shape
            differs (names the parameter and both shapes); no params given to an engine
            built with ``keep_model_weights=False``.
        """
        state = self._default_state if params is None else params
        if params is None and any(not isinstance(x, jax.Array)
                                  for x in jax.tree_util.tree_leaves(state)):
            raise ValueError("load_params: no params given, and this engine was built with "
                             "keep_model_weights=False (it holds no weights of its own)")
        ref = jax.tree_util.tree_structure(self._default_state)
        got = jax.tree_util.tree_structure(state)
        if ref != got:
            raise ValueError(f"load_params: params do not match the model's tree "
                             f"(expected {ref}, got {got})")
        refs = jax.tree_util.tree_leaves(self._default_state)
        for (path, x), r in zip(jax.tree_util.tree_flatten_with_path(state)[0], refs):
            if tuple(np.shape(x)) != tuple(r.shape):
                raise ValueError(f"load_params: parameter {jax.tree_util.keystr(path)} has "
                                 f"shape {tuple(np.shape(x))}, the model's is {tuple(r.shape)}")
        # one leaf per layer (sliced once per array given), each in the model's dtype
        stacked = jax.tree_util.tree_leaves(state)
        given = self._layers.view_leaves(stacked)
        # the per-version caches below key each view leaf by the array it was sliced from:
        # the slices themselves are not kept once transposed or quantized
        origins = self._layers.origins(stacked)
        view = jax.tree_util.tree_unflatten(self._state_treedef, [
            x if x.dtype == dt else x.astype(dt) for x, dt in zip(given, self._view_dtypes)])
        del given
        placed = jax.tree_util.tree_leaves(self._mesh_lib.shard_params(view, self._mesh))
        del view
        placed = self._quant.quantize(origins, placed)
        leaves = self._kernels.store(origins, placed)    # each slice freed once transposed
        del placed
        return EngineParams(leaves=tuple(leaves), version=jnp.asarray(version, jnp.int32))

    def param_state(self, params: EngineParams):
        """The ``nnx.State`` of ``params`` in the model's own layout, layers stacked (inverse
        of :meth:`load_params`' flattening, per-layer storage and kernel layout); int8
        kernels dequantized (the weights of the policy the engine samples from)."""
        return jax.tree_util.tree_unflatten(self._model_treedef, self._layers.stacked_leaves(
            self._quant.dequantize(self._kernels.model_leaves(params.leaves))))

    def _model(self, params: EngineParams):
        """The model on the stored leaves, its wide kernels marked ``[out, in]``, its int8
        kernels dequantized in front of their dots (:mod:`rlflow.sampler.quantization`)."""
        model = nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(
            self._state_treedef, self._quant.dequantize(params.leaves)))
        self._kernels.mark(model)
        return model

    # ------------------------------------------------------------------ decode state
    def _empty_cache(self):
        """The decode state's empty KV cache, contiguous or paged (``sampler.kv_cache``)."""
        if self.paged:
            return paged.init_state_cache(self.cfg, self.num_slots, self._paged)
        return init_cache(self.cfg, self.num_slots, self.cache_len)

    def _init_state_impl(self) -> DecodeState:
        b = self.num_slots
        return DecodeState(
            cache=self._empty_cache(),
            tokens=jnp.zeros((b,), jnp.int32), index=jnp.zeros((b,), jnp.int32),
            gen_len=jnp.zeros((b,), jnp.int32), temperature=jnp.ones((b,), jnp.float32),
            top_k=jnp.zeros((b,), jnp.int32), top_p=jnp.ones((b,), jnp.float32),
            uniforms=jnp.zeros((b, self.sampler_cfg.max_tokens), jnp.float32),
            active=jnp.zeros((b,), bool), max_len=jnp.zeros((b,), jnp.int32),
            stop_ids=jnp.full((b, MAX_STOP_IDS), -1, jnp.int32))

    def init_decode_state(self) -> DecodeState:
        """A fresh decode state: empty cache (per layer keys ``[slots, K, D, S]``, values
        ``[slots, K, S, D]``; paged: pools ``[K, N, P, D]``, no page in any slot's table),
        all slots inactive."""
        return self._init_state()

    def _insert_impl(self, prefix: Prefix, state: DecodeState, rows, slots,
                     sample_index) -> DecodeState:
        c, pc = state.cache, prefix.cache
        p = pc.max_len
        keep = pc.mask[rows]                                               # [m, P]

        def put(dst, src):
            return dst.at[slots].set(src, mode="drop")
        # Zero the unused bucket entries, then write each slot's first P cache entries;
        # padding entries carry slot = num_slots and are dropped.
        def write(caches, news, seq_axis):
            # Keys [B, K, D, S] <- [n, K, D, P] (seq_axis 3), values [B, K, S, D] <- [n, K, P, D] (2).
            at = (slots,) + tuple(slice(0, p) if a == seq_axis else slice(None) for a in (1, 2, 3))
            mask = jnp.expand_dims(keep, [a for a in (1, 2, 3) if a != seq_axis])
            return tuple(
                None if cache is None else   # a linear-attention layer: state in .linear
                insert_ring(cache, new, rows, slots, seq_axis) if new.shape[seq_axis] != p else
                cache.at[at].set(jnp.where(mask, new[rows], 0).astype(cache.dtype), mode="drop")
                for cache, new in zip(caches, news))   # (a sliding layer's ring of W < P)
        if self.paged:
            cache = paged.insert_prefix(c, pc, rows, slots, keep)
        else:
            row_mask = jnp.zeros((rows.shape[0], self.cache_len), bool).at[:, :p].set(keep)
            cache = KVCache(k=write(c.k, pc.k, 3), v=write(c.v, pc.v, 2),
                            mask=put(c.mask, row_mask),   # GDN states: the prefix row's
                            linear=jax.tree.map(lambda d, s: put(d, s[rows]), c.linear,
                                                pc.linear))
        uniforms = jax.vmap(lambda s, i: request_uniforms(s, i, self.sampler_cfg.max_tokens))(
            prefix.seed[rows], sample_index)
        return DecodeState(
            cache=cache,
            tokens=put(state.tokens, prefix.last_token[rows]),
            index=put(state.index, prefix.length[rows]),
            gen_len=put(state.gen_len, jnp.zeros_like(rows)),
            temperature=put(state.temperature, prefix.temperature[rows]),
            top_k=put(state.top_k, prefix.top_k[rows]),
            top_p=put(state.top_p, prefix.top_p[rows]),
            uniforms=put(state.uniforms, uniforms),
            active=put(state.active, jnp.ones(rows.shape, bool)),
            max_len=put(state.max_len, prefix.max_tokens[rows]),
            stop_ids=put(state.stop_ids, prefix.stop_ids[rows]))

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Put row 0 of ``prefix`` into slot ``slot`` with the prefix's sample index
        (JetStream API; ``decode_state`` is donated: use the result).

        Raises:
          ValueError: ``slot`` outside ``[0, slots)``.
        """
        if not 0 <= int(slot) < self.num_slots:
            raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
        return self.insert_batch(prefix, decode_state, [0], [slot],
                                 [int(np.asarray(prefix.sample_index)[0])])

    def insert_batch(self, prefix: Prefix, decode_state: DecodeState, rows: Sequence[int],
                     slots: Sequence[int], sample_indices: Sequence[int]) -> DecodeState:
        """Insert ``m`` samples in one call: prefix row ``rows[j]`` into slot ``slots[j]``
        as sample ``sample_indices[j]`` of its request (``decode_state`` donated).

        Inserts go in jitted calls of a fixed width per prefix size: ``rows x W``
        entries, ``W`` = ``sampler.group_size`` rounded up to a power of two (the samples
        a prefix row usually serves), padding entries dropped; more inserts take more
        calls. So the call compiles once per (bucket, prefix rows), as prefill does.

        Raises:
          ValueError: a slot outside ``[0, slots)`` or repeated, a row outside the
            prefix, or lists of different lengths.
        """
        m = len(slots)
        if not m or len(rows) != m or len(sample_indices) != m:
            raise ValueError(f"insert_batch: {len(rows)} rows, {m} slots, "
                             f"{len(sample_indices)} sample indices (need as many, >= 1)")
        n = int(prefix.length.shape[0])
        if any(not 0 <= int(r) < n for r in rows):
            raise ValueError(f"insert_batch: rows {list(rows)} must be in [0, {n}) (the "
                             f"prefix's rows; rows past the prompts given repeat row 0)")
        bad = [s for s in slots if not 0 <= int(s) < self.num_slots]
        if bad or len(set(slots)) != m:
            raise ValueError(f"insert_batch: slots {list(slots)} must be distinct and in "
                             f"[0, {self.num_slots}); bad: {bad or 'repeated'}")
        width = n * (1 << (max(self.sampler_cfg.group_size, 1) - 1).bit_length())
        for i in range(0, m, width):
            r, s, x = rows[i:i + width], slots[i:i + width], sample_indices[i:i + width]
            pad = width - len(s)
            decode_state = self._insert(
                prefix, decode_state, np.asarray(list(r) + [0] * pad, np.int32),
                np.asarray(list(s) + [self.num_slots] * pad, np.int32),
                np.asarray(list(x) + [0] * pad, np.int32))
        return decode_state

    def _release_impl(self, state: DecodeState, slot) -> DecodeState:
        return state.replace(active=state.active.at[slot].set(False))

    def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Mark a slot free (its tokens come back ``valid = 0``); donated."""
        return self._release(decode_state, np.int32(slot))

    def set_page_table(self, decode_state: DecodeState, table) -> DecodeState:
        """A paged cache's page table replaced by ``table`` (int32 ``[slots,
        sampler.pages_per_slot]``, entry ``sampler.pool_pages`` = no page; the host's
        :class:`rlflow.sampler.page_pool.PagePool`); donated.

        Raises:
          ValueError: the cache is contiguous, or the table's shape is not the cache's.
        """
        want = (self.num_slots, self.sampler_cfg.pages_per_slot) if self.paged else None
        if want is None or tuple(np.shape(table)) != want:
            raise ValueError(f"set_page_table: needs sampler.kv_cache='paged' and a table "
                             f"{want}, got kv_cache={self.sampler_cfg.kv_cache!r}, table "
                             f"{tuple(np.shape(table))}")
        return self._set_table(decode_state, np.asarray(table, np.int32))

    # ------------------------------------------------------------------ generate
    def _step(self, model, version, state: DecodeState):
        """One decode step: ``(new state, packed int32 [B, 6])`` (:data:`PACKED_FIELDS`; a
        mixture-of-experts engine appends the input tokens' expert ids, ``[B, 6 + L * k]``)."""
        b = self.num_slots
        # an inactive slot's token is not real: it writes nothing a later token reads (a
        # gated DeltaNet state stays as it was, e.g. an episode parked between turns)
        out = model.forward_cached(
            state.tokens[:, None], state.index[:, None], state.active[:, None], state.cache,
            state.index, mesh=self._mesh, return_routing=self.records_routing)
        logits, cache = out.logits, out.cache
        t = jnp.minimum(state.gen_len, state.uniforms.shape[1] - 1)
        u = jnp.take_along_axis(state.uniforms, t[:, None], axis=1)[:, 0]
        tokens, logprobs = sample_tokens(logits[:, 0], u, state.temperature, state.top_k,
                                         state.top_p)
        active = state.active
        gen_len = state.gen_len + active.astype(jnp.int32)
        index = jnp.where(active, jnp.minimum(state.index + 1, self.cache_len - 1),
                          state.index)
        stop = jnp.any(tokens[:, None] == state.stop_ids, axis=-1)
        done = jnp.where(active & stop, 1, jnp.where(active & (gen_len >= state.max_len), 2, 0))
        new_state = state.replace(cache=cache, tokens=tokens, index=index, gen_len=gen_len,
                                  active=active & (done == 0))
        packed = jnp.stack([tokens, active.astype(jnp.int32), gen_len, done.astype(jnp.int32),
                            jnp.broadcast_to(version, (b,)).astype(jnp.int32),
                            jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32),
                                                         jnp.int32)], axis=-1)
        if self.records_routing:                  # [B, 1, L, k] -> L * k columns
            packed = jnp.concatenate([packed, out.expert_ids.reshape(b, -1)], axis=-1)
        return new_state, packed

    def _generate_impl(self, params: EngineParams, state: DecodeState):
        model = self._model(params)
        new_state, packed = self._step(model, params.version, state)
        result = SampledTokens(data=packed[:, :3], tokens_idx=(0, 1), valid_idx=(1, 2),
                               length_idx=(2, 3), samples_per_slot=1,
                               logprobs=jax.lax.bitcast_convert_type(packed[:, 5], jnp.float32),
                               versions=packed[:, 4])
        return new_state, result

    def generate(self, params: EngineParams, decode_state: DecodeState
                 ) -> tuple[DecodeState, SampledTokens]:
        """One decode step for every slot (``decode_state`` is donated: use the result)."""
        return self._generate(params, decode_state)

    def _generate_packed_impl(self, params: EngineParams, state: DecodeState):
        model = self._model(params)
        return jax.lax.scan(lambda st, _: self._step(model, params.version, st), state,
                            None, length=self.decode_steps_per_call)

    def generate_packed(self, params: EngineParams, decode_state: DecodeState
                        ) -> tuple[DecodeState, jax.Array]:
        """``sampler.decode_steps_per_call`` (k) decode steps in one call.

        Returns:
          ``(new decode state, int32 [k, slots, 6])``, columns :data:`PACKED_FIELDS` (a
          mixture-of-experts engine: ``6 + L * k`` columns, the input tokens' expert ids
          after them); a slot's entries after its ``done`` step have ``valid = 0``.
          ``decode_state`` is donated: use the result.
        """
        return self._generate_packed(params, decode_state)

    # ------------------------------------------------------------------ JetStream plumbing
    def get_prefix_destination_sharding(self) -> Any:
        """Shardings of a :class:`Prefix` (KV heads over ``tensor``, the rest replicated)."""
        rep = self._mesh_lib.replicated(self._mesh)
        kv = self._mesh_lib.cache_sharding(self._mesh, jax.eval_shape(
            lambda: init_cache(self.cfg, 1, self.buckets[-1])))
        return Prefix(cache=kv._replace(mask=rep), last_token=rep, length=rep,
                      temperature=rep, top_k=rep, top_p=rep, seed=rep, sample_index=rep,
                      version=rep, max_tokens=rep, stop_ids=rep,
                      routing=rep if self.records_routing else None)

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        """The HF tokenizer folder as JetStream's ``TokenizerParameters.path``."""
        return tokenizer_pb2.TokenizerParameters(path=self.tokenizer_path)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters):
        """An :class:`rlflow.sampler.tokenizer.HFTokenizer` for ``metadata.path``."""
        from rlflow.sampler.tokenizer import HFTokenizer
        return HFTokenizer(metadata.path)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.num_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.sampler_cfg.max_prefill_length

    @property
    def max_tokens(self) -> int:
        return self.sampler_cfg.max_tokens

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        """Not used by rlflow (no JetStream orchestrator): None."""
        return None
