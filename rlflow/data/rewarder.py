"""The Rewarder: the configured reward functions, weighted, each call bounded.

``total = sum_k weight_k * reward_k`` per sample (``reward.functions`` / ``reward.weights``).
Each call runs in a reward worker process (:mod:`rlflow.data.reward_workers`) that is killed
past ``reward.timeout_s`` and limited to ``reward.memory_limit_mb``; a call that raises,
returns a non-number, times out or runs out of memory scores 0 for that function and sample,
counted per function (``reward/errors/<name>``, ``reward/timeouts/<name>``) and logged with
the sample id; a function whose last ``reward.max_consecutive_errors`` calls all failed
(raised, returned a non-number or NaN/inf, or timed out) stops the run
(:class:`~rlflow.data.rewards.RewardFunctionError`). ``reward.num_workers = 0`` calls the functions in this process instead, on a
thread joined with the timeout: for debugging only (a call that holds the GIL or allocates
without bound is then not stopped).

The served rewards ``"http"`` and ``"judge"`` (``reward.http`` / ``reward.judge``) are asked
over HTTP by an :class:`rlflow.data.http_scorer.HttpScorer` each, on its own event-loop
thread, with their own timeouts and retries; a sample whose request fails after its tries
scores 0 and is marked failed like a function's error or timeout, and the tries are counted
(``reward/http_requests/<name>``, ``reward/http_retries/<name>``,
``reward/http_timeouts/<name>``, ``reward/http_errors/<name>``).

Two ways to use it:

  * blocking: :meth:`Rewarder.score` / :meth:`Rewarder.score_group` (tests, offline scoring);
  * overlapped (the sampler): :meth:`Rewarder.submit_group` a finished group, go on decoding,
    and :meth:`Rewarder.collect` the scored groups on later loop iterations. Groups come back
    whole and in submission order.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from rlflow.config.data import SERVED_REWARDS
from rlflow.system import plugins as plugins_lib
from rlflow.data.reward_workers import RewardWorkerPool
from rlflow.data.rewards import (LOG_FIRST_FAILURES, NonFiniteRewardError,
                                 RewardFunctionError, call_reward, get_reward, reward_value,
                                 warm_up)
from rlflow.data.served_rewards import sample_dict

logger = logging.getLogger("rlflow.data.rewards")


class RewardTimeout(Exception):
    """A reward function ran past ``reward.timeout_s`` (internal; counted, reward 0)."""


def call_with_timeout(fn: Callable, args: tuple, timeout_s: float):
    """Run ``fn(*args)`` on a daemon thread and wait at most ``timeout_s`` seconds
    (``reward.num_workers = 0`` only: a thread cannot be stopped, and code that holds the
    GIL delays even the wait).

    Raises:
      RewardTimeout: the call did not return in time.
      Exception: whatever ``fn`` raised.
    """
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="rlflow-reward")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"no result after {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass(frozen=True)
class RewardBatch:
    """Rewards of N samples.

    Attributes:
      total: float32 ``[N]``: the weighted sum over functions (NaN/inf where a function
        returned one, or where a value or the sum is past the float32 range).
      components: function name -> float32 ``[N]`` (unweighted; 0 where it failed).
      nonfinite: one message per (function, sample) that returned NaN, infinity or a value
        not finite in float32 (e.g. 1e300), and per sample whose weighted total is not
        finite in float32, naming both; empty when every reward is finite.
      failed: bool ``[N]``: a function raised, returned a non-number or timed out on the
        sample (its 0 is not a grade); the group record's ``failed`` field. None: none.
    """

    total: np.ndarray
    components: Dict[str, np.ndarray]
    nonfinite: Tuple[str, ...] = ()
    failed: Optional[np.ndarray] = None


class _Job:
    def __init__(self, sample_ids, num_functions):
        self.sample_ids = list(sample_ids)
        self.values = np.zeros((num_functions, len(sample_ids)), np.float64)
        self.remaining = num_functions * len(sample_ids)
        self.nonfinite: List[str] = []
        self.bad: set = set()             # samples with a non-finite component or total
        self.failed = np.zeros(len(sample_ids), bool)   # a function raised or timed out


def finite_float32(value: float) -> bool:
    """Whether ``value`` stays finite as float32 (rewards travel as float32: a finite float64
    past ``finfo(float32).max``, e.g. 1e300, would become inf)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.float32(value)))


