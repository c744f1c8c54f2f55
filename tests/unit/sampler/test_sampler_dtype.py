"""sampler.dtype: the engine's own dtype beside the learner's (a bf16 sampler, f32 learner).

Oracles: the config fields themselves, numpy's float32 -> bfloat16 rounding (ml_dtypes),
and the layout check that every weight pull goes through (rlflow.exchange.layout).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from rlflow.config import ConfigError, ExperimentConfig, MeshConfig, ModelConfig, SamplerConfig
from rlflow.exchange import layout as layout_lib
from rlflow.mesh import make_mesh
from rlflow.models import build_model
from rlflow.sampler.engine import RlflowEngine
from rlflow.sampler.precision import pull_target, sampler_model_config


def test_sampler_dtype_is_checked_and_named():
    with pytest.raises(ConfigError, match="sampler.dtype"):
        SamplerConfig(dtype="float16")
    assert SamplerConfig().dtype is None


def test_sampler_model_config_sets_both_dtypes_only_when_asked():
    cfg = ExperimentConfig()
    assert sampler_model_config(cfg) is cfg.model                       # None: the model's
    bf = ExperimentConfig(sampler=SamplerConfig(dtype="bfloat16"))
    m = sampler_model_config(bf)
    assert (m.dtype, m.param_dtype) == ("bfloat16", "bfloat16")
    assert (bf.model.dtype, bf.model.param_dtype) == ("float32", "float32")  # learner's kept
    same = ExperimentConfig(model=ModelConfig(dtype="bfloat16", param_dtype="bfloat16"),
                            sampler=SamplerConfig(dtype="bfloat16"))
    assert sampler_model_config(same) is same.model


@pytest.mark.parametrize("model, sampler, want", [
    (("float32", "float32"), None, "float32"),
    (("float32", "float32"), "bfloat16", "bfloat16"),      # bf16 sampler, f32 learner
    (("bfloat16", "float32"), None, "bfloat16"),           # the model section computes bf16
    (("bfloat16", "float32"), "float32", "float32"),       # a float32 sampler asked for
    (("bfloat16", "bfloat16"), "float32", "bfloat16"),     # never wider than the master
    (("bfloat16", "bfloat16"), None, "bfloat16"),
])
def test_versions_are_published_in_the_samplers_compute_dtype_when_narrower(
        model, sampler, want):
    cfg = ExperimentConfig(model=ModelConfig(dtype=model[0], param_dtype=model[1]),
                           sampler=SamplerConfig(dtype=sampler))
    assert cfg.published_dtype == want


def test_bf16_engine_pulls_float32_versions_and_rounds_them_once():
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                 num_heads=2, num_kv_heads=1, head_dim=8, init_seed=1)
    learner, _ = build_model(ModelConfig(**small))
    sampler, _ = build_model(ModelConfig(**small, dtype="bfloat16", param_dtype="bfloat16"))
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    engine = RlflowEngine(sampler, SamplerConfig(num_slots=2, max_prefill_length=8,
                                                 prefill_buckets=(8,), max_tokens=4),
                          mesh=mesh)
    target = pull_target(nnx.state(sampler, nnx.Param), "float32")
    # the pull target carries the learner's dtype and the engine's shardings ...
    for t, p in zip(jax.tree.leaves(target), jax.tree.leaves(nnx.state(sampler, nnx.Param))):
        assert isinstance(t, jax.ShapeDtypeStruct) and t.dtype == jnp.float32
        assert t.shape == p.shape and t.sharding == p.sharding
    # ... so the published float32 layout passes the pull's check (a bf16 target would not)
    published = nnx.state(learner, nnx.Param)
    leaves = [{"path": p, "shape": list(x.shape), "dtype": str(x.dtype)}
              for p, x in zip(*layout_lib.flatten(published)[:2])]
    layout_lib.target_shardings(target, leaves)
    with pytest.raises(layout_lib.LayoutError, match="dtype|bfloat16"):
        layout_lib.target_shardings(nnx.state(sampler, nnx.Param), leaves)
    # the swap rounds each float32 leaf to bf16 (round to nearest even, as numpy does)
    params = engine.load_params(published, version=3)
    for got, want in zip(jax.tree.leaves(engine.param_state(params)),
                         jax.tree.leaves(published)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                      np.asarray(want).astype(ml_dtypes.bfloat16).view(np.uint16))
    # same dtype: the target still holds no array (the subscriber keeps it for the whole
    # run; arrays there kept the start-up weights resident beside every version)
    same = nnx.state(learner, nnx.Param)
    kept = pull_target(same, "float32")
    for t, p in zip(jax.tree.leaves(kept), jax.tree.leaves(same)):
        assert isinstance(t, jax.ShapeDtypeStruct) and not isinstance(t, jax.Array)
        assert (t.shape, t.dtype, t.sharding) == (p.shape, p.dtype, p.sharding)


@pytest.mark.parametrize("mode", ["forward", "merged"])
def test_bf16_lora_sampler_target_types_whole_modules_like_the_learner(mode):
    """With LoRA the published tree holds float32 adapters and the modules trained whole
    (embed, final_norm) in the learner's dtype: the target keeps the adapters' float32 and
    re-types the whole modules (their bf16 engine copies would fail the layout check),
    and the swap rounds those modules to the engine's bf16."""
    from rlflow.models.lora import LoraSpec
    from rlflow.models.lora_decoder import lora_model_parts
    from rlflow.sampler.lora_swap import AdapterApplier
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                 num_heads=2, num_kv_heads=1, head_dim=8, init_seed=1)
    spec = LoraSpec(rank=2, alpha=4.0, train_final_norm=True, train_embeddings=True)
    learner, lcfg = build_model(ModelConfig(**small))
    _, published, _ = lora_model_parts(learner, lcfg, spec)
    sampler, scfg = build_model(ModelConfig(**small, dtype="bfloat16", param_dtype="bfloat16"))
    applier = AdapterApplier(sampler, scfg, spec, mode)
    target = pull_target(applier.target, "float32")
    paths, leaves, _ = layout_lib.flatten(target, targets=True)
    kinds = {p: x.dtype for p, x in zip(paths, leaves)}
    assert any("_lora" in p for p in kinds) and any("embed" in p for p in kinds)
    assert all(dt == jnp.float32 for dt in kinds.values()), kinds
    assert any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)       # re-typed ones
    pub = [{"path": p, "shape": list(x.shape), "dtype": str(x.dtype)}
           for p, x in zip(*layout_lib.flatten(published)[:2])]
    layout_lib.target_shardings(target, pub)                             # passes
    with pytest.raises(layout_lib.LayoutError, match="bfloat16"):
        layout_lib.target_shardings(applier.target, pub)                 # the old target
    engine = RlflowEngine(applier.engine_model, SamplerConfig(
        num_slots=2, max_prefill_length=8, prefill_buckets=(8,), max_tokens=4),
        mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    params = engine.param_state(engine.load_params(applier.engine_params(published), 1))
    got = np.asarray(params["embed"][...])
    want = np.asarray(published["embed"][...]).astype(ml_dtypes.bfloat16)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    # what the learner publishes beside this bf16 sampler (published_params): the whole
    # modules in bf16, the adapters in float32; the bf16 pull target takes it as it is and
    # the swap gives the same engine weights
    from rlflow.learner.publish import published_params
    sent = published_params(published, "bfloat16")
    target16 = pull_target(applier.target, "bfloat16")
    sent_leaves = [{"path": p, "shape": list(x.shape), "dtype": str(x.dtype)}
                   for p, x in zip(*layout_lib.flatten(sent)[:2])]
    assert {d["dtype"] for d in sent_leaves} == {"bfloat16", "float32"}
    layout_lib.target_shardings(target16, sent_leaves)                   # passes
    params16 = engine.param_state(engine.load_params(applier.engine_params(sent), 2))
    for a, b in zip(jax.tree.leaves(params16), jax.tree.leaves(params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
