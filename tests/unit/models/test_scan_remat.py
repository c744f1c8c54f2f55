"""The decoder's layers under a scan with rematerialisation (issue 43, item 1): the train
step's loss, gradients, logprobs and KL equal those of the unrolled Python loop over the
layers (the oracle: ``scan_layers`` patched to the plain loop), for every ``learner.remat``
policy, with LoRA, and on fake devices (data x fsdp x tensor) against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import (ConfigError, LearnerConfig, LoraConfig, MeshConfig, ModelConfig,
                           RolloutCorrectionConfig)
from rlflow.learner import losses
from rlflow.learner.step import StepSettings, make_grad_fn, policy_logprobs
from rlflow.learner.trainer import Learner
from rlflow.models import decoder as decoder_mod
from rlflow.models import layer_scan
from rlflow.models.decoder import Block
from rlflow.models.hf import build_model
from rlflow.models.lora import LoraSpec
from rlflow.models.lora_decoder import lora_model_parts
from learner_fixtures import flat, make_group_records, one_device_mesh, tiny_experiment
from tolerances import F32_EPS, forward_atol, model_chain_len, reorder_rtol, sum_tol

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8)
SETTINGS = dict(norm_len=T, kl_coef=0.3, correction=RolloutCorrectionConfig(
    weight_cap=1.5, reject="token", reject_low=0.4, reject_high=2.5))


def unrolled(stacked, x, apply, remat="none"):
    """The oracle: the layers as a Python loop over static slices of the stacked parameters
    (what the decoder ran before the scan)."""
    for layer in layer_scan.layer_modules(stacked):
        x = apply(layer, x)
    return x


def perturbed(params, scale=0.01):
    return jax.tree.map(lambda p: p + scale * jnp.sin(jnp.arange(p.size).reshape(p.shape)),
                        params)


@pytest.fixture(scope="module")
def packed():
    """A packed (segment ids + shared-prompt prefix ids) batch of the tiny experiment and the
    model's graphdef, params and a KL reference."""
    learner = Learner(tiny_experiment(MODEL, G, T), mesh=one_device_mesh())
    batch, _ = learner.build_batch(make_group_records(7, 2, vocab=VOCAB, group_size=G,
                                                      max_tokens=T, noise=1.0))
    assert batch.prefix_ids is not None and int(np.max(batch.segment_ids)) > 1
    params = learner.params
    return learner.graphdef, params, perturbed(params), batch


def grads_of(graphdef, params, ref, batch, remat, frozen=None):
    fn = make_grad_fn(graphdef, StepSettings(remat=remat, **SETTINGS))
    return jax.jit(fn)(params, batch, ref, frozen)


def assert_step_equal(got, want, batch):
    """Loss, gradients and metric sums of two grad-fn results within the float32 bounds of
    tests/tolerances.py (see test_train_step's micro-batch test for the derivation): each
    per-token logprob carries rho = 2 chain eps (two programs), token sums add n eps."""
    (l1, g1, s1), (l2, g2, s2) = want, got
    rows, seq = batch.tokens.shape
    n = rows * seq
    rho = 2 * model_chain_len(MODEL, seq) * F32_EPS
    mask = np.asarray(batch.loss_mask)
    w = np.asarray(losses.loss_weights(mask, "token-mean", norm_len=T,
                                       segment_ids=batch.segment_ids))
    # |policy term| <= w |A| window_high is_cap; KL term bounded by its own sum
    loss_scale = float(np.sum(w * np.abs(batch.advantages))) * 2.5 * 1.5 + \
        0.3 * float(np.sum(w * mask)) * (float(s1["kl"]) / max(mask.sum(), 1) + 1.0)
    assert float(l1) != 0
    assert abs(float(l2) - float(l1)) <= (rho + sum_tol(n)) * loss_scale
    cancel = loss_scale / abs(float(l1))
    f1, f2 = flat(g1), flat(g2)
    assert set(f1) == set(f2)
    assert sum(1 for k in f1 if k[0] == "layers") > 0
    for key in f1:
        norm = np.linalg.norm(f1[key])
        if key[0] == "layers":
            assert norm > 0, key                      # every layer gets a gradient
        err = np.linalg.norm(f2[key] - f1[key])
        assert err <= (2 * rho + sum_tol(n)) * cancel * max(norm, F32_EPS), (key, err, norm)
    kl_atol = 2 * F32_EPS * float(mask.sum())     # k3 cancels: ~2 eps absolute per token
    for key in s1:
        if key == "pg_loss":
            continue
        np.testing.assert_allclose(s2[key], s1[key], rtol=rho + sum_tol(n),
                                   atol=kl_atol if key == "kl" else 0.0, err_msg=key)
    assert float(s1["kl"]) > 0


