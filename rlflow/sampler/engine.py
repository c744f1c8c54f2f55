"""rlflow's decoder behind JetStream's ``Engine`` API (google-jetstream 0.2.2).

The engine is the device side of the sampler: a slot-based KV cache of fixed shape and
four jitted functions (the MaxText ``MaxEngine`` pattern):

* ``prefill(params, padded_tokens [P], true_length)``: runs the first ``true_length - 1``
  prompt tokens into a fresh ``[L, 1, P, K, D]`` cache (one compile per bucket ``P``).
  The last prompt token is not run here: it becomes the slot's first decode input, so
  every completion token (the first included) comes out of :meth:`generate`, under the
  weights current at that step and tagged with their version. (The 0.2.2 API's
  ``prefill`` returns only the prefix, no first token.)
* ``insert(prefix, decode_state, slot)``: copies a prefix into row ``slot`` of the decode
  state (donated; ``slot`` is traced, so one compile per bucket).
* ``generate(params, decode_state)``: one decode step for all slots (one compile):
  forward of each slot's current token, then sampling with the slot's own temperature /
  top-k / top-p / key (:mod:`rlflow.sampler.sampling`). A slot whose token is one of its
  stop ids, or whose completion reaches its ``max_tokens``, is marked inactive on device
  in the same step (its later tokens come back ``valid = 0``).
* ``generate_packed(params, decode_state)``: the batching loop's fast path:
  ``sampler.decode_steps_per_call`` (k) decode steps in one jitted ``lax.scan`` over the
  same step function, returning one int32 array ``[k, slots, 6]`` (:data:`PACKED_FIELDS`)
  so the host does one device->host copy per call. Keys advance per token
  (``fold_in(request_key, t)``), so the tokens do not depend on k; a slot that finishes
  mid-call emits nothing afterwards (``valid = 0``). Weights are fixed for the k steps:
  a weight swap takes effect between calls.

Params are :class:`EngineParams`: the model's ``nnx.State`` plus its policy version, so
the version that produced each token comes out of the same jitted step as the token.
``generate`` returns :class:`SampledTokens`: JetStream's ``ResultTokens`` (``data``
``[slots, 3]`` = token, valid, length) plus ``logprobs [slots]`` and ``versions
[slots]``, keyed by slot.
"""

from __future__ import annotations

import bisect
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jetstream.engine import engine_api, tokenizer_pb2

from rlflow.models.kv_cache import KVCache, init_cache
from rlflow.sampler.sampling import (SamplingError, SamplingParams, request_key,
                                     sample_tokens, token_keys)


class PromptError(ValueError):
    """A prompt cannot be prefilled (empty, too long for the buckets, bad token id)."""


MAX_STOP_IDS = 8
"""Most stop token ids per request (the device-side stop check has a fixed width)."""

PACKED_FIELDS = ("token", "valid", "length", "done", "version", "logprob_bits")
"""Columns of :meth:`RlflowEngine.generate_packed`'s ``[k, slots, 6]`` int32 result:
token id; valid (1: the slot was active and emitted it); length (completion tokens so far,
this one included); done (0: running, 1: stop id, 2: reached ``max_tokens``); policy
version; the float32 logprob's bits (``view(np.float32)`` on the host)."""


@struct.dataclass
class EngineParams:
    """Model weights and the policy version they are. ``state``: the model's
    ``nnx.State`` of ``nnx.Param`` (placed on the engine mesh); ``version``: int32 ``[]``."""

    state: Any
    version: jax.Array


