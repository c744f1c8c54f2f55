"""The served rewards' pure parts (issue 44 item 3): request bodies, reply parsing, the
judge's score, the backoff, the config sections' checks and the API key's handling. The
network side is tests/unit/data/test_http_reward.py."""

import json
import logging
import random

import numpy as np
import pytest

from rlflow.config import ConfigError, ExperimentConfig, HttpRewardConfig, JudgeConfig, RewardConfig
from rlflow.config.secrets import install_log_redaction, secret_values
from rlflow.data.http_scorer import ServedRewardError, backoff_s, request_headers
from rlflow.data.rewards import register_reward
from rlflow.data.served_rewards import (MalformedReply, json_path, judge_score, parse_reply,
                                        request_body, sample_dict)
from rlflow.control.programs_common import config_from_dict, config_to_dict

URL = "http://127.0.0.1:8000/score"


def _samples(*completions):
    return [sample_dict("7>", c, "8", "stop", f"prompt 7 sample {i}")
            for i, c in enumerate(completions)]


def test_a_reward_model_body_holds_the_configured_fields_of_each_sample_in_order():
    cfg = HttpRewardConfig(url=URL, fields=("completion", "ref=answer", "finish_reason"),
                           extra_body='{"model": "rm", "samples": "overwritten"}')
    body = request_body(cfg, _samples("8", "9"))
    assert body == {"model": "rm", "samples": [
        {"completion": "8", "ref": "8", "finish_reason": "stop"},
        {"completion": "9", "ref": "8", "finish_reason": "stop"}]}
    flat = HttpRewardConfig(url=URL, batch_key="", batch_size=1, fields=("sample_id",))
    assert request_body(flat, _samples("8")) == {"sample_id": "prompt 7 sample 0"}


def test_a_judge_body_is_an_openai_chat_request_with_the_filled_template():
    cfg = JudgeConfig(url=URL, model="qwen", max_tokens=64, temperature=0.5,
                      prompt_template="Q: {question} R: {reference} A: {completion}",
                      extra_body='{"seed": 3}')
    assert request_body(cfg, _samples("9")) == {
        "seed": 3, "model": "qwen", "temperature": 0.5, "max_tokens": 64,
        "messages": [{"role": "user", "content": "Q: 7> R: 8 A: 9"}]}
    bare = request_body(JudgeConfig(url=URL, max_tokens=0), _samples("9"))
    assert "model" not in bare and "max_tokens" not in bare


def test_reward_model_replies_are_read_at_the_score_field():
    cfg = HttpRewardConfig(url=URL, score_field="data.0.scores")
    assert parse_reply(cfg, json.dumps({"data": [{"scores": [0.5, -2, 3]}]}), 3) == [0.5, -2.0,
                                                                                      3.0]
    flat = HttpRewardConfig(url=URL, batch_key="", batch_size=1, score_field="reward")
    assert parse_reply(flat, '{"reward": 1}', 1) == [1.0]


@pytest.mark.parametrize("text, match", [
    ("<html>502</html>", "not JSON"),
    ('{"data": []}', "no '0' on the path 'data.0.scores'"),
    ('{"data": [{"scores": [1, 2]}]}', "expected a list of 3 numbers"),
    ('{"data": [{"scores": [1, "2", 3]}]}', r"data\.0\.scores\[1\] is '2', expected a finite"),
    ('{"data": [{"scores": [1, true, 3]}]}', r"\[1\] is True"),
    ('{"data": [{"scores": [1, Infinity, 3]}]}', r"\[1\] is inf"),
    ('{"data": {"scores": [1, 2, 3]}}', "no '0' on the path"),
])
def test_malformed_reward_model_replies_say_what_is_wrong(text, match):
    with pytest.raises(MalformedReply, match=match):
        parse_reply(HttpRewardConfig(url=URL, score_field="data.0.scores"), text, 3)


def test_json_path_follows_keys_and_indices():
    data = {"a": [{"b": 1}, {"b": [5, 6]}]}
    assert json_path(data, "a.1.b.-1") == 6 and json_path(data, "a.0") == {"b": 1}
    with pytest.raises(MalformedReply, match="no '2'"):
        json_path(data, "a.2.b")


@pytest.mark.parametrize("reply, reward", [
    ("Score: 7", 0.7), ("The rubric says Score: 10 for a full answer.\nScore: 4", 0.4),
    ("**Score:** 8.5", 0.85), ("Score: 0", 0.0), ("Score: 10", 1.0)])
def test_the_judge_score_is_the_last_match_over_max_score(reply, reward):
    assert judge_score(JudgeConfig(url=URL), reply) == pytest.approx(reward, rel=1e-12)


@pytest.mark.parametrize("reply, match", [
    ("I think it is right.", "no match of score_regex"), ("Score: 11", "outside"),
    ("Score: 10.5", "outside")])
def test_a_judge_reply_without_a_usable_score_is_malformed(reply, match):
    with pytest.raises(MalformedReply, match=match):
        judge_score(JudgeConfig(url=URL), reply)


def test_a_judge_reply_is_read_from_the_first_choice():
    cfg = JudgeConfig(url=URL, score_regex=r"(\d)/5", max_score=5.0)
    reply = {"choices": [{"message": {"role": "assistant", "content": "3/5"}}]}
    assert parse_reply(cfg, json.dumps(reply), 1) == [0.6]
    with pytest.raises(MalformedReply, match="expected text"):
        parse_reply(cfg, json.dumps({"choices": [{"message": {"content": None}}]}), 1)


