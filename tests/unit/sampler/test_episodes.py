"""Multi-turn episodes in the batcher: a slot parks between turns, the environment's ids are
appended to its KV cache, every sampled token keeps its logprob and version (across a weight
swap inside a turn), and the group record's loss_mask is 1 exactly on sampled tokens."""

import dataclasses

import jax.numpy as jnp
import pytest
import numpy as np

from rlflow.config import EnvConfig
from rlflow.envs import EnvStep, register_environment
from rlflow.exchange.records import validate_group
from rlflow.learner.batch import BatchSpec, build_batch
from rlflow.models.logprobs import token_logprobs
from rlflow.sampler.batching import ContinuousBatcher, Request
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.episodes import EpisodeDriver
from rlflow.sampler.sampling import SamplingParams
from tolerances import forward_atol, sum_tol

from sampler_fixtures import with_lm_head_swapped
from test_batching import setup  # noqa: F401 - the module fixture

PROMPT = [1, 20, 33, 47]
CONT = [3, 4, 9]                      # the (fake) rendered environment answer
G = 4


class TwoTurns:
    """Answers the first turn, ends the episode with reward 1 on the second."""

    def __init__(self, record):
        self.turns = 0

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, assistant):
        self.turns += 1
        if self.turns == 1:
            return EnvStep(messages=[{"role": "user", "content": "again"}], info={"asked": 1})
        return EnvStep(done=True, reward=1.0)


register_environment("test_two_turns")(lambda record, **kw: TwoTurns(record))


class FakeRenderer:
    def __init__(self, eot, tokenizer=None):
        self.end_of_turn_ids = tuple(eot)
        self.tokenizer = tokenizer or FakeTokenizer()

    def assistant_text(self, ids):
        ids = [int(i) for i in ids]
        while ids and ids[-1] in self.end_of_turn_ids:
            ids.pop()
        return self.tokenizer.decode(ids)

    def prompt_ids(self, messages, tools=None):
        return list(PROMPT)

    def continuation_ids(self, messages, new_messages, tools=None):
        assert messages[-1]["role"] == "assistant" and new_messages[0]["content"] == "again"
        assert messages[-2]["role"] in ("user", "system")
        return list(CONT)


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_episode_logprobs_equal_recompute_across_a_swap_and_masks(setup, kv_cache):
    """(With ``sampler.kv_cache="paged"``, pages of 4 tokens: the environment's ids are
    appended into pages taken for them, issue 43 item 5.)"""
    model, engine, w0, forward = setup
    if kv_cache == "paged":
        engine = RlflowEngine(model, dataclasses.replace(
            engine.sampler_cfg, kv_cache="paged", page_size=4), mesh=engine.mesh)
    w1 = with_lm_head_swapped(w0, 5, 7)
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=3, stop_token_ids=())
    # Stop ids that end every episode's first turn by its second token: the tokens the same
    # samples (same uniforms, same weights) draw there in a single-turn run.
    single = ContinuousBatcher(engine, params=w0).run([Request(0, PROMPT, G, sampling)])[0]
    eot = sorted({int(c.tokens[1]) for c in single.completions})
    driver = EpisodeDriver(EnvConfig(name="test_two_turns", max_turns=4), FakeTokenizer(),
                           FakeRenderer(eot))
    prompt, group = driver.new_group({"prompt_id": 0}, G)
    assert prompt.tolist() == PROMPT
    batcher = ContinuousBatcher(engine, params=w0, version=0, episodes=driver)
    batcher.submit(Request(0, prompt, G, SamplingParams(
        temperature=1.0, max_tokens=16, seed=3, stop_token_ids=tuple(eot)), episode=group))
    out, swapped = [], False
    while batcher.has_work:
        out += batcher.step()
        if not swapped and batcher.counters.env_extends:
            batcher.update_params(w1, version=1)       # the extended turns go on under W1
            swapped = True
    assert len(out) == 1 and batcher.counters.env_extends == G
    record = out[0].to_record()
    validate_group(record, group_size=G, max_tokens=16)
    spans = 0
    for i, c in enumerate(out[0].completions):
        n = len(c.tokens)
        first_end = int(np.flatnonzero(np.isin(c.tokens, eot))[0])     # turn 1 ends here
        env = slice(first_end + 1, first_end + 1 + len(CONT))
        assert first_end <= 1 and c.tokens[env].tolist() == CONT
        want = np.ones(n, bool)
        want[env] = False
        assert record["loss_mask"][i, :n].tolist() == want.tolist()
        assert not record["loss_mask"][i, n:].any()
        assert (c.versions[env] == -1).all() and (c.logprobs[env] == 0).all()
        assert c.finish_reason == ("stop" if c.tokens[-1] in eot else "length")
        assert record["rewards"][i] == (1.0 if c.finish_reason == "stop" else 0.0)
        turn2 = c.versions[env.stop:]
        spans += int((turn2 == 0).any() and (turn2 == 1).any())
        # Only the output head changed, so the KV (mixed versions) equals either recompute:
        # each sampled token's logprob is the recompute under its own version's weights.
        seq = jnp.asarray([PROMPT + c.tokens.tolist()], jnp.int32)
        p = len(PROMPT)
        for v, w in ((0, w0), (1, w1)):
            logits = forward(w, seq, jnp.arange(seq.shape[1])[None], jnp.ones(seq.shape, bool))
            lp = np.asarray(token_logprobs(logits[0, p - 1:-1], jnp.asarray(c.tokens)))
            at = c.versions == v
            atol = forward_atol(model.cfg, engine.cache_len, float(np.abs(lp).max()))
            np.testing.assert_allclose(c.logprobs[at], lp[at], rtol=0, atol=atol)
    assert spans >= 1, "no turn spans the weight swap"
    assert driver.metrics()["sampler/env_steps"] >= G and driver.metrics()["env/asked"] == G

    # The learner: the loss mask is the record's loss_mask (shifted onto targets), staleness
    # counts sampled tokens only (the -1 of environment tokens are not versions).
    spec = BatchSpec(group_size=G, num_rows=G, seq_buckets=(64,), max_tokens=16,
                     max_staleness=1)
    batch, info = build_batch([record], spec, learner_version=1)
    for i in range(G):
        n = int(record["completion_lengths"][i])
        got = batch.loss_mask[i, p - 1:p - 1 + n]
        assert got.tolist() == record["loss_mask"][i, :n].tolist()
        assert batch.loss_mask[i].sum() == record["loss_mask"][i].sum()
    assert info["batch/loss_tokens"] == int(record["loss_mask"].sum())


