"""What the sampler's batching loop takes and gives back: a :class:`Request` (one prompt,
G samples, its sampling settings), each sample's :class:`Completion` (tokens, the logprobs
they were sampled with, the policy version of every token), and a request's
:class:`CompletedGroup`, which becomes the rollout group record of ``docs/interfaces.md``.

:class:`rlflow.sampler.batching.ContinuousBatcher` runs requests; these types are
re-exported from :mod:`rlflow.sampler.batching`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from rlflow.exchange.routing import NO_CHOICE
from rlflow.sampler.sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    """One prompt to sample ``num_samples`` (G) times.

    Attributes:
      prompt_id: dataset index of the prompt (returned with the group).
      prompt_tokens: int ``[P]`` token ids, no padding, ``P >= 1``.
      num_samples: completions to draw (G >= 1).
      sampling: settings (incl. seed and max_tokens); ``None``: the sampler config's
        with ``seed = sampler.seed + prompt_id``.
      episode: ``None`` (single-turn), or the episode driver's handle of this group's
        environments: each sample is a multi-turn episode (``max_tokens`` then bounds the
        whole episode after the prompt; :mod:`rlflow.sampler.episode_slots`).
    """

    prompt_id: int
    prompt_tokens: Sequence[int]
    num_samples: int = 1
    sampling: Optional[SamplingParams] = None
    episode: object = None


@dataclass
class Completion:
    """One finished sample: ``tokens`` int32 ``[T]`` (stop id included), ``logprobs``
    float32 ``[T]`` (tempered, as sampled), ``versions`` int32 ``[T]`` (policy version
    per token), ``finish_reason`` "stop" (a stop id) or "length" (``max_tokens``).

    Episodes (multi-turn) also have ``reward`` (the environment's outcome reward) and
    ``loss_mask`` bool ``[T]`` (1 on sampled tokens; environment tokens have logprob 0 and
    version -1); "length" then means cut by a limit (turns, tokens). ``failed``: the episode
    was cut by an environment error or timeout (the record's ``failed`` field).

    ``routing`` (mixture-of-experts engines; rollout routing replay): ``[T, L, k]`` expert ids
    of the input token of the decode step that produced each token: row 0 the prompt's last
    token's, row ``t`` completion token ``t - 1``'s; -1 where no decode step produced the
    token (environment tokens, tokens re-prefilled after a preemption)."""

    prompt_id: int
    sample_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    reward: Optional[float] = None
    loss_mask: Optional[np.ndarray] = None
    failed: bool = False
    routing: Optional[np.ndarray] = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class CompletedGroup:
    """A request's G completions, ordered by ``sample_index``; ``prompt_routing``
    (mixture-of-experts engines): ``[P, L, k]`` expert ids of the prompt tokens (the first
    prefill's, the last token's from its first sample's first decode step), or None."""

    request: Request
    prompt_tokens: np.ndarray
    max_tokens: int
    completions: list
    prompt_routing: Optional[np.ndarray] = None

    @property
    def prompt_id(self) -> int:
        return self.request.prompt_id

    def to_record(self) -> dict:
        """The "rollout group record" of ``docs/interfaces.md`` (rewards 0: the runtime
        fills them, except for episodes: their rewards and ``loss_mask`` are filled here, and
        ``failed`` when an environment error or timeout cut one). ``T`` = the request's
        ``max_tokens``. A mixture-of-experts engine's groups carry ``prompt_routing`` and
        ``completion_routing`` (record version 3, :mod:`rlflow.exchange.routing`): token
        ``t``'s ids are the completion's ``routing[t + 1]``, -1 on its last token and the
        padding."""
        g, t = len(self.completions), self.max_tokens
        tokens = np.zeros((g, t), np.int32)
        logprobs = np.zeros((g, t), np.float32)
        versions = np.full((g, t), -1, np.int32)
        lengths = np.zeros((g,), np.int32)
        for i, c in enumerate(self.completions):
            n = len(c.tokens)
            tokens[i, :n], logprobs[i, :n], versions[i, :n], lengths[i] = (
                c.tokens, c.logprobs, c.versions, n)
        episode = {}
        if self.request.episode is not None:
            episode["loss_mask"] = np.zeros((g, t), bool)
            for i, c in enumerate(self.completions):
                episode["loss_mask"][i, :len(c.tokens)] = c.loss_mask
            failed = np.array([c.failed for c in self.completions], bool)
            if failed.any():                    # optional: only groups with a failure
                episode["failed"] = failed
        rewards = np.array([c.reward or 0.0 for c in self.completions], np.float32)
        if self.completions[0].routing is not None:
            episode |= self._routing_fields(lengths)
        return {
            "prompt_id": np.asarray(self.prompt_id, np.int64),
            "prompt_tokens": self.prompt_tokens.astype(np.int32),
            "completion_tokens": tokens,
            "completion_lengths": lengths,
            "behaviour_logprobs": logprobs,
            "policy_versions": versions,
            "rewards": rewards,
            "truncated": np.array([c.truncated for c in self.completions], bool),
            **episode,
        }

    def _routing_fields(self, lengths) -> dict:
        """``prompt_routing [P, L, k]`` and ``completion_routing [G, T, L, k]``."""
        first = self.completions[0].routing
        tail, dtype = first.shape[1:], first.dtype
        completion = np.full((len(self.completions), self.max_tokens) + tail, NO_CHOICE, dtype)
        for i, c in enumerate(self.completions):
            n = int(lengths[i])
            completion[i, :n - 1] = c.routing[1:n]
        prompt = self.prompt_routing
        if prompt is None:                  # no prefill record: the last token's only
            prompt = np.full((len(self.prompt_tokens),) + tail, NO_CHOICE, dtype)
            prompt[-1] = first[0]
        return {"prompt_routing": prompt.astype(dtype), "completion_routing": completion}
