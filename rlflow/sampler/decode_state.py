"""The data the sampler's engine calls exchange: weights with their policy version, prefill
results, the per-slot decode state, one decode step's ``ResultTokens``; plus prompt
bucketing and the errors of bad prompts.

Every array field gives its shape (``B`` = slots, ``L`` layers, ``K`` KV heads, ``S``
cache length, ``P`` a prefill bucket, ``D`` head dim) and dtype; the jitted functions of
:class:`rlflow.sampler.engine.RlflowEngine` take and return these pytrees.
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

import jax
import numpy as np
from flax import struct
from rlflow.sampler.jetstream_api import engine_api

from rlflow.models.kv_cache import KVCache


class PromptError(ValueError):
    """A prompt cannot be prefilled (empty, too long for the buckets, bad token id)."""


MAX_STOP_IDS = 8
"""Most stop token ids per request (the device-side stop check has a fixed width)."""

PACKED_FIELDS = ("token", "valid", "length", "done", "version", "logprob_bits")
"""Columns of :meth:`RlflowEngine.generate_packed`'s ``[k, slots, 6]`` int32 result:
token id; valid (1: the slot was active and emitted it); length (completion tokens so far,
this one included); done (0: running, 1: stop id, 2: reached ``max_tokens``); policy
version; the float32 logprob's bits (``view(np.float32)`` on the host). A mixture-of-experts
engine (:attr:`RlflowEngine.records_routing`) appends ``L * k`` more columns: the expert ids
each layer chose for the step's *input* token (rollout routing replay,
:mod:`rlflow.exchange.routing`), layer-major."""


@struct.dataclass
class EngineParams:
    """Model weights and the policy version they are. ``leaves``: the arrays of the
    model's ``nnx.State`` of ``nnx.Param`` (placed on the engine mesh) as a flat tuple, in
    ``jax.tree`` order (a tuple of arrays is the cheapest argument for a jitted call;
    :meth:`RlflowEngine.param_state` rebuilds the ``nnx.State``); ``version``: int32 ``[]``."""

    leaves: tuple
    version: jax.Array


@struct.dataclass
class Prefix:
    """The prefill results of ``n`` prompts (one bucket ``P``), ready to insert into slots.

    Attributes:
      cache: :class:`KVCache`, per layer ``k [n, K, D, P]``, ``v [n, K, P, D]``, ``mask [n, P]``; row ``r``
        holds the first ``length[r]`` tokens of prompt ``r``.
      last_token: int32 ``[n]``, each prompt's last token (its slot's first decode input).
      length: int32 ``[n]``, tokens in the cache (= prompt length - 1), also the position
        of ``last_token``.
      temperature / top_k / top_p: ``[n]`` each, the requests' settings.
      seed / sample_index: uint32 / int32 ``[n]``: a sample's uniforms are
        ``request_uniforms(seed, sample_index)``; :meth:`RlflowEngine.insert_batch` takes
        the sample index per insert, so one row serves every sample of its request.
      version: int32 ``[]``, policy version of the weights the prefixes were computed with.
      max_tokens: int32 ``[n]``, most completion tokens; stop_ids: int32
        ``[n, MAX_STOP_IDS]``, the requests' stop ids padded with -1.
      routing: (mixture-of-experts engines) the expert ids the prefill chose for each
        cached prompt token and layer, ``[n, P, L, k]`` in
        :func:`rlflow.exchange.routing.routing_dtype` (the first ``length[r]`` positions of
        row ``r`` are its tokens'); None for a dense model.
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
    routing: Optional[jax.Array] = None


@struct.dataclass
class DecodeState:
    """Everything one decode step transforms, one row per slot (``B`` = slots).

    Attributes:
      cache: :class:`KVCache`, per layer ``k [B, K, D, S]``, ``v [B, K, S, D]``, ``mask [B, S]``,
        ``S = max_prefill_length + max_tokens``.
      tokens: int32 ``[B]`` next decode input of each slot.
      index: int32 ``[B]`` its cache position (= its RoPE position).
      gen_len: int32 ``[B]`` completion tokens generated so far.
      temperature / top_k / top_p: ``[B]`` per-slot settings.
      uniforms: float32 ``[B, max_tokens]``: the uniform each completion token is drawn
        with (:func:`rlflow.sampler.sampling.request_uniforms`, set at insert).
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
    uniforms: jax.Array
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
