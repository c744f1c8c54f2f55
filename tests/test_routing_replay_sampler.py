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
        _, agreement = model.hidden_states(jnp.asarray(tokens), jnp.asarray(pos),
                                           jnp.asarray(mask), routing_ids=jnp.asarray(ids))
        counted = int(2 * p + (lengths - 1).sum())         # each row: its prompt, fed tokens
        np.testing.assert_array_equal(np.asarray(agreement), [[counted, counted]] * 2)
        # the records travel: the learner batch's routing rows round-trip the bytes
        assert records.decode_bytes(records.encode_bytes(rec)).keys() == rec.keys()
