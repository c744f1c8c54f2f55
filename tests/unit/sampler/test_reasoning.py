"""Thinking models (issue 44.5): a completion splits into reasoning and answer; rewards and
tool calls read the answer only; reasoning that never closed is graded 0."""

import textwrap

import numpy as np
import pytest

from rlflow.config import EnvConfig, RewardConfig
from rlflow.data.reasoning import (ReasoningSplit, get_reasoning_parser, split_none,
                                   split_qwen3)
from delivery_fakes import CharTokenizer, RecordingBuffer

# The two inputs of issue 44, written as Qwen3 writes them.
DRAFTED_BOXED = ("<think>\nTwo sixes and thirty... let me try: \\boxed{41}? No, 6 * 7 = 42.\n"
                 "</think>\n\nThe answer is #### 42")
DRAFTED_TOOL_CALL = ("<think>\nI could run\n<tool_call>\n{\"name\": \"python\", \"arguments\": "
                     "{\"code\": \"print(6 * 7)\"}}\n</tool_call>\nbut 6 * 7 = 42 is easy.\n"
                     "</think>\n\n6 * 7 = 42.\n#### 42")


@pytest.mark.parametrize("text, want", [
    # closed: reasoning before the first </think>, answer after it
    ("<think>\nsum it\n</think>\n\n#### 42", ReasoningSplit("sum it", "#### 42", True)),
    ("<think></think>#### 42", ReasoningSplit("", "#### 42", True)),
    # a thinking template that opened <think> in the prompt: only the close is sampled
    ("sum it</think>\n#### 42", ReasoningSplit("sum it", "#### 42", True)),
    ("<think>a</think>b</think>c", ReasoningSplit("a", "b</think>c", True)),
    # open: never closed, no answer (graded 0)
    ("<think>\nsum it... \\boxed{42}", ReasoningSplit("sum it... \\boxed{42}", "", False)),
    ("<think>", ReasoningSplit("", "", False)),
    # missing: thinking off (Qwen3 enable_thinking=False), all answer
    ("#### 42", ReasoningSplit("", "#### 42", True)),
    ("", ReasoningSplit("", "", True)),
])
def test_qwen3_split_of_open_closed_and_missing_think_tags(text, want):
    assert split_qwen3(text) == want


@pytest.mark.parametrize("text", ["<think>a</think>b", "<think>a", "b"])
def test_none_split_keeps_the_whole_completion(text):
    assert split_none(text) == ReasoningSplit("", text, True)


def test_parser_names_auto_and_plugins(tmp_path):
    assert get_reasoning_parser("auto", model_type="qwen3") is split_qwen3
    assert get_reasoning_parser("auto", model_type="llama") is split_none
    assert get_reasoning_parser("qwen3") is split_qwen3
    path = tmp_path / "my_reasoning.py"
    path.write_text(textwrap.dedent("""
        def split(text):
            head, sep, tail = text.partition("ANSWER:")
            return (head, tail if sep else None)
    """))
    custom = get_reasoning_parser(f"{path}:split")
    assert custom("think ANSWER: 42") == ReasoningSplit("think ", " 42", True)
    assert custom("still thinking") == ReasoningSplit("still thinking", "", False)
    with pytest.raises(ValueError, match=r"data.reasoning_parser: expected one of"):
        get_reasoning_parser("deepseek")
    with pytest.raises(ValueError, match=r"data.reasoning_parser: .*nope"):
        get_reasoning_parser(f"{path}:nope")


def test_config_refuses_an_unknown_parser_name():
    from rlflow.config import DataConfig

    assert DataConfig().reasoning_parser == "auto"
    with pytest.raises(ValueError, match=r"data.reasoning_parser"):
        DataConfig(reasoning_parser="deepseek")


# ------------------------------------------------------------------ rewards read the answer


