"""``gsm8k_calculator``: GSM8K with a sandboxed Python tool; reward from math-verify.

Episode: ``reset`` gives a system prompt describing the ``python`` tool and the Hermes call
format (:mod:`rlflow.envs.tools`) and the question as the user turn. Each assistant message
either calls the tool (one or more ``<tool_call>`` blocks: they run in the sandbox,
:mod:`rlflow.envs.sandbox`, and their outputs come back as ``tool`` messages) or is the final
answer: the episode ends with reward ``math_verify(final message, record answer)``
(:func:`rlflow.data.rewards.math_verify_reward`: 1.0 when the last ``\\boxed{}`` / ``####``
answer equals the reference, else 0.0). A malformed call gets an error message and uses one
call of the budget; a call past ``max_tool_calls`` ends the episode with reward 0.

The sandbox's wall-clock limit (``timeout_s``) times the calls of one message must stay below
the sampler's environment-step timeout, or the step itself is timed out (reward 0).

Options (``factory(record, **options)``):
  max_tool_calls (4), timeout_s (10.0), cpu_s (5), memory_mb (512), max_output_chars (1000):
  the sandbox limits; question_field (None: ``"question"``, else ``"prompt"``),
  answer_field (``"answer"``: GSM8K's ``"... #### 72"`` or a bare value);
  tools_in_template (False): when True the tool's JSON schema is given to the chat template
  (attribute ``tools``, for Qwen-style templates that render it) and the system prompt omits
  the format description; when False the system prompt describes it (any template).

Info counters per step: ``tool_calls``, ``tool_errors``, ``tool_timeouts``
(:mod:`rlflow.envs.tools`), ``tool_limit`` (the episode ended past ``max_tool_calls``),
``reward_errors`` (the reference answer could not be parsed: reward 0).
"""

from __future__ import annotations

from typing import List, Optional

from rlflow.envs.base import EnvError, EnvStep, Message, register_environment
from rlflow.envs.sandbox import SandboxLimits
from rlflow.envs.tools import (PYTHON_TOOL, ToolCallError, new_counters, parse_tool_calls,
                               run_tool_calls, tool_message)

ANSWER_RULE = ("When you know the answer, reply without a tool call and end your reply with "
               "\"#### <answer>\".")
SYSTEM_PROMPT = (
    "Solve the math problem step by step. You can run Python code with the python tool by "
    "writing\n<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(12 * 7)\"}}"
    "\n</tool_call>\nand its output comes back. " + ANSWER_RULE)
SYSTEM_PROMPT_TEMPLATE_TOOLS = ("Solve the math problem step by step; use the python tool to "
                                "compute. " + ANSWER_RULE)


class Gsm8kCalculatorEnv:
    """One GSM8K episode with the python tool (see the module docstring)."""

    def __init__(self, question: str, answer: str, *, max_tool_calls: int,
                 limits: SandboxLimits, tools_in_template: bool):
        self.question = question
        self.answer = answer
        self.max_tool_calls = int(max_tool_calls)
        self.limits = limits
        #: JSON schemas for the chat template's ``tools=`` (None: described in the prompt)
        self.tools: Optional[List[dict]] = [PYTHON_TOOL] if tools_in_template else None
        self.calls_used = 0

    def reset(self) -> List[Message]:
        """``[system prompt, user question]``."""
        self.calls_used = 0
        system = SYSTEM_PROMPT_TEMPLATE_TOOLS if self.tools else SYSTEM_PROMPT
        return [{"role": "system", "content": system},
                {"role": "user", "content": self.question}]

    def step(self, assistant: str) -> EnvStep:
        """Run the message's tool calls, or score it as the final answer."""
        counters = new_counters()
        try:
            calls = parse_tool_calls(assistant)
        except ToolCallError as e:
            self.calls_used += 1
            if self.calls_used > self.max_tool_calls:
                return self._over_limit(counters)
            counters["tool_errors"] += 1
            return EnvStep(messages=[tool_message(f"error: {e}")], info=counters)
        if not calls:
            return self._final(assistant, counters)
        self.calls_used += len(calls)
        if self.calls_used > self.max_tool_calls:
            return self._over_limit(counters)
        messages, counters = run_tool_calls(calls, self.limits)
        return EnvStep(messages=messages, info=counters)

    def _over_limit(self, counters) -> EnvStep:
        return EnvStep(done=True, reward=0.0, info={**counters, "tool_limit": 1.0})

    def _final(self, assistant: str, counters) -> EnvStep:
        from rlflow.data.rewards import math_verify_reward

        try:
            reward = math_verify_reward(assistant, self.answer)
        except ValueError:          # the reference cannot be parsed: a data problem, counted
            return EnvStep(done=True, reward=0.0, info={**counters, "reward_errors": 1.0})
        return EnvStep(done=True, reward=reward, info=counters)


@register_environment("gsm8k_calculator")
def make_gsm8k_calculator(record: dict, *, max_tool_calls: int = 4, timeout_s: float = 10.0,
                          cpu_s: int = 5, memory_mb: int = 512, max_output_chars: int = 1000,
                          question_field: Optional[str] = None, answer_field: str = "answer",
                          tools_in_template: bool = False) -> Gsm8kCalculatorEnv:
    """``gsm8k_calculator`` for a GSM8K record (``{"question": ..., "answer": "... #### 72"}``).

    Raises:
      EnvError: the question or answer field is missing or not a non-empty string, or an
        option is out of range (the message names the field or option).
    """
    if not isinstance(record, dict):
        raise EnvError(f"gsm8k_calculator: record must be a dict, got {type(record).__name__}")
    qfield = question_field or ("question" if "question" in record else "prompt")
    for field in (qfield, answer_field):
        value = record.get(field)
        if not isinstance(value, str) or not value.strip():
            raise EnvError(f"gsm8k_calculator: record field {field!r} must be a non-empty "
                           f"string, got {value!r} (record keys: {sorted(record)})")
    if int(max_tool_calls) < 0:
        raise EnvError(f"gsm8k_calculator: option max_tool_calls must be >= 0, got "
                       f"{max_tool_calls}")
    try:
        limits = SandboxLimits(timeout_s=float(timeout_s), cpu_s=int(cpu_s),
                               memory_mb=int(memory_mb), max_output_chars=int(max_output_chars))
    except ValueError as e:
        raise EnvError(f"gsm8k_calculator: option {e}") from None
    return Gsm8kCalculatorEnv(record[qfield], record[answer_field],
                              max_tool_calls=max_tool_calls, limits=limits,
                              tools_in_template=bool(tools_in_template))
