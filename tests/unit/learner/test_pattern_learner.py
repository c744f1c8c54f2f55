"""Models of several layer kinds (Gemma 3 text, gpt-oss, Qwen3.5 and Qwen3.5-MoE:
rlflow.models.layer_pattern) in the learner: sharded fsdp=2 x tensor=2 on 4 fake devices
gives one device's step (metrics and parameters after two steps, the sharding rules placing
each kind's stack); an export after two steps loads in transformers with the learner's
logits (every family)."""

import pytest

from rlflow.config import MeshConfig, ModelConfig
from rlflow.learner.trainer import Learner
from hf_fixtures import PATTERN_FAMILIES, make_tiny_pattern_model, make_tiny_qwen35
from learner_fixtures import assert_same_train_step, make_group_records, one_device_mesh, \
    tiny_experiment

G, T = 4, 6
#: every family whose layers come in several kinds: Qwen3.5's gated DeltaNet hybrids too
EXPORT_FAMILIES = PATTERN_FAMILIES + ("qwen3_5_text", "qwen3_5_moe_text")


def make_tiny_family_model(family: str, out_dir: str) -> str:
    """:func:`hf_fixtures.make_tiny_pattern_model`, or :func:`hf_fixtures.make_tiny_qwen35`
    for the Qwen3.5 families (``qwen3_5_moe_text``: its MoE variant)."""
    if family.startswith("qwen3_5"):
        return make_tiny_qwen35(out_dir, moe=family == "qwen3_5_moe_text")
    return make_tiny_pattern_model(family, out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("family", PATTERN_FAMILIES)
def test_pattern_model_sharded_step_equals_single_device(tmp_path, family):
    path = make_tiny_pattern_model(family, str(tmp_path / family))
    cfg = tiny_experiment(ModelConfig(path=path), G, T, num_devices=4,
                          mesh=MeshConfig(fsdp=2, tensor=2))
    sharded, single = Learner(cfg), Learner(cfg, mesh=one_device_mesh())
    stack = sharded.params["layers"]["sliding_attention"]["attn"]["q_kernel"][...]
    assert len(stack.sharding.device_set) == 4 and not stack.sharding.is_fully_replicated
    for step in range(2):
        recs = make_group_records(step, 2, vocab=64, group_size=G, max_tokens=T)
        m4, m1 = sharded.train_on(recs), single.train_on(recs)
        assert_same_train_step(m4, m1, sharded.params, single.params, single.model_config,
                               rows=G * 2, seq=16)
    assert m1["policy/entropy"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", EXPORT_FAMILIES)
def test_export_after_two_steps_gives_the_learners_logits(tmp_path, family):
    """Train 2 steps, export through rlflow.export's seam: transformers loads the folder and
    its logits are the trained learner's (two float32 programs)."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from rlflow.export.hf_folder import export_params
    from rlflow.models import positions_from_mask
    from tolerances import forward_atol

    path = make_tiny_family_model(family, str(tmp_path / family))
    # a DeltaNet layer's state is one sequence's: no prompt shared by a group's rows
    shared = {"shared_prefix": False} if family.startswith("qwen3_5") else {}
    learner = Learner(tiny_experiment(ModelConfig(path=path), G, T, **shared),
                      mesh=one_device_mesh())
    before = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(learner.params)}
    for step in range(2):
        learner.train_on(make_group_records(step, 2, vocab=64, group_size=G, max_tokens=T))
    out = str(tmp_path / "export")
    export_params(learner.params, learner.model_config, out, source_dir=path)
    seq = np.array([[5, 17, 42, 9, 31, 77, 4, 8, 10, 12, 6]], np.int32)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(seq).long()).logits[0].numpy()
    model = nnx.merge(learner.graphdef, learner.params)
    mask = jnp.ones(seq.shape, bool)
    got = np.asarray(model(jnp.asarray(seq), positions_from_mask(mask), mask))[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=forward_atol(
        learner.model_config, seq.shape[1], float(np.abs(want).max())))
    after = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(learner.params)}
    assert any(not np.array_equal(after[k], before[k]) for k in before)   # it trained
