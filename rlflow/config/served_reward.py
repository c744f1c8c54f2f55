"""Rewards served over HTTP: a reward model's scoring endpoint (``reward.http``,
:class:`HttpRewardConfig`) and a chat model as judge (``reward.judge``, :class:`JudgeConfig`).

Each is used when its name (``"http"``, ``"judge"``) is in ``reward.functions``; the client
that asks them is :mod:`rlflow.data.http_scorer`, the request and reply formats are
:mod:`rlflow.data.served_rewards`. Both share the transport settings of
:class:`ServedRewardConfig` (url, batching, concurrency, timeouts, retries, headers, key).
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Tuple

from rlflow.config.validation import _check, _finite_floats, _positive, _timeout

#: What a sample offers a reward model's request body (``HttpRewardConfig.fields``).
SAMPLE_FIELDS = ("prompt", "completion", "answer", "finish_reason", "sample_id")
#: Placeholders of the judge's ``prompt_template``.
JUDGE_PLACEHOLDERS = ("question", "reference", "completion")

DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a question against a reference answer.\n\n"
    "Question:\n{question}\n\nReference answer:\n{reference}\n\n"
    "Answer to grade:\n{completion}\n\n"
    "Is the answer to grade correct and complete? Rate it from 0 (wrong) to 10 (fully "
    "correct). End your reply with one line: Score: <n>")

# The shared fields' entries of the Attributes sections below (appended to each docstring).
_TRANSPORT_ATTRIBUTES = """
      url: the endpoint, ``http://`` or ``https://`` (required when the reward is used).
      extra_body: a JSON object merged into every request body (e.g. ``{"seed": 0}``);
        "" for none.
      batch_size: samples per request (>= 1).
      max_concurrency: requests in flight at once (>= 1); more wait their turn.
      timeout_s: seconds one try may take, connect to last byte.
      max_retries: tries after the first (>= 0).
      backoff_s / max_backoff_s: the backoff's base and cap, seconds.
      headers: extra request headers, ``"Name: value"`` each; they are written to the
        run's config.json, so a secret belongs in ``api_key_env`` instead.
      api_key_env: the environment variable holding an API key ("" for none); the sampler
        reads it where it makes the requests, sends it as ``api_key_header:
        api_key_prefix + key`` and hides its value in logs; the key is never in a config.
      api_key_header / api_key_prefix: how the key is sent (``Authorization: Bearer <key>``
        by default; e.g. ``x-api-key`` and "" for servers that want that).
