"""Qwen3-MoE in the learner (issue 40 item 1): the load-balancing loss against transformers'
``load_balancing_loss_func``, its weight in the train step (``learner.moe_aux_loss_coef``)
and metric ``moe/aux_loss``, and the HF export of a model after train steps giving the
learner's logits in ``transformers``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_fixtures import make_tiny_hf_moe_model
from rlflow.config import ModelConfig
from rlflow.learner.step import StepSettings
from rlflow.learner.trainer import Learner
from rlflow.models import load_hf, positions_from_mask
from rlflow.models.hf import build_model, write_hf
from learner_fixtures import make_group_records, one_device_mesh, tiny_experiment
from tolerances import F32_EPS, forward_atol

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32,
                    intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                    tie_word_embeddings=False, init_seed=1)


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_load_balancing_loss_equals_transformers(tmp_path):
    path = make_tiny_hf_moe_model(str(tmp_path / "m"), top_k=2, norm_topk_prob=True)
    model, cfg = load_hf(path)
    toks = np.array([[0, 0, 0, 17, 200, 31, 4, 99], [5, 77, 190, 3, 42, 8, 64, 128]], np.int32)
    mask = toks != 0
    mask[1, 0] = True
    aux = nnx.jit(lambda m, t, p, a: m.hidden_states(t, p, a, moe_aux=True))(
        model, jnp.asarray(toks), positions_from_mask(mask), jnp.asarray(mask)).aux_loss
    with torch.no_grad():
        out = _hf(path)(input_ids=torch.tensor(toks, dtype=torch.long),
                        attention_mask=torch.tensor(mask, dtype=torch.long),
                        output_router_logits=True)
    want = float(out.aux_loss)
    assert want > 0
    # sums over 2 layers x 16 tokens per expert, the router's softmax and the product over
    # 16 experts: a chain of float32 reductions on both sides
    n = cfg.num_layers * toks.size + cfg.num_experts + cfg.hidden_size
    np.testing.assert_allclose(float(aux), want, rtol=2 * n * F32_EPS, atol=0)


def test_dense_model_refuses_moe_aux():
    dense, _ = build_model(ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                       num_heads=2, num_kv_heads=1, head_dim=8))
    toks = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="moe_aux=True needs a mixture-of-experts model"):
        dense.hidden_states(toks, positions_from_mask(toks > 0), toks > 0, moe_aux=True)


@pytest.fixture(scope="module")
def records():
    return make_group_records(3, 2, vocab=VOCAB, group_size=G, max_tokens=T, noise=1.0)


def test_step_settings_take_the_models_coefficient_unless_set():
    cfg = tiny_experiment(MODEL, G, T)
    s = StepSettings.from_config(cfg)
    assert s.moe_aux and s.moe_aux_coef == MODEL.router_aux_loss_coef == 0.001
    s = StepSettings.from_config(tiny_experiment(MODEL, G, T, moe_aux_loss_coef=0.0))
    assert s.moe_aux and s.moe_aux_coef == 0.0
    dense = tiny_experiment(ModelConfig(), G, T)
    assert not StepSettings.from_config(dense).moe_aux


@pytest.fixture(scope="module")
def trained(records):
    """A learner with ``moe_aux_loss_coef=0.5`` (kl_coef 0): its first step's metrics and its
    parameters before and after two steps."""
    learner = Learner(tiny_experiment(MODEL, G, T, moe_aux_loss_coef=0.5, lr=1e-2),
                      mesh=one_device_mesh())
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(learner.params))
    batch, _ = learner.build_batch(records)
    first = learner.step(batch)
    learner.step(batch)
    return learner, first, before


def test_aux_loss_enters_the_loss_with_its_coefficient_and_is_reported(trained):
    _, m, _ = trained
    aux = m["moe/aux_loss"]
    assert aux > 0
    # kl_coef = 0: loss = policy-gradient loss + 0.5 * aux (two float32 additions)
    np.testing.assert_allclose(m["learner/loss"] - m["learner/pg_loss"], 0.5 * aux, rtol=0,
                               atol=4 * F32_EPS * (abs(m["learner/pg_loss"]) + 0.5 * aux))


def test_aux_loss_gradient_reaches_the_router_and_not_the_experts(trained):
    learner, _, _ = trained
    toks = jnp.asarray([[5, 17, 33, 2, 60, 9]], jnp.int32)
    mask = toks > 0

    def aux(p):
        return nnx.merge(learner.graphdef, p).hidden_states(toks, positions_from_mask(mask),
                                                            mask, moe_aux=True).aux_loss

    g = nnx.to_pure_dict(jax.jit(jax.grad(aux))(learner.params))
    mlp = g["layers"]["mlp"]                                   # stacked: [L, ...] leaves
    for layer in range(MODEL.num_layers):
        assert np.any(np.asarray(mlp["router"][layer]) != 0), layer
    # the last layer's experts feed no router (the loss sees routers only): zero gradient;
    # the first layer's experts feed the second layer's router: not zero
    for name in ("gate_kernel", "up_kernel", "down_kernel"):
        assert not np.any(np.asarray(mlp[name][MODEL.num_layers - 1])), name
        assert np.any(np.asarray(mlp[name][0]) != 0), name


def test_export_after_train_steps_gives_the_learners_logits(trained, tmp_path):
    learner, _, before = trained
    after = nnx.to_pure_dict(learner.params)
    assert np.any(np.asarray(after["layers"]["mlp"]["down_kernel"][1])
                  != before["layers"]["mlp"]["down_kernel"][1])
    out = str(tmp_path / "export")
    write_hf(learner.params, learner.model_config, out)
    seq = np.array([[5, 17, 33, 2, 60, 9, 41, 12]], np.int32)
    mask = jnp.ones(seq.shape, bool)
    model = nnx.merge(learner.graphdef, learner.params)
    ours = np.asarray(nnx.jit(lambda m, t, p, a: m(t, p, a))(
        model, jnp.asarray(seq), positions_from_mask(mask), mask))[0]
    with torch.no_grad():
        want = _hf(out)(input_ids=torch.tensor(seq, dtype=torch.long)).logits[0].numpy()
    np.testing.assert_allclose(ours, want, rtol=0, atol=forward_atol(
        learner.model_config, seq.shape[1], float(np.abs(want).max())))


def test_context_parallel_forward_and_aux_loss_equal_one_device():
    """On a fsdp=2 x sequence=2 mesh the layers run on the folded view of the residual
    stream (rlflow.models.context_parallel); the hidden states and the load-balancing loss
    (its token mask folded alike) equal the one-device forward's."""
    from rlflow.config import MeshConfig
    from rlflow.mesh import make_mesh

    model, cfg = build_model(MODEL)
    mesh = make_mesh(MeshConfig(fsdp=2, sequence=2), jax.devices()[:4])
    rng = np.random.default_rng(0)
    toks = rng.integers(1, VOCAB, (2, 16)).astype(np.int32)
    mask = np.ones_like(toks, bool)
    mask[0, :5] = False
    toks[~mask] = 0
    args = (jnp.asarray(toks), positions_from_mask(mask), jnp.asarray(mask))
    want = nnx.jit(lambda m, *a: m.hidden_states(*a, moe_aux=True))(model, *args)
    want_h, want_aux = want.hidden, want.aux_loss
    got = nnx.jit(lambda m, *a: m.hidden_states(*a, moe_aux=True, mesh=mesh))(model, *args)
    got_h, got_aux = got.hidden, got.aux_loss
    scale = float(np.abs(np.asarray(want_h)).max())
    np.testing.assert_allclose(np.asarray(got_h)[mask], np.asarray(want_h)[mask], rtol=0,
                               atol=forward_atol(cfg, 16, scale))
    n = cfg.num_layers * toks.size + cfg.num_experts
    np.testing.assert_allclose(float(got_aux), float(want_aux), rtol=2 * n * F32_EPS, atol=0)
    assert float(want_aux) > 0
