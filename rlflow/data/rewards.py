"""Reward functions: a registry, math answer checking with math-verify, and a guarded scorer.

A reward function is ``fn(completion: str, answer: str) -> float``: the decoded completion
(special tokens removed) and the record's reference answer. A function that also takes a
keyword ``finish_reason`` (or ``**kwargs``) is told how the completion ended: ``"stop"`` (a
stop token) or ``"length"`` (cut at ``sampler.max_tokens``); the decoded text alone cannot
tell ``5<eos>`` from ``5`` followed by special tokens up to the limit (:func:`call_reward`).
Two ways to use your own:

  * name it ``"package.module:function"`` (or ``"path/to/file.py:function"``) in
    ``reward.functions``; or
  * decorate it with ``@register_reward("name")`` in a module listed in the top-level
    ``plugins`` config field, and list ``"name"``.

Every program (and every reward worker) imports these itself (:mod:`rlflow.system.plugins`); a
function registered only inside a ``--config`` file is refused when the config is resolved,
since the other programs never run that file.

Built in (each scores a truncated completion, ``finish_reason="length"``, as one that did
not finish: it stated no final answer, so 0.0; ``digits_match`` pays no stopping credit):
  * ``math_verify``: 1.0 when the completion's final answer equals the reference under
    math-verify (Kydlicek et al., HF Math-Verify), else 0.0. The reference may be a GSM8K
    answer (text ending ``#### <number>``: the number is taken) or a bare expression. The
    completion's final answer is found by :func:`completion_answer_text` (rule below).
    **Answers are values**: when the reference is a number, the final answer must be a
    number too; one with an operation left in it (``27 + 33``, ``\\boxed{27+33}``,
    ``#### 71 + 60``, a restated question) scores 0, the rule and its reasons in
    :mod:`rlflow.data.answer_values`.
  * ``math_format``: 1.0 when the completion states a final answer by rule 1 or 2 below
    (``\\boxed{...}`` or a value-like ``#### <answer>``; :func:`stated_answer`, the answer
    ``math_verify`` then checks) and, when the reference is a number, that answer is a
    value too (``\\boxed{27+33}`` is no answer to ``#### 60``); else 0.0.
  * ``exact_match``: 1.0 when completion and answer are equal after stripping whitespace.
  * ``last_number``: the strict check: 1.0 when the **last number written** in the
    completion equals the reference's number (a numeric reference only; GSM8K's ``####``
    taken), else 0.0. No extraction rules, no math-verify: it tells a model that states the
    value from one that states something math-verify reads as the value (the gap between
    the two accuracies is the size of that difference; issue 44).
  * ``digits_match``: the built-in demo task's reward (``rlflow.data.tasks``).

Served over HTTP (not functions: the names are reserved): ``http`` (a reward model's
endpoint) and ``judge`` (an LLM judge behind ``/v1/chat/completions``), set up in
``reward.http`` / ``reward.judge`` and asked asynchronously by the Rewarder
(:mod:`rlflow.data.http_scorer`, :mod:`rlflow.data.served_rewards`).

Final answer of a chat-model completion (``completion_answer_text``), first rule that applies:
  1. the content of the **last** ``\\boxed{...}`` (braces balanced; e.g. ``$\\boxed{42}$``);
  2. else the **last** ``#### <answer>`` line whose answer looks like a value: after removing
     markdown emphasis (``**``, ``__``), ``$``/``\\$``, thousands commas, a trailing period
     and a lead-in ``The answer is`` / ``Final answer:`` / ``Answer =`` it starts with a
     digit, sign, ``.``, ``(`` or a LaTeX command and is not a numbered heading (``1. First
     compute``, ``2) Then``). Markdown headings such as ``#### Step 2`` are skipped;
  3. else the completion without its markdown heading lines (lines starting with ``#``),
     left to math-verify's own extraction ("final answer is ...", then the last expression).

:class:`rlflow.data.rewarder.Rewarder` combines the configured functions with their weights and bounds each call
in time and memory by running it in a reward worker process (:mod:`rlflow.data.reward_workers`):
a function that raises, returns a non-number, runs past ``reward.timeout_s`` or past
``reward.memory_limit_mb`` gives 0 for that sample; the failure is counted per function and
logged with the sample id. A NaN or infinite reward is reported with the function and sample
(:attr:`RewardBatch.nonfinite`); :meth:`Rewarder.score` raises :class:`NonFiniteRewardError`,
the sampler follows ``learner.on_bad_reward``.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal
from typing import Callable, Dict, Sequence

from rlflow.config.data import SERVED_REWARDS
from rlflow.system import plugins as plugins_lib
from rlflow.data import answer_values
from rlflow.data.answer_values import plain_numbers
from rlflow.data.tasks import digits_match

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
_REGISTRY: Dict[str, RewardFn] = {}

#: How a completion ended: a stop token, or cut at ``sampler.max_tokens``.
FINISH_REASONS = ("stop", "length")

#: Failures of one function logged one by one before logging switches to every 1000th.
LOG_FIRST_FAILURES = 50


class NonFiniteRewardError(ValueError):
    """A reward function returned NaN or infinity; the message names it and the sample id."""


class RewardFunctionError(RuntimeError):
    """A reward function failed (raised, timed out, returned a non-number or NaN/inf) on
    ``reward.max_consecutive_errors`` calls in a row without one success: a bug in the
    function (or in every answer it reads), not a hard sample. The message names the
    function, the count and its last error with the sample id."""


def reward_value(value) -> float:
    """A reward function's return value as a float: a real number (``int``, ``float``,
    ``bool`` as 0/1, numpy scalars and 0-d numeric arrays). Anything else (a string such as
    ``"0.5"``, None, a list) is not a number.

    Raises:
      TypeError: not a number (the Rewarder scores the sample 0 and counts an error).
    """
    import numbers

    import numpy as np

    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    if (isinstance(value, np.ndarray) and value.shape == ()
            and (np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_)
            and not np.issubdtype(value.dtype, np.complexfloating)):
        return float(value)
    raise TypeError(f"returned {type(value).__name__} {str(value)[:40]!r}, expected a number "
                    f"(int, float, bool)")


def accepts_finish_reason(fn) -> bool:
    """Whether ``fn`` takes a ``finish_reason`` keyword (by name, or ``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):      # a builtin without a signature: two positionals
        return False
    return any(p.kind == p.VAR_KEYWORD or (p.name == "finish_reason" and p.kind in (
        p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) for p in params)


def call_reward(fn, completion: str, answer: str, finish_reason: str = "stop"):
    """``fn(completion, answer)``, with ``finish_reason=`` ("stop" | "length") when ``fn``
    accepts it (:func:`accepts_finish_reason`); a plain two-argument user function keeps
    working. Returns what ``fn`` returns (see :func:`reward_value`).

    Raises:
      ValueError: ``finish_reason`` is not one of :data:`FINISH_REASONS`.
      Exception: whatever ``fn`` raises.
    """
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    if accepts_finish_reason(fn):
        return fn(completion, answer, finish_reason=finish_reason)
    return fn(completion, answer)


def register_reward(name: str):
    """Decorator: register ``fn(completion, answer) -> float`` under ``name``.

    Raises:
      ValueError: ``name`` is already registered to another function, contains ``:``
        (reserved for ``module:function`` names), or is a served reward's name
        (``http``, ``judge``).
    """
    if ":" in name:
        raise ValueError(f"reward name {name!r} must not contain ':' (module:function syntax)")
    if name in SERVED_REWARDS:
        raise ValueError(f"reward name {name!r} is reserved for the served reward set up in "
                         f"reward.{name}")

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward function {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return deco


def get_reward(name: str) -> RewardFn:
    """The function ``name``: a registered name or a ``module:function`` reference.

    Raises:
      KeyError: unknown name (the message lists the registered ones and the other syntax),
        or the reference cannot be imported / is not callable.
    """
    if plugins_lib.is_reference(name):
        try:
            fn = plugins_lib.resolve(name)
        except plugins_lib.PluginError as e:
            raise KeyError(f"reward.functions: {e}") from e
        if not callable(fn):
            raise KeyError(f"reward.functions: {name!r} is a {type(fn).__name__}, not a function")
        return fn
    if name not in _REGISTRY:
        raise KeyError(f"reward.functions: unknown reward function {name!r}; "
                       f"registered: {sorted(_REGISTRY)}; a function of your own: "
                       f"'package.module:function', or register it in a module listed in "
                       f"`plugins`")
    return _REGISTRY[name]


def is_available(name: str) -> bool:
    """Whether ``name`` is registered (``module:function`` names are always looked up)."""
    return plugins_lib.is_reference(name) or name in _REGISTRY


def available_rewards() -> list:
    """Names of the registered reward functions, sorted."""
    return sorted(_REGISTRY)


def warm_up(names: Sequence[str]) -> None:
    """Do the slow first-call work of the built-in functions among ``names`` (math-verify's
    imports of sympy/latex2sympy and its first parse), outside any timed call."""
    if "math_verify" in names or "math_format" in names:
        math_verify_reward("\\boxed{1}", "#### 1")


# ---------------------------------------------------------------- math answers

_GSM8K_MARK = "####"
_BOXED_START = re.compile(r"\\boxed\s*\{")
_VALUE_START = re.compile(r"[-+\d.(\\]")
# "1. First compute", "2) Then", "(3) Check": a numbered heading, not a value
_NUMBERED_HEADING = re.compile(r"\(?\d+[.)]\s+[^\W\d]")
# "The answer is 72", "Final answer: 72", "Answer = 72": the value follows
_ANSWER_LEAD_IN = re.compile(r"^(?:the\s+)?(?:final\s+)?answer\s*(?:is\b|[:=])?\s*",
                             re.IGNORECASE)


def final_answer_text(text: str) -> str:
    """The text after the last ``####`` (first line of it, thousands commas removed), or
    ``text`` stripped when there is no ``####``. GSM8K answers end with ``#### <number>``."""
    if _GSM8K_MARK not in text:
        return text.strip()
    tail = text.rsplit(_GSM8K_MARK, 1)[1].strip()
    tail = tail.splitlines()[0] if tail else ""
    return re.sub(r"(?<=\d),(?=\d{3})", "", tail).strip()


def last_boxed(text: str):
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    for m in reversed(list(_BOXED_START.finditer(text))):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            content = text[m.end():i - 1].strip()
            if content:
                return content
    return None


def _clean_marked(line: str) -> str:
    s = line.strip().replace("**", "").replace("__", "").replace("\\$", "").replace("$", "")
    s = re.sub(r"(?<=\d),(?=\d{3})", "", s).strip()
    return s[:-1].strip() if s.endswith(".") else s


def marked_answer(completion: str):
    """The last value-like ``#### <answer>`` of a completion (cleaned as in the module
    docstring, rule 2), or None; markdown headings such as ``#### Step 2`` or
    ``#### 2. Then`` are skipped, a lead-in such as ``The answer is`` is removed."""
    if _GSM8K_MARK not in completion:
        return None
    for part in reversed(completion.split(_GSM8K_MARK)[1:]):
        lines = part.strip().splitlines()
        candidate = _clean_marked(lines[0]) if lines else ""
        candidate = _clean_marked(_ANSWER_LEAD_IN.sub("", candidate))
        if (candidate and _VALUE_START.match(candidate)
                and not _NUMBERED_HEADING.match(candidate)):
            return candidate
    return None


def stated_answer(completion: str):
    """The answer a completion states (rules 1 and 2 of the module docstring): the last
    ``\\boxed{...}`` as ``$...$``, else the last value-like ``#### <answer>``; None when it
    states none. ``math_format`` scores whether there is one, ``math_verify`` checks it.

    Answers are values: this is the *text* stated; whether it counts as an answer to a
    numeric reference is decided after math-verify parses it (:func:`graded_answers`): a
    stated ``27 + 33`` (boxed or after ``####``) is found here but is not a value, so it
    scores 0 against ``#### 60``, while ``60``, ``60.0``, ``$60``, ``1,000``, ``6e1`` and
    ``60%`` are values (the rule: :mod:`rlflow.data.answer_values`)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return f"${boxed}$"
    return marked_answer(completion)


def completion_answer_text(completion: str) -> str:
    """The final-answer text of a completion, by the rule in the module docstring
    (:func:`stated_answer`, else the completion without markdown headings)."""
    stated = stated_answer(completion)
    if stated is not None:
        return stated
    return "\n".join(line for line in completion.splitlines()
                     if not line.lstrip().startswith("#"))


def _math_verify():
    """The math_verify module, its "timeout is disabled" warning silenced.

    math-verify's own timeouts use ``signal.alarm`` (main thread only); rlflow turns them off
    and bounds each call itself (a reward worker process, :class:`Rewarder`), so the warning
    that asks the caller to handle timeouts is moot here.
    """
    import math_verify
    import math_verify.grader
    import math_verify.parser

    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


def _parse(text: str):
    return _math_verify().parse(plain_numbers(text), parsing_timeout=None)


def reference_answers(answer: str) -> list:
    """math-verify's parse of a reference answer (:func:`final_answer_text` of it).

    Raises:
      ValueError: the reference cannot be parsed (names it).
    """
    ref = final_answer_text(answer)
    gold = _parse(ref) or _parse(f"${ref}$")
    if not gold:
        raise ValueError(f"cannot parse the reference answer {answer!r}")
    return gold


def graded_answers(text: str, gold: list) -> list:
    """math-verify's parse of a completion's answer ``text``, restricted to values when the
    reference ``gold`` is a value (answers are values, :mod:`rlflow.data.answer_values`);
    ``[]``: nothing to grade (scores 0)."""
    pred = _parse(text)
    return answer_values.values(pred) if answer_values.values(gold) else pred


@register_reward("math_verify")
def math_verify_reward(completion: str, answer: str, finish_reason: str = "stop") -> float:
    """1.0 if the completion's final answer (:func:`completion_answer_text`) equals the
    reference (math-verify), else 0.0; a numeric reference is only equalled by a value
    (:func:`graded_answers`: ``71 + 60`` scores 0 against 131); 0.0 for a completion cut at
    ``max_tokens`` (``finish_reason="length"``): it never stated its final answer (the last
    number so far is not one).

    Raises:
      ValueError: the reference answer cannot be parsed (a data problem; the Rewarder
        counts it and logs the sample id).
    """
    gold = reference_answers(answer)
    if finish_reason == "length":
        return 0.0
    pred = graded_answers(completion_answer_text(completion), gold)
    if not pred:
        return 0.0
    return float(_math_verify().verify(gold, pred, timeout_seconds=None))


@register_reward("math_format")
def math_format_reward(completion: str, answer: str, finish_reason: str = "stop") -> float:
    """1.0 if the completion states a final answer as a non-empty ``\\boxed{...}`` or a
    value-like ``#### <answer>`` line (rules 1 and 2 of the module docstring; a markdown
    heading such as ``#### Step 2`` is not an answer), ended with a stop token (a completion
    cut at ``max_tokens`` is not well formed, whatever it wrote before) and, when the
    reference is a number, the stated answer is a value (``\\boxed{27+33}`` is no answer to
    ``#### 60``), else 0.0. A reference math-verify cannot parse leaves the value check alone."""
    stated = stated_answer(completion)
    if finish_reason == "length" or stated is None:
        return 0.0
    try:
        gold = reference_answers(answer)
    except ValueError:
        return 1.0
    return float(bool(graded_answers(stated, gold)))


@register_reward("exact_match")
def exact_match_reward(completion: str, answer: str, finish_reason: str = "stop") -> float:
    """1.0 if ``completion.strip() == answer.strip()`` and the completion ended with a stop
    token, else 0.0 (cut at ``max_tokens``, the decoded text may equal the answer only
    because the special tokens after it were removed)."""
    return float(finish_reason != "length" and completion.strip() == answer.strip())



# a number literal as written: optional sign (not a binary minus: no digit before it),
# digits with optional thousands commas, optional decimals
_NUMBER = re.compile(r"(?<![\d.,])-?\d+(?:,\d{3})*(?:\.\d+)?(?![\d])")


def last_number(text: str):
    """The last number literal of ``text`` as a ``Decimal`` (thousands commas removed;
    ``-5`` is negative, the ``5`` of ``10-5`` is not), or None when it has none."""
    found = _NUMBER.findall(text)
    return Decimal(found[-1].replace(",", "")) if found else None


@register_reward("last_number")
def last_number_reward(completion: str, answer: str, finish_reason: str = "stop") -> float:
    """1.0 if the last number written in the completion (:func:`last_number`) equals the
    reference's number (``60`` equals ``60.0``), else 0.0; 0.0 for a completion cut at
    ``max_tokens``. The strict twin of ``math_verify`` for numeric answers: ``71 + 60`` and
    ``131 is 71 + 60`` score 0 against 131, ``71 + 60 = 131`` scores 1.

    Raises:
      ValueError: the reference (:func:`final_answer_text`) is not a number (names it).
    """
    gold = last_number(final_answer_text(answer))
    if gold is None or _NUMBER.sub("", final_answer_text(answer)).strip(" $.%"):
        raise ValueError(f"last_number: the reference answer {answer!r} is not a number")
    if finish_reason == "length":
        return 0.0
    return float(last_number(completion) == gold)


register_reward("digits_match")(digits_match)
