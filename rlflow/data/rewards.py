"""Reward functions: a registry, math answer checking with math-verify, and a guarded scorer.

A reward function is ``fn(completion: str, answer: str) -> float``: the decoded completion
(special tokens removed) and the record's reference answer. Register one with
``@register_reward("name")`` and list it in ``reward.functions`` with a weight.

Built in:
  * ``math_verify``: 1.0 when the completion's final answer equals the reference under
    math-verify (Kydlicek et al., HF Math-Verify), else 0.0. The reference may be a GSM8K
    answer (text ending ``#### <number>``: the number is taken) or a bare expression. The
    completion's answer is the text after its last ``####`` if it has one, else whatever
    math-verify extracts (``\\boxed{}`` first, then the last expression).
  * ``math_format``: 1.0 when the completion states a final answer as ``\\boxed{...}`` or
    ``#### <answer>``, else 0.0.
  * ``exact_match``: 1.0 when completion and answer are equal after stripping whitespace.
  * ``digits_match``: the built-in demo task's reward (``rlflow.data.tasks``).

:class:`Rewarder` combines the configured functions with their weights and guards each
call: a function that raises, returns a non-number or runs past ``reward.timeout_s`` gives
0 for that sample; the failure is counted per function and logged with the sample id. A
NaN or infinite reward raises :class:`NonFiniteRewardError` naming the function and sample.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Sequence

import numpy as np

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
_REGISTRY: Dict[str, RewardFn] = {}

#: Failures of one function logged one by one before logging switches to every 1000th.
LOG_FIRST_FAILURES = 50


class NonFiniteRewardError(ValueError):
    """A reward function returned NaN or infinity; the message names it and the sample id."""


def register_reward(name: str):
    """Decorator: register ``fn(completion, answer) -> float`` under ``name``.

    Raises:
      ValueError: ``name`` is already registered to another function.
    """
    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward function {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return deco


def get_reward(name: str) -> RewardFn:
    """The registered function ``name``.

    Raises:
      KeyError: unknown name (the message lists the registered ones).
    """
    _load_builtin()
    if name not in _REGISTRY:
        raise KeyError(f"reward.functions: unknown reward function {name!r}; "
                       f"registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def available_rewards() -> list:
    """Names of the registered reward functions, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    import rlflow.data.tasks  # noqa: F401  (registers the task rewards)


# ---------------------------------------------------------------- math answers

_GSM8K_MARK = "####"
_BOXED = re.compile(r"\\boxed\s*\{\s*[^{}\s]")
_MARKED = re.compile(r"####\s*\S")


def final_answer_text(text: str) -> str:
    """The text after the last ``####`` (first line of it, thousands commas removed), or
    ``text`` stripped when there is no ``####``. GSM8K answers end with ``#### <number>``."""
    if _GSM8K_MARK not in text:
        return text.strip()
    tail = text.rsplit(_GSM8K_MARK, 1)[1].strip()
    tail = tail.splitlines()[0] if tail else ""
    return re.sub(r"(?<=\d),(?=\d{3})", "", tail).strip()


def _math_verify():
    """The math_verify module, its "timeout is disabled" warning silenced.

    math-verify's own timeouts use ``signal.alarm`` (main thread only); rlflow turns them off
    and enforces ``reward.timeout_s`` itself (:class:`Rewarder`), so the warning that asks
    the caller to handle timeouts is moot here.
    """
    import math_verify
    import math_verify.grader
    import math_verify.parser

    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


def _parse(text: str):
    return _math_verify().parse(text, parsing_timeout=None)


@register_reward("math_verify")
def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals the reference (math-verify), else 0.0.

    Raises:
      ValueError: the reference answer cannot be parsed (a data problem; the Rewarder
        counts it and logs the sample id).
    """
    ref = final_answer_text(answer)
    gold = _parse(ref) or _parse(f"${ref}$")
    if not gold:
        raise ValueError(f"cannot parse the reference answer {answer!r}")
    pred = _parse(final_answer_text(completion)) if _GSM8K_MARK in completion \
        else _parse(completion)
    if not pred:
        return 0.0
    return float(_math_verify().verify(gold, pred, timeout_seconds=None))


@register_reward("math_format")
def math_format_reward(completion: str, answer: str) -> float:
    """1.0 if the completion gives a final answer as ``\\boxed{...}`` or ``#### ...``."""
    return float(bool(_BOXED.search(completion) or _MARKED.search(completion)))


