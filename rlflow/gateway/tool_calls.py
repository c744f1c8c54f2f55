"""Model tool-call formats <-> OpenAI ``tool_calls`` (the gateway's parsers).

A parser reads the assistant text the policy sampled (end-of-turn token removed) and returns
``(content, calls)``: the text outside the calls and the calls as ``(name, arguments dict)``.
The gateway turns the calls into OpenAI ``tool_calls`` (``{"id", "type": "function",
"function": {"name", "arguments": <JSON text>}}``). The way back (an agent's assistant message
with ``tool_calls`` in a history the gateway has not recorded) is the chat template's: the
message is handed to it with ``arguments`` as a dict (:func:`template_message`).

Formats (``gateway.tool_parser``):

* ``"hermes"`` (Qwen2.5/Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>`` blocks, any number; the content is the text before the first block.
* ``"llama3"`` (Llama 3.1+ JSON tool calling): the whole message (after an optional
  ``<|python_tag|>``) is one JSON object ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), or several separated by ``;``.
* ``"none"``: never a tool call.
* ``"module:function"``: a plug-in (a model's own format, e.g. the gateway demo's tiny model,
  whose answer digit is its ``guess`` call: ``configs/agents/gateway_demo_agent.py``).

A block that is not valid JSON or has no string ``name`` is left in the content (the agent
sees what the model wrote) and counted by the caller as ``gateway/tool_parse_errors``.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Dict, List, Tuple

ToolCall = Tuple[str, dict]
Parser = Callable[[str], Tuple[str, List[ToolCall], int]]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _call_of(obj, args_keys=("arguments", "parameters")):
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            return (obj["name"], args) if isinstance(args, dict) else None
    return obj["name"], {}


def parse_hermes(text: str) -> Tuple[str, List[ToolCall], int]:
    """``<tool_call>{json}</tool_call>`` blocks -> ``(content, calls, bad blocks)``."""
    calls, bad = [], 0
    first = None
    for m in _HERMES.finditer(text):
        try:
            call = _call_of(json.loads(m.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is None:
            bad += 1
            continue
        calls.append(call)
        first = m.start() if first is None else first
    if not calls:
        return text, [], bad
    return text[:first].strip(), calls, bad


def parse_llama3(text: str) -> Tuple[str, List[ToolCall], int]:
    """Llama 3 JSON tool calls (a whole-message JSON object, ``;``-separated) ->
    ``(content, calls, bad)``."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, [], 0
    calls = []
    for part in body.split(";"):
        try:
            call = _call_of(json.loads(part))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, [], 1
        calls.append(call)
    return "", calls, 0


def parse_none(text: str) -> Tuple[str, List[ToolCall], int]:
    return text, [], 0


PARSERS: Dict[str, Parser] = {"hermes": parse_hermes, "llama3": parse_llama3,
                              "none": parse_none}


def get_parser(name: str) -> Parser:
    """The parser named ``name`` (``gateway.tool_parser``), or a ``"module:function"`` /
    ``"path/to/file.py:function"`` plug-in with the same signature (a model's own format).

    Raises:
      ValueError: an unknown name (the message lists the known ones) or a plug-in that does
        not load.
    """
    if ":" in name and name not in PARSERS:
        from rlflow.system import plugins

        try:
            return plugins.resolve(name)
        except Exception as e:  # noqa: BLE001 - named in the message
            raise ValueError(f"gateway.tool_parser: {name!r} does not load: {e}") from e
    if name not in PARSERS:
        raise ValueError(f"gateway.tool_parser: unknown format {name!r}; known: "
                         f"{sorted(PARSERS)}")
    return PARSERS[name]


def openai_tool_calls(calls: List[ToolCall], id_prefix: str) -> List[dict]:
    """``[(name, args)]`` -> OpenAI ``tool_calls`` with ids ``<id_prefix>_<i>``."""
    return [{"id": f"{id_prefix}_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, sort_keys=True)}}
            for i, (name, args) in enumerate(calls)]


def template_message(message: dict) -> dict:
    """An OpenAI chat message as the chat template takes it: ``content`` a str (text parts
    joined, None -> ""), ``tool_calls[i].function.arguments`` a dict.

    Raises:
      ValueError: a content part that is not text, or tool-call arguments that are not a
        JSON object (the message names the field).
    """
    out = dict(message)
    out["content"] = content_text(message.get("content"), "content")
    calls = message.get("tool_calls")
    if calls:
        fixed = []
        for i, call in enumerate(calls):
            fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise ValueError(f"tool_calls[{i}].function.arguments is not JSON: "
                                     f"{args[:80]!r}") from None
            if not isinstance(args, dict):
                raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON "
                                 f"object, got {type(args).__name__}")
            fn["arguments"] = args
            fixed.append({"id": call.get("id", f"call_{i}"), "type": "function",
                          "function": fn})
        out["tool_calls"] = fixed
    else:
        out.pop("tool_calls", None)
    return out


def content_text(content, where: str) -> str:
    """A message's ``content`` as text: a str, None (""), or a list of ``{"type": "text",
    "text": ...}`` parts joined.

    Raises:
      ValueError: a part that is not text (images, audio: this gateway serves text models).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}[{i}] is a {kind!r} part; only text parts are "
                                 f"served")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where} must be a string or a list of text parts, got "
                     f"{type(content).__name__}")