@pytest.fixture(scope="module")
def unrolled_step(packed):
    graphdef, params, ref, batch = packed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoder_mod, "scan_layers", unrolled)
        out = grads_of(graphdef, params, ref, batch, "none")
        logp = jax.jit(lambda p: policy_logprobs(graphdef, p, batch)[0])(params)
    return out, logp


@pytest.mark.parametrize("remat", layer_scan.REMAT_POLICIES)
def test_scanned_step_with_remat_equals_the_unrolled_loop(packed, unrolled_step, remat):
    graphdef, params, ref, batch = packed
    got = grads_of(graphdef, params, ref, batch, remat)
    assert_step_equal(got, unrolled_step[0], batch)


def test_scanned_logprobs_equal_the_unrolled_loop(packed, unrolled_step):
    graphdef, params, _, batch = packed
    logp = jax.jit(lambda p: policy_logprobs(graphdef, p, batch)[0])(params)
    want = np.asarray(unrolled_step[1])
    # |logprob| <= 2 max|logit| + log V; the tiny random model's logits are O(1)
    scale = 2 * float(np.max(np.abs(want))) + np.log(VOCAB)
    np.testing.assert_allclose(np.asarray(logp), want,
                               atol=forward_atol(MODEL, batch.tokens.shape[1], scale))
    assert np.all(np.isfinite(want)) and np.any(want != 0)


def test_lora_adapters_get_the_unrolled_gradients_under_scan_and_remat(packed):
    """LoRA: adapters (inside the blocks) trained, base frozen; the scanned step with full
    remat equals the unrolled loop."""
    _, _, _, batch = packed
    model, dcfg = build_model(MODEL)
    graphdef, adapters, base = lora_model_parts(model, dcfg, LoraSpec.from_config(
        LoraConfig(rank=4)), seed=1)
    adapters = perturbed(adapters)                # B starts at 0: give both factors signal
    ref = perturbed(adapters, 0.02)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoder_mod, "scan_layers", unrolled)
        want = grads_of(graphdef, adapters, ref, batch, "none", base)
    got = grads_of(graphdef, adapters, ref, batch, "full", base)
    assert_step_equal(got, want, batch)


@pytest.mark.slow
def test_sharded_remat_step_equals_single_device():
    """One train step (packed rows, KL, "dots" remat) on 4 fake devices, data 2 x fsdp 2, vs
    one device (fsdp x tensor with the default full remat: test_train_step's sharded test)."""
    cfg = tiny_experiment(MODEL, G, T, num_devices=4, mesh=MeshConfig(data=2, fsdp=2),
                          kl_coef=0.5, remat="dots")
    sharded, single = Learner(cfg), Learner(cfg, mesh=one_device_mesh())
    assert sharded.settings.remat == "dots"
    recs = make_group_records(3, 2, vocab=VOCAB, group_size=G, max_tokens=T)
    m4, m1 = sharded.train_on(recs), single.train_on(recs)
    chain, n = model_chain_len(MODEL, 16), G * 2 * 16
    for key in ("learner/grad_norm", "policy/kl", "policy/entropy"):
        np.testing.assert_allclose(m4[key], m1[key], rtol=reorder_rtol(chain, n),
                                   atol=2 * F32_EPS if key == "policy/kl" else 0.0,
                                   err_msg=key)
    got, want = flat(sharded.params), flat(single.params)
    for k in want:      # one Adam step at lr 1e-4 (test_train_step's sharded test)
        np.testing.assert_allclose(got[k], want[k], atol=0.1 * 1e-4, err_msg=str(k))


def test_layers_of_different_structure_are_refused():
    cfg = decoder_mod.DecoderConfig.from_model_config(MODEL)
    plain = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0)))
    adapted = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0),
                                           lora=LoraSpec.from_config(LoraConfig(rank=2))))
    with pytest.raises(layer_scan.LayerScanError, match="layer 1 has another structure"):
        layer_scan.stack_modules([plain, adapted])
    with pytest.raises(layer_scan.LayerScanError, match="at least one layer"):
        layer_scan.stack_modules([])