@register_reward("exact_match")
def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 if ``completion.strip() == answer.strip()``, else 0.0."""
    return float(completion.strip() == answer.strip())


# ---------------------------------------------------------------- guarded scorer

class RewardTimeout(Exception):
    """A reward function ran past ``reward.timeout_s`` (internal; counted, reward 0)."""


def call_with_timeout(fn: Callable, args: tuple, timeout_s: float):
    """Run ``fn(*args)`` on a daemon thread and wait at most ``timeout_s`` seconds.

    Python cannot stop a thread: a call that times out keeps running in the background
    (it does not block later calls or interpreter exit).

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
      total: float32 ``[N]``: the weighted sum over functions.
      components: function name -> float32 ``[N]`` (unweighted; 0 where it failed).
    """

    total: np.ndarray
    components: Dict[str, np.ndarray]


class Rewarder:
    """The configured reward functions, weighted and guarded (``RewardConfig``).

    Attributes:
      names / weights: the functions and their weights, in config order.
      failures: name -> {"errors": n, "timeouts": n}: samples that got 0 from that function.
    """

    def __init__(self, reward_cfg):
        self.names = tuple(reward_cfg.functions)
        self.weights = tuple(float(w) for w in reward_cfg.weights)
        self.timeout_s = float(reward_cfg.timeout_s)
        self._fns = [get_reward(n) for n in self.names]
        self.failures = {n: {"errors": 0, "timeouts": 0} for n in self.names}

    def score(self, completions: Sequence[str], answers: Sequence[str],
              sample_ids: Sequence[str]) -> RewardBatch:
        """Score N samples.

        Args:
          completions: N decoded completions.
          answers: N reference answers.
          sample_ids: N ids used in logs and errors (e.g. ``"prompt 17 sample 3"``).

        Returns:
          :class:`RewardBatch` (``total`` = sum_k weight_k * reward_k).

        Raises:
          ValueError: the three sequences differ in length.
          NonFiniteRewardError: a function returned NaN or infinity (names it and the sample).
        """
        n = len(completions)
        if len(answers) != n or len(sample_ids) != n:
            raise ValueError(f"Rewarder.score: got {n} completions, {len(answers)} answers, "
                             f"{len(sample_ids)} sample ids; expected equal lengths")
        components = {}
        total = np.zeros(n, np.float64)
        for name, fn, weight in zip(self.names, self._fns, self.weights):
            values = np.array([self._one(name, fn, c, a, sid)
                               for c, a, sid in zip(completions, answers, sample_ids)], np.float64)
            components[name] = values.astype(np.float32)
            total += weight * values
        return RewardBatch(total=total.astype(np.float32), components=components)

    def score_group(self, prompt_id: int, completions: Sequence[str], answer: str) -> np.ndarray:
        """Rewards of one group (G completions of one prompt): float32 ``[G]``.

        Sample ids are ``"prompt <prompt_id> sample <g>"``. Raises as :meth:`score`.
        """
        ids = [f"prompt {prompt_id} sample {g}" for g in range(len(completions))]
        return self.score(completions, [answer] * len(completions), ids).total

    def metrics(self) -> Dict[str, int]:
        """Failure counters, flat: ``{"reward/errors/<name>": n, "reward/timeouts/<name>": n}``."""
        out = {}
        for name, counts in self.failures.items():
            for kind, value in counts.items():
                out[f"reward/{kind}/{name}"] = value
        return out

    def _one(self, name: str, fn: RewardFn, completion: str, answer: str, sample_id) -> float:
        try:
            value = call_with_timeout(fn, (completion, answer), self.timeout_s)
            value = float(value)
        except RewardTimeout:
            self._failed(name, "timeouts", sample_id, f"ran past {self.timeout_s} s")
            return 0.0
        except Exception as e:
            self._failed(name, "errors", sample_id, f"raised {type(e).__name__}: {e}")
            return 0.0
        if not math.isfinite(value):
            raise NonFiniteRewardError(f"reward function {name!r} returned {value} for sample "
                                       f"{sample_id}; rewards must be finite numbers")
        return value

    def _failed(self, name: str, kind: str, sample_id, what: str) -> None:
        self.failures[name][kind] += 1
        count = self.failures[name]["errors"] + self.failures[name]["timeouts"]
        if count <= LOG_FIRST_FAILURES or count % 1000 == 0:
            logger.warning("reward function %r %s on sample %s: reward 0 (%d failures so far)",
                           name, what, sample_id, count)
