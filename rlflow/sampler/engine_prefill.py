"""Prefill of :class:`rlflow.sampler.engine.RlflowEngine`: one bucket of prompts run into a
fresh KV cache, the :class:`~rlflow.sampler.decode_state.Prefix` that ``insert`` copies into
the decode state (the engine's module docstring tells the whole API), and the host-side checks
of each prompt and its sampling settings.

:class:`EnginePrefill` is a mixin of the engine: its methods use the engine's ``cfg``,
``sampler_cfg``, ``buckets``, ``eos_token_ids``, ``records_routing``, ``routing_dtype``,
``_mesh``, ``_model`` and its jitted ``_prefill`` (``jax.jit(self._prefill_impl)``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlflow.models.kv_cache import init_cache
from rlflow.sampler.decode_state import (MAX_STOP_IDS, EngineParams, Prefix, PromptError,
                                         pick_bucket)
from rlflow.sampler.sampling import SamplingError, SamplingParams


class EnginePrefill:
    """The prefill half of :class:`rlflow.sampler.engine.RlflowEngine` (a mixin, see the
    module docstring)."""

    def _prefill_impl(self, params: EngineParams, padded_tokens, true_length, temperature,
                      top_k, top_p, seed, sample_index, max_tokens, stop_ids) -> Prefix:
        model = self._model(params)
        n, p = padded_tokens.shape
        lengths = true_length - 1                                         # [n]
        idx = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
        mask = idx < lengths[:, None]
        cache = init_cache(self.cfg, n, p)
        out = model.forward_cached(padded_tokens, idx, mask, cache,
                                   jnp.zeros((n,), jnp.int32),
                                   mesh=self._mesh, return_routing=self.records_routing)
        cache = out.cache
        routing = out.expert_ids.astype(self.routing_dtype) if self.records_routing else None
        last = jnp.take_along_axis(padded_tokens, lengths[:, None], axis=1)[:, 0]
        return Prefix(cache=cache, last_token=last, length=lengths,
                      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      sample_index=sample_index, version=params.version,
                      max_tokens=max_tokens, stop_ids=stop_ids, routing=routing)

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
          sample_index: which of the request's samples (selects its random stream).

        Returns:
          :class:`Prefix` with ``n = 1``.

        Raises:
          PromptError: empty prompt, ``true_length`` > ``P``, or ``P`` not a bucket.
          SamplingError: more than :data:`MAX_STOP_IDS` stop ids, or ``max_tokens``
            above ``sampler.max_tokens``.
          NotImplementedError: ``existing_prefix`` given.
        """
        if existing_prefix is not None:
            raise NotImplementedError("rlflow's engine has no prefix cache (existing_prefix)")
        return self.prefill_batch(params, [padded_tokens], [true_length], [sampling],
                                  sample_indices=[sample_index])

    def prefill_batch(self, params: EngineParams, padded_tokens: Sequence, true_lengths:
                      Sequence[int], samplings: Sequence[Optional[SamplingParams]],
                      sample_indices: Optional[Sequence[int]] = None) -> Prefix:
        """Prefill ``n`` prompts of one bucket in one call.

        Args:
          params: :class:`EngineParams`.
          padded_tokens: ``n`` int32 ``[P]`` prompts, each right-padded to the same
            bucket ``P``; true_lengths: their lengths before padding.
          samplings: each prompt's settings (``None``: the sampler config's).
          sample_indices: each row's sample index (default 0; ``insert_batch`` overrides).

        Returns:
          :class:`Prefix` whose first ``n`` rows are the prompts (the batch is padded to
          a power of two with copies of row 0).

        Raises:
          PromptError / SamplingError: as :meth:`prefill`, naming the row.
          ValueError: the lists differ in length, are empty, mix buckets, or hold more
            than ``sampler.max_prefill_batch`` prompts.
        """
        n = len(padded_tokens)
        if not n or len(true_lengths) != n or len(samplings) != n:
            raise ValueError(f"prefill_batch: {n} prompts, {len(true_lengths)} lengths, "
                             f"{len(samplings)} samplings (need as many, at least one)")
        rows = [self._prefill_row(t, ln, sp) for t, ln, sp in
                zip(padded_tokens, true_lengths, samplings)]
        widths = {r[0].shape[0] for r in rows}
        if len(widths) != 1:
            raise ValueError(f"prefill_batch: prompts padded to different buckets {widths}")
        if n > self.sampler_cfg.max_prefill_batch:
            raise ValueError(f"prefill_batch: {n} prompts; at most sampler.max_prefill_batch="
                             f"{self.sampler_cfg.max_prefill_batch} per call")
        size = 1 << (n - 1).bit_length()
        rows += [rows[0]] * (size - n)
        cols = [np.stack(c) for c in zip(*rows)]
        index = np.zeros((size,), np.int32)
        index[:n] = sample_indices if sample_indices is not None else 0
        tokens, length, temp, top_k, top_p, seed, max_tokens, stop_ids = cols
        return self._prefill(params, tokens, length, temp, top_k, top_p, seed, index,
                             max_tokens, stop_ids)

    def _prefill_row(self, padded_tokens, true_length: int,
                     sampling: Optional[SamplingParams]) -> tuple:
        """Check one prompt; its numpy columns for :meth:`_prefill_impl`."""
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
        return (np.asarray(padded_tokens, np.int32), np.int32(true_length),
                np.float32(sp.temperature), np.int32(sp.top_k), np.float32(sp.top_p),
                np.uint32(sp.seed), np.int32(sp.max_tokens), stop_ids)

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
