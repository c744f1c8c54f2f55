"""Continuous batching: scheduling counters, results mapping back, weight swap, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import ConfigError, MeshConfig, ModelConfig, SamplerConfig
from rlflow.exchange.records import validate_group
from rlflow.mesh import make_mesh
from rlflow.models import build_model
from rlflow.models.logprobs import token_logprobs
from rlflow.sampler.batching import ContinuousBatcher, Request
from rlflow.sampler.engine import PromptError, RlflowEngine
from rlflow.sampler.sampling import SamplingError, SamplingParams
from sampler_fixtures import PROMPT, first_token_weights, logits_of
from tolerances import forward_atol

VOCAB = 128


@pytest.fixture(scope="module")
def setup():
    """An untied random model (sharpened) and one engine: 4 slots, buckets 8/16, 16 tokens."""
    model = build_model(ModelConfig(vocab_size=VOCAB, tie_word_embeddings=False,
                                    init_seed=1))[0]
    nnx.update(model, jax.tree_util.tree_map(lambda x: x * 6.0, nnx.state(model, nnx.Param)))
    cfg = SamplerConfig(num_slots=4, max_prefill_length=16, prefill_buckets=(8, 16),
                        max_tokens=16, temperature=1.0, decode_steps_per_call=1)
    engine = RlflowEngine(model, cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    graphdef, state = nnx.split(model, nnx.Param)
    forward = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m))
    return model, engine, state, forward


def _lp_atol(setup, ref) -> float:
    """Logprobs of the setup model from two programs (engine decode vs full forward, other
    batch shapes): the forward's reduction lengths x eps x the logprobs' scale, with the
    engine's longest sequence (tests/tolerances.py)."""
    engine = setup[1]
    seq = engine.sampler_cfg.max_prefill_length + engine.sampler_cfg.max_tokens
    return forward_atol(setup[0].cfg, seq, float(np.abs(np.asarray(ref)).max()))


LENGTHS = [2, 16, 4, 9, 2, 12, 16, 3, 7, 5]                     # max/min = 8
PROMPTS = [[1 + i, 5, 6 + i][: 1 + i % 3] + [9] * (i % 5) for i in range(10)]


def mixed_requests():
    return [Request(100 + i, PROMPTS[i], 1, SamplingParams(temperature=1.0, max_tokens=n,
                                                           seed=i, stop_token_ids=()))
            for i, n in enumerate(LENGTHS)]


def simulate_schedule(lengths, slots, k):
    """Plain oracle of the loop: refill free slots in order before each call of k steps.
    Returns (calls, slot steps idle while requests were queued)."""
    queue, left, calls, idle = list(lengths), [0] * slots, 0, 0
    while queue or any(left):
        for s in range(slots):
            if left[s] == 0 and queue:
                left[s] = queue.pop(0)
        queued = bool(queue)
        for _ in range(k):
            idle += queued * sum(n == 0 for n in left)
            left = [max(n - 1, 0) for n in left]
        calls += 1
    return calls, idle


def test_continuous_batching_keeps_slots_busy_and_maps_results_back(setup):
    _, engine, _, _ = setup
    lengths, prompts, reqs = LENGTHS, PROMPTS, mixed_requests()
    batcher = ContinuousBatcher(engine)
    groups = batcher.run(reqs)
    c = batcher.counters
    assert sorted(g.prompt_id for g in groups) == [100 + i for i in range(10)]
    by_id = {g.prompt_id: g for g in groups}
    for i, n in enumerate(lengths):
        g = by_id[100 + i]
        assert g.prompt_tokens.tolist() == prompts[i]
        assert len(g.completions[0].tokens) == n and g.completions[0].finish_reason == "length"
    assert c.idle_slot_steps_while_queued == 0
    assert c.slot_steps_used == sum(lengths)
    assert c.decode_steps * 4 == c.slot_steps_available
    # A freed slot is refilled before the next step: the queue drains in the fewest steps
    # a greedy list scheduler allows (computed here by a plain simulation).
    free_at = [0] * 4
    for n in lengths:
        s = int(np.argmin(free_at))
        free_at[s] += n
    assert c.decode_steps == max(free_at) == simulate_schedule(lengths, 4, 1)[0]
    # Each result is the one its request gives alone (per-request seeds: no slot effect;
    # logprobs to float32 rounding: alone, its prompt is prefilled in a batch of one).
    alone = ContinuousBatcher(engine)
    for i in (1, 3, 7):
        ref = alone.run([reqs[i]])[0].completions[0]
        np.testing.assert_array_equal(by_id[100 + i].completions[0].tokens, ref.tokens)
        np.testing.assert_allclose(by_id[100 + i].completions[0].logprobs, ref.logprobs,
                                   atol=_lp_atol(setup, ref.logprobs))