def test_env_step_errors_and_timeouts_end_the_episode_counted():
    """Steps in a real worker process: one answers, one raises, one hangs past
    env.step_timeout_s (its worker is killed); the two failures end their episodes with
    reward 0, counted, and the driver goes on."""
    import time

    from rlflow.sampler.env_workers import env_pool

    cfg = EnvConfig(name="episode_envs:make_flaky", step_timeout_s=2.0, num_workers=2)
    driver = EpisodeDriver(cfg, CharTokenizer(), FakeRenderer([0], CharTokenizer()),
                           pool=env_pool(cfg))
    try:
        _, group = driver.new_group({"prompt_id": 7}, 3)
        texts = {0: "ok", 1: "raise", 2: "hang"}
        for i, text in texts.items():
            driver.turn_ended(group, i, np.asarray([ord(c) for c in text] + [0]), 0)
        got, deadline = {}, time.monotonic() + 120
        while len(got) < 3 and time.monotonic() < deadline:
            got.update({i: out for _, i, out in driver.poll(0.5)})
        assert sorted(got) == [0, 1, 2]
        assert got[0].continuation.tolist() == CONT
        assert got[1].continuation is None and got[1].reward == 0.0
        assert got[2].continuation is None and got[2].reward == 0.0
        m = driver.metrics()
        assert m["sampler/env_errors"] == 1 and m["sampler/env_timeouts"] == 1
    finally:
        driver.close()


