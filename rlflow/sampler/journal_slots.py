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

Multi-turn episodes (a request with ``episode`` set) are journaled alike: a sample's
completion so far is the episode so far (sampled turns, and the environment's ids between
them with logprob 0 and version -1), a parked slot's up to its turn's end-of-turn id, a
finished one with its reward and ``failed``. A resumed episode first has its environment
rebuilt by the driver replaying its turns (:meth:`rlflow.sampler.episodes.EpisodeDriver.resume`;
one that cannot be replayed starts over, counted), then resumes by the same re-prefill of
prompt + ids so far, into the turn in progress (its uniforms, indexed by completion
position, are those of the uninterrupted episode); an episode whose last turn had ended is
parked again at once and its environment step runs again
(:meth:`rlflow.sampler.episode_slots.EpisodeSlots._resume_turns`).
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
        An episode's sample in flight: its ids so far (module doc); a parked one's up to
        its turn's end.

        Raises:
          RuntimeError: the cache is not paged (no completion lengths are kept).
        """
        if self._pool is None:
            raise RuntimeError("the journal of partial generations needs sampler.kv_cache="
                               "'paged' (its completion lengths and resume path)")
        self._file_pending()                  # the last decode call's tokens, on the host
        lives: dict = {}
        for slot, s in enumerate(self._slots):
            if s is None:
                continue
            g = s.length if s.parked else self._gen[slot]
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
        a group whose samples all finished is ready at once. An episode's partial sample
        whose turns cannot be replayed is queued from the start (the driver counts it)."""
        episode = live.request.episode
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
                versions = np.asarray(c.versions, np.int32)
                live.completions[i] = Completion(
                    live.request.prompt_id, i, np.asarray(c.tokens, np.int32),
                    np.asarray(c.logprobs, np.float32), versions, c.finish_reason,
                    reward=None if episode is None else float(c.reward or 0.0),
                    loss_mask=None if episode is None else versions >= 0,
                    failed=bool(c.failed))
                live.pending -= 1
                if episode is not None:
                    self.episodes.ended(episode, i)
            elif episode is not None and not self._replayed(live, i, c):
                self._queue.append((live, i))
            else:
                self._queue.append((live, i, (np.asarray(c.tokens, np.int32),
                                              np.asarray(c.logprobs, np.float32),
                                              np.asarray(c.versions, np.int32))))
        if len(live.completions) == live.request.num_samples:
            self._ready.append(CompletedGroup(
                request=live.request, prompt_tokens=live.tokens,
                max_tokens=live.sampling.max_tokens,
                completions=[live.completions[i] for i in range(live.request.num_samples)]))

    def _replayed(self, live, i: int, c: Completion) -> bool:
        """Rebuild episode ``i``'s environment from its journaled ids ``c``
        (:meth:`rlflow.sampler.episodes.EpisodeDriver.resume`); keeps where its turn in
        progress began for the resume (``live.resume_turns``). False: it cannot be
        replayed (the episode starts over)."""
        from rlflow.sampler.episodes import EpisodeReplayError

        try:
            live.resume_turns[i] = self.episodes.resume(
                live.request.episode, i, c.tokens, c.versions, live.stop_ids)
        except EpisodeReplayError:
            return False
        return True