def _delivered_rewards(texts, reasoning):
    from rlflow.data.rewarder import Rewarder
    from rlflow.sampler.background import RateCounters
    from rlflow.sampler.batching import CompletedGroup, Completion, Request
    from rlflow.sampler.delivery import GroupDelivery

    req = Request(prompt_id=0, prompt_tokens=[1, 2], num_samples=len(texts))
    comps = [Completion(0, g, np.array([ord(c) for c in t], np.int32),
                        np.zeros(len(t), np.float32), np.zeros(len(t), np.int32), "stop")
             for g, t in enumerate(texts)]
    group = CompletedGroup(request=req, prompt_tokens=np.array([1, 2], np.int32),
                           max_tokens=max(map(len, texts)), completions=comps)
    rewarder = Rewarder(RewardConfig(functions=("math_verify",), weights=(1.0,), num_workers=0))
    d = GroupDelivery(CharTokenizer(), RecordingBuffer(), rewarder, RateCounters(), reasoning=reasoning)
    try:
        d.admit(req, {"answer": "#### 42", "stream_index": 0, "lease_id": 0})
        d.score([group])
        while d.waiting_for_rewards:
            d.collect(0.1)
        return d.buffer.records[0]["rewards"].tolist()
    finally:
        d.close()


def test_a_box_drafted_while_thinking_does_not_override_the_answer():
    """Issue 44: reference #### 42, \\boxed{41} drafted inside <think>, '#### 42' after it:
    1 with the qwen3 parser (0 without: the last box wins); reasoning that never closed is
    graded 0 even when it holds the right answer."""
    unclosed = "<think>\n6 * 7 = 42, so \\boxed{42}"
    assert _delivered_rewards([DRAFTED_BOXED, unclosed], split_qwen3) == [1.0, 0.0]
    assert _delivered_rewards([DRAFTED_BOXED, unclosed], None) == [0.0, 1.0]


# ------------------------------------------------------------------ tool calls read the answer

class _Renderer:
    end_of_turn_ids = (0,)

    def assistant_text(self, ids):
        return "".join(chr(int(i)) for i in ids if int(i) != 0)

    def prompt_ids(self, messages, tools=None):
        return [1, 2, 3]

    def continuation_ids(self, messages, new_messages, tools=None):
        return [4, 5]


def _episode_outcomes(texts, reasoning):
    from rlflow.sampler.episodes import EpisodeDriver

    driver = EpisodeDriver(EnvConfig(name="gsm8k_calculator", max_consecutive_errors=0),
                           CharTokenizer(), _Renderer(), reasoning=reasoning)
    _, group = driver.new_group({"prompt_id": 3, "question": "What is 6 * 7?",
                                 "answer": "#### 42"}, len(texts))
    for i, text in enumerate(texts):
        driver.turn_ended(group, i, np.asarray([ord(c) for c in text] + [0]), 0)
    outs = {i: out for _, i, out in driver.poll()}
    return [outs[i] for i in range(len(texts))], driver.metrics()


def test_a_tool_call_drafted_while_thinking_is_not_run_and_the_answer_ends_the_episode():
    """Issue 44: a message that considers a call inside <think>, drops it and answers ends the
    episode with reward 1 and no tool run; the drafted box too; an unclosed turn ends the
    episode with reward 0 and no environment step."""
    from rlflow.envs.tools import parse_tool_calls

    assert len(parse_tool_calls(DRAFTED_TOOL_CALL)) == 1      # what ran before the split
    outs, m = _episode_outcomes([DRAFTED_TOOL_CALL, DRAFTED_BOXED, "<think>\nrun <tool_call>"],
                                split_qwen3)
    assert [(o.continuation, o.reward, o.failed) for o in outs] == \
        [(None, 1.0, False), (None, 1.0, False), (None, 0.0, False)]
    assert m.get("env/tool_calls", 0.0) == 0.0 and m["sampler/env_steps"] == 2
    assert m["sampler/episodes_reasoning_unclosed"] == 1 and m["sampler/env_errors"] == 0


def test_samples_log_keeps_reasoning_and_answer():
    from rlflow.exchange.records import completion_samples

    g = {"prompt_tokens": np.array([72, 105], np.int32),
         "completion_tokens": np.array([[ord(c) for c in "<think>x</think>42"]], np.int32),
         "completion_lengths": np.array([18], np.int32),
         "policy_versions": np.zeros((1, 18), np.int32),
         "rewards": np.array([1.0], np.float32), "truncated": np.array([False]),
         "prompt_id": np.array(0, np.int64)}
    (row,) = completion_samples([g], CharTokenizer(), reasoning=split_qwen3)
    assert (row["completion"], row["reasoning"], row["answer"]) == \
        ("<think>x</think>42", "x", "42")
    (plain,) = completion_samples([g], CharTokenizer(), reasoning=split_none)
    assert "reasoning" not in plain and plain["completion"] == "<think>x</think>42"