def test_a_run_of_failed_steps_stops_at_env_max_consecutive_errors():
    """Failed steps in a row count up to env.max_consecutive_errors, then poll raises with
    the last error; a successful step resets the count; 0: never stop."""
    from rlflow.envs import EnvFailureError

    cfg = EnvConfig(name="episode_envs:make_flaky", max_consecutive_errors=2)
    driver = EpisodeDriver(cfg, CharTokenizer(), FakeRenderer([0], CharTokenizer()))
    _, group = driver.new_group({"prompt_id": 7}, 4)

    def turn(i, text):
        driver.turn_ended(group, i, np.asarray([ord(c) for c in text] + [0]), 0)

    for i, text in enumerate(["raise", "ok", "raise"]):     # a run of 1, reset, 1: goes on
        turn(i, text)
    assert [out.continuation is None for _, _, out in driver.poll()] == [True, False, True]
    turn(3, "raise")
    with pytest.raises(EnvFailureError) as e:
        driver.poll()
    assert str(e.value).startswith(
        "environment 'episode_envs:make_flaky' failed (errors or timeouts) on its last 2 "
        "steps in a row (env.max_consecutive_errors=2), the last at prompt_id 7 episode 3: "
        "RuntimeError: environment bug")
    never = EpisodeDriver(EnvConfig(name="episode_envs:make_flaky", max_consecutive_errors=0),
                          CharTokenizer(), FakeRenderer([0], CharTokenizer()))
    _, group = never.new_group({"prompt_id": 8}, 3)
    for i in range(3):
        never.turn_ended(group, i, np.asarray([ord(c) for c in "raise"] + [0]), 0)
    assert [out.reward for _, _, out in never.poll()] == [0.0] * 3


def test_steps_that_time_out_count_toward_env_max_consecutive_errors():
    """Issue 39.7: an environment whose every step times out stops the run naming it (the
    worker pool reports a step past env.step_timeout_s as status "timeout"; injected here
    as the pool's answer)."""
    from rlflow.envs import EnvFailureError

    cfg = EnvConfig(name="episode_envs:make_flaky", max_consecutive_errors=2)
    driver = EpisodeDriver(cfg, CharTokenizer(), FakeRenderer([0], CharTokenizer()))
    _, group = driver.new_group({"prompt_id": 9}, 2)
    driver._answers.append((group, 0, "timeout", "ran past env.step_timeout_s=30 s"))
    assert [out.reward for _, _, out in driver.poll()] == [0.0]
    driver._answers.append((group, 1, "timeout", "ran past env.step_timeout_s=30 s"))
    with pytest.raises(EnvFailureError, match=r"'episode_envs:make_flaky' failed \(errors or "
                       r"timeouts\) on its last 2 steps in a row .* prompt_id 9 episode 1: "
                       r"ran past env.step_timeout_s=30 s"):
        driver.poll()
    assert driver.metrics()["sampler/env_timeouts"] == 2


def test_prompts_whose_environments_cannot_start_stop_at_env_max_consecutive_errors():
    """A dropped prompt (factory / reset failed) counts toward env.max_consecutive_errors; a
    prompt whose environments start resets the count; at the limit the sampler stops with
    the last error (every prompt dropped would leave the learner waiting for ever)."""
    from types import SimpleNamespace as NS

    from rlflow.envs import EnvError, EnvFailureError
    from rlflow.sampler.program import SamplerProgram

    class Driver:                     # the episode driver's new_group: prompt 3 starts
        def new_group(self, record, group_size):
            if record["prompt_id"] != 3:
                raise EnvError(f"field 'start' missing in prompt {record['prompt_id']}")
            return np.asarray(PROMPT, np.int32), "group"

    from rlflow.sampler.delivery import GroupDelivery

    program = NS(episodes=Driver(), delivery=GroupDelivery(None, None, None, None),
                 env_reset_errors=0, env_reset_run=0,
                 renderer=FakeRenderer([0]),
                 cfg=NS(sampler=NS(max_prefill_length=8, group_size=2, max_tokens=8),
                        env=EnvConfig(name="rejects", max_consecutive_errors=3)))
    sampling = SamplingParams(temperature=1.0, max_tokens=8)

    def lease(i):
        return SamplerProgram._new_episodes(program, {"stream_index": i, "lease_id": i,
                                                      "prompt_id": i}, sampling)

    assert lease(1) is None and lease(2) is None                   # dropped, run of 2
    assert lease(3)[1] == "group" and program.env_reset_run == 0   # started: reset
    assert lease(4) is None and lease(5) is None
    with pytest.raises(EnvFailureError) as e:
        lease(6)
    assert str(e.value).startswith(
        "environment 'rejects' could not start for the last 3 prompts in a row "
        "(env.max_consecutive_errors=3), the last prompt_id 6: EnvError: field 'start' "
        "missing in prompt 6")
    assert program.env_reset_errors == 5
    assert program.delivery.take_dropped() == [[i, i] for i in (1, 2, 4, 5, 6)]


