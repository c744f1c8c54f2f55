"""Meshes and shardings on 4 fake CPU devices: sharded forward == 1-device forward; rules
map logical axes as documented; unmatched parameters are errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rlflow.config import MeshConfig, ModelConfig
from rlflow.mesh import (batch_sharding, cache_sharding, logical_to_spec, make_mesh,
                         param_shardings, shard_params)
from rlflow.models import build_model, init_cache, positions_from_mask
from tolerances import F32_EPS, forward_atol


def _cfg(family):
    return ModelConfig(model_type=family, vocab_size=128, hidden_size=32, intermediate_size=64,
                       num_heads=4, num_kv_heads=2, head_dim=8,
                       tie_word_embeddings=family != "llama", init_seed=1)


def _run(model, cfg, mesh, toks, mask, with_cache):
    """Full forward and (with_cache) a prefill + 2 decode steps, jitted with shardings."""
    graphdef, params = nnx.split(model, nnx.Param)
    pshard = param_shardings(params, mesh)
    bs = batch_sharding(mesh)
    params = jax.device_put(params, pshard)
    toks, mask = jax.device_put(toks, bs), jax.device_put(mask, bs)
    pos = positions_from_mask(mask)

    @jax.jit
    def full(params, t, p, m):
        return nnx.merge(graphdef, params)(t, p, m)

    @jax.jit
    def cached(params, t, p, m, cache, idx):
        out = nnx.merge(graphdef, params).forward_cached(t, p, m, cache, idx)
        return out.logits, out.cache

    logits = full(params, toks, pos, mask)
    if not with_cache:
        return np.asarray(logits), None
    cache = init_cache(cfg, toks.shape[0], 12)
    cache = jax.device_put(cache, cache_sharding(mesh, cache))
    b = toks.shape[0]
    steps = [cached(params, toks[:, :6], pos[:, :6], mask[:, :6], cache, jnp.zeros(b, jnp.int32))]
    for i in (6, 7):
        steps.append(cached(params, toks[:, i:i + 1], pos[:, i:i + 1], mask[:, i:i + 1],
                            steps[-1][1], jnp.full(b, i, jnp.int32)))
    return np.asarray(logits), np.concatenate([np.asarray(s[0]) for s in steps], axis=1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_fsdp2_tensor2_forward_equals_one_device(family):
    assert jax.device_count() == 4
    mcfg = _cfg(family)
    mesh4 = make_mesh(MeshConfig(fsdp=2, tensor=2))
    mesh1 = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    model1, cfg = build_model(mcfg)
    model4, _ = build_model(mcfg, mesh=mesh4)      # initialised directly in its shardings
    q = model4.layers.attn.q_kernel[...]          # stacked [L, E, H, D]
    assert len(q.sharding.device_set) == 4 and q.sharding.spec == P(None, "fsdp", "tensor", None)
    # same parameter values (jit vs eager init may differ in the last bit)
    for a, b in zip(jax.tree.leaves(nnx.state(model1, nnx.Param)),
                    jax.tree.leaves(nnx.state(model4, nnx.Param))):
        # the last bit of each value: eps relative to the largest magnitude
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                   atol=2 * F32_EPS * float(np.abs(np.asarray(a)).max()))

    rng = np.random.RandomState(0)
    toks = rng.randint(1, cfg.vocab_size, (4, 8)).astype(np.int32)
    mask = np.ones((4, 8), bool)
    mask[1, :3] = mask[3, :5] = False
    toks[~mask] = 0
    with_cache = family == "qwen2"   # the cached path is family-independent: one is enough
    full1, cached1 = _run(model1, cfg, mesh1, jnp.asarray(toks), jnp.asarray(mask), with_cache)
    full4, cached4 = _run(model1, cfg, mesh4, jnp.asarray(toks), jnp.asarray(mask), with_cache)
    assert np.abs(full1).max() > 0.1
    # two programs of one model (4-way sharded vs one device; cached vs full): the forward's
    # reduction lengths times eps times the logits' scale (tests/tolerances.py)
    atol = forward_atol(cfg, toks.shape[1], float(np.abs(full1).max()))
    np.testing.assert_allclose(full4, full1, atol=atol, rtol=0)
    if not with_cache:
        return
    np.testing.assert_allclose(cached4[mask], cached1[mask], atol=atol, rtol=0)
    np.testing.assert_allclose(cached1[mask], full1[mask], atol=atol, rtol=0)


def test_param_shardings_follow_the_rules():
    model, cfg = build_model(_cfg("qwen2"))
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2))
    sh = param_shardings(nnx.state(model, nnx.Param), mesh)
    expected = {  # MaxText-style: FSDP on embed, tensor on heads / mlp / vocab
        ("embed",): P("tensor", "fsdp"),
        # the stacked layers' leading [L] axis is never sharded
        ("layers", "attn", "q_kernel"): P(None, "fsdp", "tensor", None),
        ("layers", "attn", "k_bias"): P(None, "tensor", None),
        ("layers", "attn", "o_kernel"): P(None, "tensor", None, "fsdp"),
        ("layers", "mlp", "down_kernel"): P(None, "tensor", "fsdp"),
        ("layers", "input_norm", "scale"): P(None, None),
        ("final_norm", "scale"): P(None),
    }
    pure = sh.to_pure_dict()
    for path, spec in expected.items():
        node = pure
        for k in path:
            node = node[k]
        assert node.spec == spec, path
    placed = shard_params(nnx.state(model, nnx.Param), mesh)
    assert placed["embed"][...].sharding.spec == P("tensor", "fsdp")


def test_indivisible_dimension_is_replicated():
    model, cfg = build_model(_cfg("llama"))        # 2 kv heads, 4 query heads
    mesh = make_mesh(MeshConfig(tensor=4))
    pure = param_shardings(nnx.state(model, nnx.Param), mesh).to_pure_dict()
    assert pure["layers"]["attn"]["k_kernel"].spec == P(None, "fsdp", None, None)
    assert pure["layers"]["attn"]["q_kernel"].spec == P(None, "fsdp", "tensor", None)


def test_unmatched_parameter_is_an_error():
    model, _ = build_model(_cfg("llama"))
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2))
    params = nnx.state(model, nnx.Param)
    rules = tuple(r for r in __import__("rlflow.mesh").mesh.LOGICAL_AXIS_RULES if r[0] != "mlp")
    with pytest.raises(ValueError, match=r"layers\.mlp\.down_kernel.*'mlp' has no rule"):
        param_shardings(params, mesh, rules)

    class Bare(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="parameter w .* has no logical axes"):
        param_shardings(nnx.state(Bare(), nnx.Param), mesh)


def test_logical_to_spec_and_mesh_errors():
    assert logical_to_spec(("batch", "seq")) == P(("data", "fsdp", "expert"), "sequence")
    assert logical_to_spec(("expert", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    assert logical_to_spec(("embed", None, "mlp")) == P("fsdp", None, "tensor")
    assert logical_to_spec(("mlp", "vocab")) == P("tensor", None)    # a mesh axis is used once
    with pytest.raises(ValueError, match="logical axis 'nope' has no rule"):
        logical_to_spec(("nope",))
    with pytest.raises(ValueError, match="needs 8 devices, got 4"):
        make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    mesh = make_mesh(MeshConfig(data=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 2}
    assert mesh.axis_names == ("data", "fsdp", "expert", "sequence", "tensor")
    assert batch_sharding(mesh).spec == P(("data", "fsdp", "expert"), "sequence")
    assert dict(make_mesh(MeshConfig(expert=2, tensor=2)).shape)["expert"] == 2
    assert MeshConfig(data=2, expert=2).batch_shards == 4
    assert MeshConfig(expert=2).describe() == "data=1 x fsdp=1 x tensor=1 x expert=2"
    with pytest.raises(ValueError, match="mesh data=1 x fsdp=2 x tensor=1 x sequence=4 needs "
                                         "8 devices, got 4"):
        make_mesh(MeshConfig(fsdp=2, sequence=4))
