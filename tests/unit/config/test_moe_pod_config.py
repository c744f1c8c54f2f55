"""configs/gsm8k_qwen3_30b_a3b.py (issue 40 item 5): Qwen3-30B-A3B with its experts on the
``expert`` mesh axis, on the TPU slices the memory model picks; the memory model counts the
experts and their split; the expert axes are refused on dense models and when they do not
divide the expert count, naming ``learner.mesh.expert`` / ``sampler.mesh.expert``."""

import dataclasses
import os
import re

import pytest

from rlflow.config import (ConfigError, ExperimentConfig, LearnerConfig, MeshConfig,
                           ModelConfig, SamplerConfig)
from dry_run_memory import check_memory_line, tpu_dry_run
from rlflow.console import fit
from rlflow.console.config_args import parse_train_args
from rlflow.learner.memory import Architecture, activation_bytes, learner_memory

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CONFIG = os.path.join(REPO, "configs", "gsm8k_qwen3_30b_a3b.py")


@pytest.fixture
def moe(monkeypatch):
    """The config as the scripts load it where they run: no model folder (random init of
    Qwen3-30B-A3B's published architecture)."""
    monkeypatch.delenv("RLFLOW_MODEL_PATH", raising=False)
    return parse_train_args(["--config", CONFIG])


def test_the_config_is_qwen3_30b_a3b_with_its_experts_split(moe):
    arch = fit.architecture(moe)
    m = moe.model
    assert (m.model_type, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads,
            m.head_dim, m.vocab_size) == ("qwen3_moe", 48, 2048, 32, 4, 128, 151936)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (128, 8, 768)
    # 30.5B parameters (Qwen's "30.5B total"), 29.0B of them experts, 3.3B active a token
    assert arch.num_params() == 30_532_122_624
    assert arch.expert_params() == 48 * 128 * 3 * 2048 * 768
    active = arch.num_params() - arch.expert_params() * (1 - 8 / 128)
    assert active // 10 ** 8 == 33                 # 3.35B: embeddings and both heads included
    assert moe.learner.mesh == MeshConfig(fsdp=2, expert=8)
    assert moe.sampler.mesh == MeshConfig(expert=4)


def test_it_fits_the_slice_the_memory_model_picks_and_not_a_smaller_one(moe):
    arch = fit.architecture(moe)
    picked = dict(fit.smallest_slice(moe, arch, ("v5p", "v6e")))
    assert set(picked) == {"v5p-32", "v6e-64"}
    assert picked["v6e-64"] is not None
    # the config is laid out for the v5p pick: its learner is fit_to_slice's
    assert fit.fit_to_slice(moe, "v5p-32").learner == dataclasses.replace(moe.learner,
                                                                          num_hosts=4)
    found = fit.check_memory(moe, device_bytes=fit.device_memory("v5p-32"),
                             sampler_device_bytes=fit.device_memory("v5p-8"))
    assert found.learner_fits and found.sampler_fits
    small = fit.fit_to_slice(moe, "v5p-16")
    assert small.learner.mesh == MeshConfig(fsdp=1, expert=8)
    with pytest.raises(fit.MemoryDoesNotFit, match=r"^learner\.mesh: the learner needs .* more "
                                                   r"than 90% of a v5p-16 chip.*\(learner\.mesh"
                                                   r"\.fsdp, learner\.mesh\.expert, a larger"):
        fit.check_memory(small, device_bytes=fit.device_memory("v5p-16"),
                         where=fit.chip_name("v5p-16"))