def test_group_record_schema_and_stop_reason(setup):
    model, engine, state, forward = setup
    first = int(jnp.argmax(logits_of(forward, state, PROMPT)[-1]))
    # Greedy, stop on the first greedy token itself: stops after 1 token, reason "stop".
    reqs = [Request(7, PROMPT, 3, SamplingParams(temperature=0.0, max_tokens=5,
                                                 stop_token_ids=(first,)))]
    rec = ContinuousBatcher(engine).run(reqs)[0].to_record()
    assert rec["prompt_id"].dtype == np.int64 and int(rec["prompt_id"]) == 7
    assert rec["completion_tokens"].shape == (3, 5) and rec["completion_tokens"].dtype == np.int32
    assert rec["completion_lengths"].tolist() == [1, 1, 1]
    assert (rec["completion_tokens"][:, 0] == first).all() and (rec["completion_tokens"][:, 1:] == 0).all()
    assert (rec["policy_versions"][:, 1:] == -1).all() and (rec["policy_versions"][:, 0] == 0).all()
    assert (rec["behaviour_logprobs"][:, 1:] == 0).all()
    assert rec["truncated"].tolist() == [False] * 3 and rec["rewards"].dtype == np.float32
    assert validate_group(rec, group_size=3, max_tokens=5) == {"P": 4, "G": 3, "T": 5}


@pytest.fixture(scope="module")
def engine3(setup):
    """The setup's engine with decode_steps_per_call = 3."""
    model, engine = setup[:2]
    return RlflowEngine(model, dataclasses.replace(engine.sampler_cfg, decode_steps_per_call=3),
                        mesh=make_mesh(MeshConfig(), jax.devices()[:1]))


def test_k_steps_per_call_same_results_and_honest_counters(setup, engine3):
    """decode_steps_per_call = 3: same tokens/logprobs as k = 1 (keys advance per token);
    a slot finishing mid-call emits nothing more and idles until the next call."""
    model, engine, state, forward = setup
    ref = {g.prompt_id: g for g in ContinuousBatcher(engine).run(mixed_requests())}
    batcher = ContinuousBatcher(engine3)
    got = {g.prompt_id: g for g in batcher.run(mixed_requests())}
    assert got.keys() == ref.keys()
    for pid, g in got.items():
        c, r = g.completions[0], ref[pid].completions[0]
        np.testing.assert_array_equal(c.tokens, r.tokens)
        np.testing.assert_allclose(c.logprobs, r.logprobs, atol=_lp_atol(setup, r.logprobs))
    c = batcher.counters
    calls, idle = simulate_schedule(LENGTHS, 4, 3)
    assert (c.decode_calls, c.idle_slot_steps_while_queued) == (calls, idle)
    assert idle > 0                                   # the chunking cost is counted
    assert c.decode_steps == 3 * calls and c.slot_steps_available == 4 * 3 * calls
    assert c.slot_steps_used == sum(LENGTHS)
    # A stop id at the first token of a 3-step call: nothing after it is kept.
    first = int(jnp.argmax(logits_of(forward, state, PROMPT)[-1]))
    g = ContinuousBatcher(engine3).run([Request(7, PROMPT, 2, SamplingParams(
        temperature=0.0, max_tokens=5, stop_token_ids=(first,)))])[0]
    assert [c.tokens.tolist() for c in g.completions] == [[first], [first]]
    assert [c.finish_reason for c in g.completions] == ["stop", "stop"]


