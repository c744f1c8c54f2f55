"""Learner memory per chip (rlflow.learner.memory) against real models and a real sharded
learner state, and the 70B reference config's fit check."""

import importlib.util
import os

import jax
import numpy as np
import pytest
from flax import nnx

from rlflow.config import MeshConfig, ModelConfig, replace
from rlflow.learner.memory import Architecture, LearnerDoesNotFit, check_fits, learner_memory
from rlflow.models.hf import build_model
from learner_fixtures import tiny_experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("llama", False),
                                             ("qwen2", False), ("qwen3", True)])
def test_parameter_count_equals_the_built_model(model_type, tied):
    m = replace(MODEL, model_type=model_type, tie_word_embeddings=tied)
    params = nnx.split(build_model(m)[0], nnx.Param)[1]
    real = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert Architecture.from_model_config(m).num_params() == real


def test_state_terms_equal_the_sharded_learner_state_on_one_chip():
    """fsdp=2 x tensor=2: bytes of params and AdamW moments on device 0 of a real learner.
    The estimate divides everything by fsdp x tensor; the RMSNorm scales are replicated
    (logical axis 'norm' has no mesh axis), so device 0 holds exactly that much more."""
    from rlflow.learner.trainer import Learner

    cfg = tiny_experiment(MODEL, 4, 6, num_devices=4, mesh=MeshConfig(fsdp=2, tensor=2))
    learner = Learner(cfg)
    dev0 = jax.devices()[0]

    def on_dev0(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards")
                   and x.ndim for s in x.addressable_shards if s.device == dev0)

    mem = learner_memory(Architecture.from_model_config(MODEL), cfg)
    norms = (2 * MODEL.num_layers + 1) * MODEL.hidden_size * 4          # float32 scales
    assert on_dev0(learner.params) == mem.params + norms * (1 - 1 / 4)
    assert on_dev0(learner.state.opt_state) == mem.optimizer + 2 * norms * (1 - 1 / 4)
    assert mem.grads == mem.params and mem.reference == 0.0
    with_ref = learner_memory(Architecture.from_model_config(MODEL),
                              replace(cfg, learner=replace(cfg.learner, kl_coef=0.1)))
    assert with_ref.reference == mem.params
    # weights go by transfer (the default): the step keeps the published params beside the
    # new ones, one more params-sized term; the orbax fallback's step donates them
    assert cfg.runtime.weight_transfer == "transfer" and mem.published == mem.params
    orbax = learner_memory(Architecture.from_model_config(MODEL),
                           replace(cfg, runtime=replace(cfg.runtime, weight_transfer="orbax")))
    assert orbax.published == 0.0 and orbax.total == mem.total - mem.params


def test_activations_scale_with_rows_per_chip():
    arch = Architecture.from_model_config(MODEL)
    cfg = tiny_experiment(MODEL, 4, 6, num_devices=4, mesh=MeshConfig(fsdp=2, tensor=2))
    one = learner_memory(arch, cfg).activations
    two_micro = learner_memory(arch, replace(cfg, learner=replace(cfg.learner,
                                                                  micro_batches=2)))
    assert two_micro.activations == pytest.approx(one / 2)
    assert one > 0


def load_70b():
    path = os.path.join(REPO, "configs", "gsm8k_llama3_1_70b.py")
    spec = importlib.util.spec_from_file_location("cfg70b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_70b_reference_prints_its_memory_and_names_a_mesh_too_small(tmp_path, capsys):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    m = load_70b()
    assert m.LLAMA_3_1_70B.num_params() == 70_553_706_496     # Llama-3.1-70B's published count
    cfg = m.config(model_path=str(folder))
    err = capsys.readouterr().err
    assert "gsm8k_llama3_1_70b: learner memory per chip (32 chips): params 8.2, optimizer " \
           "16.4, grads 8.2" in err
    assert cfg.learner.num_devices == 32 and cfg.learner.mesh == MeshConfig(fsdp=16, tensor=2)
    assert check_fits(m.LLAMA_3_1_70B, cfg, m.V5P_CHIP_GIB).total < 0.9 * m.V5P_CHIP_GIB * 2**30
    with pytest.raises(LearnerDoesNotFit, match=r"learner.mesh data=1 x fsdp=8 x tensor=1: "
                                                r"70.6B parameters need per chip params 32.9"):
        m.config(model_path=str(folder), learner_mesh=MeshConfig(fsdp=8))
