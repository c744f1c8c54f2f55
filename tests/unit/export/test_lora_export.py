"""LoRA checkpoints and export: a checkpoint holds the adapters, their optimiser state and a
reference to the base (path + architecture hash), resume checks the base; ``rlflow export
--run`` writes a PEFT adapter folder that ``peft`` loads onto the base model, and with
``--merge`` the merged full model; both give the learner's logits."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_fixtures import make_tiny_hf_model
from rlflow import checkpoint as ckpt_lib
from rlflow.console import cli
from rlflow.config import CheckpointConfig, LoraConfig, ModelConfig, replace
from rlflow.learner.trainer import Learner
from learner_fixtures import flat, make_group_records, one_device_mesh, tiny_experiment
from tolerances import F32_EPS, forward_atol

TOKENS = np.array([[1, 17, 200, 31, 4, 99, 250, 8, 64, 128, 5, 77]], np.int32)   # [1, 12]
G, T = 4, 6


def _cfg(root, base):
    cfg = tiny_experiment(ModelConfig(path=base), G, T, lr=1e-3,
                          lora=LoraConfig(rank=4, alpha=8.0, lr=1e-2, targets=(".*_proj",),
                                          train_final_norm=True, train_embeddings=True))
    return replace(cfg, name="run", run_dir=os.path.join(root, "runs"),
                   checkpoint=CheckpointConfig(every_steps=1))


def _logits(learner) -> np.ndarray:
    model = nnx.merge(learner.graphdef, learner.params, learner.base)
    t = TOKENS.shape[1]
    return np.asarray(model(jnp.asarray(TOKENS), jnp.arange(t, dtype=jnp.int32)[None],
                            jnp.ones((1, t), bool)))[0]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    base = make_tiny_hf_model("qwen2", os.path.join(root, "base"))      # q/k/v biases, tied
    cfg = _cfg(root, base)
    learner = Learner(cfg, mesh=one_device_mesh())
    learner.train_on(make_group_records(0, 2, vocab=256, group_size=G, max_tokens=T))
    # adapters far from zero, so that an export that dropped or transposed one would show
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(scale=0.2, size=x.shape), x.dtype),
                          learner.params)
    learner.state = learner.state._replace(params=params)
    ck = ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(cfg.run_path), cfg.checkpoint)
    ck.save_final(learner.checkpoint(metadata=ckpt_lib.run_metadata(cfg, learner.mesh)))
    ck.close()
    return dict(root=root, base=base, cfg=cfg, learner=learner, logits=_logits(learner))


def test_checkpoint_holds_adapters_and_resume_checks_the_base(lora_run):
    cfg, learner = lora_run["cfg"], lora_run["learner"]
    step, saved, meta = ckpt_lib.restore_params(ckpt_lib.checkpoint_dir(cfg.run_path))
    leaves = jax.tree_util.tree_flatten_with_path(saved)[0]
    # adapters (+ the trained final norm and tied embedding) only: every saved array is in
    # an *_lora, final_norm or embed
    names = [[str(getattr(k, "key", k)) for k in p] for p, _ in leaves]
    assert step == 1 and leaves
    assert all(any(n.endswith("_lora") for n in p) or p[0] in ("final_norm", "embed")
               for p in names), names
    assert sum(p[0] == "final_norm" for p in names) == 1
    assert sum(p[0] == "embed" for p in names) == 1
    assert meta["lora_base"]["path"] == lora_run["base"]
    assert len(meta["lora_base"]["config_sha256"]) == 64
    again = Learner(cfg, mesh=one_device_mesh())
    again.resume(ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(cfg.run_path), cfg.checkpoint))
    assert again.version == 1
    for k, v in flat(learner.params).items():
        np.testing.assert_array_equal(flat(again.params)[k], v)
    for a, b in zip(jax.tree.leaves(again.state.opt_state), jax.tree.leaves(learner.state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # another base folder (same architecture, other weights): resume refuses, naming it
    other = make_tiny_hf_model("qwen2", os.path.join(lora_run["root"], "other"), seed=3)
    wrong = Learner(replace(cfg, model=ModelConfig(path=other)), mesh=one_device_mesh())
    with pytest.raises(ckpt_lib.CheckpointError, match="LoRA base mismatch in path"):
        wrong.resume(ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(cfg.run_path),
                                           cfg.checkpoint))


def _atol(run) -> float:
    """rlflow vs transformers logits, float32 on both sides in other summation orders: twice
    the base's forward chain (tests/tolerances.py) and the adapters' rank-r contractions
    (7 projections per layer), times eps, at the scale of the logits."""
    from rlflow.models.hf import read_decoder_config
    cfg = read_decoder_config(run["base"])
    scale = float(np.abs(run["logits"]).max())
    rank = run["cfg"].learner.lora.rank
    return (forward_atol(cfg, TOKENS.shape[1], scale)
            + 2 * cfg.num_layers * 7 * rank * F32_EPS * scale)


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits[0].numpy()


def test_peft_export_loads_onto_the_base_and_gives_the_learners_logits(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = os.path.join(lora_run["root"], "peft")
    assert cli.main(["export", "--run", lora_run["cfg"].run_path, "--out", out]) == 0
    with open(os.path.join(out, "adapter_config.json")) as f:
        conf = json.load(f)
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    # the trained final norm and embedding; tied base: PEFT ties lm_head to the trained copy
    assert conf["modules_to_save"] == ["model.norm", "embed_tokens"]
    assert conf["ensure_weight_tying"] is True
    assert sorted(conf["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    base = AutoModelForCausalLM.from_pretrained(lora_run["base"], dtype=torch.float32).eval()
    plain = _hf_logits(base)
    model = PeftModel.from_pretrained(base, out).eval()
    got = _hf_logits(model)
    assert np.abs(got - plain).max() > 1.0                # the adapters were applied
    np.testing.assert_allclose(got, lora_run["logits"], atol=_atol(lora_run), rtol=0)


def test_merged_export_gives_the_learners_logits(lora_run):
    from transformers import AutoModelForCausalLM

    out = os.path.join(lora_run["root"], "merged")
    assert cli.main(["export", "--run", lora_run["cfg"].run_path, "--out", out, "--merge"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(_hf_logits(model), lora_run["logits"], atol=_atol(lora_run),
                               rtol=0)