def test_weight_swap_new_request_gets_new_weights_and_version(setup):
    _, engine, state, forward = setup
    w0, w1 = first_token_weights(forward, state)                    # predict 5 / 7
    greedy = SamplingParams(temperature=0.0, max_tokens=1, stop_token_ids=())
    batcher = ContinuousBatcher(engine, params=w0, version=0)
    c = batcher.run([Request(0, PROMPT, 1, greedy)])[0].completions[0]
    assert c.tokens.tolist() == [5] and c.versions.tolist() == [0]

    batcher.update_params(w1, version=1)
    logp_w1 = jax.nn.log_softmax(logits_of(forward, w1, PROMPT)[-1])
    for attempt in ("after swap", "after cache re-allocation"):
        c = batcher.run([Request(1, PROMPT, 1, greedy)])[0].completions[0]
        assert c.tokens.tolist() == [7], attempt
        assert c.versions.tolist() == [1], attempt
        np.testing.assert_allclose(c.logprobs[0], logp_w1[7], atol=_lp_atol(setup, logp_w1[7]))
        batcher.reset_cache()
    assert batcher.counters.weight_swaps == 1


def test_weight_swap_in_flight_and_no_stale_prefix(setup):
    _, engine, state, forward = setup
    w0, w1 = first_token_weights(forward, state)
    batcher = ContinuousBatcher(engine, params=w0, version=0)
    # 5 samples of one prompt on 4 slots: sample 4 waits in the queue across the swap.
    batcher.submit(Request(3, PROMPT, 5, SamplingParams(temperature=0.0, max_tokens=6,
                                                        stop_token_ids=())))
    batcher.step()
    batcher.step()
    batcher.update_params(w1, version=1)
    groups = []
    while batcher.has_work:
        groups += batcher.step()
    comps = groups[0].completions
    # In flight: 2 tokens under version 0, then version 1 (the sequence continued).
    for c in comps[:4]:
        assert c.versions.tolist() == [0, 0, 1, 1, 1, 1]
        seq = PROMPT + c.tokens.tolist()
        p = len(PROMPT)
        # Only the output head changed, so the mixed-version KV equals either recompute.
        lp0 = token_logprobs(logits_of(forward, w0, seq)[p - 1:-1], jnp.asarray(c.tokens))
        lp1 = token_logprobs(logits_of(forward, w1, seq)[p - 1:-1], jnp.asarray(c.tokens))
        np.testing.assert_allclose(c.logprobs[:2], lp0[:2], rtol=0, atol=_lp_atol(setup, lp0))
        np.testing.assert_allclose(c.logprobs[2:], lp1[2:], rtol=0, atol=_lp_atol(setup, lp1))
        assert c.tokens[0] == 5
        w1_greedy = jnp.argmax(logits_of(forward, w1, seq)[p + 1:-1], axis=-1)
        assert c.tokens[2:].tolist() == np.asarray(w1_greedy).tolist()
    # Admitted after the swap: its prefix is recomputed under W1, its first token is 7.
    assert comps[4].tokens[0] == 7 and (comps[4].versions == 1).all()
    assert batcher.counters.stale_prefixes_dropped == 1


def test_weight_swap_with_k_steps_lands_between_calls(setup, engine3):
    """k = 3: a swap requested after the first call applies from the second, and each
    token carries the version (and logprob) of the weights that sampled it."""
    _, _, state, forward = setup
    w0, w1 = first_token_weights(forward, state)
    batcher = ContinuousBatcher(engine3, params=w0, version=0)
    batcher.submit(Request(3, PROMPT, 2, SamplingParams(temperature=0.0, max_tokens=6,
                                                        stop_token_ids=())))
    batcher.step()                                    # one call: tokens 0-2 under W0
    batcher.update_params(w1, version=1)
    comps = batcher.run()[0].completions
    p = len(PROMPT)
    for c in comps:
        assert c.versions.tolist() == [0, 0, 0, 1, 1, 1]
        seq = PROMPT + c.tokens.tolist()
        lp0 = token_logprobs(logits_of(forward, w0, seq)[p - 1:-1], jnp.asarray(c.tokens))
        lp1 = token_logprobs(logits_of(forward, w1, seq)[p - 1:-1], jnp.asarray(c.tokens))
        np.testing.assert_allclose(c.logprobs[:3], lp0[:3], rtol=0, atol=_lp_atol(setup, lp0))
        np.testing.assert_allclose(c.logprobs[3:], lp1[3:], rtol=0, atol=_lp_atol(setup, lp1))
        w0_greedy = jnp.argmax(logits_of(forward, w0, seq)[p - 1:p + 2], axis=-1)
        w1_greedy = jnp.argmax(logits_of(forward, w1, seq)[p + 2:-1], axis=-1)
        assert c.tokens.tolist() == np.asarray(w0_greedy).tolist() + np.asarray(w1_greedy).tolist()


