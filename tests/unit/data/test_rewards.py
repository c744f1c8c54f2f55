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
from rlflow.data.rewarder import Rewarder
from rlflow.data.rewards import (NonFiniteRewardError, RewardFunctionError, available_rewards,
                                 exact_match_reward, get_reward, last_number_reward,
                                 math_format_reward, math_verify_reward, register_reward)
from tolerances import sum_tol

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
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


@register_reward("test_huge")
def _huge(completion, answer):
    return 1e300 if completion == "bad" else 3e38     # 3e38: finite in float32 (max 3.4e38)


@register_reward("test_exits")
def _exits(completion, answer):
    raise SystemExit(3)


@register_reward("test_starts_sleep")
def _starts_sleep(completion, answer):
    import subprocess
    proc = subprocess.Popen(["sleep", "1000"])
    with open(completion, "w") as f:            # the completion is the pid file's path
        f.write(str(proc.pid))
    _release.wait(60)
    return 1.0


@register_reward("test_os_exit")
def _os_exit(completion, answer):
    os._exit(3)


@register_reward("test_not_a_number")
def _word(completion, answer):
    return "high"


@register_reward("test_length")
def _length(completion, answer):
    return float(len(completion))


@register_reward("test_sleeps")
def _sleeps(completion, answer):
    import time
    time.sleep(float(completion))              # the completion is the seconds to sleep
    return 1.0


@register_reward("test_hangs_on")
def _hangs_on(completion, answer):
    if completion == "hang":
        _release.wait(30)
    return float(len(completion))


@register_reward("test_allocates")
def _allocates(completion, answer):
    return float(len(bytearray(3 << 30)))      # 3 GiB: past a 512 MiB worker limit


_made = []


@pytest.fixture(scope="module", autouse=True)
def release_hung_threads():
    yield
    _release.set()
    for r in _made:
        r.close()


def rewarder(*names, weights=None, timeout_s=5.0, num_workers=1, memory_limit_mb=4096,
             max_consecutive_errors=256):
    """A Rewarder whose workers import this module (its test functions register there)."""
    r = Rewarder(RewardConfig(functions=names, weights=weights or (1.0,) * len(names),
                              timeout_s=timeout_s, num_workers=num_workers,
                              memory_limit_mb=memory_limit_mb,
                              max_consecutive_errors=max_consecutive_errors))
    _made.append(r)
    return r


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
    ("#### Step 1\nadd them\n#### Step 2\nsum is 5", 0.0),     # headings, not answers
    ("#### Step 1\nadd\n#### **5**", 1.0), ("$\\boxed{\\frac{1}{2}}$", 1.0),
])
def test_math_format(completion, want):
    assert math_format_reward(completion, "42") == want


@pytest.mark.parametrize("completion, answer, want", [
    ("131", "131", 1.0), ("The answer is 131.", "#### 131", 1.0),
    ("71 + 60 = 131", "131", 1.0), ("131.0", "131", 1.0), ("1,310", "1310", 1.0),
    ("-5", "-5", 1.0), ("10-5", "-5", 0.0), ("10-5", "5", 1.0),
    # restating the question, or the answer before more numbers: the last number counts
    ("71 + 60", "131", 0.0), ("71 + 60, that's a easy one.", "131", 0.0),
    ("131 is 71 + 60", "131", 0.0), ("\\boxed{131} (2 steps)", "131", 0.0),
    ("no number", "131", 0.0), ("", "131", 0.0), ("1310", "131", 0.0),
])
def test_last_number(completion, answer, want):
    assert last_number_reward(completion, answer) == want
    assert last_number_reward(completion, answer, finish_reason="length") == 0.0


@pytest.mark.parametrize("answer", ["x + 1", "3/4", "#### ", "131 apples and 2 pears"])
def test_last_number_needs_a_numeric_reference(answer):
    with pytest.raises(ValueError, match=r"last_number: the reference answer .* not a number"):
        last_number_reward("131", answer)


def test_exact_match():
    assert exact_match_reward(" 42\n", "42") == 1.0
    assert exact_match_reward("42.", "42") == 0.0


@register_reward("test_sees_finish")
def _sees_finish(completion, answer, *, finish_reason):
    return {"stop": 1.0, "length": -1.0}[finish_reason]


@register_reward("test_kwargs")
def _kwargs(completion, answer, **kw):
    return float(kw.get("finish_reason") == "length")


