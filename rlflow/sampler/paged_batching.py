"""Pages in the continuous-batching loop (``sampler.kv_cache = "paged"``): admission bounded
by free pages, pages taken as sequences grow, preemption and resume.

Mixed into :class:`rlflow.sampler.batching.ContinuousBatcher` (uses its ``engine``,
``_slots``, ``_queue``, ``_state``, ``_params``, ``_tokens`` / ``_logprobs`` /
``_versions``, ``_unfiled``, ``_ready``, ``_device_active``, ``counters``); with a
contiguous engine every method here does nothing.

* **Admission** (:meth:`PagedSlots._admit_pages`): a queued sample enters a free slot only
  if the pool can hold its cache positions up to the end of the next decode call
  (prompt, resumed tokens, ``k`` steps) and still keep one free page per sequence already
  running (a watermark, as vLLM's, against preempting right after admitting); otherwise
  it waits, and so do the samples queued behind it (first come, first served, as vLLM's
  scheduler).
* **Prefix sharing**: a group's samples admitted under one prefix share the prompt's full
  pages (``n // P`` pages for ``n`` cached prompt positions), each referenced by every
  sample's page table and by the group (while samples of it are queued); the page holding
  the prompt's end is the sample's own (written again by its insert: copy-on-write, done at
  insert), as are the pages its completion fills.
* **Growth** (:meth:`PagedSlots._reserve_decode_pages`, before every decode call): each
  decoding slot gets the pages its next ``k`` steps write, oldest admission first.
* **Preemption**: when the pool runs out, the latest admitted decoding sequence (not a
  multi-turn episode) is preempted: its completion so far (tokens, behaviour logprobs,
  versions) is kept on the host, its pages are freed, and it goes back to the front of the
  queue. It resumes by a prefill of its prompt and an append-prefill of its tokens
  (:class:`rlflow.sampler.extend.SlotExtender`), then decodes on with the same random
  stream (token ``t`` still draws uniform ``t``). Nothing is lost or sampled twice; the
  resumed KV entries are recomputed under the weights current at the resume (as a weight
  swap's are for later tokens).

The preemption scheme (recompute, not swap to host) is vLLM's default (Kwon et al. 2023,
sec. 4.5).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from rlflow.sampler.page_pool import PagePool, pages_for


class PagedSlots:
    """The batcher's page methods (module doc)."""

    _pool: Optional[PagePool] = None

    def _init_pages(self) -> None:
        eng = self.engine
        b = eng.max_concurrent_decodes
        self._pool = (PagePool(eng.sampler_cfg.pool_pages, eng.sampler_cfg.page_size, b,
                               eng.sampler_cfg.pages_per_slot) if eng.paged else None)
        self._uploaded = -1                   # pool version in the device's page table
        self._base = [0] * b                  # cached prompt positions of each slot
        self._gen = [0] * b                   # completion positions (tokens) of each slot
        self._admitted = [0] * b              # admission order, for the preemption victim
        self._admissions = 0

    def _reset_pages(self) -> None:
        if self._pool is not None:
            for item in self._queue:
                item[0].pages = None
            self._init_pages()

    # ------------------------------------------------------------------ admission
    def _drop_group_pages(self, live) -> None:
        """Release the group's reference to its shared prompt pages."""
        if self._pool is not None and live.pages is not None:
            self._pool.release(live.pages)
        live.pages = None

    def _admit_pages(self, slot: int, live, resumed: int) -> bool:
        """Take pages for a sample about to enter ``slot`` (``resumed`` tokens of it decoded
        before a preemption); False: too few free, the sample waits."""
        pool = self._pool
        if pool is None:
            return True
        n = int(live.tokens.size) - 1
        left = live.sampling.max_tokens - resumed
        need = pages_for(n + resumed + min(self.engine.decode_steps_per_call, left),
                         pool.page_size)
        if live.pages_weights != self._weights_id:     # prompt pages of older weights
            self._drop_group_pages(live)
        shared = [] if live.pages is None else list(live.pages)
        own = max(need - len(shared), 0)
        running = sum(s is not None for s in self._slots)
        if not running and own > pool.num_free:
            # Nothing runs, so nothing would free pages: other groups' prompt pages go
            # (their next samples get fresh pages; the pool holds one full sequence).
            for item in self._queue:
                if item[0] is not live:
                    self._drop_group_pages(item[0])
        if pool.num_free - own < running or not pool.assign(slot, shared, own):
            self.counters.page_waits += 1
            return False
        if live.pages is None:                # the group's shared prompt pages, held by it
            live.pages = pool.table[slot, :n // pool.page_size].tolist()
            live.pages_weights = self._weights_id
            pool.share(live.pages)
        self._base[slot], self._gen[slot] = n, resumed
        self._admissions += 1
        self._admitted[slot] = self._admissions
        return True

    def _admitted_last(self, live) -> None:
        """``live`` has no sample queued any more: its prefix and prompt pages go."""
        live.prefix = None
        self._drop_group_pages(live)

    # ------------------------------------------------------------------ growth
    def _reserve_decode_pages(self) -> None:
        """Before a decode call: pages for every decoding slot's next ``k`` positions
        (preempting the latest admitted sequences while the pool is short), then the page
        table uploaded if it changed."""
        pool = self._pool
        if pool is None:
            return
        k = self.engine.decode_steps_per_call
        order = sorted((i for i, s in enumerate(self._slots) if s is not None and not s.parked),
                       key=lambda i: self._admitted[i])
        for slot in order:
            s = self._slots[slot]
            if s is None:                      # preempted for an older slot
                continue
            left = s.live.sampling.max_tokens - self._gen[slot]
            self._reserve(slot, self._base[slot] + self._gen[slot] + min(k, max(left, 0)))
        self._upload_table()

    def _reserve(self, slot: int, tokens: int) -> bool:
        """Pages for ``tokens`` positions of ``slot``, preempting later admissions (never
        ``slot`` itself unless it is the latest, never an episode) while the pool is short.
        Returns whether ``slot`` still runs.

        Raises:
          RuntimeError: the pool cannot hold it even with every other sequence preempted.
        """
        while not self._pool.grow(slot, tokens):
            victims = [i for i, s in enumerate(self._slots) if s is not None
                       and s.live.request.episode is None and not s.parked]
            if not victims:
                raise RuntimeError(
                    f"paged KV cache: slot {slot} needs {pages_for(tokens, self._pool.page_size)}"
                    f" pages and only {self._pool.num_free} of {self._pool.num_pages} are free "
                    f"with nothing left to preempt (multi-turn episodes are not preempted): "
                    f"raise sampler.num_pages")
            victim = max(victims, key=lambda i: self._admitted[i])
            self._preempt(victim)
            if victim == slot:
                return False
        return True

    def _preempt(self, slot: int) -> None:
        """Free ``slot``'s pages; its sample goes to the front of the queue with its
        completion so far."""
        self._file_pending()                   # its last tokens must be on the host first
        s = self._slots[slot]
        g = self._gen[slot]
        saved = (self._tokens[slot, :g].copy(), self._logprobs[slot, :g].copy(),
                 self._versions[slot, :g].copy())
        if self._routing is not None:          # MoE: the experts its decode steps chose
            saved += (self._routing[slot, :g].copy(),)
            self._routing[slot] = -1
        s.live.pending += 1
        self._queue.appendleft((s.live, s.sample_index, saved))
        self._slots[slot] = None
        self._pool.free_slot(slot)
        if self._device_active[slot]:
            self._state = self.engine.release(self._state, slot)
            self._device_active[slot] = False
        self.counters.preemptions += 1

    def _file_pending(self) -> None:
        """File the last decode call's tokens now (before host arrays of its slots are
        read for a preemption or rewritten for a resume)."""
        if self._unfiled is not None:
            previous, self._unfiled = self._unfiled, None
            self._ready.extend(self._file(*previous))

    def _free_pages(self, slot: int) -> None:
        if self._pool is not None:
            self._pool.free_slot(slot)

    def _upload_table(self) -> None:
        if self._pool is not None and self._uploaded != self._pool.version:
            self._state = self.engine.set_page_table(self._state, self._pool.table)
            self._uploaded = self._pool.version

    def _note_lengths(self, packed: np.ndarray) -> None:
        """Each slot's completion length after a decode call ``[k, B, 6]``."""
        if self._pool is None:
            return
        valid = packed[:, :, 1] != 0
        for slot in np.nonzero(valid.any(axis=0))[0]:
            self._gen[slot] = int(packed[valid[:, slot], slot, 2].max())

    # ------------------------------------------------------------------ resume
    def _resume(self, resumed: list) -> None:
        """Append each resumed slot's saved completion (``[(slot, live, saved)]``, inserted
        with its prompt already) by append-prefills of up to the largest bucket, and put it
        back in the host arrays."""
        if not resumed:
            return
        if self._extender is None:
            from rlflow.sampler.extend import SlotExtender
            self._extender = SlotExtender(self.engine)
        self._upload_table()
        self._file_pending()                   # the slots' previous occupants' last tokens
        w = self._extender.max_length()
        for slot, live, (tokens, logprobs, versions, *routing) in resumed:
            g = tokens.size
            self._tokens[slot, :g], self._logprobs[slot, :g] = tokens, logprobs
            self._versions[slot, :g] = versions
            if routing:                        # as recorded when they were sampled
                self._routing[slot, :g] = routing[0]
        longest = max(saved[0].size for _, _, saved in resumed)
        for start in range(0, longest, w):
            part = [(slot, live, saved[0]) for slot, live, saved in resumed
                    if saved[0].size > start]
            lasts = [int(live.tokens[-1]) if start == 0 else int(t[start - 1])
                     for _, live, t in part]
            self._state = self._extender(self._params, self._state, [p[0] for p in part],
                                         lasts, [t[start:start + w] for _, _, t in part])
