"""Training through the gateway: each leased prompt becomes ``G`` agent sessions; when all of
them are closed, their head episodes form the prompt's group record.

Flow (:class:`GatewayRollouts`, driven by the sampler program's loop):

* :meth:`admit` (a leased prompt): ``G`` sessions are opened with the prompt's task
  (``{"prompt_id", "prompt", "answer"}``, :func:`rlflow.sampler.episodes.episode_record`) and
  queued for the agent runner (:meth:`next_session`, served as ``POST /rlflow/v1/next``).
* the agents call the gateway; each session ends with a reward (posted by the agent or the
  value its function returned), fails (the agent raised or its process died: reward 0, the
  sample is marked ``failed``) or expires (no call for ``gateway.session_timeout_s``:
  counted, marked ``failed``);
* :meth:`poll` returns the groups whose ``G`` sessions are closed as
  :class:`rlflow.sampler.requests.CompletedGroup` s (the record's ``loss_mask`` is 1 exactly on
  the sampled tokens) for the replica's delivery, like the built-in multi-turn episodes.

The group's ``prompt_tokens`` are the longest common prefix of the ``G`` episodes' ids within
their first prompts (usually the whole rendered first prompt: the agents of one task send the
same first messages); each completion is the rest of its episode (cut at ``max_tokens``,
then marked truncated). A session that made no call gives a one-id placeholder (the
end-of-turn id, no loss) marked failed (the learner never trains on an empty completion); a
group none of whose sessions made a call is dropped (counted ``gateway/groups_without_calls``;
the lease is reported as dropped).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from rlflow.sampler.requests import CompletedGroup, Completion, Request

log = logging.getLogger("rlflow.gateway")


class SessionGroup:
    """The ``G`` sessions of one leased prompt (the request's ``episode`` handle)."""

    def __init__(self, request_id: int, task: dict, sessions: list):
        self.request_id, self.task, self.sessions = request_id, task, sessions


class GatewayRollouts:
    """Leased prompts <-> agent sessions <-> group records.

    Args:
      gateway: the :class:`rlflow.gateway.service.Gateway`.
      group_size: ``G`` sessions per prompt.
      max_tokens: the records' ``T`` (``sampler.max_tokens``).
      session_timeout_s: idle seconds after which an open session expires.
    """

    def __init__(self, gateway, group_size: int, max_tokens: int, session_timeout_s: float):
        self.gateway, self.store = gateway, gateway.store
        self.group_size, self.max_tokens = int(group_size), int(max_tokens)
        self.session_timeout_s = float(session_timeout_s)
        self._groups: Dict[int, tuple] = {}           # id(Request) -> (Request, SessionGroup)
        self._todo: "collections.deque[dict]" = collections.deque()
        self._cv = threading.Condition()
        self.counts = {"groups_delivered": 0, "groups_without_calls": 0,
                       "sessions_handed_out": 0}

    # ------------------------------------------------------------------ in
    def admit(self, prompt_id: int, task: dict) -> Request:
        """Open ``G`` sessions for a leased prompt; returns the group's :class:`Request` (for
        the delivery's lease table; its ``episode`` is the :class:`SessionGroup`)."""
        sessions = [self.store.open(task=task, group=int(prompt_id))
                    for _ in range(self.group_size)]
        group = SessionGroup(prompt_id, task, sessions)
        request = Request(prompt_id=int(prompt_id), prompt_tokens=np.zeros(1, np.int32),
                          num_samples=self.group_size, episode=group)
        self._groups[id(request)] = (request, group)
        with self._cv:
            self._todo.extend({"session": s.id, "task": task} for s in sessions)
            self._cv.notify_all()
        return request

    def next_session(self, timeout_s: float) -> Optional[dict]:
        """The next session for the agent runner, waiting up to ``timeout_s``; None if none."""
        with self._cv:
            if not self._todo:
                self._cv.wait(timeout_s)
            if not self._todo:
                return None
            self.counts["sessions_handed_out"] += 1
            got = self._todo.popleft()
        s = self.store.peek(got["session"])
        if s is not None:
            s.last_active = time.monotonic()   # the idle clock starts now
        return got

    @property
    def in_flight(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ out
    def poll(self) -> tuple:
        """Expire idle sessions, then return ``(groups, dropped)``: the
        :class:`CompletedGroup` s whose sessions are all closed, and the requests of groups
        dropped for having no call at all."""
        with self._cv:                               # the HTTP threads pop from it
            waiting = {d["session"] for d in self._todo}
        for s in self.store.idle(self.session_timeout_s):
            if s.id in waiting:                       # not started by an agent yet
                continue
            log.warning("gateway session %s: no call for %g s (gateway.session_timeout_s); "
                        "it expires (reward 0, marked failed)", s.id, self.session_timeout_s)
            self.gateway.end(s, error="expired", status="expired")
        done, dropped = [], []
        for key, (request, group) in list(self._groups.items()):
            if any(s.status == "open" for s in group.sessions):
                continue
            del self._groups[key]
            for s in group.sessions:
                self.store.pop(s.id)
            built = self._group(request, group)
            if built is None:
                self.counts["groups_without_calls"] += 1
                dropped.append(request)
            else:
                self.counts["groups_delivered"] += 1
                done.append(built)
        return done, dropped

    def _group(self, request, group: SessionGroup) -> Optional[CompletedGroup]:
        episodes = [s.episode() for s in group.sessions]
        full = [None if e is None else np.concatenate([e["prompt"], e["tokens"]])
                for e in episodes]
        real = [(e, f) for e, f in zip(episodes, full) if e is not None]
        if not real:
            return None
        p = min(len(e["prompt"]) for e, _ in real)
        first = real[0][1]
        for _, f in real[1:]:
            same = first[:p] == f[:p]
            p = int(np.argmin(same)) if not same.all() else p
        p = max(p, 1)
        prompt = first[:p].astype(np.int32)
        completions: List[Completion] = []
        for i, (s, e, f) in enumerate(zip(group.sessions, episodes, full)):
            completions.append(self._completion(request.prompt_id, i, s, e, f, p))
        return CompletedGroup(request=request, prompt_tokens=prompt, max_tokens=self.max_tokens,
                              completions=completions)

    def _completion(self, prompt_id, index, session, episode, full, p) -> Completion:
        t = self.max_tokens
        failed = session.status != "ended"
        if episode is None:        # no call: one placeholder id (no loss), marked failed
            one = np.asarray([self.store.renderer.turn_end_id], np.int32)
            return Completion(prompt_id, index, one, np.zeros(1, np.float32),
                              np.full(1, -1, np.int32), "length", reward=0.0,
                              loss_mask=np.zeros(1, bool), failed=True)
        head = len(episode["prompt"]) - p                  # first-prompt ids past the common
        tokens = full[p:]
        mask = np.concatenate([np.zeros(head, bool), episode["mask"]])
        logprobs = np.concatenate([np.zeros(head, np.float32), episode["logprobs"]])
        versions = np.concatenate([np.full(head, -1, np.int32), episode["versions"]])
        cut = len(tokens) > t
        reward = 0.0 if failed else float(session.reward or 0.0)
        return Completion(prompt_id, index, tokens[:t].astype(np.int32), logprobs[:t],
                          versions[:t], "length" if cut or failed else "stop",
                          reward=reward, loss_mask=mask[:t], failed=failed)

    def metrics(self) -> Dict[str, float]:
        return {f"gateway/{k}": float(v) for k, v in self.counts.items()}

    def close(self) -> None:
        with self._cv:
            self._todo.clear()
            self._cv.notify_all()