@pytest.mark.parametrize("fn, completion, answer", [
    (math_verify_reward, "so \\boxed{42}", "#### 42"),
    (math_format_reward, "#### 42", "42"),
    (exact_match_reward, "42", "42"),
])
def test_builtin_rewards_score_a_completion_cut_at_max_tokens_zero(fn, completion, answer):
    """Issue 39.1: a completion cut at ``max_tokens`` never finished (its last number so
    far is not a final answer; ``42`` then removed special tokens is not ``42<eos>``)."""
    assert fn(completion, answer) == 1.0
    assert fn(completion, answer, finish_reason="stop") == 1.0
    assert fn(completion, answer, finish_reason="length") == 0.0


@pytest.mark.parametrize("num_workers", [1, 0])
def test_functions_that_take_finish_reason_get_it_and_two_argument_ones_still_work(num_workers):
    r = rewarder("test_sees_finish", "test_kwargs", "test_length", num_workers=num_workers)
    batch = r.score(["a", "b", "a"], ["a"] * 3, ["s0", "s1", "s2"],
                    finish_reasons=["stop", "length", "length"])
    assert batch.components["test_sees_finish"].tolist() == [1.0, -1.0, -1.0]
    assert batch.components["test_kwargs"].tolist() == [0.0, 1.0, 1.0]
    assert batch.components["test_length"].tolist() == [1.0, 1.0, 1.0]   # fn(c, a) as before
    assert r.failures["test_length"] == {"errors": 0, "timeouts": 0}
    assert r.score(["a"], ["a"], ["s"]).components["test_sees_finish"].tolist() == [1.0]
    with pytest.raises(ValueError, match="finish reasons"):
        r.score(["a"], ["a"], ["s"], finish_reasons=[])


def test_weighted_combination_equals_numpy_oracle():
    comps = ["#### 18", "\\boxed{3}", "18", "x"]
    answers = ["#### 18", "#### 18", "18", "x"]
    r = rewarder("math_verify", "math_format", "exact_match", weights=(1.0, 0.25, -0.5))
    batch = r.score(comps, answers, [f"s{i}" for i in range(4)])
    parts = np.array([[math_verify_reward(c, a), math_format_reward(c, a), exact_match_reward(c, a)]
                      for c, a in zip(comps, answers)])
    w = np.array([1.0, 0.25, -0.5])
    # float32 total of 3 weighted terms against the float64 oracle: 3 products, 2 adds and the
    # cast each round once, bounded by sum_tol over the terms' absolute sum
    np.testing.assert_allclose(batch.total, parts @ w, rtol=0,
                               atol=sum_tol(6, scale=float(np.max(np.abs(parts) @ np.abs(w)))))
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
    # it waits (no CPU): cut by the wall-clock backstop, 10 x the 0.2 s of CPU time
    assert "ran past 2 s of wall time" in caplog.text
    assert "not computing) on sample prompt 3 sample 1" in caplog.text


def test_calls_queued_in_a_worker_time_out_from_their_own_start():
    """Calls sent ahead into one worker's pipe run one after the other; each has the whole
    timeout from when it starts, not from when it was sent (3 x 0.6 s > 1 s timeout)."""
    r = rewarder("test_sleeps", timeout_s=1.0, num_workers=1)
    out = r.score(["0.6", "0.6", "0.6"], ["x"] * 3, ["a", "b", "c"])
    np.testing.assert_array_equal(out.total, [1.0, 1.0, 1.0])
    assert r.failures["test_sleeps"] == {"errors": 0, "timeouts": 0}


def test_calls_behind_a_timed_out_one_run_on_the_new_worker():
    """The worker killed at a call's timeout had later calls queued in its pipe: they run on
    the worker that replaces it (scored, not lost or counted as failures)."""
    r = rewarder("test_hangs_on", timeout_s=0.5, num_workers=1)
    out = r.score(["hang", "ab", "abc", "abcd"], ["x"] * 4, ["a", "b", "c", "d"])
    np.testing.assert_array_equal(out.total, [0.0, 2.0, 3.0, 4.0])
    assert r.failures["test_hangs_on"] == {"errors": 0, "timeouts": 1}


