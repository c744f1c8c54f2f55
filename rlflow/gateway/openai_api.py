"""OpenAI request checks and response shapes (chat completions, completions, streaming).

Served fields (anything else in a request is ignored, as OpenAI-compatible servers do):

* chat: ``messages``, ``tools``, ``tool_choice`` ("auto" or "none": decoding is not
  constrained, so "required" and a named function are refused), ``n``, ``stream``
  (``stream_options.include_usage``), ``logprobs`` (the sampled token's behaviour logprob;
  ``top_logprobs`` > 0 is refused: the sampler keeps only the sampled token's), ``max_tokens``
  / ``max_completion_tokens``, ``stop`` (strings that are one token of the vocabulary; longer
  stop strings are refused, since a cut inside a sampled turn would break token in / token
  out), ``temperature`` and ``top_p`` (only the run's values, or absent: the behaviour
  logprobs must be the ones the learner's objective expects), ``seed``.
* completions: ``prompt`` (a string or a list of token ids) and the same sampling fields.

Responses carry the standard fields and an ``rlflow`` object: the session id, the sampled
``token_ids`` and ``policy_versions`` of each choice (``choices[i].rlflow``).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, List, Optional

from rlflow.gateway.sessions import GatewayError


@dataclass
class CallSpec:
    """A checked request: what to generate and how to answer."""

    messages: Any = None
    prompt: Any = None
    tools: Any = None
    parse_tools: bool = True
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    max_tokens: Optional[int] = None
    stop_ids: tuple = ()
    seed: Optional[int] = None
    model: str = ""


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(400, "invalid_request_error", message, param)


def _int(body, key, low, high=None) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high and v > high):
        raise _bad(f"'{key}' must be an integer in [{low}, {high or 'inf'}], got {v!r}", key)
    return v


def _run_value(body, key, allowed: float) -> None:
    v = body.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(f"'{key}' must be a number, got {v!r}", key)
    if abs(float(v) - float(allowed)) > 1e-6:
        raise _bad(f"'{key}'={v} is not allowed: this run samples with {key}={allowed} (the "
                   f"behaviour logprobs must be the policy's at the run's settings); omit "
                   f"it or send {allowed}", key)


def parse_call(body, *, chat: bool, sampling, stop_id_of, max_n: int) -> CallSpec:
    """Check a request body.

    Args:
      body: the decoded JSON.
      chat: chat completions (``messages``) or completions (``prompt``).
      sampling: the run's :class:`rlflow.sampler.sampling.SamplingParams` (temperature, top-p).
      stop_id_of: ``str -> Optional[int]``: the id of a one-token stop string, else None.
      max_n: most choices per call.

    Raises:
      GatewayError: 400 naming the field and what was expected.
    """
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", "")
    spec = CallSpec(model=str(body.get("model") or ""))
    if chat:
        spec.messages = body.get("messages")
        if not isinstance(spec.messages, list) or not spec.messages:
            raise _bad("'messages' must be a non-empty list of messages", "messages")
        spec.tools = body.get("tools") or None
        if spec.tools is not None and not isinstance(spec.tools, list):
            raise _bad("'tools' must be a list of tool objects", "tools")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise _bad(f"'tool_choice'={choice!r} is not served: the gateway does not "
                       f"constrain decoding; use 'auto' or 'none'", "tool_choice")
        spec.parse_tools = choice != "none"
        top = body.get("top_logprobs")
        if top:
            raise _bad("'top_logprobs' > 0 is not served: the sampler keeps only the sampled "
                       "token's logprob", "top_logprobs")
        spec.logprobs = bool(body.get("logprobs"))
        spec.max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    else:
        spec.prompt = body.get("prompt")
        ok = isinstance(spec.prompt, str) and spec.prompt or (
            isinstance(spec.prompt, list) and spec.prompt and
            all(isinstance(t, int) and not isinstance(t, bool) for t in spec.prompt))
        if not ok:
            raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
        lp = body.get("logprobs")
        if lp not in (None, 0, 1, False, True):
            raise _bad("'logprobs' > 1 is not served: the sampler keeps only the sampled "
                       "token's logprob", "logprobs")
        spec.logprobs = lp is not None and lp is not False
        spec.max_tokens = _int(body, "max_tokens", 1)
    spec.n = _int(body, "n", 1, max_n) or 1
    spec.stream = bool(body.get("stream"))
    opts = body.get("stream_options") or {}
    spec.include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    spec.seed = _int(body, "seed", 0)
    _run_value(body, "temperature", sampling.temperature)
    _run_value(body, "top_p", sampling.top_p)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    ids = []
    for s in stops:
        i = stop_id_of(s)
        if i is None:
            raise _bad(f"stop string {s!r} is not one token of this model's vocabulary; only "
                       f"one-token stops are served (a cut inside a sampled token sequence "
                       f"would break token in / token out)", "stop")
        ids.append(i)
    spec.stop_ids = tuple(ids)
    return spec


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def logprob_entries(tokenizer, ids, logprobs) -> List[dict]:
    """OpenAI ``logprobs.content`` entries: each sampled token's text, logprob and bytes."""
    out = []
    for i, lp in zip(ids, logprobs):
        text = tokenizer.decode([int(i)], skip_special_tokens=False)
        out.append({"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8")),
                    "top_logprobs": []})
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens),
            "total_tokens": int(prompt_tokens + completion_tokens)}


