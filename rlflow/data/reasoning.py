"""Thinking models: split a completion into its reasoning and its answer.

A thinking model (Qwen3 with its default template, DeepSeek-R1 style models) writes its
reasoning first, ``<think> ... </think>``, then the answer. Only the answer is graded and
only the answer may act: rewards (:class:`rlflow.sampler.delivery.GroupDelivery`) and an
environment's ``step`` (tool-call parsing in :mod:`rlflow.envs.tools`, through
:class:`rlflow.sampler.episodes.EpisodeDriver`) read :attr:`ReasoningSplit.answer`, so a
``\\boxed{41}`` drafted while thinking does not override the stated ``#### 42``, and a tool
call considered and dropped inside ``<think>`` is not run. ``samples.jsonl`` keeps both parts
(``reasoning`` and ``answer`` beside the whole ``completion``).

**A completion whose reasoning never closed is graded 0** (reward 0 without calling the
reward functions; an episode's turn ends the episode with reward 0, no environment step): it
ran out of tokens, or stopped, while thinking, and has stated no answer; grading the thought
would reward drafts.

``data.reasoning_parser`` (:func:`get_reasoning_parser`):

* ``"none"``: no reasoning; the whole completion is the answer.
* ``"qwen3"``: Qwen3's ``<think>...</think>`` (as vLLM's ``qwen3`` reasoning parser):
  the reasoning is the text before the first ``</think>`` (a leading ``<think>`` removed), the
  answer the text after it (leading whitespace removed). ``<think>`` without ``</think>``:
  never closed. Neither tag: no reasoning, the whole completion is the answer (Qwen3 with
  ``enable_thinking=False`` renders an empty think block into the prompt).
* ``"auto"`` (default): ``"qwen3"`` for a Qwen3 model (``model_type`` "qwen3" or "qwen3_moe"), else
  ``"none"``.
* ``"package.module:function"`` / ``"path/file.py:function"`` (loaded like reward plug-ins,
  :mod:`rlflow.system.plugins`): ``function(completion: str)`` returning a
  :class:`ReasoningSplit` or a pair ``(reasoning, answer)`` with ``answer=None`` for
  reasoning that never closed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from rlflow.system import plugins as plugins_lib

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
BUILT_IN = ("none", "qwen3", "auto")


class ReasoningSplit(NamedTuple):
    """A completion's two parts.

    Attributes:
      reasoning: the thinking text ("" when there is none).
      answer: the text that is graded and acts (tool calls); "" when ``closed`` is False.
      closed: False when the reasoning never closed (graded 0).
    """

    reasoning: str
    answer: str
    closed: bool = True


ReasoningParser = Callable[[str], ReasoningSplit]


def split_none(completion: str) -> ReasoningSplit:
    """No reasoning: the whole completion is the answer."""
    return ReasoningSplit("", completion, True)


def split_qwen3(completion: str) -> ReasoningSplit:
    """Qwen3's ``<think>...</think>`` split (rule in the module docstring)."""
    if THINK_CLOSE in completion:
        reasoning, _, answer = completion.partition(THINK_CLOSE)
        reasoning = reasoning.lstrip()
        if reasoning.startswith(THINK_OPEN):
            reasoning = reasoning[len(THINK_OPEN):]
        return ReasoningSplit(reasoning.strip(), answer.lstrip(), True)
    if THINK_OPEN in completion:
        return ReasoningSplit(completion.split(THINK_OPEN, 1)[1].strip(), "", False)
    return ReasoningSplit("", completion, True)


def get_reasoning_parser(name: str, *, model_type: Optional[str] = None) -> ReasoningParser:
    """The parser ``data.reasoning_parser`` names (module docstring).

    Args:
      name: "none", "qwen3", "auto" or a ``module:function`` reference.
      model_type: the model's family ("llama", "qwen2", "qwen3"), for "auto".

    Returns: a function ``completion -> ReasoningSplit`` (a plug-in's pair is converted).

    Raises:
      ValueError: an unknown name, or a reference that cannot be loaded or is not callable
        (the message names ``data.reasoning_parser``).
    """
    if name == "auto":
        name = "qwen3" if model_type in ("qwen3", "qwen3_moe") else "none"
    if name == "none":
        return split_none
    if name == "qwen3":
        return split_qwen3
    if not plugins_lib.is_reference(name):
        raise ValueError(f"data.reasoning_parser: expected one of {list(BUILT_IN)} or "
                         f"'package.module:function', got {name!r}")
    try:
        fn = plugins_lib.resolve(name)
    except plugins_lib.PluginError as e:
        raise ValueError(f"data.reasoning_parser: {e}") from e
    if not callable(fn):
        raise ValueError(f"data.reasoning_parser: {name!r} is a {type(fn).__name__}, not a "
                         f"function")

    def plugin(completion: str) -> ReasoningSplit:
        out = fn(completion)
        if isinstance(out, ReasoningSplit):
            return out
        try:
            reasoning, answer = out
        except (TypeError, ValueError):
            raise TypeError(f"data.reasoning_parser {name!r} returned {type(out).__name__}, "
                            f"expected ReasoningSplit or (reasoning, answer or None)") from None
        if answer is None:
            return ReasoningSplit(str(reasoning), "", False)
        return ReasoningSplit(str(reasoning), str(answer), True)
    return plugin
