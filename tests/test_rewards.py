"""Reward functions and the guarded, weighted Rewarder; GSM8K answers through math-verify.

The GSM8K test runs the real test file through the path a run uses: ``configs/gsm8k.py`` ->
the prompt pipeline (a BPE tokenizer trained here on the questions) -> ``Rewarder`` of that
config's ``reward`` section; the expected reference number is read from the raw record.
"""

import json
import logging
import math
import os
import threading

import numpy as np
import pytest

from rlflow.config import RewardConfig, load_config_file, replace
from rlflow.data.rewards import (NonFiniteRewardError, Rewarder, available_rewards,
                                 exact_match_reward, get_reward, math_format_reward,
                                 math_verify_reward, register_reward)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_TEST = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "gsm8k", "test.jsonl"))

_release = threading.Event()


@register_reward("test_raises")
def _raises(completion, answer):
    raise RuntimeError(f"cannot score {completion!r}")


@register_reward("test_hangs")
def _hangs(completion, answer):
    _release.wait(30)  # released at module teardown
    return 1.0


@register_reward("test_nan")
def _nan(completion, answer):
    return float("nan") if completion == "bad" else 0.5


@register_reward("test_inf")
def _inf(completion, answer):
    return -math.inf if completion == "bad" else 1.0


@register_reward("test_not_a_number")
def _word(completion, answer):
    return "high"


@register_reward("test_length")
def _length(completion, answer):
    return float(len(completion))


@pytest.fixture(scope="module", autouse=True)
def release_hung_threads():
    yield
    _release.set()


def rewarder(*names, weights=None, timeout_s=5.0):
    return Rewarder(RewardConfig(functions=names, weights=weights or (1.0,) * len(names),
                                 timeout_s=timeout_s))


def test_registry_lists_builtins_and_rejects_unknown_and_duplicate_names():
    assert {"math_verify", "math_format", "exact_match", "digits_match"} <= set(available_rewards())
    with pytest.raises(KeyError, match=r"unknown reward function 'nope'; registered: .*math_verify"):
        get_reward("nope")
    with pytest.raises(ValueError, match=r"'exact_match' is already registered"):
        register_reward("exact_match")(lambda c, a: 0.0)