"""


@dataclass(frozen=True)
class ServedRewardConfig:
    """What every served reward shares: where it is, how it is batched and retried.

    Every request is retried after a timeout, a connection error, an HTTP 408/429/5xx status
    or a reply that holds no valid score, waiting ``uniform(0, min(max_backoff_s, backoff_s *
    2**(k-1)))`` seconds before retry k (exponential backoff with full jitter); other 4xx
    statuses are final. A sample whose request still fails scores 0 and is marked failed in
    its record (``learner.on_failed_sample``). A request ends at most about
    ``(max_retries + 1) * timeout_s + max_retries * max_backoff_s`` seconds after it starts;
    the sampler never waits on it (it decodes on while the reply is due).

    Attributes:"""

    url: str = ""
    extra_body: str = ""
    batch_size: int = 8
    max_concurrency: int = 4
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    headers: Tuple[str, ...] = ()
    api_key_env: str = ""
    api_key_header: str = "Authorization"
    api_key_prefix: str = "Bearer "

    #: The section's name in messages (``reward.http`` / ``reward.judge``).
    SECTION = "reward.served"

    def __post_init__(self):
        where = self.SECTION
        _finite_floats(self, where)
        _check(not self.url or re.match(r"https?://[^/\s]+", self.url) is not None,
               f"{where}.url", f"must start with http:// or https:// and a host, got "
                               f"{self.url!r}")
        _positive(self.batch_size, f"{where}.batch_size")
        _positive(self.max_concurrency, f"{where}.max_concurrency")
        _timeout(self.timeout_s, f"{where}.timeout_s")
        _check(self.max_retries >= 0, f"{where}.max_retries",
               f"must be >= 0, got {self.max_retries}")
        _check(self.backoff_s >= 0, f"{where}.backoff_s", f"must be >= 0, got {self.backoff_s}")
        _check(self.max_backoff_s >= self.backoff_s, f"{where}.max_backoff_s",
               f"must be >= backoff_s ({self.backoff_s}), got {self.max_backoff_s}")
        if self.extra_body:
            try:
                extra = json.loads(self.extra_body)
            except ValueError as e:
                extra = None
                _check(False, f"{where}.extra_body", f"is not JSON ({e})")
            _check(isinstance(extra, dict), f"{where}.extra_body", "must be a JSON object {...}")
        for h in self.headers:
            _check(":" in h and bool(h.split(":", 1)[0].strip()), f"{where}.headers",
                   f"entry {h!r}: expected 'Name: value'")
        named = {n.lower() for n, _ in header_pairs(self.headers)}
        _check(self.api_key_header.lower() not in named, f"{where}.headers",
               f"sets {self.api_key_header!r}, the API key's header: headers are written to "
               f"config.json; put the key in an environment variable named by "
               f"{where}.api_key_env")
        _check(not self.api_key_env
               or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env) is not None,
               f"{where}.api_key_env",
               f"must be an environment variable's name, got {self.api_key_env!r}")


@dataclass(frozen=True)
class HttpRewardConfig(ServedRewardConfig):
    """A reward model's scoring endpoint (``reward.http``, reward name ``"http"``).

    POST ``{**extra_body, batch_key: [sample, ...]}``, one number per sample back at
    ``score_field``, in order (:mod:`rlflow.data.served_rewards`). Transport, retries and
    failures as :class:`ServedRewardConfig`.

    Attributes:
      fields: what each sample sends: entries ``"name"`` or ``"key=name"`` (sent under
        ``key``), ``name`` one of prompt (the prompt as the model saw it, template
        applied), completion (its answer part for a thinking model), answer (the
        reference), finish_reason ("stop" | "length"), sample_id.
      batch_key: the body key of the list of samples; "" sends one sample's fields as the
        body itself (needs ``batch_size`` 1).
      score_field: dotted path in the JSON reply (``a.b.0``) to the list of numbers, one per
        sample in request order (one number when ``batch_key`` is "")."""

    fields: Tuple[str, ...] = ("prompt", "completion", "answer")
    batch_key: str = "samples"
    score_field: str = "scores"

    SECTION = "reward.http"

    def __post_init__(self):
        super().__post_init__()
        where = self.SECTION
        _check(bool(self.fields), f"{where}.fields", "needs at least one field")
        for entry in self.fields:
            key, name = field_pairs((entry,))[0]
            _check(name in SAMPLE_FIELDS and bool(key), f"{where}.fields",
                   f"entry {entry!r}: expected 'name' or 'key=name' with name one of "
                   f"{list(SAMPLE_FIELDS)}")
        _check(bool(self.score_field), f"{where}.score_field",
               "must name the reply's score field")
        if not self.batch_key:
            _check(self.batch_size == 1, f"{where}.batch_size",
                   f"must be 1 with batch_key='' (one sample per request), got "
                   f"{self.batch_size}")


@dataclass(frozen=True)
class JudgeConfig(ServedRewardConfig):
    """A chat model as judge (``reward.judge``, reward name ``"judge"``).

    An OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, SGLang, TGI, hosted APIs),
    one sample per request: the user message is ``prompt_template`` filled in, the reward
    the score parsed from the reply with ``score_regex`` over ``max_score``
    (:mod:`rlflow.data.served_rewards`). Transport, retries and failures as
    :class:`ServedRewardConfig`.

    Attributes:
      model: the body's ``model``; "" leaves it out.
      prompt_template: the judge's user message, a Python format string with
        ``{question}`` (the prompt, template applied), ``{reference}`` and
        ``{completion}`` (required).
      score_regex: the judge's score: group 1 of the regex's last match in the reply, a
        number in ``[0, max_score]`` (no match, or outside: a malformed reply).
      max_score: the top of the judge's scale (> 0); the reward is ``score / max_score``.
      max_tokens: the body's ``max_tokens`` (0 leaves it out).
      temperature: the body's ``temperature`` (>= 0)."""

    batch_size: int = 1
    max_concurrency: int = 8
    model: str = ""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    score_regex: str = r"Score:\s*\**\s*([0-9]+(?:\.[0-9]+)?)"
    max_score: float = 10.0
    max_tokens: int = 512
    temperature: float = 0.0

    SECTION = "reward.judge"

    def __post_init__(self):
        super().__post_init__()
        where = self.SECTION
        _check(self.batch_size == 1, f"{where}.batch_size",
               f"must be 1 (a chat request grades one answer), got {self.batch_size}")
        _positive(self.max_score, f"{where}.max_score")
        _check(self.max_tokens >= 0, f"{where}.max_tokens", f"must be >= 0, got {self.max_tokens}")
        _check(self.temperature >= 0, f"{where}.temperature",
               f"must be >= 0, got {self.temperature}")
        try:
            regex = re.compile(self.score_regex)
        except re.error as e:
            regex = None
            _check(False, f"{where}.score_regex", f"is not a regular expression ({e})")
        _check(regex.groups >= 1, f"{where}.score_regex", "needs a group capturing the score")
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f}
        except ValueError as e:
            names = set()
            _check(False, f"{where}.prompt_template", f"is not a format string ({e})")
        unknown = sorted(names - set(JUDGE_PLACEHOLDERS))
        _check(not unknown, f"{where}.prompt_template",
               f"unknown placeholder(s) {unknown}; allowed: {list(JUDGE_PLACEHOLDERS)}")
        _check("completion" in names, f"{where}.prompt_template",
               "must contain {completion} (the text the judge grades)")


ServedRewardConfig.__doc__ += _TRANSPORT_ATTRIBUTES
HttpRewardConfig.__doc__ += _TRANSPORT_ATTRIBUTES
JudgeConfig.__doc__ += _TRANSPORT_ATTRIBUTES


def field_pairs(fields: Tuple[str, ...]) -> Tuple[Tuple[str, str], ...]:
    """``fields`` entries as ``(body key, sample field)`` pairs (``"key=name"`` or ``"name"``)."""
    return tuple(tuple(f.split("=", 1)) if "=" in f else (f, f) for f in fields)


def header_pairs(headers: Tuple[str, ...]) -> Tuple[Tuple[str, str], ...]:
    """``"Name: value"`` entries as ``(name, value)`` pairs, both stripped."""
    return tuple((h.split(":", 1)[0].strip(), h.split(":", 1)[1].strip()) for h in headers)
