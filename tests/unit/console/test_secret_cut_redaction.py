"""A served reward's API key echoed by the server stays hidden when the quoted reply is cut
short (issue 49 fault 2, a new user's report: ``...EEEEBearer sk-live-ABCDE' (tries: 1)``):
the reply is redacted before it is cut, and the log/stream redaction also hides a key's
cut-off start. Keys with quotes or backslashes are refused where they are read, and their
escaped spellings are redacted anyway (the buffer token may hold them)."""

from __future__ import annotations

import json
import queue

import pytest

from rlflow.config import ExperimentConfig, HttpRewardConfig, JudgeConfig, RewardConfig
from rlflow.config.secrets import MIN_PREFIX, REDACTED, clean_api_key, redact_text
from rlflow.data.http_scorer import HttpScorer, ServedRewardError, request_headers
from reward_server import RewardServer, chat_reply

KEY = "sk-live-ABCDEFGHIJKLMNOPQRSTUVWX"      # 32 characters: the cut can fall at each
SHOWN = 6                                      # no start of the key this long may show
OFFSETS = (1, 2, 5, 6, 7, 8, 13, len(KEY) - 1)  # characters of the key before the cut


def _cfg(url: str, kind: str):
    served = dict(url=url, api_key_env="RM_KEY", max_retries=0, batch_size=1)
    if kind == "judge":
        return ExperimentConfig(reward=RewardConfig(functions=("judge",), weights=(1.0,),
                                                    judge=JudgeConfig(**served))).reward.judge
    return ExperimentConfig(reward=RewardConfig(functions=("http",), weights=(1.0,),
                                                http=HttpRewardConfig(**served))).reward.http


def _reasons(kind: str, reply) -> list[str]:
    """The failure reason of one request per offset in OFFSETS; ``reply(echo, off)`` is the
    server's (status, text) for the sent header ``echo`` and that offset."""
    def respond(n, path, body, headers):
        auth = {k.lower(): v for k, v in headers.items()}["authorization"]
        return reply(auth, OFFSETS[n])

    results: queue.SimpleQueue = queue.SimpleQueue()
    with RewardServer(respond) as server:
        scorer = HttpScorer(0, _cfg(server.url + "/score", kind), results)
        try:
            got = []
            for i in range(len(OFFSETS)):      # one at a time: request n gets OFFSETS[n]
                scorer.submit([{"completion": "c", "answer": "a", "prompt": "p"}])
                got.append(results.get(timeout=60))
        finally:
            scorer.close()
    assert [status for _, _, status, _ in got] == ["error"] * len(OFFSETS), got
    return [reason for _, _, _, reason in got]


def _pad(limit: int, before: int, off: int) -> str:
    """Padding that puts the cut at ``limit`` characters ``off`` characters into the key,
    after ``before`` other characters and ``Bearer ``."""
    return "E" * (limit - before - len("Bearer ") - off)


# (kind, reply(echo, off)): each quotes the reply cut at a fixed length
CASES = {
    # the body of a 4xx, quoted up to 200 characters
    "401 body": ("http", lambda echo, off: (401, _pad(200, 0, off) + echo + " is not valid")),
    # a reply that is not JSON, quoted up to 120 characters
    "not JSON": ("http", lambda echo, off: (200, _pad(120, 0, off) + echo + " <html>")),
    # a JSON reply without the score: repr of the object, 120 characters ("{'error': '")
    "no score": ("http", lambda echo, off: (200, json.dumps(
        {"error": _pad(120, len("{'error': '"), off) + echo + " bad"}))),
    # a judge's text without a score, 120 characters
    "judge text": ("judge", lambda echo, off: chat_reply(_pad(120, 0, off) + echo + " ok")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_key_crossing_the_cut_of_a_quoted_reply_shows_no_part(case, monkeypatch):
    monkeypatch.setenv("RM_KEY", KEY + "\n")
    kind, reply = CASES[case]
    for off, reason in zip(OFFSETS, _reasons(kind, reply)):
        assert "EEEE" in reason, reason        # the padding, so the cut was where meant
        assert KEY[:SHOWN] not in reason, (off, reason)
        # the key's place holds the marker, itself cut where the key would have been
        assert "EBearer " + (REDACTED + " ")[:off] in reason, (off, reason)


def test_the_log_redaction_hides_a_cut_off_start_of_the_key():
    for off in range(MIN_PREFIX, len(KEY)):
        for tail in ("", "'", "...' (tries: 1)", "\\r\"}"):
            text = f"reason: 'EEEBearer {KEY[:off]}{tail}"
            out = redact_text(text, [KEY + "\r\n"])
            assert out == f"reason: 'EEEBearer {REDACTED}{tail}", (off, tail, out)
    # a run shorter than MIN_PREFIX is left (it cannot be told from other text) and
    # text that merely starts like the header is not touched
    assert redact_text("sk-live tokens; Bearer scheme", [KEY]) == "sk-live tokens; Bearer scheme"


@pytest.mark.parametrize("bad", ['sk-live-QQ\\RR"SS-123', 'sk-live-"quoted"', "sk-live-it's",
                                 "sk-\\x41BCDEFGHJK"])
def test_a_key_with_a_quote_or_backslash_is_refused_naming_the_variable(bad):
    with pytest.raises(ServedRewardError) as e:
        request_headers(_cfg("http://127.0.0.1:9", "http"), {"RM_KEY": bad})
    msg = str(e.value)
    assert msg.startswith("reward.http.api_key_env: the environment variable RM_KEY "), msg
    assert "a quote or backslash at character" in msg and "token68" in msg, msg
    assert bad not in msg and bad[8:] not in msg, msg
    # the characters token68 allows pass
    assert clean_api_key("sk-A_b.c~d+e/f==", "X") == "sk-A_b.c~d+e/f=="


def test_escaped_spellings_of_a_secret_with_quotes_and_backslashes_are_redacted():
    """The buffer token may hold any character; its spellings in a JSON body, in the repr
    of a JSON-escaped text and in a repr holding both quote kinds, written out here."""
    token = 'tok-QQ\\RR"SS\'TT-1234'
    header = "Bearer " + token
    as_json = json.dumps({"auth": header})                     # ...QQ\\RR\"SS'TT...
    spellings = [as_json, repr(as_json), repr(json.dumps(header)), repr(header + '"'),
                 repr(header.encode()), json.dumps(repr(header)), str({"k": header})]
    for text in spellings:
        out = redact_text(f"reply {text} end", [token])
        assert REDACTED in out and "QQ" not in out and "RR" not in out and "TT-1" not in out, \
            (text, out)