def test_one_poll_takes_every_answer_waiting_in_the_pipes():
    """A poll returns every answer the workers have sent, not one per worker: the sampler
    polls once per decode call, so one answer per worker per poll capped its scoring rate."""
    import time

    r = rewarder("test_length", num_workers=1)
    pool = r._pool
    pool.wait_ready()
    ids = [pool.submit(0, "x" * i, "") for i in range(10)]
    first = pool.poll(0)                       # all ten sent into the pipe (calls_per_worker)
    assert pool.pending == 10 - len(first)
    deadline = time.monotonic() + 60
    while not pool._workers[0].conn.poll(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)                            # the other answers follow the first
    second = pool.poll(0)
    assert max(len(first), len(second)) >= 2   # one poll, several answers of one worker
    assert first + second == [(t, "ok", float(i)) for i, t in enumerate(ids)]


@pytest.mark.parametrize("num_workers", [1, 0])
def test_a_reward_that_exits_is_a_counted_error(num_workers):
    r = rewarder("test_exits", num_workers=num_workers)
    assert r.score(["a"], ["a"], ["id"]).total.tolist() == [0.0]
    assert r.failures["test_exits"]["errors"] == 1


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"     # a zombie is dead
    except FileNotFoundError:
        return False


def test_a_timed_out_reward_leaves_no_process_it_started(tmp_path):
    import time

    pid_file = tmp_path / "sleep.pid"
    r = rewarder("test_starts_sleep", timeout_s=2.0)
    assert r.score([str(pid_file)], ["x"], ["id"]).total.tolist() == [0.0]
    assert r.failures["test_starts_sleep"]["timeouts"] == 1
    pid = int(pid_file.read_text())
    for _ in range(300):                       # SIGKILL lands asynchronously; no timing assert
        if not _alive(pid):
            break
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the reward's `sleep 1000` outlived its killed worker"


def test_a_worker_that_exits_reports_its_exit_code(caplog):
    r = rewarder("test_os_exit")
    with caplog.at_level(logging.WARNING, logger="rlflow.data.rewards"):
        assert r.score(["a"], ["a"], ["id"]).total.tolist() == [0.0]
    assert r.failures["test_os_exit"]["errors"] == 1
    assert "reward worker died (exit code 3)" in caplog.text


@register_reward("test_fails_on_x")
def _fails_on_x(completion, answer):
    if completion == "hang":
        _release.wait(30)
    if completion.startswith("x"):
        raise ValueError(f"cannot score {completion!r}")
    return 1.0


@pytest.mark.parametrize("num_workers", [1, 0])
def test_a_function_failing_every_call_stops_at_max_consecutive_errors(num_workers):
    """Failures in a row count up to reward.max_consecutive_errors, then stop with the last
    error; a success resets the count, a timeout counts as a failure (issue 39.7); 0: never."""
    r = rewarder("test_fails_on_x", timeout_s=0.3, num_workers=num_workers,
                 max_consecutive_errors=3)
    out = r.score(["x1", "x2", "ok", "x3", "hang"], ["a"] * 5,
                  [f"prompt 5 sample {i}" for i in range(5)])
    assert out.total.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert r.failures["test_fails_on_x"] == {"errors": 3, "timeouts": 1}
    with pytest.raises(RewardFunctionError) as e:      # x3, hang (timeout), x5: 3 in a row
        r.score(["x5"], ["a"], ["prompt 6 sample 0"])
    assert str(e.value).startswith(
        "reward function 'test_fails_on_x' failed (errors or timeouts) on its last 3 calls "
        "in a row (reward.max_consecutive_errors=3), the last on sample prompt 6 sample 0: "
        "ValueError: cannot score 'x5'")
    never = rewarder("test_fails_on_x", num_workers=num_workers, max_consecutive_errors=0)
    assert never.score([f"x{i}" for i in range(5)], ["a"] * 5,
                       [str(i) for i in range(5)]).total.tolist() == [0.0] * 5


@pytest.mark.parametrize("num_workers", [1, 0])
def test_a_function_that_never_returns_stops_the_run_naming_it(num_workers):
    """Issue 39.7: 392 timeouts and no success ended a run with success true; now the
    timeouts in a row reach reward.max_consecutive_errors and stop it."""
    r = rewarder("test_hangs", timeout_s=0.2, num_workers=num_workers, max_consecutive_errors=2)
    with pytest.raises(RewardFunctionError, match=r"'test_hangs' failed \(errors or timeouts\) "
                       r"on its last 2 calls in a row .* sample s1: timed out: ran past "
                       r"(0\.2 s|2 s of wall time)"):
        r.score(["a", "b"], ["a"] * 2, ["s0", "s1"])
    assert r.failures["test_hangs"]["timeouts"] == 2


