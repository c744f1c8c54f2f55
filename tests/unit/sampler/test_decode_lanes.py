"""Decode lanes (sampler.decode_lanes): the slots split into batchers that decode at the same
time give the completions one batcher gives, keep a request's samples together, and take
every new weight version."""

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from rlflow.config import (ConfigError, EnvConfig, ExperimentConfig, MeshConfig, ModelConfig,
                           SamplerConfig)
from rlflow.mesh import make_mesh
from rlflow.models import build_model
from rlflow.sampler.batching import ContinuousBatcher, Request
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.lanes import DecodeLanes, lane_count
from rlflow.sampler.sampling import SamplingParams
from sampler_fixtures import PROMPT, first_token_weights
from tolerances import forward_atol

VOCAB = 128
LENGTHS = [2, 16, 4, 9, 2, 12, 16, 3, 7, 5]
PROMPTS = [[1 + i, 5, 6 + i][: 1 + i % 3] + [9] * (i % 5) for i in range(10)]


def engine_with(model, slots):
    cfg = SamplerConfig(num_slots=slots, max_prefill_length=16, prefill_buckets=(8, 16),
                        max_tokens=16, temperature=1.0, decode_steps_per_call=2)
    return RlflowEngine(model, cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))


@pytest.fixture(scope="module")
def setup():
    """An untied random model (sharpened: confident tokens), a 4-slot engine and a 2-slot
    engine (one lane of two)."""
    model = build_model(ModelConfig(vocab_size=VOCAB, tie_word_embeddings=False,
                                    init_seed=1))[0]
    nnx.update(model, jax.tree_util.tree_map(lambda x: x * 6.0, nnx.state(model, nnx.Param)))
    return model, engine_with(model, 4), engine_with(model, 2)


def requests(samples=1):
    return [Request(100 + i, PROMPTS[i], samples,
                    SamplingParams(temperature=1.0, max_tokens=n, seed=i, stop_token_ids=()))
            for i, n in enumerate(LENGTHS)]


def test_lanes_give_the_completions_of_one_batcher(setup):
    """Per-request seeds: a sample's tokens do not depend on its slot or lane; logprobs to
    float32 rounding (other batch shapes)."""
    model, four, two = setup
    ref = {g.prompt_id: g for g in ContinuousBatcher(four).run(requests(2))}
    lanes = DecodeLanes(two, lanes=2)
    counters = lanes.counters                   # a live view, read before the work
    assert counters.slot_steps_used == 0 and counters.occupancy == 0.0
    got = {g.prompt_id: g for g in lanes.run(requests(2))}
    assert got.keys() == ref.keys()
    seq = two.sampler_cfg.max_prefill_length + two.sampler_cfg.max_tokens
    for pid, g in got.items():
        assert [c.sample_index for c in g.completions] == [0, 1]
        for c, r in zip(g.completions, ref[pid].completions):
            np.testing.assert_array_equal(c.tokens, r.tokens)
            atol = forward_atol(model.cfg, seq, float(np.abs(r.logprobs).max()))
            np.testing.assert_allclose(c.logprobs, r.logprobs, atol=atol)
    c = counters
    assert c.slot_steps_used == 2 * sum(LENGTHS)
    assert c.occupancy == pytest.approx(c.slot_steps_used / c.slot_steps_available)
    assert c.completions_truncated == 2 * len(LENGTHS)
    assert c.slot_steps_available == sum(b.counters.slot_steps_available for b in lanes.lanes)
    assert all(b.counters.decode_calls > 0 for b in lanes.lanes)     # both lanes decoded
    assert not lanes.has_work and lanes.num_active == 0
    lanes.close()


def test_requests_go_to_the_least_loaded_lane_with_their_samples_together(setup):
    _, _, two = setup
    lanes = DecodeLanes(two, lanes=2)
    sp = SamplingParams(temperature=1.0, max_tokens=3, stop_token_ids=())
    for pid, n in enumerate([3, 2, 1, 1]):
        lanes.submit(Request(pid, PROMPT, n, sp.replace(seed=pid)))
    # 3 -> lane 0; 2 -> lane 1; 1 -> lane 1 (2 < 3); 1 -> lane 0 (3 = 3: the first)
    assert [b.num_queued for b in lanes.lanes] == [4, 3]
    groups = lanes.run()
    assert sorted((g.prompt_id, len(g.completions)) for g in groups) == \
        [(0, 3), (1, 2), (2, 1), (3, 1)]
    lanes.close()


