"""rlflow.eval.metrics against plain oracles: pass@k as Chen et al. 2021 eq. 1 written with
math.comb, maj@k as a hand-written vote."""

import math

import numpy as np
import pytest

from rlflow.eval.metrics import eval_metrics, majority_correct, pass_at_k


def _pass_at_k_oracle(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 1), (5, 3), (10, 10), (16, 4), (100, 7)])
def test_pass_at_k_matches_the_binomial_oracle(n, k):
    c = np.arange(n + 1)
    got = pass_at_k(np.full(n + 1, n), c, k)
    want = np.array([_pass_at_k_oracle(n, int(ci), k) for ci in c])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_pass_at_k_large_n_stays_finite_where_factorials_overflow():
    # C(2000, 50) ~ 1e100 does not fit float32 and loses everything in a naive float ratio
    n, c, k = 2000, 3, 50
    want = 1.0 - math.comb(n - c, k) / math.comb(n, k)          # exact big-int ratio
    np.testing.assert_allclose(pass_at_k(n, c, k), [want], rtol=1e-12)


def test_pass_at_k_refuses_bad_counts():
    with pytest.raises(ValueError, match="problem 1 has n=2 samples and c=3"):
        pass_at_k([4, 2], [1, 3], 1)
    with pytest.raises(ValueError, match="n >= k=5"):
        pass_at_k([4], [1], 5)
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k([4], [1], 0)


def test_majority_vote_oracle():
    answers = [["7", "8", "7", "9"],       # 7 wins, one 7 is correct -> 1
               ["1", "2", "2", "1"],       # tie 1/2: 1 seen first, no 1 is correct -> 0
               [" 5", "5 ", "6", "6"],     # tie after strip: 5 first, correct -> 1
               ["3", "4", "4", "4"]]       # 4 wins, none correct -> 0
    correct = np.array([[True, False, True, False],
                        [False, True, True, False],
                        [True, True, False, False],
                        [True, False, False, False]])
    np.testing.assert_array_equal(majority_correct(answers, correct), [1.0, 0.0, 1.0, 0.0])


def test_eval_metrics_against_numpy():
    rng = np.random.default_rng(0)
    p, k = 6, 4
    rewards = rng.random((p, k))
    correct = rewards >= 0.5
    lengths = rng.integers(1, 9, (p, k))
    truncated = lengths == 8
    answers = [[str(int(r * 3)) for r in row] for row in rewards]
    got = eval_metrics(rewards, correct, lengths, truncated, answers)
    c = correct.sum(1)
    assert got["eval/reward_mean"] == pytest.approx(rewards.mean(), rel=1e-12)
    assert got["eval/pass@1"] == pytest.approx((c / k).mean(), rel=1e-12)
    assert got["eval/pass@4"] == pytest.approx(
        np.mean([_pass_at_k_oracle(k, int(ci), k) for ci in c]), rel=1e-12)
    assert got["eval/maj@4"] == pytest.approx(majority_correct(answers, correct).mean())
    assert got["eval/completion_length"] == pytest.approx(lengths.mean())
    assert got["eval/truncation_rate"] == pytest.approx(truncated.mean())
    assert got["eval/num_prompts"] == p and got["eval/num_samples"] == k
    one = eval_metrics(rewards[:, :1], correct[:, :1], lengths[:, :1], truncated[:, :1],
                       [row[:1] for row in answers])
    assert "eval/pass@1" in one and not any(key.startswith("eval/maj@") for key in one)


def test_eval_metrics_per_reward_function_means():
    rng = np.random.default_rng(1)
    p, k = 5, 3
    parts = {"math_verify": (rng.random((p, k)) < 0.5).astype(float),
             "last_number": (rng.random((p, k)) < 0.5).astype(float)}
    rewards = parts["math_verify"]
    got = eval_metrics(rewards, rewards >= 0.5, np.ones((p, k)), np.zeros((p, k), bool),
                       [["a"] * k] * p, components=parts)
    for name, values in parts.items():     # 0/1 values: exact integer sums
        assert got[f"eval/reward/{name}"] == values.sum() / values.size
    assert "eval/reward/other" not in got
    with pytest.raises(ValueError, match=r"components\['last_number'\] is \(5, 2\)"):
        eval_metrics(rewards, rewards >= 0.5, np.ones((p, k)), np.zeros((p, k), bool),
                     [["a"] * k] * p, components={"last_number": np.zeros((p, 2))})


def test_aggregate_reports_the_functions_every_record_has():
    from rlflow.eval.scoring import aggregate

    def record(i, mv, ln, other=None):
        parts = {"math_verify": [mv], "last_number": [ln]}
        if other is not None:
            parts["other"] = [other]
        return {"prompt_id": i, "rewards": [mv], "correct": [mv >= 0.5], "lengths": [3],
                "truncated": [False], "answers": ["7"], "components": parts}

    got = aggregate([record(0, 1.0, 0.0, other=1.0), record(1, 1.0, 1.0),
                     record(2, 0.0, 0.0)])
    assert got["eval/reward/math_verify"] == 2 / 3 and got["eval/reward/last_number"] == 1 / 3
    assert "eval/reward/other" not in got                # one record has no such component
    no_parts = [{key: v for key, v in record(0, 1.0, 1.0).items() if key != "components"}]
    assert not any(key.startswith("eval/reward/") for key in aggregate(no_parts))


def test_eval_metrics_refuses_ragged_input():
    with pytest.raises(ValueError, match=r"must all be \[prompts, samples\]"):
        eval_metrics(np.zeros((2, 3)), np.zeros((2, 2), bool), np.zeros((2, 3)),
                     np.zeros((2, 3), bool), [["a"] * 3] * 2)