def _axes(module):
    return {tuple(v.get_metadata()["out_sharding"]) for v in
            jax.tree.leaves(nnx.state(module), is_leaf=lambda x: isinstance(x, nnx.Variable))}


def test_stacked_layers_hold_each_layer_in_order():
    """stack_modules: every variable [L, ...] with slice i = block i, logical axes led by
    "layers"; layer_modules gives each block back (its own axes); the decoder's layers are the
    blocks drawn from its rngs after the embedding."""
    cfg = decoder_mod.DecoderConfig.from_model_config(MODEL)
    lora = LoraSpec.from_config(LoraConfig(rank=2))
    rngs = nnx.Rngs(params=3)
    blocks = [Block(cfg, rngs=rngs, lora=lora) for _ in range(MODEL.num_layers)]
    stacked = layer_scan.stack_modules(blocks)
    assert layer_scan.num_layers(stacked) == MODEL.num_layers
    got = [np.asarray(x) for x in jax.tree.leaves(nnx.state(stacked))]
    assert all(x.shape[0] == MODEL.num_layers for x in got)
    assert all(axes[0] == layer_scan.LAYER_AXIS for axes in _axes(stacked))
    for i, (block, view) in enumerate(zip(blocks, layer_scan.layer_modules(stacked))):
        want = jax.tree.leaves(nnx.state(block))
        for g, w, v in zip(got, want, jax.tree.leaves(nnx.state(view))):
            np.testing.assert_array_equal(g[i], np.asarray(w))
            np.testing.assert_array_equal(np.asarray(v), np.asarray(w))
        assert _axes(view) == _axes(block)
        assert nnx.graphdef(view) == nnx.graphdef(block)
    model, _ = build_model(MODEL)
    rngs = nnx.Rngs(params=MODEL.init_seed)
    rngs.params()                                  # the embedding's draw
    first = Block(cfg, rngs=rngs)
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.up_kernel[...][0]),
                                  np.asarray(first.mlp.up_kernel[...]))


def test_layer_trees_stack_and_unstack():
    """The boundary helpers (HF names, checkpoints of per-layer trees): stack_trees of L
    per-layer trees is leaf-wise np.stack (numpy stays numpy) and unstack_tree inverts it."""
    rng = np.random.default_rng(0)
    trees = [{"attn": {"q": rng.normal(size=(2, 3))}, "norm": rng.normal(size=(3,))}
             for _ in range(4)]
    stacked = layer_scan.stack_trees(trees)
    assert isinstance(stacked["attn"]["q"], np.ndarray) and stacked["attn"]["q"].shape == (4, 2, 3)
    for i, tree in enumerate(layer_scan.unstack_tree(stacked)):
        np.testing.assert_array_equal(tree["attn"]["q"], trees[i]["attn"]["q"])
        np.testing.assert_array_equal(tree["norm"], trees[i]["norm"])
    with pytest.raises(layer_scan.LayerScanError, match="differ in shape"):
        layer_scan.stack_trees([trees[0], {"attn": {"q": np.zeros((3, 3))}, "norm": trees[0]["norm"]}])
    with pytest.raises(layer_scan.LayerScanError, match="layer 1's tree differs"):
        layer_scan.stack_trees([trees[0], {"attn": trees[0]["attn"]}])


def test_remat_policy_names_are_checked():
    with pytest.raises(ConfigError, match="learner.remat"):
        LearnerConfig(remat="some")
    with pytest.raises(layer_scan.LayerScanError, match="learner.remat must be one of"):
        layer_scan.checkpoint_policy("some")
    assert layer_scan.checkpoint_policy("none") is None
    assert LearnerConfig().remat == "full"


def test_offload_is_refused_without_a_pinned_host_memory_space(monkeypatch):
    class Memory:
        kind = "device"

    class Device:
        def addressable_memories(self):
            return [Memory()]

    monkeypatch.setattr(layer_scan.jax, "devices", lambda: [Device()])
    with pytest.raises(layer_scan.LayerScanError, match="'offload' needs a 'pinned_host'"):
        layer_scan.checkpoint_policy("offload")
