"""Request bodies and reply parsing of the served rewards (``reward.http`` / ``reward.judge``,
:mod:`rlflow.config.served_reward`): pure functions, no network
(the client is :mod:`rlflow.data.http_scorer`).

Two kinds:

* a reward model's endpoint (``reward.http``, :class:`rlflow.config.HttpRewardConfig`):
  the body is ``{**extra_body, batch_key: [item, ...]}`` with one item per sample,
  ``{key: sample[name]}`` for each entry of ``fields``; the reply is a JSON object whose
  ``score_field`` (a dotted path, list indices as numbers: ``result.scores``,
  ``data.0.score``) holds one number per item, in order. With ``batch_key = ""`` the one
  item is the whole body and ``score_field`` holds one number.
* a generative judge (``reward.judge``, :class:`rlflow.config.JudgeConfig`) behind the
  OpenAI-compatible ``/v1/chat/completions`` (vLLM, SGLang, TGI, the hosted APIs): the body
  is ``{**extra_body, "model": model, "messages": [{"role": "user", "content":
  prompt_template.format(question=..., reference=..., completion=...)}], "temperature": t,
  "max_tokens": n}``; the reply's ``choices[0].message.content`` is searched with
  ``score_regex`` and the last match's group 1, a number in ``[0, max_score]``, divided by
  ``max_score`` is the reward (LLM-as-a-judge single-answer grading with a reference,
  Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena", sec. 3.1).

A reply that breaks these rules raises :class:`MalformedReply` (the client retries, then
marks the samples failed).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, List, Mapping, Sequence

from rlflow.config.secrets import redact_text
from rlflow.config.served_reward import (HttpRewardConfig, JudgeConfig, ServedRewardConfig,
                                         field_pairs)

#: Where a chat completion's text is in its reply.
CHAT_REPLY_PATH = "choices.0.message.content"


class MalformedReply(ValueError):
    """A server's reply is not JSON, lacks the score, or the score is not a usable number;
    the message says what was expected and shows the start of the reply."""


def sample_dict(prompt: str, completion: str, answer: str, finish_reason: str,
                sample_id: str) -> Dict[str, str]:
    """One sample as the request fields know it (:data:`rlflow.config.served_reward.SAMPLE_FIELDS`)."""
    return {"prompt": prompt, "completion": completion, "answer": answer,
            "finish_reason": finish_reason, "sample_id": sample_id}


def request_body(cfg: ServedRewardConfig, samples: Sequence[Mapping[str, str]]) -> dict:
    """The JSON body of one request for ``samples`` (at most ``cfg.batch_size``; one for
    the judge and for ``batch_key = ""``), by the module docstring's rules."""
    body = json.loads(cfg.extra_body) if cfg.extra_body else {}
    if isinstance(cfg, JudgeConfig):
        (s,) = samples
        content = cfg.prompt_template.format(question=s["prompt"], reference=s["answer"],
                                             completion=s["completion"])
        if cfg.model:
            body["model"] = cfg.model
        body["messages"] = [{"role": "user", "content": content}]
        body["temperature"] = cfg.temperature
        if cfg.max_tokens:
            body["max_tokens"] = cfg.max_tokens
        return body
    items = [{key: s[name] for key, name in field_pairs(cfg.fields)} for s in samples]
    if not cfg.batch_key:
        (item,) = items
        body.update(item)
        return body
    body[cfg.batch_key] = items
    return body


def json_path(data: Any, path: str, secrets: Sequence[str] = ()) -> Any:
    """``data`` followed along the dotted ``path`` (``"a.b.0"``: key a, key b, index 0).

    Raises:
      MalformedReply: a key or index on the way is missing (names it; the reply quoted
        with ``secrets`` redacted, then cut).
    """
    node = data
    for part in path.split("."):
        if isinstance(node, list) and re.fullmatch(r"-?\d+", part) \
                and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise MalformedReply(f"no {part!r} on the path {path!r} in the reply "
                                 f"{_head(data, secrets)}")
    return node


def _number(value: Any, where: str, secrets: Sequence[str] = ()) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise MalformedReply(f"{where} is {_head(value, secrets)}, expected a finite number")
    return float(value)


def parse_reply(cfg: ServedRewardConfig, text: str, num_samples: int,
                secrets: Sequence[str] = ()) -> List[float]:
    """The rewards of ``num_samples`` samples from a reply's body ``text``.

    ``secrets`` (the API key sent) are redacted in every part of the reply a message quotes,
    before it is cut short (a server may echo the key; a key crossing the cut would
    otherwise stay partly visible).

    Raises:
      MalformedReply: not JSON; the score is missing, not a finite number, or there are not
        ``num_samples`` of them; (judge) the reply's text has no match of ``score_regex`` or
        the score is outside ``[0, max_score]``.
    """
    try:
        data = json.loads(text)
    except ValueError:
        raise MalformedReply(f"the reply is not JSON: {_head(text, secrets)}") from None
    if isinstance(cfg, JudgeConfig):
        content = json_path(data, CHAT_REPLY_PATH, secrets)
        if not isinstance(content, str):
            raise MalformedReply(f"{CHAT_REPLY_PATH} is {_head(content, secrets)}, "
                                 "expected text")
        return [judge_score(cfg, content, secrets)]
    assert isinstance(cfg, HttpRewardConfig), type(cfg)
    scores = json_path(data, cfg.score_field, secrets)
    if not cfg.batch_key:
        return [_number(scores, cfg.score_field, secrets)]
    if not isinstance(scores, list) or len(scores) != num_samples:
        raise MalformedReply(f"{cfg.score_field} is {_head(scores, secrets)}, expected a list of "
                             f"{num_samples} numbers (one per sample, in order)")
    return [_number(v, f"{cfg.score_field}[{i}]", secrets) for i, v in enumerate(scores)]


def judge_score(cfg: JudgeConfig, reply: str, secrets: Sequence[str] = ()) -> float:
    """A judge's reply text -> reward in ``[0, 1]``: group 1 of the last match of
    ``cfg.score_regex``, divided by ``cfg.max_score``.

    Raises:
      MalformedReply: no match, or the number is outside ``[0, max_score]`` (the reply
        quoted with ``secrets`` redacted, then cut).
    """
    matches = list(re.finditer(cfg.score_regex, reply))
    if not matches:
        raise MalformedReply(f"the judge's reply has no match of score_regex "
                             f"{cfg.score_regex!r}: {_head(reply, secrets)}")
    try:
        score = float(matches[-1].group(1))
    except (TypeError, ValueError):
        raise MalformedReply(f"the judge's score {matches[-1].group(1)!r} is not a "
                             f"number") from None
    if not 0.0 <= score <= cfg.max_score:
        raise MalformedReply(f"the judge's score {score} is outside [0, max_score="
                             f"{cfg.max_score}]")
    return score / cfg.max_score


def _head(value: Any, secrets: Sequence[str] = (), limit: int = 120) -> str:
    """``value`` for a message: its repr (a string's quoted) with ``secrets`` redacted
    (:func:`rlflow.config.secrets.redact_text`) and only then cut at ``limit`` characters,
    so no part of a secret crossing the cut stays."""
    text = redact_text(value if isinstance(value, str) else repr(value), secrets)
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return repr(cut) if isinstance(value, str) else cut