@struct.dataclass
class Prefix:
    """One prompt's prefill result, ready to ``insert`` into a slot.

    Attributes:
      cache: :class:`KVCache` with ``k, v [L, 1, P, K, D]`` and ``mask [1, P]`` holding the
        first ``length`` prompt tokens (``P`` the bucket).
      last_token: int32 ``[]``, the last prompt token (the slot's first decode input).
      length: int32 ``[]``, tokens in the cache (= prompt length - 1), also the position
        of ``last_token``.
      temperature / top_k / top_p: the request's settings, ``[]`` each.
      seed / sample_index: uint32 / int32 ``[]``: the slot's key is
        ``fold_in(key(seed), sample_index)`` (replace ``sample_index`` to insert the same
        prefix as another sample of the group).
      version: int32 ``[]``, policy version of the weights the prefix was computed with.
      max_tokens: int32 ``[]``, most completion tokens; stop_ids: int32
        ``[MAX_STOP_IDS]``, the request's stop ids padded with -1.
    """

    cache: KVCache
    last_token: jax.Array
    length: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    sample_index: jax.Array
    version: jax.Array
    max_tokens: jax.Array
    stop_ids: jax.Array


@struct.dataclass
class DecodeState:
    """Everything one decode step transforms, one row per slot (``B`` = slots).

    Attributes:
      cache: :class:`KVCache`, ``k, v [L, B, S, K, D]``, ``mask [B, S]``,
        ``S = max_prefill_length + max_tokens``.
      tokens: int32 ``[B]`` next decode input of each slot.
      index: int32 ``[B]`` its cache position (= its RoPE position).
      gen_len: int32 ``[B]`` completion tokens generated so far.
      temperature / top_k / top_p: ``[B]`` per-slot settings; keys: uint32 ``[B, 2]``
        raw PRNG key data (``jax.random.key_data``: plain arrays are cheaper to pass to
        a jitted call than typed keys).
      active: bool ``[B]`` the slot holds a running request.
      max_len: int32 ``[B]`` its ``max_tokens``; stop_ids: int32 ``[B, MAX_STOP_IDS]``
        its stop ids (-1 padded).
    """

    cache: KVCache
    tokens: jax.Array
    index: jax.Array
    gen_len: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array
    active: jax.Array
    max_len: jax.Array
    stop_ids: jax.Array


@struct.dataclass
class SampledTokens(engine_api.ResultTokens):
    """``ResultTokens`` of one decode step plus what RL needs per slot.

    ``data`` is int32 ``[B, 3]``: token, valid (the slot was active), length (completion
    tokens so far, this one included). ``logprobs``: float32 ``[B]``, the tempered logprob
    each token was sampled with; ``versions``: int32 ``[B]`` the policy version of the
    weights that produced it.
    """

    logprobs: Optional[jax.Array] = None
    versions: Optional[jax.Array] = None

    def convert_to_numpy(self) -> "SampledTokens":
        return SampledTokens(np.asarray(self.data), self.tokens_idx, self.valid_idx,
                             self.length_idx, self.samples_per_slot,
                             np.asarray(self.logprobs), np.asarray(self.versions))


def pick_bucket(buckets: Sequence[int], length: int) -> int:
    """Smallest bucket >= ``length``.

    Raises:
      PromptError: ``length`` exceeds the largest bucket.
    """
    i = bisect.bisect_left(list(buckets), length)
    if i == len(buckets):
        raise PromptError(f"prompt of {length} tokens is longer than the largest prefill "
                          f"bucket {buckets[-1]} (sampler.max_prefill_length)")
    return int(buckets[i])