@pytest.mark.parametrize("completion, answer, want", [
    ("#### 18", "She makes $18.\n#### 18", 1.0),
    ("so the total is \\boxed{18}.", "#### 18", 1.0),
    ("she makes 18 dollars", "#### 18", 1.0),
    ("#### 1,250", "#### 1250", 1.0),
    ("#### 17", "#### 18", 0.0),
    ("\\boxed{17}", "#### 18", 0.0),
    ("no number here", "#### 18", 0.0),
    ("", "#### 18", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("#### 0.5", "\\frac{1}{2}", 1.0),
])
def test_math_verify(completion, answer, want):
    assert math_verify_reward(completion, answer) == want


def test_math_verify_unparseable_reference_is_an_error():
    with pytest.raises(ValueError, match=r"cannot parse the reference answer"):
        math_verify_reward("#### 3", "#### ")


@pytest.mark.parametrize("completion, want", [
    ("so \\boxed{42}", 1.0), ("work\n#### 42", 1.0), ("the answer is 42", 0.0),
    ("\\boxed{}", 0.0), ("####", 0.0),
])
def test_math_format(completion, want):
    assert math_format_reward(completion, "42") == want


def test_exact_match():
    assert exact_match_reward(" 42\n", "42") == 1.0
    assert exact_match_reward("42.", "42") == 0.0


def test_weighted_combination_equals_numpy_oracle():
    comps = ["#### 18", "\\boxed{3}", "18", "x"]
    answers = ["#### 18", "#### 18", "18", "x"]
    r = rewarder("math_verify", "math_format", "exact_match", weights=(1.0, 0.25, -0.5))
    batch = r.score(comps, answers, [f"s{i}" for i in range(4)])
    parts = np.array([[math_verify_reward(c, a), math_format_reward(c, a), exact_match_reward(c, a)]
                      for c, a in zip(comps, answers)])
    np.testing.assert_allclose(batch.total, parts @ np.array([1.0, 0.25, -0.5]), rtol=1e-6)
    assert batch.total.dtype == np.float32 and batch.total.shape == (4,)
    np.testing.assert_array_equal(batch.components["math_format"], parts[:, 1])


def test_raising_function_gives_zero_is_counted_and_logged_with_sample_id(caplog):
    r = rewarder("test_length", "test_raises", weights=(1.0, 1.0))
    with caplog.at_level(logging.WARNING, logger="rlflow.data.rewards"):
        out = r.score_group(17, ["ab", "abc"], "x")
    np.testing.assert_array_equal(out, [2.0, 3.0])  # test_raises contributed 0
    assert r.failures["test_raises"] == {"errors": 2, "timeouts": 0}
    assert r.metrics()["reward/errors/test_raises"] == 2
    assert r.metrics()["reward/errors/test_length"] == 0
    text = caplog.text
    assert "prompt 17 sample 0" in text and "prompt 17 sample 1" in text
    assert "RuntimeError: cannot score 'abc'" in text


def test_timeout_gives_zero_and_is_counted(caplog):
    r = rewarder("test_hangs", timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="rlflow.data.rewards"):
        out = r.score(["abcd"], ["x"], ["prompt 3 sample 1"])
    np.testing.assert_array_equal(out.total, [0.0])
    assert r.failures["test_hangs"] == {"errors": 0, "timeouts": 1}
    assert "ran past 0.2 s on sample prompt 3 sample 1" in caplog.text


def test_non_number_is_a_counted_failure():
    r = rewarder("test_not_a_number")
    assert r.score(["a"], ["a"], ["id"]).total.tolist() == [0.0]
    assert r.failures["test_not_a_number"]["errors"] == 1


@pytest.mark.parametrize("name", ["test_nan", "test_inf"])
def test_nan_and_inf_rewards_are_rejected_with_the_sample_id(name):
    r = rewarder(name)
    with pytest.raises(NonFiniteRewardError,
                       match=rf"{name!r} returned (nan|-inf) for sample prompt 9 sample 1"):
        r.score_group(9, ["ok", "bad"], "x")


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match=r"2 completions, 1 answers, 2 sample ids"):
        rewarder("exact_match").score(["a", "b"], ["a"], ["0", "1"])


@pytest.fixture(scope="module")
def gsm8k_records():
    if not os.path.isfile(GSM8K_TEST):
        pytest.skip(f"GSM8K test file not found at {GSM8K_TEST} (expected <repo>/../shared/data)")
    with open(GSM8K_TEST) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_gsm8k_config_scores_correct_answers_1_and_wrong_answers_0(gsm8k_records, tmp_path):
    from rlflow.data.pipeline import build_prompt_pipeline
    from rlflow.data.tokenizer import build_bpe_tokenizer

    cfg = load_config_file(os.path.join(REPO, "configs", "gsm8k.py"))
    cfg = replace(cfg, data=replace(cfg.data, path=GSM8K_TEST))
    tok = build_bpe_tokenizer((r["question"] for r in gsm8k_records), str(tmp_path / "tok"),
                              vocab_size=512)
    assert len(tok) <= 512
    it, stats = build_prompt_pipeline(cfg.data, tok, seed=cfg.seed)
    assert stats.num_records == len(gsm8k_records)
    assert stats.num_kept + stats.num_too_long == len(gsm8k_records)
    r = Rewarder(cfg.reward)
    for _ in range(12):
        e = next(it)
        record = gsm8k_records[e["prompt_id"]]
        assert e["answer"] == record["answer"]
        assert record["question"] in e["prompt_text"] and "####" in e["prompt_text"]
        assert tok.decode(e["prompt_tokens"].tolist()) == e["prompt_text"]
        gold = record["answer"].split("####")[-1].strip().replace(",", "")
        wrong = str(int(gold) + 1)
        completions = [f"Step by step.\n#### {gold}", f"The answer is \\boxed{{{gold}}}.",
                       f"#### {wrong}", f"\\boxed{{{wrong}}}", "I don't know."]
        rewards = r.score_group(e["prompt_id"], completions, e["answer"])
        assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0], (gold, rewards)
    assert r.failures["math_verify"] == {"errors": 0, "timeouts": 0}