def test_lanes_step_at_the_same_time(setup):
    """Each lane's step runs on its own thread: two steps that each wait for the other
    only return when they run together (sequential steps would break the barrier)."""
    _, _, two = setup
    lanes = DecodeLanes(two, lanes=2)
    barrier = threading.Barrier(2, timeout=30)
    threads = []
    for lane in lanes.lanes:
        lane.submit(Request(0, PROMPT, 1, SamplingParams(max_tokens=2, stop_token_ids=())))

        def step():
            threads.append(threading.get_ident())
            barrier.wait()
            return []
        lane.step = step
    assert lanes.step() == []
    assert len(set(threads)) == 2 and threading.get_ident() not in threads
    lanes.close()


def test_a_new_version_reaches_every_lane(setup):
    model, _, two = setup
    graphdef, state = nnx.split(model, nnx.Param)
    forward = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m))
    w0, w1 = first_token_weights(forward, state)               # PROMPT's greedy token 5 / 7
    greedy = SamplingParams(temperature=0.0, max_tokens=1, stop_token_ids=())
    lanes = DecodeLanes(two, params=w0, version=0, lanes=2)

    def first_tokens():
        groups = lanes.run([Request(i, PROMPT, 2, greedy) for i in range(2)])
        assert sorted(g.prompt_id for g in groups) == [0, 1]
        assert all(b.counters.decode_calls > 0 for b in lanes.lanes)
        return sorted((c.tokens.tolist(), c.versions.tolist())
                      for g in groups for c in g.completions)

    assert first_tokens() == [([5], [0])] * 4
    lanes.update_params(w1, version=1)
    assert first_tokens() == [([7], [1])] * 4
    assert lanes.version == 1 and lanes.counters.weight_swaps == 2     # one per lane
    lanes.close()


def test_lane_settings_are_checked():
    with pytest.raises(ConfigError, match=r"sampler\.decode_lanes.*must divide "
                       r"sampler\.num_slots=16.*got 3"):
        SamplerConfig(num_slots=16, decode_lanes=3)
    with pytest.raises(ConfigError, match=r"sampler\.decode_lanes.*integer >= 0.*got -1"):
        SamplerConfig(decode_lanes=-1)
    with pytest.raises(ConfigError, match=r"sampler\.decode_lanes.*integer >= 0.*got 1.5"):
        SamplerConfig(decode_lanes=1.5)
    SamplerConfig(num_slots=5, decode_lanes=0)        # 0: the sampler chooses (lane_count)
    ExperimentConfig(sampler=SamplerConfig(num_slots=16, decode_lanes=0),
                     env=EnvConfig(name="guess_digit"))
    with pytest.raises(ConfigError, match=r"sampler\.decode_lanes.*multi-turn"):
        ExperimentConfig(sampler=SamplerConfig(num_slots=16, decode_lanes=2),
                         env=EnvConfig(name="guess_digit"))
    with pytest.raises(ValueError, match="needs >= 2 lanes"):
        DecodeLanes(None, lanes=1)


def test_lane_count_chooses_two_only_where_two_measured_faster():
    """decode_lanes=0: 2 lanes on the CPU backend with >= 2 CPUs, a model of hidden >= 256,
    an even num_slots >= 4 and single-turn requests; each condition alone turns it to 1."""
    pays = dict(hidden_size=256, backend="cpu", cpus=2, multi_turn=False)
    assert lane_count(0, 16, **pays) == 2
    for change in (dict(hidden_size=255), dict(backend="tpu"), dict(backend="gpu"),
                   dict(cpus=1), dict(multi_turn=True), dict(replicas=2)):
        assert lane_count(0, 16, **{**pays, **change}) == 1, change
    assert lane_count(0, 2, **pays) == 1 and lane_count(0, 6, **pays) == 2
    assert lane_count(0, 15, **pays) == 1
    assert lane_count(0, 16, **{**pays, "cpus": 4, "replicas": 2}) == 2   # 2 CPUs each
    assert lane_count(4, 16, **{**pays, "backend": "tpu"}) == 4   # set: taken as it is
    assert lane_count(1, 16, **pays) == 1
