"""CLI: ``rlflow train`` config file + tyro overrides; ``rlflow export`` end to end."""

import json
import os
import textwrap

import numpy as np
import pytest

from rlflow.console import cli, config_args
from rlflow.config import ExperimentConfig

CONFIG = textwrap.dedent("""
    from rlflow.config import ExperimentConfig, LearnerConfig, SamplerConfig

    def config():
        return ExperimentConfig(name="tiny", learner=LearnerConfig(lr=1e-3, num_steps=3),
                                sampler=SamplerConfig(group_size=2))
""")


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(CONFIG)
    return str(path)


def test_train_overrides_apply_on_top_of_the_config_file(config_file):
    cfg = cli.parse_train_args(["--config", config_file, "--learner.lr", "1e-6",
                                "--sampler.temperature", "0.5"])
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.learner.lr == 1e-6 and cfg.sampler.temperature == 0.5
    # untouched fields keep the file's values, not the dataclass defaults
    assert cfg.name == "tiny" and cfg.learner.num_steps == 3 and cfg.sampler.group_size == 2
    assert cli.parse_train_args(["--config", config_file]).learner.lr == 1e-3


def test_train_invalid_override_names_the_field(config_file, capsys):
    with pytest.raises(SystemExit):
        cli.parse_train_args(["--config", config_file, "--learner.lr", "-1"])
    assert "learner.lr" in capsys.readouterr().err


def test_train_unknown_flag_and_missing_file(config_file, tmp_path):
    with pytest.raises(SystemExit):
        cli.parse_train_args(["--config", config_file, "--learner.nope", "1"])
    with pytest.raises(FileNotFoundError, match="config file not found"):
        cli.parse_train_args(["--config", str(tmp_path / "missing.py")])
    assert cli.main(["train", "--config", str(tmp_path / "missing.py")]) == 2


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_export_command_writes_a_transformers_folder(tmp_path, capsys):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from hf_fixtures import make_tiny_hf_model

    src = make_tiny_hf_model("qwen2", str(tmp_path / "src"))
    out = str(tmp_path / "out")
    assert cli.main(["export", "--model-path", src, "--out", out, "--dtype", "bfloat16"]) == 0
    assert "wrote qwen2 model" in capsys.readouterr().out
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = load_file(os.path.join(src, "model.safetensors"))["model.embed_tokens.weight"]
    got = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_allclose(got, ref, rtol=2 ** -8)          # bf16 rounding only
    assert not np.array_equal(got, ref)


def test_export_argument_errors(tmp_path, capsys):
    assert cli.main(["export", "--out", str(tmp_path / "o")]) == 2
    assert "exactly one of --model-path or --run" in capsys.readouterr().err
    assert cli.main(["export", "--model-path", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_train_help_is_short_and_starts_with_config(config_file, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", config_file, "--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 40                                       # was 382
    assert lines[0] == "usage: rlflow train [--config PATH] [--SECTION.FIELD VALUE ...]"
    flags = [ln.split()[0] for ln in lines if ln.startswith("  --")]
    assert flags[0] == "--config"
    assert "--learner.num-steps" in flags and "--checkpoint.overwrite" in flags   # README's
    assert all("_" not in f for f in flags), flags                                # hyphens
    assert any("(now: 3)" in ln for ln in lines if "--learner.num-steps" in ln)  # the file's
    assert any("(now: false)" in ln for ln in lines if "--checkpoint.overwrite" in ln)
    assert any("--help-all" in ln and "docs/config.md" in ln for ln in lines)


def test_train_help_shows_the_values_the_other_flags_make(config_file, capsys):
    def now(args, flag):
        with pytest.raises(SystemExit):
            cli.main(["train", "--config", config_file, *args])
        out = capsys.readouterr().out
        return [ln for ln in out.splitlines() if ln.startswith(f"  {flag} ")][0], out

    line, out = now(["--learner.num-steps", "7", "--checkpoint.overwrite", "--help"],
                    "--learner.num-steps")
    assert line.endswith("(now: 7)") and "do not parse" not in out
    line, _ = now(["--checkpoint.overwrite", "--help"], "--checkpoint.overwrite")
    assert line.endswith("(now: true)")
    line, out = now(["-h", "--learner.num-steps", "seven"], "--learner.num-steps")
    assert line.endswith("(now: 3)")                             # the file's
    assert out.rstrip().endswith("the values shown are the config file's)")


def test_help_all_writes_booleans_as_help_does(config_file, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", config_file, "--help-all"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--checkpoint.overwrite {true,false}" in out and "--learner.num-steps" in out
    assert "True" not in out and "False" not in out and "(default: false)" in out


def test_common_flags_of_the_help_are_config_fields():
    import dataclasses

    for name, _ in config_args.COMMON_FLAGS:
        node = ExperimentConfig()
        for part in name.split("."):
            assert part in {f.name for f in dataclasses.fields(node)}, name
            node = getattr(node, part)


@pytest.mark.parametrize("word,value", [("true", True), ("True", True), ("1", True),
                                        ("yes", True), ("ON", True), ("false", False),
                                        ("False", False), ("0", False), ("off", False)])
def test_bool_flags_accept_true_false_words(config_file, word, value):
    cfg = cli.parse_train_args(["--config", config_file, "--runtime.restart_sampler", word])
    assert cfg.runtime.restart_sampler is value
    cfg = cli.parse_train_args(["--config", config_file, f"--runtime.restart-sampler={word}"])
    assert cfg.runtime.restart_sampler is value


def test_bool_flag_alone_means_true_and_a_bad_word_is_refused(config_file, capsys):
    cfg = cli.parse_train_args(["--config", config_file, "--checkpoint.overwrite",
                                "--learner.lr", "1e-6"])
    assert cfg.checkpoint.overwrite is True and cfg.learner.lr == 1e-6
    for bad in (["--runtime.restart_sampler", "maybe"], ["--runtime.restart-sampler=2"]):
        with pytest.raises(SystemExit) as e:
            cli.parse_train_args(["--config", config_file, *bad])
        assert e.value.code == 2
        word = bad[-1].rsplit("=", 1)[-1]
        assert (f"{bad[0].split('=')[0]} takes true/false, 1/0, yes/no, on/off (any case), "
                f"got {word!r}") in capsys.readouterr().err


@pytest.mark.parametrize("word,value", [("false", False), ("OFF", False), ("true", True),
                                        ("1", True), ("None", None), ("none", None)])
def test_optional_bool_flags_take_the_same_words(config_file, word, value):
    """learner.packing is Optional[bool] (None: decided by the learner): it takes the words
    a plain bool flag takes, and none."""
    cfg = cli.parse_train_args(["--config", config_file, "--learner.packing", word])
    assert cfg.learner.packing is value
    cfg = cli.parse_train_args(["--config", config_file, f"--learner.scale-by-std={word}"])
    assert cfg.learner.scale_by_std is value


def test_none_is_only_a_word_for_optional_bool_flags(config_file, capsys):
    with pytest.raises(SystemExit):
        cli.parse_train_args(["--config", config_file, "--learner.dynamic-sampling", "none"])
    err = capsys.readouterr().err
    assert "got 'none'" in err and ", none" not in err    # the user's word, not 'None'
    with pytest.raises(SystemExit):
        cli.parse_train_args(["--config", config_file, "--learner.packing", "maybe"])
    assert "on/off, none (any case), got 'maybe'" in capsys.readouterr().err