def test_bad_input_errors(setup):
    _, engine, _, _ = setup
    b = ContinuousBatcher(engine)
    with pytest.raises(PromptError, match="prompt_id 4: empty prompt"):
        b.submit(Request(4, [], 1))
    with pytest.raises(PromptError, match="prompt_id 5: prompt of 17 tokens is longer.*16"):
        b.submit(Request(5, list(range(1, 18)), 1))
    with pytest.raises(PromptError, match="prompt_id 6: prompt token 128 at index 1"):
        b.submit(Request(6, [1, VOCAB], 1))
    with pytest.raises(SamplingError, match="prompt_id 8: unknown stop id"):
        b.submit(Request(8, [1, 2], 1, SamplingParams(stop_token_ids=(3, VOCAB))))
    with pytest.raises(SamplingError, match="max_tokens=17 exceeds sampler.max_tokens=16"):
        b.submit(Request(9, [1, 2], 1, SamplingParams(max_tokens=17)))
    with pytest.raises(SamplingError, match="num_samples"):
        b.submit(Request(10, [1, 2], 0))
    with pytest.raises(PromptError, match="prompt_id 13: prompt token ids must be integers"):
        b.submit(Request(13, [1.7, 2.2], 1))
    with pytest.raises(SamplingError, match="prompt_id 12: 9 stop ids"):
        b.submit(Request(12, [1, 2], 1, SamplingParams(stop_token_ids=tuple(range(9)))))
    for kw, field in [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -2}, "max_tokens"),
                      ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
                      ({"top_p": 1.01}, "top_p")]:
        if field == "temperature":
            with pytest.raises(ConfigError, match="sampler.decode_steps_per_call"):
                SamplerConfig(decode_steps_per_call=0)
        with pytest.raises(SamplingError, match=f"sampling.{field}"):
            SamplingParams(**kw)
        with pytest.raises(ConfigError, match=f"sampler.{field}"):
            SamplerConfig(**kw)
    assert b.num_queued == 0 and b.counters.prompts_truncated == 0


def test_long_prompt_truncate_is_counted(setup):
    _, engine, _, _ = setup
    b = ContinuousBatcher(engine, on_long_prompt="truncate")
    long = list(range(1, 21))
    g = b.run([Request(11, long, 1, SamplingParams(max_tokens=2, stop_token_ids=()))])[0]
    assert g.prompt_tokens.tolist() == long[-16:]
    assert b.counters.prompts_truncated == 1


def test_swap_to_other_weights_with_the_same_version_number_recomputes_the_prefix(setup):
    """Staleness follows the weights, not the version number: re-sending version 0 with
    other weights (every layer changed, so the KV differs) still drops the prefix computed
    under the old ones; the sample admitted after the swap equals a W1-only run."""
    _, engine, w0, _ = setup
    w1 = jax.tree_util.tree_map(lambda x: x * 0.7, w0)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, stop_token_ids=())
    batcher = ContinuousBatcher(engine, params=w0, version=0)
    batcher.submit(Request(0, PROMPT, 5, greedy))
    batcher.step()                                  # 4 of 5 samples admitted under w0
    batcher.update_params(w1, version=0)
    late = batcher.run()[0].completions[4]
    assert batcher.counters.stale_prefixes_dropped == 1
    ref = ContinuousBatcher(engine, params=w1).run([Request(0, PROMPT, 1, greedy)])
    ref = ref[0].completions[0]
    assert late.tokens.tolist() == ref.tokens.tolist()
    np.testing.assert_allclose(late.logprobs, ref.logprobs, atol=_lp_atol(setup, ref.logprobs))


def test_load_params_names_a_wrong_shape_and_casts_dtypes(setup):
    _, engine, state, _ = setup
    pure = state.to_pure_dict()
    pure["embed"] = jnp.zeros((VOCAB // 2, pure["embed"].shape[1]))
    bad = jax.tree_util.tree_map(lambda x: x, state)
    nnx.replace_by_pure_dict(bad, pure)
    with pytest.raises(ValueError, match=r"parameter .*embed.* has shape \(64, \d+\), the "
                                         r"model's is \(128, \d+\)"):
        engine.load_params(bad)
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), state)
    params = engine.load_params(half)
    assert {x.dtype for x in params.leaves} == {jnp.dtype(jnp.float32)}