class Rewarder:
    """The configured reward functions, weighted and bounded (``RewardConfig``).

    Args:
      reward_cfg: ``RewardConfig`` (functions, weights, timeout_s, num_workers,
        memory_limit_mb).
      plugins: modules to import first (the top-level ``plugins`` config field), here and in
        every worker.

    Attributes:
      names / weights: the functions and their weights, in config order.
      failures: name -> {"errors": n, "timeouts": n}: samples that got 0 from that function.

    Raises (construction):
      KeyError: an unknown function name (lists the registered ones).
      rlflow.system.plugins.PluginError: a plugin cannot be imported.
      rlflow.data.http_scorer.ServedRewardError: a served reward's API key is not in the
        environment.
    """

    def __init__(self, reward_cfg, plugins: Sequence[str] = ()):
        plugins_lib.import_plugins(plugins)
        self.names = tuple(reward_cfg.functions)
        self.weights = tuple(float(w) for w in reward_cfg.weights)
        self.timeout_s = float(reward_cfg.timeout_s)
        self._fns = [None if n in SERVED_REWARDS else get_reward(n) for n in self.names]
        # served rewards: slot -> its HTTP client; results come back on one queue
        self._served_results: "queue.SimpleQueue" = queue.SimpleQueue()
        self._served: dict = {}     # slot -> rlflow.data.http_scorer.HttpScorer
        self._served_tasks: Dict[Tuple[int, int], Tuple[Hashable, int]] = {}
        local = [k for k, fn in enumerate(self._fns) if fn is not None]
        self._pool_index = {k: j for j, k in enumerate(local)}   # slot -> worker function
        self.failures = {n: {"errors": 0, "timeouts": 0} for n in self.names}
        self.max_consecutive_errors = int(getattr(reward_cfg, "max_consecutive_errors", 0))
        self._error_run = {n: 0 for n in self.names}   # failed calls since the last success
        self._jobs: "collections.OrderedDict[Hashable, _Job]" = collections.OrderedDict()
        self._tasks: Dict[int, Tuple[Hashable, int, int]] = {}
        self._pool: Optional[RewardWorkerPool] = None
        num_workers = int(getattr(reward_cfg, "num_workers", 0))
        if num_workers > 0 and local:
            specs = [(self.names[k], self._fns[k].__module__
                      if plugins_lib.importable_elsewhere(self._fns[k].__module__) else "")
                     for k in local]
            self._pool = RewardWorkerPool(
                specs, plugins=plugins, num_workers=num_workers, timeout_s=self.timeout_s,
                memory_limit_mb=int(getattr(reward_cfg, "memory_limit_mb", 0)))
        elif local:
            warm_up([self.names[k] for k in local])   # first-call imports outside timed calls
        try:
            for k, name in enumerate(self.names):
                if name in SERVED_REWARDS:
                    from rlflow.data.http_scorer import HttpScorer   # httpx: only when used

                    self._served[k] = HttpScorer(k, getattr(reward_cfg, name),
                                                 self._served_results)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ overlapped use
    def submit(self, key: Hashable, completions: Sequence[str], answers: Sequence[str],
               sample_ids: Sequence[str],
               finish_reasons: Optional[Sequence[str]] = None,
               prompts: Optional[Sequence[str]] = None) -> None:
        """Queue N samples under ``key`` (returned by :meth:`collect` once all are scored).

        ``finish_reasons``: N of "stop" / "length" (how each completion ended; default all
        "stop"), passed to the functions that take it
        (:func:`rlflow.data.rewards.call_reward`). ``prompts``: N prompt texts (template
        applied) for the served rewards (default all "").

        Raises:
          ValueError: the sequences differ in length, or ``key`` is already pending.
          RewardFunctionError: (``reward.num_workers = 0``, scored here) a function's run of
            failures reached ``reward.max_consecutive_errors``.
        """
        n = len(completions)
        finish_reasons = ["stop"] * n if finish_reasons is None else list(finish_reasons)
        prompts = [""] * n if prompts is None else list(prompts)
        if len(answers) != n or len(sample_ids) != n or len(finish_reasons) != n \
                or len(prompts) != n:
            raise ValueError(f"Rewarder.score: got {n} completions, {len(answers)} answers, "
                             f"{len(sample_ids)} sample ids, {len(finish_reasons)} finish "
                             f"reasons, {len(prompts)} prompts; expected equal lengths")
        if key in self._jobs:
            raise ValueError(f"Rewarder.submit: key {key!r} is already pending")
        job = self._jobs[key] = _Job(sample_ids, len(self.names))
        for k, scorer in self._served.items():    # first: the requests go out at once
            samples = [sample_dict(*s) for s in zip(prompts, completions, answers,
                                                     finish_reasons, sample_ids)]
            for i, task_id in enumerate(scorer.submit(samples)):
                self._served_tasks[(k, task_id)] = (key, i)
        for k, fn in enumerate(self._fns):
            if fn is None:
                continue
            for i, (c, a, f) in enumerate(zip(completions, answers, finish_reasons)):
                if self._pool is None:
                    self._in_process(job, k, i, fn, c, a, f)
                else:
                    self._tasks[self._pool.submit(self._pool_index[k], c, a, f)] = (key, k, i)

    def submit_group(self, key: Hashable, prompt_id: int, completions: Sequence[str],
                     answer: str, finish_reasons: Optional[Sequence[str]] = None,
                     prompt: str = "") -> None:
        """Queue one group (G completions of one prompt, each with its finish reason;
        ``prompt``: its text, for the served rewards); ids ``"prompt <id> sample <g>"``."""
        g = len(completions)
        self.submit(key, completions, [answer] * g, _group_ids(prompt_id, g), finish_reasons,
                    [prompt] * g)

    def collect(self, timeout: float = 0.0) -> List[Tuple[Hashable, RewardBatch]]:
        """The submitted jobs that are fully scored, in submission order (a job waits for
        every earlier one), each ``(key, RewardBatch)``; waits at most ``timeout`` seconds
        for results to arrive.

        Raises:
          rlflow.data.reward_workers.RewardWorkerError: the workers cannot load the functions.
          RewardFunctionError: a function's run of failures reached
            ``reward.max_consecutive_errors``.
        """
        self._pump(timeout)
        done = []
        while self._jobs:
            key, job = next(iter(self._jobs.items()))
            if job.remaining:
                break
            del self._jobs[key]
            done.append((key, self._batch(job)))
        return done

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet collected."""
        return len(self._jobs)

    # ------------------------------------------------------------------ blocking use
    def score(self, completions: Sequence[str], answers: Sequence[str],
              sample_ids: Sequence[str],
              finish_reasons: Optional[Sequence[str]] = None,
              prompts: Optional[Sequence[str]] = None) -> RewardBatch:
        """Score N samples and wait for them.

        Args:
          completions: N decoded completions.
          answers: N reference answers.
          sample_ids: N ids used in logs and errors (e.g. ``"prompt 17 sample 3"``).
          finish_reasons: N of "stop" / "length" (default all "stop"); see :meth:`submit`.
          prompts: N prompt texts for the served rewards (default all ""); see :meth:`submit`.

        Returns:
          :class:`RewardBatch` (``total`` = sum_k weight_k * reward_k).

        Raises:
          ValueError: the three sequences differ in length.
          NonFiniteRewardError: a function returned NaN or infinity (names it and the sample).
          RewardFunctionError: a function's run of failures reached
            ``reward.max_consecutive_errors``.
        """
        key = ("rlflow.score", object())
        self.submit(key, completions, answers, sample_ids, finish_reasons, prompts)
        job = self._jobs[key]
        while job.remaining:
            self._pump(0.05)
        del self._jobs[key]
        batch = self._batch(job)
        if batch.nonfinite:
            raise NonFiniteRewardError(f"{batch.nonfinite[0]}; rewards must be finite numbers")
        return batch

    def score_group(self, prompt_id: int, completions: Sequence[str], answer: str,
                    finish_reasons: Optional[Sequence[str]] = None,
                    prompt: str = "") -> np.ndarray:
        """Rewards of one group (G completions of one prompt): float32 ``[G]``.

        Sample ids are ``"prompt <prompt_id> sample <g>"``; ``prompt``: its text, for the
        served rewards. Raises as :meth:`score`.
        """
        return self.score_group_batch(prompt_id, completions, answer, finish_reasons,
                                      prompt).total

    def score_group_batch(self, prompt_id: int, completions: Sequence[str], answer: str,
                          finish_reasons: Optional[Sequence[str]] = None,
                          prompt: str = "") -> RewardBatch:
        """:meth:`score_group` with each function's rewards: the :class:`RewardBatch` of
        the group (``total`` and ``components`` ``[G]``). Raises as :meth:`score`."""
        g = len(completions)
        return self.score(completions, [answer] * g, _group_ids(prompt_id, g),
                          finish_reasons, [prompt] * g)

    def metrics(self) -> Dict[str, int]:
        """Failure counters, flat: ``{"reward/errors/<name>": n, "reward/timeouts/<name>": n}``
        (samples scored 0), and per served reward its tries ``reward/http_<kind>/<name>``
        (kind: requests, retries, timeouts, errors; :mod:`rlflow.data.http_scorer`)."""
        out = {}
        for name, counts in self.failures.items():
            for kind, value in counts.items():
                out[f"reward/{kind}/{name}"] = value
        for k, scorer in self._served.items():
            for kind, value in scorer.counts.items():
                out[f"reward/http_{kind}/{self.names[k]}"] = value
        return out

    def close(self) -> None:
        """Stop the reward workers and the served rewards' clients."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for scorer in self._served.values():
            scorer.close()
        self._served = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ internals
    def _pump(self, timeout: float) -> None:
        """Settle the results that arrived, waiting at most ``timeout`` seconds for the
        first (on the workers when some of their calls are out, else on the served
        rewards)."""
        if self._pool is not None and self._tasks:
            served_in = not self._served_results.empty()
            for task_id, status, value in self._pool.poll(0.0 if served_in else timeout):
                key, k, i = self._tasks.pop(task_id)
                job = self._jobs.get(key)
                if job is not None:
                    self._settle(job, k, i, status, value)
            timeout = 0.0
        while self._served_tasks:
            try:
                k, task_id, status, value = self._served_results.get(timeout=timeout) \
                    if timeout > 0 else self._served_results.get_nowait()
            except queue.Empty:
                return
            timeout = 0.0
            key, i = self._served_tasks.pop((k, task_id))
            job = self._jobs.get(key)
            if job is not None:
                self._settle(job, k, i, status, value)

    def _in_process(self, job: _Job, k: int, i: int, fn, completion, answer,
                    finish_reason) -> None:
        try:
            value = ("ok", reward_value(call_with_timeout(
                call_reward, (fn, completion, answer, finish_reason), self.timeout_s)))
        except RewardTimeout:
            value = ("timeout", f"ran past {self.timeout_s} s")
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a reward error (SystemExit too) scores 0
            value = ("error", f"{type(e).__name__}: {e}")
        self._settle(job, k, i, *value)

    def _settle(self, job: _Job, k: int, i: int, status: str, value) -> None:
        name, sample_id = self.names[k], job.sample_ids[i]
        job.remaining -= 1
        if status == "ok":
            job.values[k, i] = value
            if finite_float32(value):
                self._error_run[name] = 0
            else:
                job.bad.add(i)
                job.nonfinite.append(f"reward function {name!r} returned {value} for sample "
                                     f"{sample_id}" + (" (not finite in float32)"
                                                       if math.isfinite(value) else ""))
                self._failed_again(name, sample_id, f"returned {value}")
        elif status == "timeout":
            job.failed[i] = True
            self._failed(name, "timeouts", sample_id, str(value))
            self._failed_again(name, sample_id, f"timed out: {value}")
        else:
            job.failed[i] = True
            self._failed(name, "errors", sample_id, f"raised {value}")
            self._failed_again(name, sample_id, value)

    def _failed_again(self, name: str, sample_id, what: str) -> None:
        """One more call of ``name`` in a row that gave no usable reward (it raised, timed
        out, or returned a non-number or a non-finite one); at ``max_consecutive_errors``
        stop."""
        self._error_run[name] += 1
        limit = self.max_consecutive_errors
        if limit and self._error_run[name] >= limit:
            raise RewardFunctionError(
                f"reward function {name!r} failed (errors or timeouts) on its last "
                f"{self._error_run[name]} calls in a row (reward.max_consecutive_errors="
                f"{limit}), the last on sample {sample_id}: {what}. Fix the function (or "
                f"raise the limit or reward.timeout_s; 0: never stop)")

    def _batch(self, job: _Job) -> RewardBatch:
        total = np.asarray(self.weights, np.float64) @ job.values if len(self.names) else \
            np.zeros(job.values.shape[1])
        with np.errstate(over="ignore", invalid="ignore"):
            total32 = np.asarray(total, np.float32)
            components = {n: job.values[k].astype(np.float32) for k, n in enumerate(self.names)}
        for i in np.flatnonzero(~np.isfinite(total32)):
            if int(i) not in job.bad:          # finite components, weighted sum overflows
                job.bad.add(int(i))
                job.nonfinite.append(
                    f"weighted reward total {float(total[i])} of sample {job.sample_ids[i]} "
                    f"(reward.weights {list(self.weights)}) is not finite in float32")
        return RewardBatch(total=total32,
                           components=components,
                           nonfinite=tuple(job.nonfinite), failed=job.failed)

    def _failed(self, name: str, kind: str, sample_id, what: str) -> None:
        self.failures[name][kind] += 1
        count = self.failures[name]["errors"] + self.failures[name]["timeouts"]
        if count <= LOG_FIRST_FAILURES or count % 1000 == 0:
            logger.warning("reward function %r %s on sample %s: reward 0 (%d failures so far)",
                           name, what, sample_id, count)


def _group_ids(prompt_id: int, g: int) -> List[str]:
    return [f"prompt {prompt_id} sample {i}" for i in range(g)]
