"""What the batcher hands the journal of partial generations, and takes back on a resume.

Mixed into :class:`rlflow.sampler.batching.ContinuousBatcher` (uses its ``_slots``,
``_queue``, ``_gen``, ``_tokens`` / ``_logprobs`` / ``_versions``, ``_ready`` and
``_file_pending``; a paged cache, ``sampler.kv_cache = "paged"``, keeps ``_gen``, each
slot's completion length):

* :meth:`JournalSlots.partials`: every request in flight that has a sample begun, with its
  samples so far: a finished one as its :class:`Completion`, a decoding or preempted one as a
  ``Completion`` with ``finish_reason == ""`` (its tokens, behaviour logprobs and versions
  up to the last decode call, filed first); and every group finished but not yet returned
  by ``step()``, with its completions.
* :meth:`JournalSlots._queue_samples` (from ``submit(request, resumed=...)``): finished
  samples are taken as they are; partial ones are queued as a preempted sample is, with
  their completion so far, and resume by the paged pool's preemption path (a prefill of the
  prompt, an append-prefill of the tokens, then decoding on with the same random stream:
  token ``t`` still draws uniform ``t``, :mod:`rlflow.sampler.paged_batching`). Their KV
  entries are recomputed under the current weights; their tokens keep the versions they
  were sampled with.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rlflow.sampler.requests import CompletedGroup, Completion, Request


class JournalSlots:
    """The batcher's journal methods (module doc)."""

    def partials(self) -> list[tuple[Request, list[Completion]]]:
        """``[(request, samples so far)]`` of the requests in flight with a sample begun
        (finished: ``finish_reason`` "stop" / "length"; in flight: ""; arrays are copies),
        then of the groups finished and not yet returned by ``step()`` (their completions).

        Raises:
          RuntimeError: the cache is not paged (no completion lengths are kept) or a slot
            holds a multi-turn episode (not journaled).
        """
        if self._pool is None:
            raise RuntimeError("the journal of partial generations needs sampler.kv_cache="
                               "'paged' (its completion lengths and resume path)")
        self._file_pending()                  # the last decode call's tokens, on the host
        lives: dict = {}
        for slot, s in enumerate(self._slots):
            if s is None:
                continue
            if s.live.request.episode is not None:
                raise RuntimeError("multi-turn episodes are not journaled")
            g = self._gen[slot]
            lives.setdefault(id(s.live), (s.live, []))[1].append(Completion(
                s.live.request.prompt_id, s.sample_index, self._tokens[slot, :g].copy(),
                self._logprobs[slot, :g].copy(), self._versions[slot, :g].copy(), ""))
        for live, i, *saved in self._queue:   # (its finished samples count, too)
            samples = lives.setdefault(id(live), (live, []))[1]
            if saved:                         # preempted: its completion so far
                tokens, logprobs, versions = saved[0][:3]
                samples.append(Completion(
                    live.request.prompt_id, i, tokens.copy(), logprobs.copy(),
                    versions.copy(), ""))
        out = []
        for live, samples in lives.values():
            samples += list(live.completions.values())
            if samples:                       # (a request not begun: nothing to keep)
                out.append((live.request, sorted(samples, key=lambda c: c.sample_index)))
        # groups finished by the filing above (or earlier), not yet returned by step()
        return out + [(g.request, list(g.completions)) for g in self._ready]

    def _queue_samples(self, live, resumed: Sequence[Completion]) -> None:
        """Queue ``live``'s samples, those in ``resumed`` from where they were (module doc);
        a group whose samples all finished is ready at once."""
        by_index = {}
        for c in resumed:
            i = int(c.sample_index)
            if not 0 <= i < live.request.num_samples or i in by_index:
                raise ValueError(f"prompt_id {live.request.prompt_id}: resumed sample index "
                                 f"{i} is not one of 0..{live.request.num_samples - 1} once")
            n = len(c.tokens)
            if c.finish_reason in ("stop", "length"):
                by_index[i] = c
            elif c.finish_reason == "" and 0 < n < live.sampling.max_tokens:
                by_index[i] = c
            elif not (c.finish_reason == "" and n == 0):
                raise ValueError(f"prompt_id {live.request.prompt_id} sample {i}: a resumed "
                                 f"sample needs finish_reason 'stop'/'length', or '' with "
                                 f"1..{live.sampling.max_tokens - 1} tokens; got "
                                 f"{c.finish_reason!r} with {n}")
        for i in range(live.request.num_samples):
            c = by_index.get(i)
            if c is None:
                self._queue.append((live, i))
            elif c.finish_reason:
                live.completions[i] = Completion(
                    live.request.prompt_id, i, np.asarray(c.tokens, np.int32),
                    np.asarray(c.logprobs, np.float32), np.asarray(c.versions, np.int32),
                    c.finish_reason)
                live.pending -= 1
            else:
                self._queue.append((live, i, (np.asarray(c.tokens, np.int32),
                                              np.asarray(c.logprobs, np.float32),
                                              np.asarray(c.versions, np.int32))))
        if len(live.completions) == live.request.num_samples:
            self._ready.append(CompletedGroup(
                request=live.request, prompt_tokens=live.tokens,
                max_tokens=live.sampling.max_tokens,
                completions=[live.completions[i] for i in range(live.request.num_samples)]))
