"""One sampler replica's groups out: leased prompts in flight -> rewards -> the learner's
ring buffer.

:class:`GroupDelivery` holds the leases of the prompts this replica admitted to its batcher
and has not yet delivered or dropped (the ledger's admission counts them), hands each finished
group to the reward workers without waiting (:class:`rlflow.data.rewarder.Rewarder`), and puts
the groups whose rewards are in into the buffer, whole and in the order they finished, each
tagged with its prompt's ``stream_index`` and ``lease_id``. Multi-turn episodes come with their
environments' rewards: their groups go to the buffer as they finish (no reward workers). A
sample on which a reward function raised or timed out is marked in the record's ``failed``
field (counted as ``sampler/reward_failed_samples``).

A group with a NaN/inf reward follows ``learner.on_bad_reward``: "drop" drops it (logged with
the function and sample, counted as ``sampler/dropped_bad_reward_groups``, its lease reported
to the ledger as dropped), "error" raises :class:`rlflow.data.rewards.NonFiniteRewardError`.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from rlflow.data.rewards import NonFiniteRewardError
from rlflow.run.journal import oldest_version


def graded_texts(group, tokenizer, reasoning=None) -> tuple[list[str], list[str], np.ndarray]:
    """What the reward functions grade of a finished group (training here, and the held-out
    evaluation: :mod:`rlflow.sampler.eval_runner`, :mod:`rlflow.console.offline_eval`).

    Args:
      group: :class:`rlflow.sampler.requests.CompletedGroup` (k completions).
      tokenizer: the run's tokenizer (decoded with special tokens skipped).
      reasoning: a thinking model's splitter (``data.reasoning_parser``,
        :func:`rlflow.data.reasoning.get_reasoning_parser`), or None: the whole completion.

    Returns:
      ``(texts, finish_reasons, unclosed)``: the k answer texts; each completion's
      ``"stop" | "length"`` (the decoded text cannot tell a stop token from a cut at
      ``max_tokens`` followed by removed special tokens); bool ``[k]``, True where the
      reasoning never closed (such a sample is graded 0).
    """
    texts = [tokenizer.decode(c.tokens.tolist(), skip_special_tokens=True)
             for c in group.completions]
    unclosed = np.zeros(len(texts), bool)
    if reasoning is not None:
        splits = [reasoning(t) for t in texts]
        texts = [s.answer for s in splits]
        unclosed = np.array([not s.closed for s in splits], bool)
    return texts, [c.finish_reason for c in group.completions], unclosed


log = logging.getLogger("rlflow.sampler")


def _leased(record: dict, element) -> dict:
    """``record`` tagged with its prompt's ``stream_index`` and ``lease_id`` (the ledger's)."""
    record["stream_index"] = np.asarray(element["stream_index"], np.int64)
    record["lease_id"] = np.asarray(element["lease_id"], np.int64)
    return record


def lease_key(element) -> list[int]:
    """``[stream_index, lease_id]`` of a leased prompt: how the ledger names a lease."""
    return [int(element["stream_index"]), int(element["lease_id"])]


class GroupDelivery:
    """Leases in flight, reward scoring and buffer delivery of one sampler replica.

    Args:
      tokenizer: decodes completion tokens for the reward functions (``decode(ids,
        skip_special_tokens=True)``).
      buffer: the learner's ring buffer client (``put_groups(records) -> {index: error}``).
      rewarder: the reward workers; ``None`` for multi-turn episodes (rewards come from the
        environments).
      window: the replica's :class:`rlflow.sampler.background.RateCounters` (time spent in
        the buffer call counts as idle).
      on_bad_reward: ``learner.on_bad_reward`` ("drop" or "error").
      reasoning: a thinking model's completion splitter (``data.reasoning_parser``,
        :mod:`rlflow.data.reasoning`): the reward functions score the answer part only, and a
        completion whose reasoning never closed gets reward 0. None: the whole completion.
    """

    def __init__(self, tokenizer, buffer, rewarder, window, *, on_bad_reward: str = "drop",
                 reasoning=None, keep_sent: bool = False):
        self.tokenizer = tokenizer
        self.buffer = buffer
        self.rewarder = rewarder
        self.window = window
        self.on_bad_reward = on_bad_reward
        self.reasoning = reasoning
        self.in_flight: dict[int, dict] = {}     # id(Request) -> leased prompt
        # id(Request) -> (Request, record, unclosed reasoning bool [G], CompletedGroup)
        # awaiting its rewards (the Request is held so that its id is not reused while it
        # is scored)
        self.scoring: dict[int, tuple] = {}
        # with keep_sent (the journal of partial generations): id(Request) -> (lease,
        # CompletedGroup, oldest token version) of groups in the buffer, not yet surely
        # trained (release_sent)
        self.keep_sent = keep_sent
        self.sent: dict[int, tuple] = {}
        self.dropped_leases: list[list[int]] = []   # [stream_index, lease_id] dropped here
        self.bad_reward_groups = 0   # groups dropped for a NaN/inf reward (on_bad_reward=drop)
        self.groups_delivered = 0    # groups put into the buffer, in total
        self.rejected = 0            # groups the buffer refused (a bug if ever > 0)
        self.failed_samples = 0      # samples marked failed by a reward error or timeout

    # ------------------------------------------------------------------ leases
    def admit(self, request, element) -> None:
        """``request`` (a :class:`rlflow.sampler.batching.Request`) was submitted to the
        batcher for the leased prompt ``element``; it counts as in flight until delivered
        or dropped."""
        self.in_flight[id(request)] = element

    def drop(self, element) -> None:
        """A leased prompt never started (e.g. its environments could not be created): the
        ledger hears of it with the next status."""
        self.dropped_leases.append(lease_key(element))

    def take_dropped(self) -> list[list[int]]:
        """The leases dropped since the last call (for the status to the ledger)."""
        dropped, self.dropped_leases = self.dropped_leases, []
        return dropped

    def held(self) -> list:
        """``[(lease, request, completions)]`` of the finished groups still being scored and,
        with ``keep_sent``, of those in the learner's buffer not yet surely trained (the
        journal of partial generations keeps both: a kill of this replica or of the learner
        must not lose them)."""
        out = [(self.in_flight[k], g.request, g.completions)
               for k, (_, _, _, g) in self.scoring.items()]
        return out + [(e, g.request, g.completions) for e, g, _ in self.sent.values()]

    def release_sent(self, learner_version: int, max_staleness: int) -> None:
        """Forget the sent groups the learner has surely consumed: a group whose oldest
        token is of version ``v`` is taken at a step with policy version at most
        ``v + max_staleness`` (or dropped as stale), so it is trained (or dropped) once the
        learner's version exceeds ``v + max_staleness + 1``."""
        for key in [k for k, (_, _, v) in self.sent.items()
                    if learner_version > v + max_staleness + 1]:
            del self.sent[key]

    @property
    def waiting_for_rewards(self) -> bool:
        """Some finished groups are still being scored."""
        return bool(self.scoring)

    # ------------------------------------------------------------------ groups out
    def score(self, groups) -> None:
        """Hand the groups a decode step finished to the reward workers (no wait); they stay
        in ``in_flight`` (admission counts them) until delivered or dropped. Episode groups
        (no rewarder) are delivered at once."""
        if self.rewarder is None:
            sent = [(id(g.request), self.in_flight.pop(id(g.request)), g) for g in groups]
            rejected = self.deliver([_leased(g.to_record(), e) for _, e, g in sent])
            self._keep_sent(sent, rejected)
            return
        for group in groups:
            key = id(group.request)
            element = self.in_flight[key]
            texts, finish, unclosed = graded_texts(group, self.tokenizer, self.reasoning)
            self.scoring[key] = (group.request, group.to_record(), unclosed, group)
            self.rewarder.submit_group(key, group.prompt_id, texts, element["answer"], finish,
                                       str(element.get("prompt_text", "")))

    def collect(self, timeout: float = 0.0) -> None:
        """Deliver the groups whose rewards are in (waiting up to ``timeout`` seconds for the
        first); a group with a NaN/inf reward follows ``on_bad_reward``.

        Raises:
          NonFiniteRewardError: a NaN/inf reward with ``on_bad_reward="error"`` (names the
            function and sample).
          rlflow.exchange.ring.BufferClosedError: the learner closed the buffer.
        """
        if self.rewarder is None:
            return
        records, groups = [], []
        for key, batch in self.rewarder.collect(timeout):
            _, record, unclosed, group = self.scoring.pop(key)
            element = self.in_flight.pop(key)
            record = _leased(record, element)
            if batch.nonfinite:
                if self.on_bad_reward == "error":
                    raise NonFiniteRewardError(
                        f"{batch.nonfinite[0]}; rewards must be finite numbers "
                        f"(learner.on_bad_reward='drop' drops such groups)")
                self.bad_reward_groups += 1
                self.drop(element)
                log.warning("%s: group of prompt_id %d dropped (learner.on_bad_reward='drop'; "
                            "%d dropped so far)", batch.nonfinite[0], int(record["prompt_id"]),
                            self.bad_reward_groups)
                continue
            record["rewards"] = np.asarray(batch.total, np.float32)
            if unclosed.any():     # reasoning never closed: 0
                record["rewards"] = np.where(unclosed, np.float32(0.0), record["rewards"])
            failed = batch.failed
            if failed is not None:
                failed = failed & ~unclosed          # graded 0 whatever the function did
            if failed is not None and failed.any():  # a reward error / timeout: no grade
                record["failed"] = failed | record.get("failed", False)
                self.failed_samples += int(failed.sum())
            records.append(record)
            groups.append((key, element, group))
        self._keep_sent(groups, self.deliver(records))

    def _keep_sent(self, groups, rejected) -> None:
        """With ``keep_sent``: hold the groups ``[(key, lease, CompletedGroup)]`` put into
        the buffer (but those ``rejected``) until :meth:`release_sent`, each with the oldest
        policy version of its sampled tokens (an episode's environment tokens, version -1,
        are not sampled)."""
        if not self.keep_sent:
            return
        for i, (key, element, group) in enumerate(groups):
            oldest = oldest_version(group.completions)
            if i not in rejected and oldest is not None:
                self.sent[key] = (element, group, oldest)

    def deliver(self, records) -> dict:
        """Send scored groups in one request to the buffer; ``{index: error}`` of those it
        refused."""
        if not records:
            return {}
        t0 = time.monotonic()
        rejected = self.buffer.put_groups(records)
        self.window.add(idle=time.monotonic() - t0)
        for i, err in rejected.items():      # never expected: a bug, logged and counted
            self.rejected += 1
            log.error("the buffer rejected the group of prompt_id %d: %s",
                      int(records[i]["prompt_id"]), err)
        self.groups_delivered += len(records) - len(rejected)
        return rejected

    def metrics(self) -> dict[str, float]:
        """This replica's delivery figures for its status (``sampler/...``), with the reward
        workers' error and timeout counts."""
        out = {"sampler/rejected_groups": float(self.rejected),
               "sampler/dropped_bad_reward_groups": float(self.bad_reward_groups),
               "sampler/in_flight": float(len(self.in_flight)),
               "sampler/groups_delivered": float(self.groups_delivered),
               "sampler/reward_failed_samples": float(self.failed_samples)}
        if self.rewarder is not None:   # reward functions that raised or timed out (scored 0)
            out.update({k: float(v) for k, v in self.rewarder.metrics().items()})
        return out

    def close(self) -> None:
        if self.rewarder is not None:
            self.rewarder.close()
