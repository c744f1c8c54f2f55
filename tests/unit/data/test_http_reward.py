"""Served rewards against a local server (issue 44 item 3): the Rewarder asks ``reward.http``
(a reward model's ``scores`` endpoint) and ``reward.judge`` (an OpenAI-compatible chat judge)
on 127.0.0.1 (:mod:`reward_server`), and a server that hangs, fails with 500, answers
garbage or restarts is timed out, retried, counted, and never holds the caller.

No timing assertions: the tries, retries and failures are counted, and each test ends within
its configured budget (``timeout_s`` x tries) by construction.
"""

import json

import numpy as np
import pytest

from rlflow.config import HttpRewardConfig, JudgeConfig, RewardConfig
from rlflow.data.http_scorer import ServedRewardError
from rlflow.data.rewarder import Rewarder
from rlflow.sampler.background import RateCounters
from rlflow.sampler.delivery import GroupDelivery
from delivery_fakes import CharTokenizer, RecordingBuffer
from reward_server import HANG, RewardServer, chat_reply, scores_reply
from tolerances import sum_tol


def _length_score(item):
    return float(len(item["completion"]))


def _rewarder(url, *, functions=("http",), weights=(1.0,), num_workers=0, **served):
    """A Rewarder whose ``reward.http`` (and ``reward.judge``) asks ``url``; quick retries."""
    http = dict(url=url + "/score", batch_size=2, max_concurrency=2, timeout_s=2.0,
                max_retries=2, backoff_s=0.001, max_backoff_s=0.01)
    http.update(served)
    judge = JudgeConfig(url=url + "/v1/chat/completions", timeout_s=2.0, max_retries=1,
                        backoff_s=0.001, max_backoff_s=0.01, model="judge-model",
                        max_score=10.0)
    return Rewarder(RewardConfig(functions=functions, weights=weights, num_workers=num_workers,
                                 http=HttpRewardConfig(**http), judge=judge))


def _score(rewarder, completions, answer="a", prompt="p"):
    n = len(completions)
    return rewarder.score(completions, [answer] * n, [f"s{i}" for i in range(n)],
                          prompts=[prompt] * n)


def test_a_batch_comes_back_right_and_in_order():
    with RewardServer(lambda n, path, body, h: scores_reply(body, _length_score)) as server, \
            _rewarder(server.url, batch_size=3) as rewarder:
        completions = ["a", "bbbb", "cc", "ddddddd", "", "eee", "ffffff"]
        batch = _score(rewarder, completions, answer="ref", prompt="2>")
        np.testing.assert_array_equal(batch.total, [len(c) for c in completions])
        assert not batch.failed.any()
        # 7 samples in requests of 3: 3 requests, each with the configured fields only
        bodies = [body for _, body, _ in server.requests]
        assert sorted(len(b["samples"]) for b in bodies) == [1, 3, 3]
        sent = sorted((s["completion"], s["prompt"], s["answer"]) for b in bodies
                      for s in b["samples"])
        assert sent == sorted((c, "2>", "ref") for c in completions)
        assert all(set(s) == {"prompt", "completion", "answer"} for b in bodies
                   for s in b["samples"])
        m = rewarder.metrics()
        assert (m["reward/http_requests/http"], m["reward/http_retries/http"]) == (3, 0)
        assert m["reward/errors/http"] == 0 and m["reward/timeouts/http"] == 0


def test_fields_renamed_flat_body_and_extra_body_reach_the_server():
    def respond(n, path, body, h):
        return 200, json.dumps({"result": {"score": float(body["text"] == body["ref"])}})

    with RewardServer(respond) as server, _rewarder(
            server.url, batch_size=1, batch_key="", fields=("text=completion", "ref=answer",
                                                             "finish_reason"),
            score_field="result.score", extra_body='{"model": "rm-7b"}') as rewarder:
        batch = _score(rewarder, ["a", "b"], answer="a")
        np.testing.assert_array_equal(batch.total, [1.0, 0.0])
        assert {json.dumps(b, sort_keys=True) for _, b, _ in server.requests} == {
            json.dumps({"model": "rm-7b", "text": t, "ref": "a", "finish_reason": "stop"},
                       sort_keys=True) for t in "ab"}


