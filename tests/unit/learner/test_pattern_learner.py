"""Models of several layer kinds (rlflow.models.layer_pattern) in the learner.

Gemma 3 text and gpt-oss: sharded fsdp=2 x tensor=2 on 4 fake devices gives one device's step
(metrics and parameters after two steps, the sharding rules placing each kind's stack), and
the single-device learner, exported after those two steps, loads in transformers with the
learner's logits. Qwen3.5-MoE (gated DeltaNet + gated attention + experts with a shared
one; it holds every part of dense Qwen3.5 but its MLP): the same export after two steps (its
sharded step: tests/unit/learner/test_qwen35_sharded_step.py)."""

import pytest

from rlflow.config import MeshConfig, ModelConfig
from rlflow.learner.trainer import Learner
from hf_fixtures import PATTERN_FAMILIES, make_tiny_pattern_model, make_tiny_qwen35
from learner_fixtures import assert_same_train_step, flat, make_group_records, \
    one_device_mesh, tiny_experiment

G, T = 4, 6


def assert_export_gives_the_learners_logits(learner, source_dir: str, out: str, before):
    """Export ``learner``'s params through rlflow.export's seam: transformers loads the
    folder and its logits are the learner's (two float32 programs); ``before``: the
    params' flat numpy values before training (some must have moved)."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from rlflow.export.hf_folder import export_params
    from rlflow.models import positions_from_mask
    from tolerances import forward_atol

    export_params(learner.params, learner.model_config, out, source_dir=source_dir)
    seq = np.array([[5, 17, 42, 9, 31, 77, 4, 8, 10, 12, 6]], np.int32)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(seq).long()).logits[0].numpy()
    model = nnx.merge(learner.graphdef, learner.params)
    mask = jnp.ones(seq.shape, bool)
    forward = nnx.jit(lambda m, tokens: m(tokens, positions_from_mask(mask), mask))
    got = np.asarray(forward(model, jnp.asarray(seq)))[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=forward_atol(
        learner.model_config, seq.shape[1], float(np.abs(want).max())))
    after = flat(learner.params)
    assert any(not np.array_equal(after[k], before[k]) for k in before)   # it trained


@pytest.mark.slow
@pytest.mark.parametrize("family", PATTERN_FAMILIES)
def test_pattern_model_sharded_step_equals_single_device_and_exports(tmp_path, family):
    path = make_tiny_pattern_model(family, str(tmp_path / family))
    cfg = tiny_experiment(ModelConfig(path=path), G, T, num_devices=4,
                          mesh=MeshConfig(fsdp=2, tensor=2))
    sharded, single = Learner(cfg), Learner(cfg, mesh=one_device_mesh())
    stack = sharded.params["layers"]["sliding_attention"]["attn"]["q_kernel"][...]
    assert len(stack.sharding.device_set) == 4 and not stack.sharding.is_fully_replicated
    before = flat(single.params)
    for step in range(2):
        recs = make_group_records(step, 2, vocab=64, group_size=G, max_tokens=T)
        m4, m1 = sharded.train_on(recs), single.train_on(recs)
        assert_same_train_step(m4, m1, sharded.params, single.params, single.model_config,
                               rows=G * 2, seq=16)
    assert m1["policy/entropy"] > 0
    assert_export_gives_the_learners_logits(single, path, str(tmp_path / "export"), before)


@pytest.mark.slow
def test_qwen3_5_moe_export_after_two_steps_gives_the_learners_logits(tmp_path):
    """One cycle (three DeltaNet layers, one gated attention layer), a shared expert; no
    shared prompt in the learner's rows (a DeltaNet state is one sequence's)."""
    path = make_tiny_qwen35(str(tmp_path / "qwen3_5_moe"), num_layers=4, moe=True)
    learner = Learner(tiny_experiment(ModelConfig(path=path), G, T, shared_prefix=False),
                      mesh=one_device_mesh())
    before = flat(learner.params)
    for step in range(2):
        learner.train_on(make_group_records(step, 2, vocab=64, group_size=G, max_tokens=T))
    assert_export_gives_the_learners_logits(learner, path, str(tmp_path / "export"), before)
