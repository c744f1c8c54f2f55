"""Rollout routing replay in the sampler (issue 40 item 3): a mixture-of-experts engine
records the experts its prefill and decode steps chose for every token, the group record
carries them (record version 3) aligned with the tokens, and they are the experts the same
model's full forward chooses (router agreement 1 in float32)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlflow.config import MeshConfig, ModelConfig, SamplerConfig
from rlflow.exchange import records, routing
from rlflow.mesh import make_mesh
from rlflow.models.hf import build_model
from rlflow.sampler.batching import ContinuousBatcher, Request
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.sampling import SamplingParams

MOE = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, init_seed=2)


def test_engine_records_each_tokens_experts_in_the_group_record():
    model = build_model(MOE)[0]
    nnx.update(model, jax.tree_util.tree_map(lambda x: x * 4.0, nnx.state(model, nnx.Param)))
    cfg = SamplerConfig(num_slots=3, max_prefill_length=8, prefill_buckets=(8,), max_tokens=6,
                        temperature=1.0, decode_steps_per_call=4)
    engine = RlflowEngine(model, cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    assert engine.records_routing and engine.routing_dtype == np.int8
    prompts = [[1, 17, 42, 5], [3, 9, 11, 2, 60, 7]]
    groups = ContinuousBatcher(engine).run(
        [Request(i, p, 2, SamplingParams(temperature=1.0, max_tokens=6, seed=i))
         for i, p in enumerate(prompts)])
    for group in groups:
        rec = group.to_record()
        dims = records.validate_group(rec)                 # version 3: checks ids and -1s
        assert (dims["L"], dims["k"]) == (2, 2) and rec["completion_routing"].dtype == np.int8
        p, lengths = dims["P"], rec["completion_lengths"]
        assert (rec["prompt_routing"] >= 0).all()          # every prompt token recorded
        for g, n in enumerate(lengths):
            fed = rec["completion_routing"][g, :n - 1]
            assert (fed >= 0).all() and (rec["completion_routing"][g, n - 1:] == -1).all()
        # the full forward of the same float32 model over prompt + completion chooses the
        # recorded experts: the rows as the learner lays them out (routing_rows)
        seq = p + rec["completion_tokens"].shape[1]
        ids = routing.routing_rows(rec, p, seq)
        tokens = np.concatenate([np.repeat(rec["prompt_tokens"][None], 2, 0),
                                 rec["completion_tokens"]], 1)
        mask = np.arange(seq)[None] < p + lengths[:, None]
        pos = np.broadcast_to(np.arange(seq, dtype=np.int32), tokens.shape)
        agreement = model.hidden_states(jnp.asarray(tokens), jnp.asarray(pos),
                                        jnp.asarray(mask),
                                        routing_ids=jnp.asarray(ids)).router_agreement
        counted = int(2 * p + (lengths - 1).sum())         # each row: its prompt, fed tokens
        np.testing.assert_array_equal(np.asarray(agreement), [[counted, counted]] * 2)
        # the records travel: the learner batch's routing rows round-trip the bytes
        assert records.decode_bytes(records.encode_bytes(rec)).keys() == rec.keys()


def test_episode_records_the_sampled_turns_experts_and_none_for_environment_tokens():
    """A two-turn episode: the environment's tokens are appended by a prefill, so no decode
    step records them (-1) and the sampled token before them has no recorded successor
    either; every other token's ids are the full forward's choice (float32, one version)."""
    from rlflow.config import EnvConfig
    from rlflow.sampler.episodes import EpisodeDriver
    from test_episodes import CONT, FakeRenderer, FakeTokenizer

    model = build_model(MOE)[0]
    nnx.update(model, jax.tree_util.tree_map(lambda x: x * 4.0, nnx.state(model, nnx.Param)))
    cfg = SamplerConfig(num_slots=2, max_prefill_length=8, prefill_buckets=(8,), max_tokens=12,
                        temperature=1.0, decode_steps_per_call=2)
    engine = RlflowEngine(model, cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    prompt = [1, 20, 33, 47]
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3, stop_token_ids=())
    single = ContinuousBatcher(engine).run([Request(0, prompt, 2, sampling)])[0]
    eot = sorted({int(c.tokens[1]) for c in single.completions})   # turn 1 ends by token 2
    driver = EpisodeDriver(EnvConfig(name="test_two_turns", max_turns=4), FakeTokenizer(),
                           FakeRenderer(eot))
    prompt, group = driver.new_group({"prompt_id": 0}, 2)
    batcher = ContinuousBatcher(engine, episodes=driver)
    batcher.submit(Request(0, prompt, 2, SamplingParams(temperature=1.0, max_tokens=12, seed=3,
                                                         stop_token_ids=tuple(eot)),
                           episode=group))
    out = []
    while batcher.has_work:
        out += batcher.step()
    rec = out[0].to_record()
    dims = records.validate_group(rec)
    p = dims["P"]
    for i, c in enumerate(out[0].completions):
        n = len(c.tokens)
        first_end = int(np.flatnonzero(np.isin(c.tokens, eot))[0])
        env = np.arange(first_end + 1, first_end + 1 + len(CONT))
        assert c.tokens[env].tolist() == CONT
        recorded = (rec["completion_routing"][i, :n] >= 0).all(-1).all(-1)
        want = np.ones(n, bool)
        want[n - 1] = False                         # the last token: no forward took it in
        want[env[:-1]] = False                      # environment tokens before the last
        want[first_end] = False                     # its successor was prefilled, not decoded
        assert recorded.tolist() == want.tolist()
        seq = np.array([prompt.tolist() + c.tokens.tolist()], np.int32)
        ids = np.concatenate([rec["prompt_routing"][None],
                              rec["completion_routing"][i:i + 1, :n]], 1)
        pos = np.arange(seq.shape[1], dtype=np.int32)[None]
        agreement = model.hidden_states(jnp.asarray(seq), jnp.asarray(pos),
                                        jnp.ones(seq.shape, bool),
                                        routing_ids=jnp.asarray(ids)).router_agreement
        counted = p + int(want.sum())
        np.testing.assert_array_equal(np.asarray(agreement), [[counted, counted]] * 2)


def test_preempted_and_resumed_samples_keep_the_experts_they_were_sampled_with():
    """A paged pool too small for the slots (sequences preempted and resumed by prefill): each
    record's routing equals the contiguous cache's run of the same requests; the ids of the
    tokens decoded before a preemption are the saved ones, not the resume prefill's."""
    import dataclasses

    model = build_model(MOE)[0]
    nnx.update(model, jax.tree_util.tree_map(lambda x: x * 4.0, nnx.state(model, nnx.Param)))
    base = SamplerConfig(num_slots=4, max_prefill_length=8, prefill_buckets=(8,), max_tokens=16,
                         temperature=1.0, decode_steps_per_call=3)
    reqs = [Request(i, [1 + i, 5, 9, 2 + i], 2, SamplingParams(
        temperature=1.0, max_tokens=16, seed=i, stop_token_ids=())) for i in range(3)]
    out = {}
    for name, cfg in (("contiguous", base), ("paged", dataclasses.replace(
            base, kv_cache="paged", page_size=4, num_pages=6, num_slots=4))):
        engine = RlflowEngine(model, cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
        batcher = ContinuousBatcher(engine)
        out[name] = {g.prompt_id: g.to_record() for g in batcher.run(reqs)}
        if name == "paged":
            assert batcher.counters.preemptions > 0
    for pid, rec in out["paged"].items():
        want = out["contiguous"][pid]
        np.testing.assert_array_equal(rec["completion_tokens"], want["completion_tokens"])
        for field in routing.ROUTING_FIELDS:
            np.testing.assert_array_equal(rec[field], want[field], err_msg=f"{pid} {field}")