def test_a_hanging_server_is_timed_out_retried_counted_and_others_are_scored():
    """Requests for "slow" hang for good; the others are answered. The hanging sample fails
    after 1 + max_retries timed-out tries (reward 0, marked failed), every other sample is
    scored while that request hangs (the server holds it until the test ends)."""
    def respond(n, path, body, h):
        if any(s["completion"] == "slow" for s in body["samples"]):
            return HANG
        return scores_reply(body, _length_score)

    with RewardServer(respond) as server, _rewarder(
            server.url, batch_size=1, max_concurrency=2, timeout_s=1.0,
            max_retries=1) as rewarder:
        rewarder.submit("g0", ["slow", "aa"], ["x"] * 2, ["g0 s0", "g0 s1"])
        rewarder.submit("g1", ["bbb", "c"], ["x"] * 2, ["g1 s0", "g1 s1"])
        done = {}
        while len(done) < 2:
            done.update(rewarder.collect(0.05))
        np.testing.assert_array_equal(done["g0"].total, [0.0, 2.0])
        np.testing.assert_array_equal(done["g0"].failed, [True, False])
        np.testing.assert_array_equal(done["g1"].total, [3.0, 1.0])
        assert not done["g1"].failed.any()
        assert not server.release.is_set()    # the hung requests were never answered
        assert server.answered == 3           # ... while the three others were
        m = rewarder.metrics()
        assert m["reward/http_timeouts/http"] == 2     # the first try and its one retry
        assert m["reward/http_retries/http"] == 1
        assert m["reward/timeouts/http"] == 1 and m["reward/errors/http"] == 0


def test_submitting_never_waits_for_the_server():
    """Every request is held until the test releases it: ``submit`` and ``collect(0)``
    return before that (if either waited on the server, this test would never end)."""
    with RewardServer(lambda n, path, body, h: HANG) as server, \
            _rewarder(server.url, timeout_s=5.0) as rewarder:
        for g in range(8):
            rewarder.submit(g, ["a", "b"], ["x"] * 2, [f"{g}/0", f"{g}/1"])
        assert rewarder.collect(0.0) == [] and rewarder.pending == 8
        assert not server.release.is_set()


def test_a_500_is_retried_then_succeeds():
    def respond(n, path, body, h):
        return (500, "overloaded") if n < 2 else scores_reply(body, _length_score)

    with RewardServer(respond) as server, _rewarder(server.url, batch_size=4,
                                                    max_retries=3) as rewarder:
        batch = _score(rewarder, ["a", "bb", "ccc"])
        np.testing.assert_array_equal(batch.total, [1.0, 2.0, 3.0])
        assert not batch.failed.any()
        m = rewarder.metrics()
        assert (m["reward/http_requests/http"], m["reward/http_retries/http"],
                m["reward/http_errors/http"]) == (3, 2, 2)


@pytest.mark.parametrize("reply", [
    "not json {", json.dumps({"nope": [1, 2]}), json.dumps({"scores": [1.0, "high"]}),
    json.dumps({"scores": [1.0]}), json.dumps({"scores": [1.0, float("nan")]})],
    ids=["garbage", "missing", "non-numeric", "too-few", "nan"])
def test_a_malformed_reply_is_retried_counted_and_marks_the_samples_failed(reply):
    with RewardServer(lambda n, path, body, h: (200, reply)) as server, \
            _rewarder(server.url, batch_size=2, max_retries=1) as rewarder:
        batch = _score(rewarder, ["a", "bb"])
        np.testing.assert_array_equal(batch.total, [0.0, 0.0])
        np.testing.assert_array_equal(batch.failed, [True, True])
        m = rewarder.metrics()
        assert (m["reward/http_requests/http"], m["reward/http_errors/http"]) == (2, 2)
        assert m["reward/errors/http"] == 2 and len(server.requests) == 2


def test_a_client_error_is_not_retried():
    with RewardServer(lambda n, path, body, h: (400, "bad field")) as server, \
            _rewarder(server.url, max_retries=3) as rewarder:
        batch = _score(rewarder, ["a"])
        assert batch.failed.all() and len(server.requests) == 1
        assert rewarder.metrics()["reward/http_retries/http"] == 0


def test_a_server_that_restarts_mid_run_is_caught_up_with():
    """Scored once; the server stops (port closed, kept-alive connections cut); a batch is
    submitted and fails its tries until the server starts again on the same port, then is
    scored with no sample failed."""
    server = RewardServer(lambda n, path, body, h: scores_reply(body, _length_score)).start()
    try:
        with _rewarder(server.url, max_retries=1000, backoff_s=0.005,
                       max_backoff_s=0.02) as rewarder:
            np.testing.assert_array_equal(_score(rewarder, ["ab"]).total, [2.0])
            server.stop()
            rewarder.submit("after", ["abc", "d"], ["x"] * 2, ["s0", "s1"])
            while rewarder.metrics()["reward/http_errors/http"] < 2:   # refused, refused
                assert rewarder.collect(0.01) == []
            server.start(server.port)
            done = []
            while not done:
                done = rewarder.collect(0.05)
            (key, batch), = done
            np.testing.assert_array_equal(batch.total, [3.0, 1.0])
            assert key == "after" and not batch.failed.any()
            assert rewarder.metrics()["reward/http_retries/http"] >= 2
    finally:
        server.stop()