def test_nan_rewards_in_a_row_stop_at_max_consecutive_errors():
    """A NaN is no usable reward: with learner.on_bad_reward="drop" the sampler drops its
    group, so a function returning NaN every time would leave the learner waiting for ever;
    a run of them counts toward reward.max_consecutive_errors (a finite value resets it)."""
    r = rewarder("test_nan", num_workers=0, max_consecutive_errors=3)
    r.submit("g1", ["bad", "ok", "bad", "bad"], ["a"] * 4, [f"p1 s{i}" for i in range(4)])
    (_, batch), = r.collect()
    assert len(batch.nonfinite) == 3                 # reported for on_bad_reward; run of 2
    with pytest.raises(RewardFunctionError, match=r"'test_nan' failed \(errors or timeouts\) "
                       r"on its last 3 calls in a row \(reward.max_consecutive_errors=3\), "
                       r"the last on sample p2 s0: returned nan"):
        r.submit("g2", ["bad"], ["a"], ["p2 s0"])


def test_non_number_is_a_counted_failure():
    r = rewarder("test_not_a_number")
    assert r.score(["a"], ["a"], ["id"]).total.tolist() == [0.0]
    assert r.failures["test_not_a_number"]["errors"] == 1


@register_reward("test_returns")
def _returns(completion, answer):
    import numpy
    return {"str": "0.5", "none": None, "bool": True, "np": numpy.float32(0.25),
            "np0d": numpy.array(0.75), "int": 2, "list": [1.0]}[completion]


@pytest.mark.parametrize("num_workers", [1, 0])
def test_only_numbers_are_rewards(num_workers):
    """A string ("0.5"), None or a list scores 0 and is counted; bool and numpy numbers are
    numbers."""
    r = rewarder("test_returns", num_workers=num_workers)
    kinds = ["str", "none", "list", "bool", "np", "np0d", "int"]
    batch = r.score(kinds, ["x"] * len(kinds), kinds)
    assert batch.total.tolist() == [0.0, 0.0, 0.0, 1.0, 0.25, 0.75, 2.0]
    assert r.failures["test_returns"]["errors"] == 3


@pytest.mark.parametrize("name", ["test_nan", "test_inf"])
def test_nan_and_inf_rewards_are_rejected_with_the_sample_id(name):
    r = rewarder(name)
    with pytest.raises(NonFiniteRewardError,
                       match=rf"{name!r} returned (nan|-inf) for sample prompt 9 sample 1"):
        r.score_group(9, ["ok", "bad"], "x")


@pytest.mark.parametrize("num_workers", [1, 0])
def test_a_value_past_the_float32_range_is_non_finite(num_workers):
    r = rewarder("test_huge", num_workers=num_workers)
    with pytest.raises(NonFiniteRewardError, match=r"'test_huge' returned 1e\+300 for sample "
                                                   r"prompt 4 sample 1 \(not finite in float32"):
        r.score_group(4, ["ok", "bad"], "x")
    assert r.score_group(4, ["ok"], "x").tolist() == [np.float32(3e38)]
    # each value finite in float32, their weighted sum (6e38) is not
    r2 = rewarder("test_huge", "test_huge", weights=(1.0, 1.0), num_workers=num_workers)
    r2.submit_group("k", 5, ["ok"], "x")
    done = []
    while not done:
        done = r2.collect(timeout=0.1)
    batch = done[0][1]
    assert np.isinf(batch.total[0]) and len(batch.nonfinite) == 1
    assert batch.nonfinite[0].startswith("weighted reward total 6e+38 of sample prompt 5 "
                                         "sample 0")


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
    _made.append(r)
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


# ---------------------------------------------------------------- bounded calls (issue 14.1)