def chat_response(rid: str, model: str, choices: List[dict], prompt_len: int,
                  session: str) -> dict:
    """A ``chat.completion`` object; ``choices``: ``{"message", "finish_reason", "logprobs",
    "ids", "versions"}`` per choice."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "message": c["message"],
                         "finish_reason": c["finish_reason"], "logprobs": c["logprobs"],
                         "rlflow": {"token_ids": c["ids"], "policy_versions": c["versions"]}}
                        for i, c in enumerate(choices)],
            "usage": usage(prompt_len, sum(len(c["ids"]) for c in choices)),
            "rlflow": {"session": session}}


def chat_chunks(response: dict, include_usage: bool) -> List[dict]:
    """The streamed form of a finished ``chat.completion``: per choice a role chunk, a
    content chunk (with its logprobs), a tool-calls chunk, a finish chunk; then a usage chunk
    when asked."""
    base = {"id": response["id"], "object": "chat.completion.chunk",
            "created": response["created"], "model": response["model"],
            "system_fingerprint": None}
    chunks = []
    for c in response["choices"]:
        msg, i = c["message"], c["index"]

        def chunk(delta, finish=None, logprobs=None, extra=None):
            ch = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            if extra:
                ch["rlflow"] = extra
            return dict(base, choices=[ch])

        chunks.append(chunk({"role": "assistant", "content": ""}))
        if msg.get("reasoning_content"):
            chunks.append(chunk({"reasoning_content": msg["reasoning_content"]}))
        if msg.get("content") or c["logprobs"]:
            chunks.append(chunk({"content": msg.get("content") or ""}, logprobs=c["logprobs"]))
        for k, call in enumerate(msg.get("tool_calls") or ()):
            chunks.append(chunk({"tool_calls": [dict(call, index=k)]}))
        chunks.append(chunk({}, finish=c["finish_reason"], extra=c["rlflow"]))
    if include_usage:
        chunks.append(dict(base, choices=[], usage=response["usage"]))
    return chunks


def completion_response(rid: str, model: str, choices: List[dict], prompt_len: int,
                        session: str) -> dict:
    """A ``text_completion`` object (legacy completions)."""
    out = []
    for i, c in enumerate(choices):
        lp = None
        if c["logprobs"] is not None:
            entries = c["logprobs"]["content"]
            lp = {"tokens": [e["token"] for e in entries],
                  "token_logprobs": [e["logprob"] for e in entries],
                  "top_logprobs": None, "text_offset": []}
        out.append({"index": i, "text": c["text"], "finish_reason": c["finish_reason"],
                    "logprobs": lp,
                    "rlflow": {"token_ids": c["ids"], "policy_versions": c["versions"]}})
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": out,
            "usage": usage(prompt_len, sum(len(c["ids"]) for c in choices)),
            "rlflow": {"session": session}}


def error_body(err: GatewayError) -> dict:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            409: "conflict_error", 413: "invalid_request_error", 503: "server_error",
            504: "timeout_error"}.get(err.status, "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param,
                      "code": err.code}}