def test_backoff_is_full_jitter_under_the_exponential_cap():
    cfg = HttpRewardConfig(url=URL, backoff_s=0.5, max_backoff_s=3.0)
    rng = random.Random(0)
    for retry, cap in ((1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (9, 3.0)):
        waits = np.array([backoff_s(cfg, retry, rng) for _ in range(2000)])
        assert waits.min() >= 0.0 and waits.max() <= cap
        assert waits.max() > 0.9 * cap and waits.min() < 0.1 * cap   # spread over [0, cap]


@pytest.mark.parametrize("cls, kwargs, match", [
    (HttpRewardConfig, dict(url="127.0.0.1:8000"), r"^reward\.http\.url: must start with"),
    (HttpRewardConfig, dict(fields=("completion", "logits")), r"^reward\.http\.fields: entry 'logits'"),
    (HttpRewardConfig, dict(fields=()), r"^reward\.http\.fields: needs"),
    (HttpRewardConfig, dict(batch_key="", batch_size=4), r"^reward\.http\.batch_size: must be 1"),
    (HttpRewardConfig, dict(batch_size=0), r"^reward\.http\.batch_size: must be > 0"),
    (HttpRewardConfig, dict(timeout_s=0.0), r"^reward\.http\.timeout_s"),
    (HttpRewardConfig, dict(max_retries=-1), r"^reward\.http\.max_retries"),
    (HttpRewardConfig, dict(backoff_s=2.0, max_backoff_s=1.0), r"^reward\.http\.max_backoff_s"),
    (HttpRewardConfig, dict(extra_body="[1]"), r"^reward\.http\.extra_body: must be a JSON object"),
    (HttpRewardConfig, dict(extra_body="{x"), r"^reward\.http\.extra_body: is not JSON"),
    (HttpRewardConfig, dict(headers=("X-Team rl",)), r"^reward\.http\.headers: entry"),
    (HttpRewardConfig, dict(headers=("Authorization: Bearer sk-1",)),
     r"^reward\.http\.headers: sets 'Authorization'.*api_key_env"),
    (HttpRewardConfig, dict(api_key_env="MY-KEY"), r"^reward\.http\.api_key_env"),
    (JudgeConfig, dict(batch_size=4), r"^reward\.judge\.batch_size: must be 1"),
    (JudgeConfig, dict(score_regex=r"Score: \d+"), r"^reward\.judge\.score_regex: needs a group"),
    (JudgeConfig, dict(score_regex=r"Score: (\d+"), r"^reward\.judge\.score_regex: is not a"),
    (JudgeConfig, dict(prompt_template="{question} {answer}"),
     r"^reward\.judge\.prompt_template: unknown placeholder\(s\) \['answer'\]"),
    (JudgeConfig, dict(prompt_template="{question}"), r"^reward\.judge\.prompt_template: must contain"),
    (JudgeConfig, dict(max_score=0.0), r"^reward\.judge\.max_score"),
    (JudgeConfig, dict(temperature=-1.0), r"^reward\.judge\.temperature"),
])
def test_a_bad_served_reward_setting_is_refused_naming_the_field(cls, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cls(**kwargs)


def test_a_used_served_reward_needs_its_url_and_the_name_is_reserved():
    with pytest.raises(ConfigError, match=r"^reward\.judge\.url: is required"):
        RewardConfig(functions=("math_verify", "judge"), weights=(1.0, 1.0))
    RewardConfig(functions=("judge",), weights=(1.0,), judge=JudgeConfig(url=URL))
    with pytest.raises(ValueError, match="reserved"):
        register_reward("judge")(lambda c, a: 0.0)


def test_a_served_reward_config_round_trips_through_the_resolved_json():
    cfg = ExperimentConfig(reward=RewardConfig(
        functions=("digits_match", "http"), weights=(1.0, 0.5),
        http=HttpRewardConfig(url=URL, headers=("X-Team: rl",), fields=("text=completion",))))
    assert config_from_dict(ExperimentConfig, config_to_dict(cfg)) == cfg


def test_the_api_key_is_read_from_its_variable_and_hidden_in_logs(monkeypatch):
    cfg = ExperimentConfig(reward=RewardConfig(
        functions=("http",), weights=(1.0,),
        http=HttpRewardConfig(url=URL, api_key_env="RM_KEY", api_key_header="x-api-key",
                              api_key_prefix="")))
    env = {"RM_KEY": "sk-abc123"}
    assert request_headers(cfg.reward.http, env) == {"x-api-key": "sk-abc123"}
    with pytest.raises(ServedRewardError, match=r"^reward\.http\.api_key_env: .* RM_KEY"):
        request_headers(cfg.reward.http, {})
    assert "sk-abc123" not in json.dumps(config_to_dict(cfg))     # the config has its name only
    assert secret_values(cfg, env) == ["sk-abc123"]
    # the programs' logs hide it
    monkeypatch.setenv("RM_KEY", "sk-abc123")
    logger = logging.getLogger("test_served_rewards")
    stream = __import__("io").StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        install_log_redaction(secret_values(cfg), logger)
        logger.warning("request with key %s failed", "sk-abc123")
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "request with key <redacted> failed\n"


def test_rlflow_train_refuses_a_served_reward_whose_key_is_not_in_the_environment(monkeypatch):
    from rlflow.console.checks import _check_rewards

    cfg = ExperimentConfig(reward=RewardConfig(
        functions=("judge",), weights=(1.0,), judge=JudgeConfig(url=URL, api_key_env="JUDGE_KEY")))
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"^reward\.judge\.api_key_env: .*JUDGE_KEY"):
        _check_rewards(cfg)
    monkeypatch.setenv("JUDGE_KEY", "k")
    _check_rewards(cfg)
