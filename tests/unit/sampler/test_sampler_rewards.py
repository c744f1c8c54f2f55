"""The sampler program's reward path (issue 14, items 1, 4, 5): finished groups are scored
by reward workers while decoding goes on, delivered whole and in order; a NaN/inf reward
follows ``learner.on_bad_reward``; a user's reward function named ``file.py:function``
reaches the program and its workers.

The program's :class:`rlflow.sampler.delivery.GroupDelivery` is driven through its
``score`` / ``collect`` methods and the program's ``_status``, with stand-ins for the
engine-side objects (tokenizer, buffer, run control), so no JAX runtime is needed; the
Rewarder and its worker processes are the real ones.
"""

import textwrap

import numpy as np
import pytest

from rlflow.config import ExperimentConfig, LearnerConfig, RewardConfig
from rlflow.data.rewarder import Rewarder
from rlflow.data.rewards import NonFiniteRewardError
from rlflow.sampler.batching import CompletedGroup, Completion, Request
from rlflow.control.run_control import ControlReply
from rlflow.sampler.background import RateCounters
from rlflow.sampler.delivery import GroupDelivery
from rlflow.sampler.program import SamplerProgram
from rlflow.sampler.weight_pause import SwapPauseMeter
from delivery_fakes import CharTokenizer, RecordingBuffer
from tolerances import sum_tol


class _Control:
    instance = 0

    def __init__(self):
        self.metrics = None

    def status(self, **kw):
        self.metrics, self.dropped = kw["metrics"], kw.get("dropped")
        return ControlReply()


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent("""
        def nan_on_bad(completion, answer):
            return float("nan") if completion == "bad" else float(len(completion))
    """))
    return str(path)


def _program(plugin_file, on_bad_reward):
    cfg = ExperimentConfig(
        reward=RewardConfig(functions=(f"{plugin_file}:nan_on_bad",), weights=(1.0,),
                            num_workers=2),
        learner=LearnerConfig(on_bad_reward=on_bad_reward))
    p = object.__new__(SamplerProgram)      # only what _status reads
    p.cfg, p.window = cfg, RateCounters()
    p.delivery = GroupDelivery(CharTokenizer(), RecordingBuffer(), Rewarder(cfg.reward, plugins=cfg.plugins),
                               p.window, on_bad_reward=cfg.learner.on_bad_reward)
    p.control, p.prompts_started = _Control(), 0
    p.swap, p.pause, p.version = {}, SwapPauseMeter(), 0
    return p


def _group(prompt_id, texts, finish_reasons=None):
    req = Request(prompt_id=prompt_id, prompt_tokens=[1, 2], num_samples=len(texts))
    reasons = finish_reasons or ["stop"] * len(texts)
    comps = [Completion(prompt_id, g, np.array([ord(c) for c in t], np.int32),
                        np.zeros(len(t), np.float32), np.zeros(len(t), np.int32), reason)
             for g, (t, reason) in enumerate(zip(texts, reasons))]
    return CompletedGroup(request=req, prompt_tokens=np.array([1, 2], np.int32),
                          max_tokens=8, completions=comps)


def _admit(d, groups):
    for g in groups:       # leased prompts (the ledger's keys travel with each group)
        d.admit(g.request, {"answer": "x", "stream_index": 10 + g.request.prompt_id,
                            "lease_id": 100 + g.request.prompt_id})
    d.score(groups)


def _drain(d):
    while d.waiting_for_rewards:
        d.collect(0.1)


def test_groups_are_scored_off_the_decode_loop_and_delivered_whole_in_order(plugin_file):
    d = _program(plugin_file, "error").delivery
    try:
        groups = [_group(i, ["a" * (i + 1), "b" * (i + 2)]) for i in range(4)]
        _admit(d, groups)
        assert len(d.in_flight) == 4            # scoring groups still count for admission
        _drain(d)
        assert [int(r["prompt_id"]) for r in d.buffer.records] == [0, 1, 2, 3]
        for i, rec in enumerate(d.buffer.records):
            np.testing.assert_array_equal(rec["rewards"], [i + 1, i + 2])
            assert rec["rewards"].dtype == np.float32
            assert (int(rec["stream_index"]), int(rec["lease_id"])) == (10 + i, 100 + i)
        assert d.in_flight == {} and d.groups_delivered == 4
    finally:
        d.close()


@pytest.mark.parametrize("num_workers", [1, 0])
def test_the_reward_sees_how_each_completion_ended(num_workers):
    """Issue 39.1: ``8`` ended by a stop token and ``8`` cut at max_tokens (special tokens
    after it removed by the decode) read the same; the demo's reward pays the stop credit
    only for the first. Before the fix both scored 1.0."""
    cfg = RewardConfig(functions=("digits_match",), weights=(1.0,), num_workers=num_workers)
    d = GroupDelivery(CharTokenizer(), RecordingBuffer(), Rewarder(cfg), RateCounters())
    try:
        g = _group(0, ["8", "8", "7"], ["stop", "length", "stop"])
        d.admit(g.request, {"answer": "8", "stream_index": 0, "lease_id": 0})
        d.score([g])
        _drain(d)
        # float64 rewards stored as float32 (one rounding) and summed over one function
        # (tests/tolerances.py): within two roundings of eps / 2
        np.testing.assert_allclose(d.buffer.records[0]["rewards"], [1.0, 0.9, 0.1],
                                   rtol=sum_tol(2))
    finally:
        d.close()