class RlflowEngine(engine_api.Engine):
    """JetStream engine for :class:`rlflow.models.decoder.Decoder`.

    Args:
      model: a ``Decoder`` (its graph is kept; its weights are the default params).
      sampler_cfg: :class:`rlflow.config.SamplerConfig` (slots, buckets, max_tokens).
      mesh: the sampler's mesh (axes ``data, fsdp, tensor``); ``None``: built from
        ``sampler_cfg.mesh`` over ``jax.devices()`` (``rlflow.mesh.make_mesh``).
      tokenizer_path: HF tokenizer folder for ``get_tokenizer`` / ``build_tokenizer``.
      eos_token_ids: stop ids; ``None``: the model config's ``eos_token_ids`` (which
        ``load_hf`` fills from config.json and generation_config.json).
    """

    def __init__(self, model, sampler_cfg, *, mesh=None, tokenizer_path: str = "",
                 eos_token_ids: Optional[Sequence[int]] = None):
        from rlflow import mesh as mesh_lib
        self._mesh_lib = mesh_lib
        self.cfg = model.cfg
        self.sampler_cfg = sampler_cfg
        self._mesh = mesh if mesh is not None else mesh_lib.make_mesh(sampler_cfg.mesh)
        self.graphdef, state = nnx.split(model, nnx.Param)
        self._default_state = state
        self.tokenizer_path = tokenizer_path
        self.eos_token_ids = tuple(int(e) for e in (
            self.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids))
        self.buckets = tuple(int(b) for b in sampler_cfg.prefill_buckets)
        self.cache_len = sampler_cfg.max_prefill_length + sampler_cfg.max_tokens
        self.num_slots = sampler_cfg.num_slots
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

    # ------------------------------------------------------------------ layout
    def _decode_state_sharding(self) -> "DecodeState":
        """KV cache per ``rlflow.mesh`` (KV heads over ``tensor``, slots over ``data`` x
        ``fsdp``, each replicated where the size does not divide); per-slot vectors
        follow the slot axis."""
        shape = (self.cfg.num_layers, self.num_slots, self.cache_len, self.cfg.num_kv_heads,
                 self.cfg.head_dim)
        cache = self._mesh_lib.cache_sharding(self._mesh, KVCache(
            k=jax.ShapeDtypeStruct(shape, jnp.float32), v=None,
            mask=jax.ShapeDtypeStruct(shape[1:3], bool)))
        vec = self._mesh_lib.logical_sharding(self._mesh, ("cache_batch",), (self.num_slots,))
        return DecodeState(cache=cache, tokens=vec, index=vec, gen_len=vec, temperature=vec,
                           top_k=vec, top_p=vec, keys=vec, active=vec, max_len=vec,
                           stop_ids=vec)

    # ------------------------------------------------------------------ params
    def load_params(self, params=None, version: int = 0) -> EngineParams:
        """Place weights on the engine mesh and tag them with their policy version.

        Args:
          params: the model's ``nnx.State`` (``nnx.split(model, nnx.Param)[1]``), e.g. a
            new learner version; ``None``: the weights of the model given at construction.
          version: policy version (int >= 0).

        Raises:
          ValueError: the params' tree does not match the model's.
        """
        state = self._default_state if params is None else params
        ref = jax.tree_util.tree_structure(self._default_state)
        got = jax.tree_util.tree_structure(state)
        if ref != got:
            raise ValueError(f"load_params: params do not match the model's tree "
                             f"(expected {ref}, got {got})")
        state = self._mesh_lib.shard_params(state, self._mesh)
        return EngineParams(state=state, version=jnp.asarray(version, jnp.int32))

    # ------------------------------------------------------------------ prefill
    def _prefill_impl(self, params: EngineParams, padded_tokens, true_length, temperature,
                      top_k, top_p, seed, sample_index, max_tokens, stop_ids) -> Prefix:
        model = nnx.merge(self.graphdef, params.state)
        p = padded_tokens.shape[0]
        n = true_length - 1
        idx = jnp.arange(p, dtype=jnp.int32)
        mask = (idx < n)[None]
        cache = init_cache(self.cfg, 1, p)
        _, cache = model.forward_cached(padded_tokens[None], idx[None], mask, cache,
                                        jnp.zeros((1,), jnp.int32))
        return Prefix(cache=cache, last_token=padded_tokens[n], length=n,
                      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      sample_index=sample_index, version=params.version,
                      max_tokens=max_tokens, stop_ids=stop_ids)

    def prefill(self, *, params: EngineParams, existing_prefix: Optional[Prefix] = None,
                padded_tokens: jax.Array, true_length: int,
                sampling: Optional[SamplingParams] = None, sample_index: int = 0) -> Prefix:
        """Prefill one prompt (JetStream API, plus this request's sampling settings).

        Args:
          params: :class:`EngineParams` from :meth:`load_params`.
          existing_prefix: not supported (must be None: no prefix cache, so no state from
            an older policy version is ever reused).
          padded_tokens: int32 ``[P]``, the prompt right-padded to a bucket ``P``
            (:meth:`pad_prompt`).
          true_length: prompt tokens before padding, ``1 <= true_length <= P``.
          sampling: the request's settings (default: the sampler config's); its
            ``max_tokens`` and stop ids (``None``: the engine's EOS ids) end the slot.
          sample_index: which of the request's samples (selects its PRNG stream).

        Returns:
          :class:`Prefix`.

        Raises:
          PromptError: empty prompt, ``true_length`` > ``P``, or ``P`` not a bucket.
          SamplingError: more than :data:`MAX_STOP_IDS` stop ids, or ``max_tokens``
            above ``sampler.max_tokens``.
          NotImplementedError: ``existing_prefix`` given.
        """
        if existing_prefix is not None:
            raise NotImplementedError("rlflow's engine has no prefix cache (existing_prefix)")
        p = int(np.shape(padded_tokens)[0])
        if p not in self.buckets:
            raise PromptError(f"padded length {p} is not a prefill bucket {self.buckets}")
        if not 1 <= int(true_length) <= p:
            raise PromptError(f"true_length must be in [1, {p}], got {true_length}")
        sp = sampling or SamplingParams.from_config(self.sampler_cfg)
        stop = self.eos_token_ids if sp.stop_token_ids is None else sp.stop_token_ids
        if len(stop) > MAX_STOP_IDS:
            raise SamplingError(f"sampling.stop_token_ids: at most {MAX_STOP_IDS} stop ids, "
                                f"got {len(stop)}: {tuple(stop)}")
        if sp.max_tokens > self.sampler_cfg.max_tokens:
            raise SamplingError(f"sampling.max_tokens={sp.max_tokens} exceeds "
                                f"sampler.max_tokens={self.sampler_cfg.max_tokens}")
        stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
        stop_ids[:len(stop)] = stop
        return self._prefill(params, np.asarray(padded_tokens, np.int32),
                             np.int32(true_length), np.float32(sp.temperature),
                             np.int32(sp.top_k), np.float32(sp.top_p),
                             np.uint32(sp.seed), np.int32(sample_index),
                             np.int32(sp.max_tokens), stop_ids)

    def pad_prompt(self, tokens) -> tuple[np.ndarray, int]:
        """Right-pad a prompt to its bucket: returns (int32 ``[P]``, true length).

        Raises:
          PromptError: empty, longer than the largest bucket, or an id outside the vocab.
        """
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if tokens.size == 0:
            raise PromptError("empty prompt (0 tokens): a prompt needs at least one token")
        bad = (tokens < 0) | (tokens >= self.cfg.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise PromptError(f"prompt token {int(tokens[i])} at index {i} is outside the "
                              f"vocabulary [0, {self.cfg.vocab_size})")
        p = pick_bucket(self.buckets, tokens.size)
        return np.pad(tokens, (0, p - tokens.size)), int(tokens.size)

    # ------------------------------------------------------------------ decode state
    def _init_state_impl(self) -> DecodeState:
        b = self.num_slots
        return DecodeState(
            cache=init_cache(self.cfg, b, self.cache_len),
            tokens=jnp.zeros((b,), jnp.int32), index=jnp.zeros((b,), jnp.int32),
            gen_len=jnp.zeros((b,), jnp.int32), temperature=jnp.ones((b,), jnp.float32),
            top_k=jnp.zeros((b,), jnp.int32), top_p=jnp.ones((b,), jnp.float32),
            keys=jax.random.key_data(jax.random.split(jax.random.key(0), b)),
            active=jnp.zeros((b,), bool), max_len=jnp.zeros((b,), jnp.int32),
            stop_ids=jnp.full((b, MAX_STOP_IDS), -1, jnp.int32))

    def init_decode_state(self) -> DecodeState:
        """A fresh decode state: empty cache ``[L, slots, S, K, D]``, all slots inactive."""
        return self._init_state()

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot) -> DecodeState:
        c, pc = state.cache, prefix.cache
        p = pc.k.shape[2]
        keep = pc.mask[0][None, None, :, None, None]
        # Zero the unused bucket entries, then write the slot's first P cache entries.
        k = jax.lax.dynamic_update_slice(c.k, jnp.where(keep, pc.k, 0).astype(c.k.dtype),
                                         (0, slot, 0, 0, 0))
        v = jax.lax.dynamic_update_slice(c.v, jnp.where(keep, pc.v, 0).astype(c.v.dtype),
                                         (0, slot, 0, 0, 0))
        row = jnp.zeros((1, self.cache_len), bool).at[:, :p].set(pc.mask)
        mask = jax.lax.dynamic_update_slice(c.mask, row, (slot, 0))
        key = request_key(prefix.seed, prefix.sample_index)
        return DecodeState(
            cache=KVCache(k=k, v=v, mask=mask),
            tokens=state.tokens.at[slot].set(prefix.last_token),
            index=state.index.at[slot].set(prefix.length),
            gen_len=state.gen_len.at[slot].set(0),
            temperature=state.temperature.at[slot].set(prefix.temperature),
            top_k=state.top_k.at[slot].set(prefix.top_k),
            top_p=state.top_p.at[slot].set(prefix.top_p),
            keys=state.keys.at[slot].set(jax.random.key_data(key)),
            active=state.active.at[slot].set(True),
            max_len=state.max_len.at[slot].set(prefix.max_tokens),
            stop_ids=state.stop_ids.at[slot].set(prefix.stop_ids))

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Put ``prefix`` into slot ``slot`` (``decode_state`` is donated: use the result)."""
        if not 0 <= int(slot) < self.num_slots:
            raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
        return self._insert(prefix, decode_state, np.int32(slot))

    def _release_impl(self, state: DecodeState, slot) -> DecodeState:
        return state.replace(active=state.active.at[slot].set(False))

    def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Mark a slot free (its tokens come back ``valid = 0``); donated."""
        return self._release(decode_state, np.int32(slot))

    # ------------------------------------------------------------------ generate
    def _step(self, model, version, state: DecodeState):
        """One decode step: ``(new state, packed int32 [B, 6])`` (:data:`PACKED_FIELDS`)."""
        b = self.num_slots
        logits, cache = model.forward_cached(
            state.tokens[:, None], state.index[:, None], jnp.ones((b, 1), bool), state.cache,
            state.index)
        keys = token_keys(jax.random.wrap_key_data(state.keys), state.gen_len)
        tokens, logprobs = sample_tokens(logits[:, 0], keys, state.temperature, state.top_k,
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
        return new_state, packed

    def _generate_impl(self, params: EngineParams, state: DecodeState):
        model = nnx.merge(self.graphdef, params.state)
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
        model = nnx.merge(self.graphdef, params.state)
        return jax.lax.scan(lambda st, _: self._step(model, params.version, st), state,
                            None, length=self.decode_steps_per_call)

    def generate_packed(self, params: EngineParams, decode_state: DecodeState
                        ) -> tuple[DecodeState, jax.Array]:
        """``sampler.decode_steps_per_call`` (k) decode steps in one call.

        Returns:
          ``(new decode state, int32 [k, slots, 6])``, columns :data:`PACKED_FIELDS`; a
          slot's entries after its ``done`` step have ``valid = 0``. ``decode_state`` is
          donated: use the result.
        """
        return self._generate_packed(params, decode_state)

    # ------------------------------------------------------------------ JetStream plumbing
    def get_prefix_destination_sharding(self) -> Any:
        """Shardings of a :class:`Prefix` (KV heads over ``tensor``, the rest replicated)."""
        rep = self._mesh_lib.replicated(self._mesh)
        kv = self._mesh_lib.logical_sharding(
            self._mesh, self._mesh_lib.CACHE_AXES,
            (self.cfg.num_layers, 1, self.buckets[-1], self.cfg.num_kv_heads, self.cfg.head_dim))
        return Prefix(cache=KVCache(k=kv, v=kv, mask=rep), last_token=rep, length=rep,
                      temperature=rep, top_k=rep, top_p=rep, seed=rep, sample_index=rep,
                      version=rep)

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