def test_the_memory_model_splits_only_the_experts_over_the_expert_axis(moe):
    """Parameters a chip = (outside the experts + experts / expert) / (fsdp x tensor), the
    same count for every state term; the dispatch's rows grow the activations with the
    expert axis (every gathered token's k pairs, the dropless worst case)."""
    arch = fit.architecture(moe)
    n, nx = arch.num_params(), arch.expert_params()
    mem = {}
    for expert in (1, 8):
        mesh = MeshConfig(fsdp=16 // expert, expert=expert)
        cfg = dataclasses.replace(moe, learner=dataclasses.replace(moe.learner, mesh=mesh))
        mem[expert] = learner_memory(arch, cfg)
        per_chip = (n - nx + nx / expert) / mesh.fsdp
        assert mem[expert].params == pytest.approx(4 * per_chip, rel=1e-12)
        assert mem[expert].optimizer == pytest.approx(8 * per_chip, rel=1e-12)
        assert mem[expert].grads == pytest.approx(8 * per_chip, rel=1e-12)
    assert mem[8].params > mem[1].params               # the dense part on 2, not 16, chips
    # remat "full": L layer inputs a token, and one layer's working set with the dispatch's
    # rows (module doc of rlflow.learner.memory); the logits of 128 tokens are smaller
    a, h, f, k, t = 2, 2048, 768, 8, 1280
    for expert in (1, 8):
        mlp = a * (2 * (expert - 1) * h + expert * k * (2 * h + 4 * f)) + 4 * 128
        working = a * (4 * h + 2 * (32 + 2 * 4) * 128) + mlp + 3 * a * expert * k * f
        want = t * 48 * a * h + max(t * working, 128 * 12 * 151936)
        got = activation_bytes(arch, rows=1, seq=t, compute_bytes=a, remat="full",
                               scores_materialised=False, logits_chunk_tokens=128,
                               expert=expert)
        assert got == pytest.approx(want, rel=1e-12)
        assert t * working > 128 * 12 * 151936
    dense = Architecture(151936, 2048, 6144, 48, 32, 4, 128, qk_norm=True)
    assert dense.expert_params() == 0 and dense.params_per_shard(4, 8) == dense.num_params() / 4


def _start(*extra):
    return tpu_dry_run("moe", "configs/gsm8k_qwen3_30b_a3b.py", "/home/me/Qwen3-30B-A3B", "v5p-32", "v5p-8", 2, *extra)


def test_scripts_dry_run_prints_the_memory_of_the_picked_slices():
    proc = _start()
    assert proc.returncode == 0, proc.stderr
    # float32 params, the version published in the bfloat16 sampler's dtype
    check_memory_line(proc.stderr, "v5p-32", published_over_params=0.5)
    assert re.search(r"sampler replica [\d.]+ GiB, [\d.]+ GiB a device of a v5p-8 chip",
                     proc.stderr)
    assert "--learner.num_hosts 4" in proc.stdout and "tpu-vm ssh moe-learner" in proc.stdout


def _experiment(model, learner_mesh=MeshConfig(), sampler_mesh=MeshConfig()):
    return ExperimentConfig(
        model=model,
        sampler=SamplerConfig(max_prefill_length=8, prefill_buckets=(8,), max_tokens=7,
                              num_devices=sampler_mesh.num_devices, mesh=sampler_mesh),
        learner=LearnerConfig(groups_per_step=2, num_devices=learner_mesh.num_devices,
                              mesh=learner_mesh))


def test_expert_axes_only_for_moe_models_and_dividing_the_expert_count(tmp_path):
    tiny_moe = ModelConfig(model_type="qwen3_moe", num_experts=8)
    assert _experiment(tiny_moe, MeshConfig(fsdp=2, expert=2), MeshConfig(expert=4))
    with pytest.raises(ConfigError, match=r"^learner\.mesh\.expert: is 2, but the model is "
                                          r"dense \(model\.model_type='llama'\)"):
        _experiment(ModelConfig(), MeshConfig(expert=2))
    with pytest.raises(ConfigError, match=r"^sampler\.mesh\.expert: must divide the model's "
                                          r"6 experts .* got 4"):
        _experiment(dataclasses.replace(tiny_moe, num_experts=6), sampler_mesh=MeshConfig(
            expert=4))
    # a model folder's config.json decides (the random model's fields are ignored)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 64}')
    with pytest.raises(ConfigError, match=r"^learner\.mesh\.expert: is 2, but the model is "
                                          r"dense .*model\.path"):
        _experiment(dataclasses.replace(tiny_moe, path=str(tmp_path)), MeshConfig(expert=2))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 4}')
    assert _experiment(ModelConfig(path=str(tmp_path)), MeshConfig(expert=4))
    from rlflow.config.model import HF_MOE_TYPES
    from rlflow.models.config import MOE_MODEL_TYPES
    assert HF_MOE_TYPES == MOE_MODEL_TYPES     # the config package's copy of the models' list
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe_text", "num_experts": 6}')
    with pytest.raises(ConfigError, match=r"^learner\.mesh\.expert: must divide the model's "
                                          r"6 experts"):
        _experiment(ModelConfig(path=str(tmp_path)), MeshConfig(expert=4))
    # the batch splits over data x fsdp x expert
    with pytest.raises(ConfigError, match=r"learner\.micro_batches: .* 4 samples must divide "
                                          r"into .*learner\.mesh\.expert = 8 parts"):
        ExperimentConfig(model=tiny_moe, sampler=SamplerConfig(
            max_prefill_length=8, prefill_buckets=(8,), max_tokens=7, group_size=2),
            learner=LearnerConfig(groups_per_step=2, num_devices=8,
                                  mesh=MeshConfig(fsdp=2, expert=4)))