class Contract:
    """``step`` returns what the assistant text names: an EnvStep that breaks the contract
    (reward or info not numbers), or a user message of ``n`` characters (``"chars <n>"``)."""

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, assistant):
        if assistant == "text reward":
            return EnvStep(done=True, reward="high")
        if assistant == "array reward":
            return EnvStep(done=True, reward=np.ones(2))
        if assistant == "text info":
            return EnvStep(done=True, reward=1.0, info={"calls": "many"})
        if assistant == "nan info":
            return EnvStep(done=True, reward=1.0, info={"calls": float("nan")})
        if assistant == "list info":
            return EnvStep(done=True, reward=1.0, info=[1])
        if assistant == "numpy":
            return EnvStep(done=True, reward=np.float32(0.5), info={"calls": np.int64(2)})
        return EnvStep(messages=[{"role": "user", "content": "x" * int(assistant.split()[1])}])


register_environment("test_contract")(lambda record, **kw: Contract())


class VocabTokenizer(CharTokenizer):
    def get_vocab(self):                  # one character per token: char_bound = 2n + 1024
        return {chr(i): i for i in range(32, 127)}


class RecordingRenderer(FakeRenderer):
    def __init__(self):
        super().__init__([0], CharTokenizer())
        self.rendered = []

    def continuation_ids(self, messages, new_messages, tools=None):
        self.rendered.append(len(new_messages[0]["content"]))
        return list(CONT)


def _contract_driver(**kw):
    renderer = RecordingRenderer()
    driver = EpisodeDriver(EnvConfig(name="test_contract", max_consecutive_errors=0),
                           VocabTokenizer(), renderer, **kw)
    return driver, renderer


def _answers(driver, texts):
    _, group = driver.new_group({"prompt_id": 5}, len(texts))
    for i, text in enumerate(texts):
        driver.turn_ended(group, i, np.asarray([ord(c) for c in text] + [0]), 0)
    return [out for _, _, out in driver.poll()]


def test_a_step_whose_reward_or_info_is_not_a_number_ends_the_episode_counted(caplog):
    """A reward or info value that is not a number is a bad step (reward 0, counted, the log
    names the environment, the episode and the field), not a crash of the sampler; numpy
    numbers are numbers."""
    driver, _ = _contract_driver()
    bad = ["text reward", "array reward", "text info", "nan info", "list info"]
    with caplog.at_level("WARNING", logger="rlflow.sampler.episodes"):
        outs = _answers(driver, bad + ["numpy"])
    assert [(o.continuation, o.reward, o.truncated) for o in outs[:5]] == \
        [(None, 0.0, False)] * 5
    assert outs[5].reward == 0.5 and outs[5].continuation is None
    m = driver.metrics()
    assert m["sampler/env_errors"] == 5 and m["env/calls"] == 2.0
    text = caplog.text
    assert "environment 'test_contract', prompt_id 5 episode 0: EnvStep.reward must be a " \
           "number (or None), got str 'high'" in text
    assert "episode 1: EnvStep.reward must be a number (or None), got ndarray" in text
    assert "episode 2: EnvStep.info['calls'] must be a finite number, got str 'many'" in text
    assert "episode 3: EnvStep.info['calls'] must be a finite number, got float nan" in text
    assert "episode 4: EnvStep.info must be a dict of numbers, got list" in text


