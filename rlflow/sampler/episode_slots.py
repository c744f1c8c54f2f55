"""Multi-turn episodes in the continuous-batching loop: a slot parks between turns.

A request whose ``episode`` is set (a handle of the sampler's episode driver,
:class:`rlflow.sampler.episodes.EpisodeDriver`) is sampled as ``G`` episodes. When an
episode's turn ends on a stop id (an end-of-turn id), its slot is *parked*: it keeps its
KV cache and is not refilled, and the engine has already marked it inactive, so the other
slots decode on (the parked slot's outputs come back ``valid = 0``). The turn's ids go to
the driver (``episodes.turn_ended``), which runs the environment step in a worker process.
At the start of each :meth:`ContinuousBatcher.step`, the answers that arrived
(``episodes.poll``) are applied: the continuation ids are appended to the slot's KV cache
(:class:`rlflow.sampler.extend.SlotExtender`, one call for all answered slots) and the slot
decodes again; an answer that ends the episode (done, an environment error or timeout, the
turn limit) finishes the completion with the episode's reward.

Host arrays: environment tokens are written into the slot's completion arrays with
behaviour logprob 0 and policy version -1; the completion's ``loss_mask`` is 1 exactly on
the sampled tokens (version >= 0). An answer that would pass the episode's token limit (the
request's ``max_tokens``: the continuation plus at least one sampled token) or the largest
prefill bucket ends the episode as truncated (reward 0, counted in
``BatchCounters.episodes_cut_tokens``). A turn that reaches ``max_tokens`` without a stop id
ends the episode as truncated too (reward 0).

The driver interface (duck-typed): ``turn_ended(handle, sample_index, turn_ids, used)``,
``poll(timeout) -> [(handle, sample_index, EpisodeOutcome)]``, ``ended(handle,
sample_index)`` (the episode's completion is final; free its environment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

#: Seconds ``step`` waits for environment answers when every busy slot is parked.
PARKED_WAIT_S = 0.02


@dataclass(frozen=True)
class EpisodeOutcome:
    """An environment's answer to a turn.

    Attributes:
      continuation: int ids to append (the rendered new messages and the next assistant
        header), or ``None``: the episode ends.
      reward: the episode's outcome reward (read when it ends).
      truncated: the episode was cut by a limit (``env.max_turns``) rather than ended by
        the environment.
      failed: the episode was cut by an environment error or timeout (an infrastructure
        failure, not the policy's): the group record marks it (``failed``) and the learner
        follows ``learner.on_failed_sample``.
    """

    continuation: Optional[np.ndarray] = None
    reward: float = 0.0
    truncated: bool = False
    failed: bool = False


class EpisodeSlots:
    """The batcher's episode methods (mixed into ``ContinuousBatcher``; uses its state:
    ``_slots``, ``_tokens``, ``_logprobs``, ``_versions``, ``_state``, ``_params``,
    ``_device_active``, ``counters`` and ``episodes``)."""

    episodes = None
    _extender = None

    def _init_episodes(self, episodes) -> None:
        self.episodes = episodes
        self._parked: dict = {}           # (id(handle), sample index) -> slot
        self._ready: list = []            # groups finished by an environment's answer

    def _parks(self, s, done_code: int) -> bool:
        """Whether a slot that finished with ``done_code`` (1: stop id, 2: max_tokens) keeps
        its slot for the environment's answer (an episode's turn that ended on a stop id)."""
        if s is None or s.live.request.episode is None or done_code != 1:
            return False
        s.parked = True
        return True

    def _turn_ended(self, s, slot: int, n: int) -> None:
        """Hand a parked slot's turn (its ids since ``turn_start``) to the driver."""
        s.length = n
        s.turns += 1
        key = (id(s.live.request.episode), s.sample_index)
        self._parked[key] = slot
        self.episodes.turn_ended(s.live.request.episode, s.sample_index,
                                 self._tokens[slot, s.turn_start:n].copy(), n)

    def _waiting_only(self) -> bool:
        """Every occupied slot is parked and nothing is queued (the step may wait)."""
        busy = [s for s in self._slots if s is not None]
        return bool(busy) and all(s.parked for s in busy) and not self._queue \
            and self._unfiled is None

    def _resume_episodes(self) -> None:
        """Apply the environments' answers that arrived: append continuations (one
        extend call) or end episodes."""
        if self.episodes is None or not self._parked:
            return
        wait = PARKED_WAIT_S if self._waiting_only() else 0.0
        slots, lasts, conts = [], [], []
        for handle, index, out in self.episodes.poll(wait):
            slot = self._parked.pop((id(handle), index), None)
            if slot is None:
                continue
            s = self._slots[slot]
            s.parked = False
            n = s.length
            cont = None if out.continuation is None else \
                np.asarray(out.continuation, np.int32).reshape(-1)
            if cont is None:
                self._end_episode(s, slot, n, "length" if out.truncated else "stop",
                                  out.reward, failed=out.failed)
                continue
            if self._extender is None:
                from rlflow.sampler.extend import SlotExtender
                self._extender = SlotExtender(self.engine)
            if cont.size == 0 or cont.size > self._extender.max_length() or \
                    n + cont.size + 1 > s.live.sampling.max_tokens:
                self.counters.episodes_cut_tokens += 1
                self._end_episode(s, slot, n, "length", 0.0)
                continue
            if self._pool is not None:          # paged: pages for the continuation
                self._gen[slot] = n + cont.size
                self._reserve(slot, self._base[slot] + n + cont.size)
            self._tokens[slot, n:n + cont.size] = cont
            self._logprobs[slot, n:n + cont.size] = 0.0
            self._versions[slot, n:n + cont.size] = -1
            s.turn_start = n + cont.size
            slots.append(slot)
            lasts.append(int(self._tokens[slot, n - 1]))   # the turn's end-of-turn id
            conts.append(cont)
        if slots:
            self._upload_table()
            self._state = self._extender(self._params, self._state, slots, lasts, conts)
            for slot in slots:
                self._device_active[slot] = True
            self.counters.env_extends += len(slots)

    def _resume_turns(self, resumed: list) -> None:
        """Episodes among the samples just resumed from the journal (``[(slot, live,
        saved)]``, their ids re-prefilled): each gets where its turn in progress began,
        and one whose last turn had ended parks again (inactive on the device, as after
        its end-of-turn id) and hands that turn to the driver: its environment step runs
        again (:mod:`rlflow.sampler.journal_slots`)."""
        for slot, live, saved in resumed:
            s = self._slots[slot]
            state = live.resume_turns.pop(s.sample_index, None)
            if state is None:
                continue
            s.turn_start, parked, s.turns = state
            if parked:
                self._state = self.engine.release(self._state, slot)
                self._device_active[slot] = False
                s.parked = True
                self._turn_ended(s, slot, int(saved[0].size))

    def _end_episode(self, s, slot: int, n: int, reason: str, reward: float,
                     failed: bool = False) -> None:
        """Finish a parked episode with the environment's reward; frees the slot."""
        self._slots[slot] = None
        self._free_pages(slot)
        group = self._finish(s, slot, n, reason, reward=reward, failed=failed)
        if group is not None:
            self._ready.append(group)

    def _take_ready(self) -> list:
        ready, self._ready = self._ready, []
        return ready
