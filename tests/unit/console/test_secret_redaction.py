"""A served reward's API key never reaches a log, a terminal or the launcher's failure line
(issue 49, fault 2): the key is stripped of an editor's trailing CR/LF and checked where it is
read, and every form of it (with and without the whitespace, as repr of str and bytes, as
JSON) is redacted in log lines, logged tracebacks, the fatal traceback and stderr."""

from __future__ import annotations

import io
import json
import logging
import queue
import sys
import threading

import pytest

from rlflow.config import (ConfigError, ExperimentConfig, HttpRewardConfig, RewardConfig,
                           secrets)
from rlflow.config.secrets import REDACTED, install_log_redaction, install_stream_redaction
from rlflow.data.http_scorer import HttpScorer, ServedRewardError, request_headers
from reward_server import RewardServer

KEY = "sk-live-7f3a9c2e41"
RAW = KEY + "\r\n"                      # as `export RM_KEY=$(cat key.txt)` from an editor's file


def forms_of(key: str) -> list[str]:
    """The spellings of ``key`` a leak would show, written out here (not the module's
    list): the key itself is a substring of each but the bytes/JSON escapes of a key with
    special characters, so checking ``key`` and these covers them."""
    header = "Bearer " + key
    return [key, repr(key + "\r"), repr((header + "\r").encode()), json.dumps(key + "\r\n")]


def _cfg(url="http://127.0.0.1:9/score", **http):
    return ExperimentConfig(reward=RewardConfig(functions=("http",), weights=(1.0,),
                                                http=HttpRewardConfig(url=url,
                                                                      api_key_env="RM_KEY",
                                                                      **http)))


@pytest.fixture(autouse=True)
def fresh_redaction(monkeypatch):
    """Each test starts with no installed secrets and restores sys.stdout / sys.stderr."""
    monkeypatch.setattr(secrets, "_INSTALLED", [])
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)


def test_a_key_with_a_trailing_crlf_is_stripped_and_inner_whitespace_is_refused(monkeypatch):
    cfg = _cfg()
    assert request_headers(cfg.reward.http, {"RM_KEY": RAW}) == {"Authorization":
                                                                  "Bearer " + KEY}
    assert request_headers(cfg.reward.http, {"RM_KEY": "\t" + KEY + " \n"})[
        "Authorization"] == "Bearer " + KEY
    for bad, what in ((KEY[:6] + " " + KEY[6:], "a space at character 7"),
                      (KEY[:6] + "\r" + KEY[6:], "a control character (U+000D) at character 7"),
                      (KEY[:6] + "\x00" + KEY[6:], "a control character (U+0000)"),
                      (KEY[:6] + "é" + KEY[6:], "a non-ASCII character")):
        with pytest.raises(ServedRewardError) as e:
            request_headers(cfg.reward.http, {"RM_KEY": bad})
        msg = str(e.value)
        assert msg.startswith("reward.http.api_key_env: the environment variable RM_KEY "), msg
        assert what in msg and KEY[:6] not in msg and KEY[6:] not in msg, msg
    # rlflow train's pre-start check refuses it the same way (exit 2 there)
    from rlflow.console.checks import _check_rewards

    monkeypatch.setenv("RM_KEY", KEY[:6] + " " + KEY[6:])
    with pytest.raises(ConfigError, match=r"^reward\.http\.api_key_env: .*RM_KEY .*a space"):
        _check_rewards(cfg)
    monkeypatch.setenv("RM_KEY", RAW)
    _check_rewards(cfg)


def test_every_form_of_the_key_is_redacted_in_log_lines_and_logged_tracebacks():
    stream = io.StringIO()
    logger = logging.getLogger("rlflow.test_secret_redaction")
    logger.propagate = False
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("[sampler] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    try:
        install_log_redaction([RAW], logger)
        for form in forms_of(KEY):
            logger.warning("request failed: %s", form)
        try:
            raise RuntimeError(f"Illegal header value {('Bearer ' + KEY + chr(13)).encode()!r}")
        except RuntimeError:
            logger.exception("scoring failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert KEY not in text and "sk-live" not in text, text
    assert text.count(REDACTED) == len(forms_of(KEY)) + 1
    assert "[sampler] WARNING request failed: " in text and "Traceback" in text
    assert f"Illegal header value b'Bearer {REDACTED}\\r'" in text


def test_stderr_and_a_thread_s_uncaught_error_are_redacted(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)   # not pytest's
    install_stream_redaction([RAW])

    def boom():
        raise ValueError(f"server said: {json.dumps({'echo': 'Bearer ' + KEY})}")

    t = threading.Thread(target=boom)
    t.start()
    t.join()
    print(repr(RAW), file=sys.stderr)
    text = err.getvalue()
    assert "ValueError: server said:" in text and KEY not in text, text
    assert f"'{REDACTED}'" in text


def test_the_fatal_traceback_and_line_are_redacted(monkeypatch):
    """The launcher's child prints the traceback that ends it outside logging, then the
    ``rlflow fatal:`` line the launcher reports; both hide the key."""
    from rlflow.launcher import launch

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)

    def child_main(argv):            # as the real one: redaction installed, then a failure
        install_log_redaction([RAW], logging.getLogger("rlflow.test_fatal"))
        header = ("Bearer " + KEY + "\r").encode()
        raise RuntimeError(f"Illegal header value {header!r}; 401 body: {KEY}")

    monkeypatch.setattr(launch, "child_main", child_main)
    assert launch.run_child([]) == 1
    text = err.getvalue()
    assert "Traceback (most recent call last)" in text and KEY not in text, text
    assert (f"rlflow fatal: RuntimeError: Illegal header value b'Bearer {REDACTED}\\r'; "
            f"401 body: {REDACTED}") in text


def test_a_key_echoed_in_a_401_reply_is_not_in_the_scorers_error(monkeypatch):
    """A loopback server that answers 401 with the request's Authorization header: the
    error the scorer reports (counted, logged, raised after too many) hides the key."""
    def respond(n, path, body, headers):
        auth = {k.lower(): v for k, v in headers.items()}.get("authorization", "")
        return 401, json.dumps({"error": f"invalid key {auth!r}", "key": auth[7:]})

    monkeypatch.setenv("RM_KEY", RAW)
    results: queue.SimpleQueue = queue.SimpleQueue()
    with RewardServer(respond) as server:
        cfg = _cfg(url=server.url + "/score", max_retries=0)
        scorer = HttpScorer(0, cfg.reward.http, results)
        try:
            scorer.submit([{"completion": "a", "answer": "a", "prompt": "p"}])
            slot, task_id, status, reason = results.get(timeout=30)
        finally:
            scorer.close()
        sent = {k.lower(): v for k, v in server.requests[0][2].items()}["authorization"]
    assert sent == "Bearer " + KEY                     # stripped before it was sent
    assert status == "error" and "HTTP 401" in reason and REDACTED in reason, reason
    assert KEY not in reason and "sk-live" not in reason, reason