def test_messages_too_long_for_the_episode_end_it_truncated_without_rendering():
    """New messages whose text exceeds what the episode's token limit can hold (here 2 x 16
    + 1024 characters: one character per token) end the episode as truncated, reward 0,
    counted in sampler/episodes_cut_tokens, and are never handed to the renderer; messages
    at the bound are rendered. First messages over the prompt's bound drop the prompt."""
    from rlflow.data.tokenizer import char_bound
    from rlflow.envs import EnvError

    bound = char_bound(VocabTokenizer(), 16)
    assert bound == 2 * 16 + 1024
    driver, renderer = _contract_driver(max_episode_tokens=16)
    outs = _answers(driver, [f"chars {bound}", f"chars {bound + 1}", "chars 5000000"])
    assert outs[0].continuation.tolist() == CONT
    assert [(o.continuation, o.reward, o.truncated) for o in outs[1:]] == \
        [(None, 0.0, True)] * 2
    assert renderer.rendered == [bound]
    m = driver.metrics()
    assert m["sampler/episodes_cut_tokens"] == 2 and m["sampler/env_errors"] == 0

    class LongReset(Contract):
        def reset(self):
            return [{"role": "user", "content": "y" * (char_bound(VocabTokenizer(), 8) + 1)}]

    register_environment("test_long_reset")(lambda record, **kw: LongReset())
    long_reset = EpisodeDriver(EnvConfig(name="test_long_reset"), VocabTokenizer(),
                               RecordingRenderer(), max_prompt_tokens=8)
    with pytest.raises(EnvError, match=r"^environment 'test_long_reset', prompt_id 3: reset\(\) "
                                       r"returned 1041 characters of messages, more than "
                                       r"sampler.max_prefill_length tokens can hold"):
        long_reset.new_group({"prompt_id": 3}, 2)


# ---------------------------------------------------------------- failure marks (issue 44.7)

class CrashOnSecond:
    """Episode k of a group ends on its first step with reward k / 4, except episode 1,
    whose environment raises (an infrastructure failure)."""

    made = 0

    def __init__(self, record):
        self.k = CrashOnSecond.made % G
        CrashOnSecond.made += 1

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, assistant):
        if self.k == 1:
            raise ConnectionError("sandbox lost")
        return EnvStep(done=True, reward=self.k / 4)


register_environment("test_crash_second")(lambda record, **kw: CrashOnSecond(record))


@pytest.mark.parametrize("mode", ["mask", "zero_reward"])
def test_a_group_with_one_environment_crash(setup, mode):
    """The crashed episode is marked failed in the record; with on_failed_sample="mask" it
    has no loss position and no weight in the GRPO baseline (numpy oracle over the other
    three); with "zero_reward" it trains as reward 0; batch/failed_samples counts it."""
    from test_advantages import np_grpo

    _, engine, w0, _ = setup
    single = ContinuousBatcher(engine, params=w0).run([Request(0, PROMPT, G, SamplingParams(
        temperature=1.0, max_tokens=16, seed=3, stop_token_ids=()))])[0]
    eot = sorted({int(c.tokens[1]) for c in single.completions})  # every turn ends by token 2
    CrashOnSecond.made = 0
    driver = EpisodeDriver(EnvConfig(name="test_crash_second", max_turns=2,
                                     max_consecutive_errors=0), FakeTokenizer(),
                           FakeRenderer(eot))
    prompt, group = driver.new_group({"prompt_id": 0}, G)
    batcher = ContinuousBatcher(engine, params=w0, version=0, episodes=driver)
    batcher.submit(Request(0, prompt, G, SamplingParams(
        temperature=1.0, max_tokens=16, seed=3, stop_token_ids=tuple(eot)), episode=group))
    out = []
    while batcher.has_work:
        out += batcher.step()
    record = out[0].to_record()
    validate_group(record, group_size=G, max_tokens=16)
    assert record["failed"].tolist() == [False, True, False, False]
    assert driver.metrics()["sampler/env_errors"] == 1
    np.testing.assert_array_equal(record["rewards"], [0.0, 0.0, 0.5, 0.75])

    spec = BatchSpec(group_size=G, num_rows=G, seq_buckets=(64,), max_tokens=16,
                     on_failed_sample=mode)
    batch, info = build_batch([record], spec, learner_version=0)
    assert info["batch/failed_samples"] == 1
    per_sample = np.array([batch.advantages[i][batch.loss_mask[i]].mean() for i in (0, 2, 3)])
    if mode == "mask":
        assert not batch.loss_mask[1].any() and info["batch/loss_samples"] == 3
        want = np_grpo([[0.0, 0.5, 0.75]])[0]
    else:
        assert batch.loss_mask[1].any() and info["batch/loss_samples"] == 4
        want = np_grpo([[0.0, 0.0, 0.5, 0.75]])[0][[0, 2, 3]]
    np.testing.assert_allclose(per_sample, want, atol=sum_tol(G, scale=4.0))
