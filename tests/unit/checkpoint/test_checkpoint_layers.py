"""Checkpoints written before the decoder stored its layers stacked (per-layer paths
``layers/<i>/...`` in the parameters and the optimiser moments) restore into the stacked
layout (rlflow.checkpoint.layer_layout): each stacked array is its saved layers in order, on
the target's shardings; read without a target, on the host; a checkpoint that does not fit
is refused naming the array."""

import jax
import numpy as np
import pytest
from flax import nnx

from rlflow.checkpoint import CheckpointError, Checkpointer, LearnerCheckpoint, restore_params
from rlflow.checkpoint.targets import path_name
from rlflow.config import MeshConfig, ModelConfig
from rlflow.learner.trainer import Learner
from rlflow.models import layer_scan
from learner_fixtures import tiny_experiment

MODEL = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                    tie_word_embeddings=False, init_seed=2)


class PerLayerDecoder(nnx.Module):
    """The parameter tree rlflow saved before the stacking: the blocks in an ``nnx.List``
    (paths ``layers/<i>/attn/q_kernel/value``), the other modules as they are."""

    def __init__(self, model, num_layers=None):
        self.embed = model.embed
        self.layers = nnx.List(layer_scan.layer_modules(model.layers)[:num_layers])
        self.final_norm = model.final_norm
        self.lm_head = model.lm_head


def _named(tree) -> dict:
    return {path_name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def learner():
    """A learner on 4 fake devices (fsdp 2 x tensor 2): the restore targets."""
    return Learner(tiny_experiment(MODEL, 2, 4, num_devices=4,
                                   mesh=MeshConfig(fsdp=2, tensor=2)))


def _save_per_layer(learner, folder, num_layers=None):
    """Params and moved optimiser moments (one update with the params as gradient) of the
    learner's model in the per-layer layout, saved at step 3; returns them by path name."""
    model = nnx.merge(learner.graphdef, jax.device_get(learner.params))   # host arrays
    params = nnx.state(PerLayerDecoder(model, num_layers), nnx.Param)
    opt_state = learner.tx.init(params)
    _, opt_state = jax.jit(learner.tx.update)(params, opt_state, params)
    with Checkpointer(folder) as ck:
        ck.save_final(LearnerCheckpoint(step=3, params=params, opt_state=opt_state))
    return _named(params), _named(opt_state)


def _assert_stacked(got: dict, saved: dict):
    """Every restored array equals the saved one of its name, or (stacked) the saved
    ``layers/<i>/`` arrays in order."""
    assert any("layers/" in n for n in got)
    for name, value in got.items():
        if name in saved:
            np.testing.assert_array_equal(value, saved[name], err_msg=name)
            continue
        parts = [saved[name.replace("layers/", f"layers/{i}/", 1)] for i in range(len(value))]
        assert len(value) == MODEL.num_layers, name
        np.testing.assert_array_equal(value, np.stack(parts), err_msg=name)
    assert len(got) < len(saved)            # fewer arrays: one per kind, not one per layer


def test_per_layer_checkpoint_restores_stacked_onto_the_targets_shardings(learner, tmp_path):
    params, opt_state = _save_per_layer(learner, str(tmp_path))
    assert any(n.startswith("layers/2/mlp/") for n in params)
    st = learner.state
    with Checkpointer(str(tmp_path)) as ck:
        got = ck.restore(params_target=st.params, opt_state_target=st.opt_state)
    assert jax.tree.structure(got.params) == jax.tree.structure(st.params)
    assert jax.tree.structure(got.opt_state) == jax.tree.structure(st.opt_state)
    for new, target in zip(jax.tree.leaves((got.params, got.opt_state)),
                           jax.tree.leaves((st.params, st.opt_state))):
        assert new.shape == target.shape and new.sharding == target.sharding
    q = got.params["layers"]["attn"]["q_kernel"][...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    _assert_stacked(_named(got.params), params)
    _assert_stacked(_named(got.opt_state), opt_state)


def test_per_layer_checkpoint_reads_stacked_onto_the_host_without_a_target(learner, tmp_path):
    params, _ = _save_per_layer(learner, str(tmp_path))
    step, host, _ = restore_params(str(tmp_path))
    assert step == 3
    assert isinstance(host["layers"]["mlp"]["gate_kernel"]["value"], np.ndarray)
    assert set(host["layers"]) == {"attn", "input_norm", "mlp", "post_attn_norm"}
    _assert_stacked(_named(host), params)


def test_per_layer_checkpoint_of_another_depth_is_refused_naming_the_array(learner, tmp_path):
    _save_per_layer(learner, str(tmp_path), num_layers=2)
    with Checkpointer(str(tmp_path)) as ck, pytest.raises(
            CheckpointError, match=r"params/layers/.*per-layer parameters.*layers \[2\] are "
                                   r"not saved"):
        ck.restore(params_target=learner.state.params, restore_opt_state=False)
