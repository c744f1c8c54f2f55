"""rlflow's continuous-batching loop over the JetStream ``Engine`` API.

The pattern of MaxText's offline engine (not JetStream's orchestrator/Driver): a queue of
samples to run; before every decode call each free slot is refilled from the queue, and
slots whose completion ended (a stop id, or ``max_tokens``) are freed as soon as the call
that ended them returns. A prompt's ``G`` samples share one prefill (while no weight
swap happens) and come back together as one group.

Refill: the prompts admitted in one refill that need a prefix are prefilled together
(:meth:`RlflowEngine.prefill_batch`, per bucket, calls of up to
``sampler.max_prefill_batch`` prompts), and the admitted samples are inserted with one
:meth:`RlflowEngine.insert_batch` per prefix batch. Both compile at most
``log2(max_prefill_batch) + 1`` times per bucket.

Decode calls: each :meth:`ContinuousBatcher.step` runs ``sampler.decode_steps_per_call``
(k) decode steps in one jitted call (:meth:`RlflowEngine.generate_packed`) and copies one
``[k, slots, 6]`` array to the host. Stop ids and ``max_tokens`` are checked on device, so
a slot that finishes mid-call emits nothing more; it is refilled at the next call, and its
remaining steps of the call count as idle (not used) in the counters. While a call runs
on the device, the host files the previous call's tokens into their completions (so
:meth:`ContinuousBatcher.step` returns the groups the previous call completed).

Weight swap: :meth:`ContinuousBatcher.update_params` may be called from any thread; the
new weights take effect before the next decode call (with k > 1: between calls). Sequences in flight continue under
them (their earlier KV entries stay), every token is tagged with the version that
produced it, and a prefix computed under an older version is never inserted again
(it is recomputed).

Multi-turn episodes (a request with ``episode`` set): a slot parks between turns, keeps its
KV cache, and the environment's tokens are appended by a prefill of those tokens only
(:mod:`rlflow.sampler.episode_slots`).

Counters (:class:`BatchCounters`) make the scheduling checkable without timing:
``idle_slot_steps_while_queued`` counts free slots during a decode step while samples
were waiting; it must stay 0.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from rlflow.exchange.routing import NO_CHOICE
from rlflow.sampler.decode_state import PACKED_FIELDS, EngineParams
from rlflow.sampler.engine import MAX_STOP_IDS, PromptError
from rlflow.sampler.episode_slots import EpisodeSlots
from rlflow.sampler.journal_slots import JournalSlots
from rlflow.sampler.paged_batching import PagedSlots
from rlflow.sampler.requests import CompletedGroup, Completion, Request  # noqa: F401 (re-exported)
from rlflow.sampler.sampling import SamplingError, SamplingParams


@dataclass
class BatchCounters:
    """Scheduling counters (plain ints, no timing).

    decode_steps: decode steps run (k per call); decode_calls: jitted decode calls;
    slot_steps_available: decode_steps x slots; slot_steps_used: slot steps whose token
    was kept; idle_slot_steps_while_queued: free slots during a step while samples waited
    (0 with k = 1; with k > 1 the steps after a slot finished mid-call); prefills / prefix_reuses:
    prompts prefilled and inserts that reused a group's prefix; stale_prefixes_dropped:
    prefixes recomputed because a weight swap came between two samples' admissions; prompts_truncated: prompts
    cut to ``max_prefill_length`` (``on_long_prompt="truncate"``); weight_swaps;
    completions_stopped / completions_truncated; prefill_calls / insert_calls:
    ``prefill_batch`` / ``insert_batch`` calls (several prompts / samples each); env_extends:
    episode slots that got environment tokens appended; episodes_cut_tokens: episodes ended
    (truncated) because the environment's answer would pass the token limit; preemptions:
    sequences preempted for pages (paged KV cache), page_waits: admissions that waited
    for free pages.
    """

    decode_steps: int = 0
    decode_calls: int = 0
    slot_steps_available: int = 0
    slot_steps_used: int = 0
    idle_slot_steps_while_queued: int = 0
    prefills: int = 0
    prefix_reuses: int = 0
    stale_prefixes_dropped: int = 0
    prompts_truncated: int = 0
    weight_swaps: int = 0
    completions_stopped: int = 0
    completions_truncated: int = 0
    prefill_calls: int = 0
    insert_calls: int = 0
    env_extends: int = 0
    episodes_cut_tokens: int = 0
    preemptions: int = 0
    page_waits: int = 0

    @property
    def occupancy(self) -> float:
        """Fraction of slot steps that produced a kept token."""
        return self.slot_steps_used / max(self.slot_steps_available, 1)


@dataclass
class _Live:
    """Host-side state of one submitted request."""
    request: Request
    tokens: np.ndarray
    sampling: SamplingParams
    stop_ids: frozenset
    completions: dict = field(default_factory=dict)
    prefix: object = None
    prefix_weights: int = -1
    pending: int = 0              # samples of it in the queue
    pages: object = None          # paged cache: the group's shared prompt pages
    pages_weights: int = -1
    prompt_routing: object = None  # MoE: (Prefix.routing, row) of its first prefill
    # episodes resumed from the journal: sample index -> (turn_start, parked, turns)
    resume_turns: dict = field(default_factory=dict)


@dataclass
class _Slot:
    live: _Live
    sample_index: int
    parked: bool = False          # episode between turns (waiting for its environment)
    turn_start: int = 0           # episode: first completion position of the current turn
    turns: int = 0                # episode: turns ended so far
    length: int = 0               # episode: completion tokens when it parked


class ContinuousBatcher(EpisodeSlots, PagedSlots, JournalSlots):
    """Drives an :class:`rlflow.sampler.engine.RlflowEngine` with continuous batching.

    Args:
      engine: the engine (its ``sampler_cfg`` gives slots, buckets, ``max_tokens``,
        ``on_long_prompt`` and default sampling settings).
      params: initial weights (``nnx.State``; ``None``: the engine model's own; or
        :class:`rlflow.sampler.decode_state.EngineParams` already placed by
        ``engine.load_params``).
      version: their policy version.
      on_long_prompt: "error" or "truncate" (keep the last ``max_prefill_length``
        tokens, counted); ``None``: ``sampler_cfg.on_long_prompt``.
      episodes: the episode driver for requests with ``episode`` set
        (:mod:`rlflow.sampler.episode_slots`); ``None``: single-turn only.

    Raises:
      ValueError: ``on_long_prompt`` is not one of the two.
    """

    def __init__(self, engine, params=None, version: int = 0,
                 on_long_prompt: Optional[str] = None, episodes=None):
        self.engine = engine
        self.cfg = engine.sampler_cfg
        self.on_long_prompt = on_long_prompt or self.cfg.on_long_prompt
        if self.on_long_prompt not in ("error", "truncate"):
            raise ValueError(f"on_long_prompt must be 'error' or 'truncate', "
                             f"got {self.on_long_prompt!r}")
        self.counters = BatchCounters()
        self._params = _placed(engine, params, version)
        self.version = int(version)
        self._weights_id = 0          # +1 per swap: a prefix is reused only under its weights
        self._pending_params = None
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._slots: list[Optional[_Slot]] = [None] * engine.max_concurrent_decodes
        self._device_active = [False] * engine.max_concurrent_decodes
        self._state = None
        self._unfiled = None          # (packed, finished) of the last call, not yet filed
        # Host copies of each slot's completion so far, written in place per call.
        shape = (engine.max_concurrent_decodes, engine.max_tokens)
        self._tokens = np.zeros(shape, np.int32)
        self._logprobs = np.zeros(shape, np.float32)
        self._versions = np.zeros(shape, np.int32)
        # MoE engines (rollout routing replay): the expert ids of each decode step's input
        # token, at the position of the token the step produced (-1: none recorded)
        self._routing = None
        if engine.records_routing:
            self._routing = np.full(shape + (engine.cfg.num_layers,
                                             engine.cfg.num_experts_per_tok), NO_CHOICE,
                                    engine.routing_dtype)
        self._init_episodes(episodes)
        self._init_pages()

    # ------------------------------------------------------------------ input
    def submit(self, request: Request, resumed: Sequence[Completion] = ()) -> None:
        """Queue a request's G samples; ``resumed``: samples of it begun or finished before
        (from the journal of partial generations, :mod:`rlflow.sampler.journal_slots`).

        Raises:
          PromptError: empty prompt, non-integer ids, an id outside the vocabulary, or a
            prompt longer than ``max_prefill_length`` when ``on_long_prompt="error"``
            (names the prompt_id).
          SamplingError: ``num_samples`` < 1, ``max_tokens`` above the engine's, or a stop
            id outside the vocabulary.
        """
        pid = request.prompt_id
        tokens = np.asarray(request.prompt_tokens).reshape(-1)
        if tokens.size and tokens.dtype.kind not in "iu":
            raise PromptError(f"prompt_id {pid}: prompt token ids must be integers, got "
                              f"dtype {tokens.dtype} (first value {tokens[0]!r})")
        tokens = tokens.astype(np.int64)
        truncated = False
        try:
            if tokens.size > self.cfg.max_prefill_length:
                if self.on_long_prompt == "error":
                    raise PromptError(
                        f"prompt of {tokens.size} tokens is longer than the largest prefill "
                        f"bucket sampler.max_prefill_length={self.cfg.max_prefill_length} "
                        f"(set sampler.on_long_prompt='truncate' to keep the last tokens)")
                tokens, truncated = tokens[-self.cfg.max_prefill_length:], True
            self.engine.pad_prompt(tokens)        # checks empty / vocabulary range
        except PromptError as e:
            raise PromptError(f"prompt_id {pid}: {e}") from None
        sp = request.sampling or SamplingParams.from_config(
            self.cfg, seed=(self.cfg.seed + int(pid)) % 2**32)
        if request.num_samples < 1:
            raise SamplingError(f"prompt_id {pid}: num_samples must be >= 1, "
                                f"got {request.num_samples}")
        if sp.max_tokens > self.engine.max_tokens:
            raise SamplingError(f"prompt_id {pid}: sampling.max_tokens={sp.max_tokens} exceeds "
                                f"sampler.max_tokens={self.engine.max_tokens} (the KV cache size)")
        stop = sp.stop_token_ids if sp.stop_token_ids is not None else self.engine.eos_token_ids
        vocab = self.engine.cfg.vocab_size
        unknown = [i for i in stop if not 0 <= i < vocab]
        if unknown:
            raise SamplingError(f"prompt_id {pid}: unknown stop id(s) {unknown}: not in the "
                                f"vocabulary [0, {vocab})")
        if len(stop) > MAX_STOP_IDS:
            raise SamplingError(f"prompt_id {pid}: {len(stop)} stop ids {tuple(stop)}; at most "
                                f"{MAX_STOP_IDS} are supported")
        if request.episode is not None and self.episodes is None:
            raise SamplingError(f"prompt_id {pid}: an episode request needs a batcher "
                                f"with an episode driver (episodes=)")
        if resumed and self._pool is None:
            raise SamplingError(f"prompt_id {pid}: resuming samples needs "
                                f"sampler.kv_cache='paged'")
        self.counters.prompts_truncated += int(truncated)
        live = _Live(request=request, tokens=tokens.astype(np.int32), sampling=sp,
                     stop_ids=frozenset(stop), pending=request.num_samples)
        self._queue_samples(live, resumed)

    def update_params(self, params, version: int) -> None:
        """New weights (``nnx.State``), used from the next decode step on (thread-safe).

        The arrays are re-laid onto the engine's mesh here (``engine.load_params``), unless
        ``params`` are ``EngineParams`` (placed already).
        """
        engine_params = _placed(self.engine, params, version)
        with self._lock:
            self._pending_params = (engine_params, int(version))

    # ------------------------------------------------------------------ state
    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_active(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def has_work(self) -> bool:
        """Samples queued or decoding, or results not yet returned by :meth:`step`."""
        return bool(self._queue) or self.num_active > 0 or self._unfiled is not None \
            or bool(self._ready)

    def reset_cache(self) -> None:
        """Free the decode state (KV cache); the next step allocates a fresh one.

        Raises:
          RuntimeError: sequences are in flight.
        """
        if self.num_active:
            raise RuntimeError(f"reset_cache: {self.num_active} sequences are in flight")
        self._state = None
        self._device_active = [False] * len(self._slots)
        self._reset_pages()

    def _apply_pending_params(self) -> None:
        with self._lock:
            pending, self._pending_params = self._pending_params, None
        if pending is not None:
            self._params, self.version = pending
            self._weights_id += 1
            self.counters.weight_swaps += 1

    def _prefill(self, lives: list) -> None:
        """Prefill the prompts of ``lives`` (no valid prefix): per bucket, calls of up to
        ``sampler.max_prefill_batch`` prompts; each live's ``prefix`` becomes
        ``(Prefix, row)``."""
        by_bucket: dict = {}
        for live in lives:
            padded, n = self.engine.pad_prompt(live.tokens)
            by_bucket.setdefault(padded.shape[0], []).append((live, padded, n))
        c = self.cfg.max_prefill_batch
        for group in (g[i:i + c] for g in by_bucket.values() for i in range(0, len(g), c)):
            prefix = self.engine.prefill_batch(self._params, [g[1] for g in group],
                                               [g[2] for g in group],
                                               [g[0].sampling for g in group])
            for row, (live, _, _) in enumerate(group):
                live.prefix, live.prefix_weights = (prefix, row), self._weights_id
                if prefix.routing is not None and live.prompt_routing is None:
                    live.prompt_routing = (prefix.routing, row)
            self.counters.prefills += len(group)
            self.counters.prefill_calls += 1

    def _refill(self) -> None:
        """Admit queued samples into every free slot: prefill the prompts that have no
        prefix under the current weights (per bucket, calls of up to
        ``sampler.max_prefill_batch`` prompts), then insert the admitted samples, one
        ``insert_batch`` per prefix batch. Free slots with nothing queued are released on
        the device."""
        admitted = []                         # (slot, live, sample index, resumed or None)
        waits = False                         # (paged) the queue's head waits for pages
        for slot, s in enumerate(self._slots):
            if s is not None:
                continue
            if self._queue and not waits:
                live, i, *saved = self._queue[0]
                saved = saved[0] if saved else None
                waits = not self._admit_pages(slot, live, 0 if saved is None else
                                              saved[0].size)
                if not waits:
                    self._queue.popleft()
                    live.pending -= 1
                    admitted.append((slot, live, i, saved))
                    continue
            if self._device_active[slot]:
                self._state = self.engine.release(self._state, slot)
                self._device_active[slot] = False
        if not admitted:
            return
        need = {}                                         # id -> live, in admission order
        for _, live, _, _ in admitted:
            if live.prefix is not None and live.prefix_weights != self._weights_id:
                live.prefix = None                        # computed under older weights
                self.counters.stale_prefixes_dropped += 1
            if live.prefix is None:
                need[id(live)] = live
        self._prefill(list(need.values()))
        self.counters.prefix_reuses += len(admitted) - len(need)
        inserts: dict = {}                                # id(Prefix) -> (Prefix, [..])
        resumed = []
        for slot, live, i, saved in admitted:
            prefix, row = live.prefix
            inserts.setdefault(id(prefix), (prefix, []))[1].append((row, slot, i))
            self._device_active[slot] = True
            self._slots[slot] = _Slot(live=live, sample_index=i)
            if saved is not None:
                resumed.append((slot, live, saved))
        for live in {id(a[1]): a[1] for a in admitted}.values():
            if live.pending == 0:
                self._admitted_last(live)                 # none queued: drop its prefix
        self._upload_table()
        for prefix, items in inserts.values():
            rows, slots, index = zip(*items)
            self._state = self.engine.insert_batch(prefix, self._state, rows, slots, index)
            self.counters.insert_calls += 1
        self._resume(resumed)
        self._resume_turns(resumed)

    # ------------------------------------------------------------------ loop
    def step(self) -> list[CompletedGroup]:
        """Apply pending weights, refill free slots, run one decode call (k steps).

        Host bookkeeping is overlapped with the device: the call dispatches its decode
        step, then files the previous call's tokens into their completions while the
        step runs, then waits for the step and frees the slots it finished (refilled at
        the start of the next call, before its decode step). So the groups returned are
        those completed by the previous call; a final call with nothing left to decode
        returns the last ones (``has_work`` stays True until then).

        Returns:
          The groups completed by the previous call (possibly empty).

        Raises:
          RuntimeError: the engine reports a busy slot as inactive.
        """
        self._apply_pending_params()
        if self._state is None:
            self._state = self.engine.init_decode_state()
        self._resume_episodes()
        self._refill()
        self._reserve_decode_pages()
        busy = [s is not None and not s.parked for s in self._slots]
        in_flight = None
        if any(busy):
            queued = bool(self._queue)
            self._state, in_flight = self.engine.generate_packed(self._params, self._state)
            in_flight.copy_to_host_async()            # lands while the host files below
        previous, self._unfiled = self._unfiled, None
        done = self._file(*previous) if previous is not None else []
        if in_flight is not None:
            packed = np.asarray(in_flight)                # the one device->host copy
            self._unfiled = (packed, self._collect(packed, busy, queued))
        return self._take_ready() + done

    def _collect(self, packed: np.ndarray, busy: list, queued: bool) -> list:
        """Check a decode call's ``[k, B, 6]`` result, count it, free the slots it
        finished; returns ``[(step, slot, _Slot)]`` of those finished."""
        k, b = packed.shape[:2]
        valid = packed[:, :, 1] != 0                      # [k, B]
        if not valid[0][busy].all():
            bad = [i for i in range(b) if busy[i] and not valid[0, i]]
            raise RuntimeError(f"engine returned an invalid token for busy slot(s) {bad}")
        used = int(valid.sum())
        c = self.counters
        c.decode_calls += 1
        c.decode_steps += k
        c.slot_steps_available += k * b
        c.slot_steps_used += used
        if queued:
            c.idle_slot_steps_while_queued += k * b - used
        self._note_lengths(packed)
        finished = []
        for j, slot in zip(*np.nonzero(packed[:, :, 3])):
            finished.append((j, slot, self._slots[slot]))
            if not self._parks(self._slots[slot], packed[j, slot, 3]):
                self._slots[slot] = None                  # (an episode's turn keeps it)
                self._free_pages(slot)
            self._device_active[slot] = False             # the engine deactivated it
        return finished

    def _file(self, packed: np.ndarray, finished: list) -> list[CompletedGroup]:
        """Write a decode call's tokens into the host arrays and finish completions."""
        step_i, slot_i = np.nonzero(packed[:, :, 1])
        pos = packed[step_i, slot_i, 2] - 1
        self._tokens[slot_i, pos] = packed[step_i, slot_i, 0]
        self._logprobs[slot_i, pos] = packed[step_i, slot_i, 5].view(np.float32)
        self._versions[slot_i, pos] = packed[step_i, slot_i, 4]
        if self._routing is not None:                     # the step's input token's experts
            self._routing[slot_i, pos] = packed[step_i, slot_i, len(PACKED_FIELDS):].reshape(
                (-1,) + self._routing.shape[2:])
        done = []
        for j, slot, s in finished:
            reason = "stop" if packed[j, slot, 3] == 1 else "length"
            group = self._finish(s, slot, int(packed[j, slot, 2]), reason)
            if group is not None:
                done.append(group)
        return done

    def _finish(self, s: _Slot, slot: int, n: int, reason: str,
                reward: Optional[float] = None, failed: bool = False
                ) -> Optional[CompletedGroup]:
        if s.parked:                                      # an episode's turn, not its end
            self._turn_ended(s, slot, n)
            return None
        live = s.live
        if reason == "stop":
            self.counters.completions_stopped += 1
        else:
            self.counters.completions_truncated += 1
        versions = self._versions[slot, :n].copy()
        episode = live.request.episode
        if episode is not None:
            self.episodes.ended(episode, s.sample_index)
        live.completions[s.sample_index] = Completion(
            prompt_id=live.request.prompt_id, sample_index=s.sample_index,
            tokens=self._tokens[slot, :n].copy(), logprobs=self._logprobs[slot, :n].copy(),
            versions=versions, finish_reason=reason,
            reward=None if episode is None else float(reward or 0.0),
            loss_mask=None if episode is None else versions >= 0, failed=failed,
            routing=None if self._routing is None else self._routing[slot, :n].copy())
        if self._routing is not None:
            self._routing[slot] = NO_CHOICE               # the next occupant starts blank
        if len(live.completions) < live.request.num_samples:
            return None
        prompt_routing = None
        if live.prompt_routing is not None:               # the prefill's, then step 0's
            ids, row = live.prompt_routing
            cached = np.asarray(ids[row, :len(live.tokens) - 1])
            prompt_routing = np.concatenate([cached, live.completions[0].routing[:1]])
        return CompletedGroup(request=live.request, prompt_tokens=live.tokens,
                              max_tokens=live.sampling.max_tokens,
                              completions=[live.completions[i] for i in
                                           range(live.request.num_samples)],
                              prompt_routing=prompt_routing)

    def run(self, requests: Sequence[Request] = ()) -> list[CompletedGroup]:
        """Submit ``requests`` and step until every queued sample has finished.

        Returns:
          The completed groups in completion order.
        """
        for r in requests:
            self.submit(r)
        out = []
        while self.has_work:
            out.extend(self.step())
        return out


def _placed(engine, params, version: int) -> EngineParams:
    """``params`` on the engine's mesh, tagged with ``version`` (``engine.load_params``);
    :class:`EngineParams` (placed by ``load_params`` already) as they are."""
    if isinstance(params, EngineParams):
        return params
    return engine.load_params(params, version)
