"""Expert weights outside the step (issue 40 item 4): a MoE model's weights published on a
learner mesh fsdp=2 x expert=2 reach a sampler laid out expert=4 bit for bit, the pull asking
for the learner's own shards (the expert kernels' layout names ``expert``); an orbax
checkpoint saved on one expert layout restores on another with the same values and logits;
LoRA on the attention projections of a MoE model trains on an expert mesh as on one device.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from rlflow.config import LoraConfig, MeshConfig, ModelConfig
from rlflow.exchange import layout as layout_lib
from rlflow.exchange.coordinator import Coordinator
from rlflow.exchange.transfer import WeightPublisher, WeightSubscriber
from rlflow.learner.trainer import Learner
from rlflow.mesh import make_mesh, param_shardings
from rlflow.models.hf import build_model
from checkpoint_fixtures import restore_on_another_mesh
from learner_fixtures import flat, make_group_records, one_device_mesh, tiny_experiment
from tolerances import MIXED_SIGN_CANCEL, model_chain_len, reorder_rtol

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32,
                    intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=16, tie_word_embeddings=False, init_seed=3)
EXPERT_KERNEL = "['layers']['mlp']['gate_kernel'].value"     # stacked [L, n, E, F]


def meshes():
    devs = jax.devices()[:4]
    return (make_mesh(MeshConfig(fsdp=2, expert=2), devs), make_mesh(MeshConfig(expert=4), devs))


def by_path(tree) -> dict:
    paths, leaves, _ = layout_lib.flatten(tree)
    return dict(zip(paths, leaves))


def test_expert_weights_reach_a_sampler_with_another_expert_layout():
    learner_mesh, sampler_mesh = meshes()
    model, _ = build_model(MODEL, mesh=learner_mesh)
    params = nnx.state(model, nnx.Param)
    described = {leaf["path"]: leaf for leaf in layout_lib.describe(
        *layout_lib.flatten(params)[:2])["leaves"]}
    assert described[EXPERT_KERNEL]["spec"] == [None, "expert", "fsdp", "tensor"]  # [L, n, E, F]
    pub = WeightPublisher(pull_timeout_s=30)
    coord = Coordinator(pub).start()
    try:
        pub.publish(1, params)
        target = param_shardings(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                              params), sampler_mesh)
        sub = WeightSubscriber(coord.address, consumer_id="s0", target=target, timeout_s=30)
        version, pulled = sub.poll()
        sub.close()
    finally:
        coord.close()
    assert version == 1
    want, got, shardings = by_path(params), by_path(pulled), by_path(target)
    assert want.keys() == got.keys()
    for path, x in want.items():
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(x), err_msg=path)
        assert got[path].sharding == shardings[path], path
    assert got[EXPERT_KERNEL].sharding.spec[1] == "expert"
    assert got[EXPERT_KERNEL].addressable_shards[0].data.shape[1] == MODEL.num_experts // 4


def test_checkpoint_saved_on_one_expert_layout_restores_on_another(tmp_path):
    learner_mesh, sampler_mesh = meshes()
    params_a, params_b, logits, ref, atol = restore_on_another_mesh(tmp_path, MODEL,
                                                                    learner_mesh, sampler_mesh)
    a, b = by_path(params_a), by_path(params_b)
    for path in a:
        np.testing.assert_array_equal(np.asarray(b[path]), np.asarray(a[path]), err_msg=path)
    assert b[EXPERT_KERNEL].sharding.mesh.shape == sampler_mesh.shape
    assert b[EXPERT_KERNEL].sharding.spec[1] == "expert"
    np.testing.assert_allclose(np.asarray(logits(params_b)), ref, rtol=0, atol=atol)


@pytest.mark.slow
def test_lora_on_attention_trains_a_moe_model_on_an_expert_mesh():
    """Adapters on q/k/v/o of a MoE model (the experts frozen), one step on fsdp=2 x
    expert=2 equals one device: the loss within the reordering bound, the adapters after an
    Adam step within lr / 10 (as tests/unit/models/test_lora.py's sharded step)."""
    lora = LoraConfig(rank=4, alpha=8.0, lr=1e-2, targets=("q_proj", "k_proj", "v_proj",
                                                           "o_proj"))
    cfg = tiny_experiment(MODEL, G, T, num_devices=4, mesh=MeshConfig(fsdp=2, expert=2),
                          kl_coef=0.2, lora=lora)
    sharded, single = Learner(cfg), Learner(cfg, mesh=one_device_mesh())
    assert not any("mlp" in str(k) for k in flat(sharded.params))      # attention adapters only
    base = sharded.base["layers"]["mlp"]["gate_kernel"][...]
    assert base.sharding.spec[1] == "expert"                            # the frozen experts
    recs = make_group_records(0, 2, vocab=VOCAB, group_size=G, max_tokens=T, version=0)
    m4, m1 = sharded.train_on(recs), single.train_on(recs)
    chain = model_chain_len(MODEL, 16) + MODEL.num_layers * 4 * lora.rank
    assert m1["learner/loss"] != 0
    np.testing.assert_allclose(m4["learner/loss"], m1["learner/loss"], atol=0,
                               rtol=reorder_rtol(chain, 2 * G * 16, MIXED_SIGN_CANCEL))
    got, want = flat(sharded.params), flat(single.params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=lora.lr / 10, err_msg=str(k))
