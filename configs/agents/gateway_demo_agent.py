"""The gateway demo's agent program, written only against the official ``openai`` client:
``guess_digit`` as a multi-step tool-using task (configs/gateway_demo.py).

The agent offers the model one tool, ``guess(digit)``, and asks ``"?"``. Each call's answer is
either a ``guess`` tool call (the agent runs the tool: right -> the episode ends with reward
``1 - 0.1 (t - 1)`` on turn ``t``; wrong -> the tool's result ``"+"`` (higher) or ``"-"``
(lower) goes back as a ``tool`` message), or plain text (the agent answers ``"?"``). The
whole history is sent back on every call, as any OpenAI agent does. At most 3 turns; a turn
cut by the token limit, or a call refused because the episode's tokens are used up
(``context_length_exceeded``), ends the episode with reward 0. Rewards as
``rlflow.envs.guess_digit``.

The tiny model's 20-token vocabulary cannot spell JSON, so its tool-call format is its own:
an answer that starts with a digit is a call of ``guess`` with that digit
(:func:`parse_guess`, the run's ``gateway.tool_parser``); the gateway turns it into OpenAI
``tool_calls``, and a real model's ``<tool_call>`` JSON would go the same way ("hermes").
"""

import json

import openai

TOOLS = [{"type": "function", "function": {
    "name": "guess", "description": "Guess the hidden digit; answers '+' (higher) or '-' (lower).",
    "parameters": {"type": "object", "properties": {"digit": {"type": "integer"}},
                   "required": ["digit"]}}}]
MAX_TURNS = 3
TURN_PENALTY = 0.1


def parse_guess(text: str):
    """The demo model's tool-call format: ``"3..."`` -> ``guess(digit=3)``."""
    t = text.strip()
    if t[:1].isdigit():
        return "", [("guess", {"digit": int(t[0])})], 0
    return text, [], 0


def agent(client, task) -> float:
    """Play one episode through ``client`` (an ``openai.OpenAI`` bound to the session);
    ``task["answer"]`` is the hidden digit. Returns the reward."""
    hidden = int(task["answer"])
    messages = [{"role": "user", "content": "?"}]
    for turn in range(1, MAX_TURNS + 1):
        try:
            r = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError as e:      # the episode's tokens are used up
            if e.code == "context_length_exceeded":
                return 0.0
            raise
        choice = r.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason == "length":
            return 0.0
        if not choice.message.tool_calls:
            messages.append({"role": "user", "content": "?"})
            continue
        call = choice.message.tool_calls[0]
        digit = json.loads(call.function.arguments)["digit"]
        if digit == hidden:
            return 1.0 - TURN_PENALTY * (turn - 1)
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": "+" if hidden > digit else "-"})
    return 0.0
