"""Tool calls in the Hermes / Qwen format, and the built-in ``python`` tool.

Format (what Qwen2.5 / Qwen3 chat templates describe when given ``tools=``, and what their
models write): one or more blocks in the assistant message::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(12 * 7)"}}
    </tool_call>

:func:`parse_tool_calls` returns the calls (none: the message is a final answer) or raises
:class:`ToolCallError` whose message is meant for the model (malformed JSON, an unclosed
block, a missing name, arguments that are not an object). :func:`run_tool_calls` runs parsed
calls and returns one ``{"role": "tool", "content": ...}`` message per call plus counters.

Counters (numbers for ``EnvStep.info``): ``tool_calls`` (calls run), ``tool_errors``
(malformed call, unknown tool, bad arguments, an exception, a crash, the memory or output
limit), ``tool_timeouts`` (wall-clock or CPU-time limit).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from rlflow.envs.sandbox import SandboxLimits, run_python

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN, CLOSE = "<tool_call>", "</tool_call>"

#: JSON schema of the ``python`` tool (for a chat template's ``tools=`` argument).
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": ("Run a Python 3 program in a sandbox and return what it prints "
                        "(stdout and stderr). No network; limited time and memory."),
        "parameters": {"type": "object",
                       "properties": {"code": {"type": "string",
                                               "description": "the program; use print()"}},
                       "required": ["code"]},
    },
}


class ToolCallError(ValueError):
    """A malformed tool call; ``str(error)`` is the message returned to the model."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's ``name`` and its ``arguments`` (a JSON object)."""

    name: str
    arguments: Dict[str, Any]


def parse_tool_calls(text: str) -> List[ToolCall]:
    """The tool calls in an assistant message, in order; ``[]`` when it has none.

    Raises:
      ToolCallError: a ``<tool_call>`` without ``</tool_call>`` (or the reverse), a block
        whose content is not a JSON object, without a string ``"name"``, or whose
        ``"arguments"`` is neither an object nor a string holding one. The message says
        which block (1-based) and what was expected.
    """
    if text.count(OPEN) != text.count(CLOSE):
        raise ToolCallError(f"malformed tool call: {text.count(OPEN)} {OPEN} but "
                            f"{text.count(CLOSE)} {CLOSE}; write "
                            f'{OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}')
    calls = []
    for i, m in enumerate(_BLOCK.finditer(text), 1):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"tool call {i}: invalid JSON ({e.msg} at character "
                                f"{e.pos}): {body[:200]}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError(f'tool call {i}: expected a JSON object with a string "name" '
                                f'and an "arguments" object, got {body[:200]}')
        args = obj.get("arguments", {})
        if isinstance(args, str):       # some models write the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            raise ToolCallError(f'tool call {i} ({obj["name"]}): "arguments" must be a JSON '
                                f"object, got {json.dumps(args)[:200]}")
        calls.append(ToolCall(obj["name"], args))
    return calls


def tool_message(content: str) -> Dict[str, str]:
    """``{"role": "tool", "content": content}``: a tool result for the chat template."""
    return {"role": "tool", "content": content}


def new_counters() -> Dict[str, float]:
    """``{"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0}``."""
    return {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0}


def run_python_tool(arguments: Dict[str, Any], limits: SandboxLimits) -> Tuple[str, str]:
    """Run the ``python`` tool: ``(output for the model, sandbox status)``; a missing or
    non-string ``code`` argument gives status ``"error"`` without starting a process."""
    code = arguments.get("code")
    if not isinstance(code, str):
        return ('error: the python tool needs a string argument "code", got '
                f"{json.dumps(arguments)[:200]}"), "error"
    result = run_python(code, limits)
    return (result.output if result.output.strip() else "(no output)"), result.status


def run_tool_calls(calls: List[ToolCall], limits: SandboxLimits
                   ) -> Tuple[List[Dict[str, str]], Dict[str, float]]:
    """Run ``calls`` one after another (only the ``python`` tool is known).

    Returns:
      ``(messages, counters)``: one tool message per call, and the counters of the module
      docstring for these calls.
    """
    counters = new_counters()
    messages = []
    for call in calls:
        counters["tool_calls"] += 1
        if call.name != "python":
            counters["tool_errors"] += 1
            messages.append(tool_message(f"error: unknown tool {call.name!r}; available: "
                                         f"['python']"))
            continue
        output, status = run_python_tool(call.arguments, limits)
        if status in ("timeout", "cpu_limit"):
            counters["tool_timeouts"] += 1
        elif status != "ok":
            counters["tool_errors"] += 1
        messages.append(tool_message(output))
    return messages, counters
