"""Append-prefill into live slots: the environment's tokens of a multi-turn episode.

A slot whose turn ended on an end-of-turn id is inactive at cache position ``index[slot]``:
its last sampled id (the end-of-turn id) is not in the KV cache yet. (While the slot is
inactive the decode steps of the other slots still overwrite its ``tokens`` entry and the
cache entry at ``index``, so the host passes the end-of-turn id back.) The environment's
answer is rendered to continuation ids ``c_0 .. c_{n-1}`` (``rlflow.envs.chat``).
:class:`SlotExtender` runs ``[eot, c_0 .. c_{n-2}]`` at positions ``index .. index + n - 1``
against the slot's own cache (a prefill of the new tokens only, JetStream's
``prefill(existing_prefix=...)`` semantics), so ``c_{n-1}`` becomes the slot's next decode
input at ``index + n``, exactly as a prompt's last token does after a prefill; the slot is
then active again and decoding goes on from there. Past turns are never recomputed; the
entries written keep the weights current at the extend (as a prefill's do).

``gen_len`` (tokens after the prompt) grows by ``n``, so the completion positions of the
host's arrays stay aligned with the episode (environment tokens included), the slot's
uniforms keep being indexed by position, and ``max_len`` (the request's ``max_tokens``, the
episode token limit) bounds the whole episode.

Shapes: ``m`` slots per call are padded to a power of two (padding slots point past the
last slot and are dropped) and the continuations to a prefill bucket ``W``; so a call
compiles at most ``(log2(slots) + 1) x len(buckets)`` times.

With a paged cache the slots' pages must hold positions ``index .. index + n - 1`` before
the call (the host takes them); the batcher also uses this call to resume a preempted
sequence (its generated ids appended after a fresh prefill of its prompt).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlflow.sampler.paged import set_slot_rows, slot_rows
from rlflow.sampler.decode_state import DecodeState, EngineParams, pick_bucket


class SlotExtender:
    """Jitted append-prefill for one :class:`rlflow.sampler.engine.RlflowEngine`."""

    def __init__(self, engine):
        self.engine = engine
        self._extend = jax.jit(self._impl, donate_argnums=(1,),
                               out_shardings=engine._state_sharding)

    def max_length(self) -> int:
        """Most continuation ids one call takes (the largest prefill bucket)."""
        return int(self.engine.buckets[-1])

    def _impl(self, params: EngineParams, state: DecodeState, slots, first, tokens, lengths
              ) -> DecodeState:
        eng = self.engine
        model = eng._model(params)
        safe = jnp.minimum(slots, eng.num_slots - 1)                         # [m]
        sub = slot_rows(state.cache, slots)
        index = state.index[safe]
        w = tokens.shape[1]
        run = jnp.concatenate([first[:, None], tokens[:, :-1]], axis=1)          # [m, W]
        cols = jnp.arange(w, dtype=jnp.int32)[None, :]
        sub = model.forward_cached(run, index[:, None] + cols, cols < lengths[:, None],
                                   sub, index, mesh=eng.mesh).cache
        last = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]

        def put(dst, src):
            return dst.at[slots].set(src.astype(dst.dtype), mode="drop")
        return state.replace(cache=set_slot_rows(state.cache, sub, slots),
                             tokens=put(state.tokens, last), index=put(state.index, index + lengths),
                             gen_len=put(state.gen_len, state.gen_len[safe] + lengths),
                             active=put(state.active, jnp.ones(slots.shape, bool)))

    def __call__(self, params: EngineParams, state: DecodeState, slots: Sequence[int],
                 last_ids: Sequence[int], continuations: Sequence[Sequence[int]]
                 ) -> DecodeState:
        """Append ``continuations[j]`` to slot ``slots[j]`` and make it active again
        (``state`` is donated: use the result).

        Args:
          params: :class:`EngineParams` (the weights current now).
          state: the decode state; each slot given must be inactive after a stop id.
          slots: distinct slot indices; last_ids: each slot's last sampled id (its
            end-of-turn id); continuations: their ids (each 1 .. :meth:`max_length` ids
            inside the vocabulary).

        Raises:
          ValueError: repeated or out-of-range slots, an empty or too long continuation,
            an id outside the vocabulary, or lists of different lengths.
        """
        eng = self.engine
        m = len(slots)
        if not m or len(continuations) != m or len(last_ids) != m:
            raise ValueError(f"extend: {m} slots, {len(continuations)} continuations "
                             f"(need as many, >= 1)")
        if len(set(slots)) != m or any(not 0 <= int(s) < eng.num_slots for s in slots):
            raise ValueError(f"extend: slots {list(slots)} must be distinct and in "
                             f"[0, {eng.num_slots})")
        rows = [np.asarray(c, np.int64).reshape(-1) for c in continuations]
        for s, r in zip(slots, rows):
            if not 1 <= r.size <= self.max_length():
                raise ValueError(f"extend: slot {s}: {r.size} continuation ids; need 1 .. "
                                 f"{self.max_length()} (the largest prefill bucket)")
            if ((r < 0) | (r >= eng.cfg.vocab_size)).any():
                raise ValueError(f"extend: slot {s}: an id outside the vocabulary "
                                 f"[0, {eng.cfg.vocab_size})")
        width = pick_bucket(eng.buckets, max(r.size for r in rows))
        size = 1 << (m - 1).bit_length()
        tokens = np.zeros((size, width), np.int32)
        lengths = np.ones((size,), np.int32)
        first = np.zeros((size,), np.int32)
        slot_arr = np.full((size,), eng.num_slots, np.int32)
        for j, (s, r) in enumerate(zip(slots, rows)):
            tokens[j, :r.size], lengths[j], slot_arr[j] = r, r.size, int(s)
            first[j] = int(last_ids[j])
        return self._extend(params, state, slot_arr, first, tokens, lengths)