def test_nan_reward_with_drop_drops_the_group_and_counts_it_in_the_status(plugin_file):
    p = _program(plugin_file, "drop")
    d = p.delivery
    try:
        _admit(d, [_group(3, ["ok", "bad"]), _group(4, ["ok", "fine"])])
        _drain(d)
        assert [int(r["prompt_id"]) for r in d.buffer.records] == [4]
        assert d.bad_reward_groups == 1 and d.in_flight == {}
        p._status()
        assert p.control.metrics["sampler/dropped_bad_reward_groups"] == 1.0
        assert p.control.metrics["sampler/groups_delivered"] == 1.0
        assert p.control.dropped == [[13, 103]]     # the ledger resolves the prompt
        assert d.dropped_leases == []
    finally:
        d.close()


def test_nan_reward_with_error_stops_naming_function_and_sample(plugin_file):
    d = _program(plugin_file, "error").delivery
    try:
        _admit(d, [_group(3, ["ok", "bad"])])
        with pytest.raises(NonFiniteRewardError,
                           match=r"'.*my_rewards.py:nan_on_bad' returned nan for sample "
                                 r"prompt 3 sample 1"):
            _drain(d)
        assert d.buffer.records == []
    finally:
        d.close()


class _GoneParent:
    """A worker's end of the pipe after its parent died: recv or send raises ``error``."""

    def __init__(self, error, *, on="recv"):
        self.error, self.on = error, on

    def recv(self):
        if self.on == "recv":
            raise self.error
        return (7, "x")

    def send(self, msg):
        raise self.error


@pytest.mark.parametrize("error, on", [(ConnectionResetError(104, "reset"), "recv"),
                                       (EOFError(), "recv"),
                                       (BrokenPipeError(32, "pipe"), "send")])
def test_reward_worker_leaves_quietly_when_its_parent_is_gone(error, on):
    """kill -9 of the sampler: its reward workers see EOF, a reset or a broken pipe and
    return (no traceback written into the sampler's log, which the launcher would then
    report as the sampler's own error)."""
    from rlflow.data.reward_workers import serve
    serve(_GoneParent(error, on=on), lambda *a: 1.0)        # returns; raising fails the test


@pytest.mark.parametrize("failures", [1, 3])
def test_a_prompt_the_batcher_refuses_is_retried_then_stops_the_sampler(failures):
    """The batcher refuses a prompt (e.g. longer than the prefill bucket, as an environment's
    rendered first turn can be): retried, and after MAX_PROMPT_RETRIES + 1 refusals the
    sampler stops with SamplerError naming the prompt and the batcher's error."""
    from rlflow.sampler.program import MAX_PROMPT_RETRIES, SamplerError

    calls = []

    class Batcher:
        def submit(self, request, resumed=()):
            calls.append(request.prompt_id)
            if len(calls) <= failures:      # the batcher's errors name the prompt
                raise ValueError(f"prompt_id {request.prompt_id}: prompt of 3 tokens is longer "
                                 f"than the largest prefill bucket")

    p = object.__new__(SamplerProgram)
    p.cfg, p.episodes, p.batcher = ExperimentConfig(), None, Batcher()
    p.delivery, p.prompts_started = GroupDelivery(None, None, None, None), 0
    element = {"seed": 5, "prompt_tokens": [1, 2, 3], "prompt_id": 7}
    if failures <= MAX_PROMPT_RETRIES:
        p._submit(element)
        assert calls == [7] * (failures + 1) and p.prompts_started == 1
        assert list(p.delivery.in_flight.values()) == [element]
    else:
        with pytest.raises(SamplerError, match=rf"^prompt_id 7 failed {MAX_PROMPT_RETRIES + 1} "
                                               r"times: prompt of 3 tokens is longer"):
            p._submit(element)
        assert calls == [7] * (MAX_PROMPT_RETRIES + 1) and p.delivery.in_flight == {}


def test_a_reward_error_marks_the_sample_failed_in_the_delivered_record(tmp_path):
    """Issue 44.7: a reward function that raises on one sample scores it 0 *and* marks it
    failed in the group record; groups without a failure carry no ``failed`` field."""
    path = tmp_path / "flaky_rewards.py"
    path.write_text(textwrap.dedent("""
        def raise_on_bad(completion, answer):
            if completion == "bad":
                raise RuntimeError("scorer crashed")
            return float(len(completion))
    """))
    cfg = RewardConfig(functions=(f"{path}:raise_on_bad",), weights=(1.0,), num_workers=0)
    d = GroupDelivery(CharTokenizer(), RecordingBuffer(), Rewarder(cfg), RateCounters())
    try:
        _admit(d, [_group(0, ["ok", "bad", "okay"]), _group(1, ["a", "bb", "ccc"])])
        _drain(d)
        first, second = d.buffer.records
        assert first["failed"].tolist() == [False, True, False]
        np.testing.assert_array_equal(first["rewards"], [2.0, 0.0, 4.0])
        assert "failed" not in second
        assert d.metrics()["sampler/reward_failed_samples"] == 1.0
    finally:
        d.close()