def _finishes(fn, limit_s=300.0):
    """Run ``fn`` on a thread; its result, or a failure if it has not returned in ``limit_s``
    (a liveness bound far above the 2 s timeout under test, not a timing assertion)."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    t.join(limit_s)
    assert "out" in box, f"no return after {limit_s} s"
    return box["out"]


def test_gil_holding_reward_is_killed_at_the_timeout_and_counted(caplog):
    """``\\boxed{10^{10^{9}}}`` makes math-verify compute a 3e9-bit integer power, which holds
    the GIL when compared with an expression reference: a thread timeout never got control
    back. The worker is killed: reward 0, a timeout with the sample id, and the replacement
    worker scores the next group. Against a numeric reference the power is not a value
    (answers are values), so it scores 0 without being computed."""
    r = rewarder("math_verify", timeout_s=2.0)
    with caplog.at_level(logging.WARNING, logger="rlflow.data.rewards"):
        out = _finishes(lambda: r.score_group(4, ["\\boxed{10^{10^{9}}}", "\\boxed{1 + x}"],
                                              "$x + 1$"))
    assert out.tolist() == [0.0, 1.0]
    assert r.failures["math_verify"] == {"errors": 0, "timeouts": 1}
    assert "ran past 2 s of CPU time on sample prompt 4 sample 0" in caplog.text
    assert r.score_group(5, ["#### 5"], "#### 5").tolist() == [1.0]
    assert r.score_group(6, ["\\boxed{10^{10^{9}}}"], "#### 5").tolist() == [0.0]
    assert r.failures["math_verify"] == {"errors": 0, "timeouts": 1}


def test_allocation_past_the_memory_limit_is_a_counted_error(caplog):
    r = rewarder("test_allocates", "test_length", memory_limit_mb=512)
    with caplog.at_level(logging.WARNING, logger="rlflow.data.rewards"):
        out = r.score_group(2, ["abc"], "x")
    assert out.tolist() == [3.0]                       # test_allocates scored 0
    assert r.failures["test_allocates"] == {"errors": 1, "timeouts": 0}
    assert "MemoryError" in caplog.text and "prompt 2 sample 0" in caplog.text


def test_overlapped_scoring_returns_whole_groups_in_submission_order():
    r = rewarder("test_length", num_workers=2)
    groups = {f"g{i}": ["x" * (i + g) for g in range(3)] for i in range(5)}
    for i, (key, texts) in enumerate(groups.items()):
        r.submit_group(key, i, texts, "x")
    assert r.pending == 5
    done = []
    while len(done) < 5:
        done += r.collect(timeout=0.1)
    assert [k for k, _ in done] == list(groups)
    for key, batch in done:
        np.testing.assert_array_equal(batch.total, [len(t) for t in groups[key]])
        assert batch.nonfinite == ()
    assert r.pending == 0 and r.collect() == []


def test_nonfinite_reward_is_reported_with_function_and_sample_when_overlapped():
    r = rewarder("test_nan")
    r.submit_group("k", 6, ["ok", "bad"], "x")
    done = []
    while not done:
        done = r.collect(timeout=0.1)
    (key, batch), = done
    assert batch.nonfinite == ("reward function 'test_nan' returned nan for sample "
                               "prompt 6 sample 1",)
    assert batch.total[0] == 0.5 and np.isnan(batch.total[1])


def test_in_process_mode_scores_like_the_workers():
    # math_verify + exact_match: both match, neither, only math_verify
    comps, answers = ["#### 18", "\\boxed{3}", "#### 5"], ["#### 18", "#### 18", "5"]
    ids = ["a", "b", "c"]
    inproc = rewarder("math_verify", "exact_match", num_workers=0).score(comps, answers, ids)
    pooled = rewarder("math_verify", "exact_match").score(comps, answers, ids)
    np.testing.assert_array_equal(inproc.total, pooled.total)
    np.testing.assert_array_equal(inproc.total, [2.0, 0.0, 1.0])


# ---------------------------------------------------------------- final answers (issue 14.9)

# Realistic chat-model completions; the expected reward is worked out by reading each one.
CHAT_COMPLETIONS = [
    ("#### Step 1 ... #### Step 2\nThe answer is $\\boxed{42}$.", "#### 42", 1.0),
    ("#### Step 1: add\n3 + 4 = 7\n#### Step 2: double\n7 * 6 = 42\n\n**Final answer:** 42",
     "#### 42", 1.0),
    ("First $x = 7$, then $\\boxed{x = 7}$... wait, doubling: $\\boxed{14}$", "#### 14", 1.0),
    ("First $x = 7$, then $\\boxed{x = 7}$... wait, doubling: $\\boxed{14}$", "#### 7", 0.0),
    ("She pays 3 * $4 = $12.\n#### **12**", "#### 12", 1.0),
    ("Total: 1,000 + 250 = 1,250 dollars.\n#### $1,250.", "#### 1250", 1.0),
    ("## Solution\n#### Step 1\nHalf of 10 is 5.\n#### Answer\n5", "#### 5", 1.0),
    ("The answer is **18**.", "#### 18", 1.0),
    ("We get $\\boxed{\\frac{3}{4}}$ of the pie.", "0.75", 1.0),
    ("#### 17\nOops, recheck: 18 apples.\n#### 18", "#### 18", 1.0),
    ("#### 18\nOops, recheck: it is 17.\n#### 17", "#### 18", 0.0),
    ("I think 41 or 43, so \\boxed{43}", "#### 42", 0.0),
    ("#### Step 2\nno numbers here", "#### 2", 0.0),
    # numbered headings are not answers; a lead-in before the value is dropped (issue 14 f.)
    ("#### 1. First compute\n48/2 = 24\n#### 2. Then\n48+24=72\nFinal: 72", "72", 1.0),
    ("#### The answer is 72", "72", 1.0),
    ("#### Final answer: **72**.", "#### 72", 1.0),
    ("#### 1) Halve\n48/2 = 24\n#### 2) Add\n48+24=72", "2", 0.0),
]


@pytest.mark.parametrize("completion, answer, want", CHAT_COMPLETIONS)
def test_math_format_agrees_with_the_answer_math_verify_checks(completion, answer, want):
    """One rule: math_format is 1 exactly when rule 1 or 2 finds a stated answer (a value here:
    every reference is a number), and then
    math_verify scores that answer (a stand-alone completion of it scores the same)."""
    from rlflow.data.rewards import stated_answer

    stated = stated_answer(completion)
    assert math_format_reward(completion, answer) == float(stated is not None)
    if stated is not None:
        assert math_verify_reward(completion, answer) == math_verify_reward(
            stated if stated.startswith("$") else f"#### {stated}", answer)


@pytest.mark.parametrize("completion, answer, want", CHAT_COMPLETIONS)
def test_math_verify_on_chat_model_completions(completion, answer, want):
    assert math_verify_reward(completion, answer) == want


@pytest.mark.parametrize("completion, want", [
    ("a \\boxed{1} b \\boxed{\\frac{1}{2}} c", "$\\frac{1}{2}$"),
    ("#### Step 1\n#### 7 apples\n#### Summary", "7 apples"),
    ("#### **1,250**.", "1250"),
    ("no marker", "no marker"),
    ("#### Step 2\nno numbers here", "no numbers here"),
    ("#### 1. First compute\n48/2 = 24\n#### 2. Then\n48+24=72\nFinal: 72",
     "48/2 = 24\n48+24=72\nFinal: 72"),
    ("#### The answer is 72", "72"),
    ("#### Answer\n5", "5"),
])
def test_completion_answer_text_rule(completion, want):
    from rlflow.data.rewards import completion_answer_text

    assert completion_answer_text(completion) == want


# ---------------------------------------------------------------- answers are values (issue 44.4)

# Realistic completions against numeric references: an answer with an operation left in it is
# not an answer (it would let a policy score by restating the question); the last value stated
# is. Expected rewards worked out by reading each line.
VALUE_ANSWERS = [
    # restatements of the question (what SmolLM2 learned to write in issue 44)
    ("71 + 60, that's a easy one.", "#### 131", 0.0),
    ("27 + 33", "#### 60", 0.0),
    ("The sum is 27 + 33.", "#### 60", 0.0),
    ("\\boxed{27+33}", "#### 60", 0.0),
    ("$\\boxed{27 + 33}$", "#### 60", 0.0),
    ("#### 27 + 33", "#### 60", 0.0),
    ("#### 71 + 60", "#### 131", 0.0),
    ("We need 30 \\times 2, so \\boxed{30 \\times 2}", "#### 60", 0.0),
    ("\\boxed{2*30}", "#### 60", 0.0),
    ("\\boxed{\\frac{1}{2} + \\frac{1}{4}}", "0.75", 0.0),
    ("\\boxed{2^3}", "#### 8", 0.0),
    # chains and statements: the last value stated is the answer
    ("27 + 33 = 60", "#### 60", 1.0),
    ("27 + 33 = 61", "#### 60", 0.0),
    ("71 + 60 = 131, that's a easy one.", "#### 131", 1.0),
    ("The answer is 60.", "#### 60", 1.0),
    ("60", "#### 60", 1.0),
    ("#### 60", "#### 60", 1.0),
    ("\\boxed{60}", "#### 60", 1.0),
    ("So $27 + 33 = \\boxed{60}$.", "#### 60", 1.0),
    # math-verify's equivalence between values still applies
    ("The answer is 60.0", "#### 60", 1.0),
    ("She pays $60", "#### 60", 1.0),
    ("#### 6e1", "#### 60", 1.0),
    ("#### 1.5e3", "#### 1500", 1.0),
    ("#### 60%", "#### 60", 1.0),
    ("#### 1,000", "#### 1000", 1.0),
    ("\\boxed{1{,}000}", "#### 1000", 1.0),
    # negative numbers and decimals
    ("The temperature drops to -5 degrees.", "#### -5", 1.0),
    ("#### -5", "#### 5", 0.0),
    ("\\boxed{-3 + -2}", "#### -5", 0.0),
    ("Each costs 2.5 dollars.", "#### 2.5", 1.0),
    ("\\boxed{0.75}", "#### 0.75", 1.0),
    # fractions where the reference is a fraction
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("#### 3/4", "\\frac{3}{4}", 1.0),
    ("#### -3/4", "-\\frac{3}{4}", 1.0),
    ("\\boxed{0.75}", "3/4", 1.0),
    ("\\boxed{\\frac{6}{8}}", "3/4", 1.0),
    ("\\boxed{\\frac{1}{2}}", "3/4", 0.0),
    ("\\boxed{3\\frac{1}{2}}", "#### 3.5", 1.0),
]


@pytest.mark.parametrize("completion, answer, want", VALUE_ANSWERS)
def test_numeric_references_are_only_equalled_by_values(completion, answer, want):
    assert math_verify_reward(completion, answer) == want


@pytest.mark.parametrize("completion, answer, want", [
    ("\\boxed{27+33}", "#### 60", 0.0),        # stated, but not a value
    ("#### 71 + 60", "#### 131", 0.0),
    ("\\boxed{60}", "#### 60", 1.0),
    ("#### 59", "#### 60", 1.0),               # a stated value: the format is right
    ("\\boxed{x + 1}", "$x + 1$", 1.0),        # a non-numeric reference: any stated answer
])
def test_math_format_needs_a_value_for_a_numeric_reference(completion, answer, want):
    assert math_format_reward(completion, answer) == want


def test_expression_references_keep_math_verify_equivalence():
    assert math_verify_reward("\\boxed{1 + x}", "$x + 1$") == 1.0
    assert math_verify_reward("\\boxed{\\sqrt{4 \\cdot 2}}", "$2\\sqrt{2}$") == 1.0


@pytest.mark.parametrize("text, want", [
    ("60", True), ("-5", True), ("60.0", True), ("\\frac{3}{4}", True), ("3/4", True),
    ("-3/4", True), ("60%", True), ("1,000", True),
    ("27 + 33", False), ("2*30", False), ("1/2 + 1/4", False), ("2^3", False),
    ("\\sqrt{2}", False), ("x", False), ("3/x", False),
])
def test_is_value_on_math_verify_parses(text, want):
    from rlflow.data.answer_values import is_value
    from rlflow.data.rewards import _parse

    parsed = _parse(f"${text}$")
    assert parsed, text
    assert is_value(parsed[0]) is want


def test_plain_numbers_rewrites_scientific_notation_only():
    from rlflow.data.answer_values import plain_numbers

    assert plain_numbers("6e1 and 2.5E-3, not x2e3 or 1.2.3e4") == \
        "60 and 0.0025, not x2e3 or 1.2.3e4"


@pytest.mark.parametrize("num_workers", [1, 0])
def test_samples_a_function_raised_or_timed_out_on_are_marked_failed(num_workers):
    """A reward failure is not a grade: RewardBatch.failed marks the sample (the group
    record's ``failed``); a NaN is a bad reward (on_bad_reward), not a failure."""
    r = rewarder("test_length", "test_raises_on_b", weights=(1.0, 1.0), num_workers=num_workers)
    out = r.score(["aa", "b", "ccc"], ["x"] * 3, ["s0", "s1", "s2"])
    np.testing.assert_array_equal(out.failed, [False, True, False])
    np.testing.assert_array_equal(out.total, [4.0, 1.0, 6.0])
    hang = rewarder("test_hangs", timeout_s=0.2, num_workers=num_workers)
    assert hang.score(["abcd"], ["x"], ["s"]).failed.tolist() == [True]


@register_reward("test_raises_on_b")
def _raises_on_b(completion, answer):
    if completion == "b":
        raise ValueError("b is bad")
    return float(len(completion))
