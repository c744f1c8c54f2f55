"""LoRA: the adapted forward equals the merged-kernel oracle ``W + (alpha/r) A @ B`` (numpy),
B = 0 is the base model exactly, adapter gradients follow the chain rule from the full-weight
gradient, and the learner trains adapters only (frozen base, adapter-only AdamW state, KL
reference = the base)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlflow.config import (ConfigError, ExperimentConfig, LearnerConfig, LoraConfig,
                           ModelConfig)
from rlflow.learner.batch import BatchSpec, TrainBatch, build_batch
from rlflow.learner.step import StepSettings, make_grad_fn
from rlflow.learner.trainer import Learner
from rlflow.models.decoder import positions_from_mask
from rlflow.models.hf import build_model
from rlflow.models.lora import LoraSpec, adapter_pairs, merged_params, tree_bytes
from rlflow.models.lora_decoder import lora_model_parts
from learner_fixtures import flat, make_group_records, one_device_mesh, tiny_experiment
from tolerances import MIXED_SIGN_CANCEL, model_chain_len, reorder_rtol

VOCAB, G, T = 64, 4, 6
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, model_type="qwen2",
                    tie_word_embeddings=False, init_seed=5)
SPEC = LoraSpec(rank=4, alpha=8.0)
EPS32 = float(np.finfo(np.float32).eps)


def _parts(spec=SPEC, model_cfg=MODEL):
    model, dcfg = build_model(model_cfg)
    # 0.02-scale random weights give flat logits; scale them so comparisons are not trivial
    gd, p = nnx.split(model, nnx.Param)
    model = nnx.merge(gd, jax.tree.map(lambda x: x * 6.0 if x.ndim > 1 else x, p))
    return (model, dcfg) + lora_model_parts(model, dcfg, spec, seed=1)


def _random_adapters(adapters, seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(scale=scale, size=x.shape), x.dtype),
                        adapters)


def _inputs(seed=0, b=3, t=7):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None] >= np.array([0, 2, 1])[:, None])
    return tokens, positions_from_mask(mask), mask


_fwd = jax.jit(lambda gd, states, t, p, m: nnx.merge(gd, *states)(t, p, m), static_argnums=0)


def _numpy_merged(base, adapters, scale):
    """Oracle: ``W + scale * A @ B`` per adapted kernel, in float64 numpy."""
    pure = jax.tree.map(np.asarray, base.to_pure_dict())
    n = 0
    for path, _, a, b in adapter_pairs(adapters):
        node = pure
        for k in path[:-1]:
            node = node[k]
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)   # [L, ...] stacked
        d = np.stack([np.tensordot(ai, bi, axes=([ai.ndim - 1], [0])) for ai, bi in zip(a64, b64)])
        node[path[-1]] = (node[path[-1]].astype(np.float64) + scale * d).astype(np.float32)
        n += len(a64)
    return pure, n


@pytest.mark.parametrize("kw, match", [
    (dict(rank=-1), r"learner\.lora\.rank"),
    (dict(rank=4, alpha=0.0), r"learner\.lora\.alpha"),
    (dict(rank=4, dropout=0.1), r"learner\.lora\.dropout: only 0\.0"),
    (dict(rank=4, targets=("qkv",)), r"learner\.lora\.targets: 'qkv' matches none"),
    (dict(rank=4, targets=("(",)), r"learner\.lora\.targets: '\(' is not a regular"),
    (dict(rank=4, lr=-1.0), r"learner\.lora\.lr"),
    (dict(rank=4, swap="both"), r"learner\.lora\.swap"),
])
def test_lora_config_errors_name_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        LoraConfig(**kw)


def test_lora_config_selects_projections_and_refuses_a_value_head():
    assert LoraConfig(rank=2, targets=("q_proj|v_proj", "down.*")).projections == (
        "q_proj", "v_proj", "down_proj")
    with pytest.raises(ConfigError, match=r"learner\.lora: LoRA with learner\.advantage='gae'"):
        LearnerConfig(advantage="gae", lora=LoraConfig(rank=2))
    assert ExperimentConfig(learner=LearnerConfig(lora=LoraConfig(rank=2))).learner.lora.enabled


def test_trained_final_norm_moves_from_the_base_to_the_trained_tree():
    spec = LoraSpec(rank=2, alpha=2.0, projections=("q_proj",), train_final_norm=True)
    model, _, _, trained, base = _parts(spec)
    assert "final_norm" not in base.to_pure_dict()
    np.testing.assert_array_equal(np.asarray(trained["final_norm"]["scale"][...]),
                                  np.asarray(model.final_norm.scale[...]))


def test_trained_embeddings_move_from_the_base_to_the_trained_tree():
    spec = LoraSpec(rank=2, alpha=2.0, projections=("q_proj",), train_embeddings=True)
    model, _, _, trained, base = _parts(spec)                          # untied: embed, lm_head
    assert {"embed", "lm_head"} <= set(trained.to_pure_dict())
    assert not {"embed", "lm_head"} & set(base.to_pure_dict())
    np.testing.assert_array_equal(np.asarray(trained["lm_head"][...]),
                                  np.asarray(model.lm_head[...]))
    assert LoraConfig(rank=2, train_embeddings=True).train_embeddings


def test_adapters_on_every_projection_with_logical_axes():
    _, dcfg, _, adapters, _ = _parts()
    pairs = adapter_pairs(adapters)                  # one per projection, stacked over layers
    assert len(pairs) == 7
    n = MODEL.num_layers
    q = adapters["layers"]["attn"]["q_lora"]
    assert q["a"].shape == (n, 32, 4) and q["b"].shape == (n, 4, 4, 8)
    assert q["a"].get_metadata()["out_sharding"] == ("layers", "embed", "lora_rank")
    assert q["b"].get_metadata()["out_sharding"] == ("layers", "lora_rank", "q_heads", "head_dim")
    o = adapters["layers"]["attn"]["o_lora"]
    assert o["a"].shape == (n, 4, 8, 4) and o["b"].shape == (n, 4, 32)
    assert all(np.all(np.asarray(b) == 0) for _, _, _, b in pairs)      # B = 0 at init
    # only q/v targeted: the others are absent
    spec = LoraSpec(rank=2, alpha=2.0, projections=("q_proj", "v_proj"))
    names = {n for _, n, _, _ in adapter_pairs(_parts(spec)[3])}
    assert names == {"q_proj", "v_proj"}


def test_zero_b_gives_the_base_logits_exactly():
    model, _, gd, adapters, base = _parts()
    tokens, pos, mask = _inputs()
    plain_gd, plain = nnx.split(model, nnx.Param)
    want = np.asarray(_fwd(plain_gd, (plain,), tokens, pos, mask))
    got = np.asarray(_fwd(gd, (adapters, base), tokens, pos, mask))
    np.testing.assert_array_equal(got, want)


def test_lora_forward_equals_numpy_merged_kernel_oracle():
    model, _, gd, adapters, base = _parts()
    adapters = _random_adapters(adapters)
    tokens, pos, mask = _inputs(1)
    merged, n = _numpy_merged(base, adapters, SPEC.scale)
    assert n == 14
    plain_gd, plain = nnx.split(model, nnx.Param)
    nnx.replace_by_pure_dict(plain, merged)
    want = np.asarray(_fwd(plain_gd, (plain,), tokens, pos, mask))
    got = np.asarray(_fwd(gd, (adapters, base), tokens, pos, mask))
    base_logits = np.asarray(_fwd(gd, (jax.tree.map(jnp.zeros_like, adapters), base),
                                  tokens, pos, mask))
    assert np.abs(want - base_logits).max() > 1.0           # the adapters matter
    # float32: two layers of length-<=48 contractions, logits O(10): eps * 48 * 10 * layers
    np.testing.assert_allclose(got, want, atol=EPS32 * 48 * 10 * 2 * 8, rtol=0)
    # merged_params (the sampler's / export's merge) gives the same kernels
    mine = merged_params(base, adapters, SPEC.scale)
    for path, _, _, _ in adapter_pairs(adapters):
        a, b = mine, merged
        for k in path:
            a, b = a[k], b[k]
        np.testing.assert_allclose(np.asarray(a), b, atol=EPS32 * 8, rtol=EPS32 * 8)


def _batch(seed=0):
    recs = make_group_records(seed, 2, vocab=VOCAB, group_size=G, max_tokens=T)
    spec = BatchSpec.from_config(tiny_experiment(MODEL, G, T))
    batch, _ = build_batch(recs, spec, 0)
    return TrainBatch(*[None if x is None else jnp.asarray(x) for x in batch])


def test_adapter_gradients_follow_the_chain_rule_of_the_full_weight_gradient():
    """dL/dA = s * dL/dW . B^T and dL/dB = s * A^T . dL/dW (W' = W + s A B), with dL/dW the
    plain decoder's gradient at the merged kernels; KL to the base via zero adapters."""
    model, _, gd, adapters, base = _parts()
    adapters = _random_adapters(adapters, seed=2, scale=0.2)
    batch = _batch()
    s = StepSettings(kl_coef=0.3)
    batch = batch._replace(token_rewards=jnp.zeros_like(batch.advantages))
    zeros = jax.tree.map(jnp.zeros_like, adapters)
    _, g_lora, st = jax.jit(make_grad_fn(gd, s))(adapters, batch, zeros, base)
    plain_gd, plain = nnx.split(model, nnx.Param)
    ref = jax.tree.map(lambda x: x, plain)
    nnx.replace_by_pure_dict(plain, merged_params(base, adapters, SPEC.scale))
    _, g_full, st_full = jax.jit(make_grad_fn(plain_gd, s))(plain, batch, ref)
    np.testing.assert_allclose(st["kl"], st_full["kl"], rtol=1e-4)
    assert st["kl"] > 0
    gf = g_full.to_pure_dict()
    for path, _, a, b in adapter_pairs(adapters):
        node = gf
        for k in path:
            node = node[k]
        dws = np.asarray(node, np.float64)                     # [L, ...]: per layer
        a64s, b64s = np.asarray(a, np.float64), np.asarray(b, np.float64)
        n_in = a64s.ndim - 2
        want_a = SPEC.scale * np.stack([
            np.tensordot(dw, b64, axes=(list(range(n_in, dw.ndim)), list(range(1, b64.ndim))))
            for dw, b64 in zip(dws, b64s)])
        want_b = SPEC.scale * np.stack([
            np.tensordot(a64, dw, axes=(list(range(n_in)), list(range(n_in))))
            for a64, dw in zip(a64s, dws)])
        gnode = g_lora.to_pure_dict()["layers"][path[1]][path[2].replace("kernel", "lora")]
        tol = 1e-4 * max(np.abs(want_a).max(), np.abs(want_b).max())
        np.testing.assert_allclose(np.asarray(gnode["a"]), want_a, atol=tol, err_msg=str(path))
        np.testing.assert_allclose(np.asarray(gnode["b"]), want_b, atol=tol, err_msg=str(path))


def test_learner_trains_adapters_only_and_the_kl_reference_is_the_base():
    cfg = tiny_experiment(MODEL, G, T, lr=1e-3, kl_coef=0.1, num_steps=5,
                          lora=LoraConfig(rank=4, alpha=8.0, lr=1e-2))
    learner = Learner(cfg, mesh=one_device_mesh())
    assert learner.base is not None
    base0 = {k: v.copy() for k, v in flat(learner.base).items()}
    ad0 = flat(learner.params)
    assert set(ad0) == {k for k in ad0 if k[-1] in ("a", "b")}      # state.params: adapters
    # the optimiser state holds adapter-shaped moments only (mu, nu) + scalars
    opt_bytes = tree_bytes(learner.state.opt_state)
    ad_bytes = tree_bytes(learner.params)
    assert 2 * ad_bytes <= opt_bytes <= 2 * ad_bytes + 64
    assert tree_bytes(learner.ref_params) == ad_bytes             # no second copy of the base
    kls = []
    for step in range(5):
        m = learner.train_on(make_group_records(step, 2, vocab=VOCAB, group_size=G,
                                                max_tokens=T, version=learner.version))
        assert m["learner/skipped"] == 0
        kls.append(m["policy/kl"])
        assert m["learner/lr"] == pytest.approx(1e-2)              # learner.lora.lr
    assert learner.version == 5
    # B = 0 at step 0: the policy is the base (the two forwards fuse differently: rounding)
    assert kls[0] < 1e-9 and kls[-1] > 1e-5, kls
    for k, v in flat(learner.base).items():
        np.testing.assert_array_equal(v, base0[k], err_msg=str(k))   # bit-identical base
    ad5 = flat(learner.params)
    assert all(not np.array_equal(ad5[k], ad0[k]) for k in ad0 if k[-1] == "b")


@pytest.mark.slow
def test_sharded_lora_step_equals_single_device():
    """fsdp=2 x tensor=2 on 4 fake devices vs 1 device: adapters laid out by their logical
    axes (A's input axis over fsdp/tensor like its kernel's), same adapters after 2 steps."""
    from rlflow.config import MeshConfig

    cfg = tiny_experiment(MODEL, G, T, num_devices=4, mesh=MeshConfig(fsdp=2, tensor=2),
                          kl_coef=0.2, lora=LoraConfig(rank=4, alpha=8.0, lr=1e-2))
    sharded, single = Learner(cfg), Learner(cfg, mesh=one_device_mesh())
    a = sharded.params["layers"]["mlp"]["down_lora"]["a"][...]   # [L, F, r]: F over tensor
    assert len(a.sharding.device_set) == 4 and not a.sharding.is_fully_replicated
    # other reduction orders in every matmul and token sum (tests/tolerances.py): the forward
    # chain (each adapted projection adds its rank-r contraction: 7 per layer) twice plus the
    # batch's n positions, times eps; the loss is a mixed-sign sum
    rows, seq, lr = 2 * G, 16, cfg.learner.lora.lr
    chain = model_chain_len(MODEL, seq) + MODEL.num_layers * 7 * SPEC.rank
    for step in range(2):
        recs = make_group_records(step, 2, vocab=VOCAB, group_size=G, max_tokens=T,
                                  version=step)
        m4, m1 = sharded.train_on(recs), single.train_on(recs)
        assert m1["learner/loss"] != 0
        np.testing.assert_allclose(m4["learner/loss"], m1["learner/loss"], atol=0,
                                   rtol=reorder_rtol(chain, rows * seq, MIXED_SIGN_CANCEL))
    got, want = flat(sharded.params), flat(single.params)
    # adapters after 2 Adam steps: as in test_sharded_step_equals_single_device, each update
    # is ~lr * sign(g), moved by lr * reorder_rtol by rounding, except where a gradient is
    # within rounding of 0 (m / sqrt(v) anywhere in [-1, 1]): lr / 10 admits those and no
    # wrong update (lr)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=0.1 * lr, err_msg=str(k))