def test_the_judge_is_asked_with_the_template_and_its_score_is_parsed_and_scaled():
    def respond(n, path, body, h):
        assert path == "/v1/chat/completions"
        text = body["messages"][0]["content"]
        if "Answer to grade:\ngarbled" in text:
            return chat_reply("I cannot decide.")
        if "Answer to grade:\nover" in text:
            return chat_reply("Score: 12")
        good = "Answer to grade:\n42" in text
        return chat_reply(f"The format asks for 'Score: <n>'.\nScore: {7 if good else 2}")

    with RewardServer(respond) as server, \
            _rewarder(server.url, functions=("judge",)) as rewarder:
        batch = _score(rewarder, ["42", "41", "garbled", "over"], answer="#### 42",
                       prompt="What is 6 x 7?")
        # the score over max_score rounded once to float32, times weight 1, summed over one
        # function: two roundings of eps / 2 at most (tests/tolerances.py)
        np.testing.assert_allclose(batch.total, [0.7, 0.2, 0.0, 0.0], rtol=sum_tol(2))
        np.testing.assert_array_equal(batch.failed, [False, False, True, True])
        _, body, _ = server.requests[0]
        assert body["model"] == "judge-model" and body["temperature"] == 0.0
        assert body["max_tokens"] == 512 and len(body["messages"]) == 1
        content = body["messages"][0]["content"]
        assert "Question:\nWhat is 6 x 7?" in content and "Reference answer:\n#### 42" in content
        m = rewarder.metrics()
        # 4 samples, one per request; the two malformed ones tried twice
        assert (m["reward/http_requests/judge"], m["reward/http_errors/judge"]) == (6, 4)
        assert m["reward/errors/judge"] == 2


def test_served_and_local_rewards_are_weighted_together():
    with RewardServer(lambda n, path, body, h: scores_reply(body, _length_score)) as server, \
            _rewarder(server.url, functions=("exact_match", "http"),
                      weights=(2.0, 0.5)) as rewarder:
        batch = _score(rewarder, ["a", "bbbb"], answer="a")
        np.testing.assert_allclose(batch.total, [2.0 * 1 + 0.5 * 1, 2.0 * 0 + 0.5 * 4])
        np.testing.assert_array_equal(batch.components["http"], [1.0, 4.0])


def test_the_api_key_comes_from_the_environment_as_a_header(monkeypatch):
    monkeypatch.setenv("TEST_RM_KEY", "sk-test-123")
    with RewardServer(lambda n, path, body, h: scores_reply(body, _length_score)) as server, \
            _rewarder(server.url, api_key_env="TEST_RM_KEY",
                      headers=("X-Team: rl",)) as rewarder:
        _score(rewarder, ["a"])
        headers = {k.lower(): v for k, v in server.requests[0][2].items()}
        assert headers["authorization"] == "Bearer sk-test-123" and headers["x-team"] == "rl"
    monkeypatch.delenv("TEST_RM_KEY")
    with pytest.raises(ServedRewardError, match=r"reward\.http\.api_key_env: .*TEST_RM_KEY"):
        _rewarder("http://127.0.0.1:9", api_key_env="TEST_RM_KEY")


def _group(prompt_id, texts):
    from rlflow.sampler.batching import CompletedGroup, Completion, Request

    req = Request(prompt_id=prompt_id, prompt_tokens=[1, 2], num_samples=len(texts))
    comps = [Completion(prompt_id, g, np.array([ord(c) for c in t], np.int32),
                        np.zeros(len(t), np.float32), np.zeros(len(t), np.int32), "stop")
             for g, t in enumerate(texts)]
    return CompletedGroup(request=req, prompt_tokens=np.array([1, 2], np.int32),
                          max_tokens=8, completions=comps)


def test_the_sampler_delivers_a_failed_request_as_a_failed_sample():
    """The sampler's delivery: the sample whose request hangs is marked ``failed`` in its
    record (the learner leaves it out, ``learner.on_failed_sample``) and counted; the prompt
    text reaches the server."""
    def respond(n, path, body, h):
        if body["samples"][0]["completion"] == "slow":
            return HANG
        return scores_reply(body, _length_score)

    with RewardServer(respond) as server:
        d = GroupDelivery(CharTokenizer(), RecordingBuffer(),
                          _rewarder(server.url, batch_size=1, timeout_s=1.0, max_retries=0),
                          RateCounters())
        try:
            g = _group(5, ["slow", "abc"])
            d.admit(g.request, {"answer": "x", "stream_index": 0, "lease_id": 0,
                                "prompt_text": "5>"})
            d.score([g])
            while d.waiting_for_rewards:
                d.collect(0.05)
            (rec,) = d.buffer.records
            np.testing.assert_array_equal(rec["rewards"], [0.0, 3.0])
            np.testing.assert_array_equal(rec["failed"], [True, False])
            assert d.metrics()["sampler/reward_failed_samples"] == 1.0
            assert d.metrics()["reward/http_timeouts/http"] == 1.0
            assert {b["samples"][0]["prompt"] for _, b, _ in server.requests} == {"5>"}
        finally:
            d.close()
