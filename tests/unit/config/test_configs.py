"""Every experiment file in configs/ loads with rlflow.config.load_config_file and validates.

The folder is globbed: configs added by anyone are checked here. Reference configs that
point at a local Hugging Face folder read it from $RLFLOW_MODEL_PATH (an empty folder is
enough to validate; weights are only read at program start).
"""

import glob
import os

import pytest

from rlflow.console.cli import parse_train_args
from rlflow.config import ConfigError, ExperimentConfig, load_config_file
from rlflow.control.programs_common import config_from_dict, config_to_dict

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
REFERENCE = ["gsm8k_qwen2_5_0_5b.py", "gsm8k_qwen2_5_7b.py", "gsm8k_llama3_1_70b.py"]


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    folder = tmp_path / "hf-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")    # a model folder stand-in (no weights needed)
    monkeypatch.setenv("RLFLOW_MODEL_PATH", str(folder))
    return str(folder)


def test_the_reference_configs_are_there():
    names = {os.path.basename(p) for p in CONFIGS}
    assert set(REFERENCE) <= names, names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_validates_and_round_trips(path, model_dir):
    cfg = load_config_file(path)
    assert isinstance(cfg, ExperimentConfig)
    # what the TPU hosts do: resolve to JSON and rebuild (validation runs again)
    assert config_from_dict(ExperimentConfig, config_to_dict(cfg)) == cfg
    # and rlflow train's command-line overrides apply on top of the file
    over = parse_train_args(["--config", path, "--learner.lr", "3e-7", "--name", "override"])
    assert over.learner.lr == 3e-7 and over.name == "override"
    assert over.model == cfg.model


@pytest.mark.parametrize("name", REFERENCE)
def test_reference_config_uses_the_model_folder_and_names_a_missing_one(name, model_dir,
                                                                         monkeypatch, tmp_path):
    path = os.path.join(REPO, "configs", name)
    cfg = load_config_file(path)
    assert cfg.model.path == model_dir
    assert cfg.learner.mesh.num_devices == cfg.learner.num_devices
    assert cfg.sampler.mesh.num_devices == cfg.sampler.num_devices
    missing = str(tmp_path / "no-such-model")
    monkeypatch.setenv("RLFLOW_MODEL_PATH", missing)
    with pytest.raises(ConfigError, match=r"model\.path: .*no-such-model.*RLFLOW_MODEL_PATH"):
        load_config_file(path)


def test_smollm2_arith_never_trains_on_a_held_out_pair(tmp_path):
    """configs/smollm2_arith.py: the held-out sums are distinct unordered pairs that the
    training file holds in neither order; every answer is the sum."""
    import importlib.util
    import json
    import re

    spec = importlib.util.spec_from_file_location(
        "smollm2_arith", os.path.join(REPO, "configs", "smollm2_arith.py"))
    arith = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arith)
    lo, hi = arith.OPERANDS

    def pairs(path):
        out = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                a, b = (int(v) for v in re.fullmatch(
                    r"What is (\d+) \+ (\d+)\? Reply with the number only\.",
                    r["question"]).groups())
                assert r["answer"] == str(a + b) and lo <= a <= hi and lo <= b <= hi, r
                out.append(frozenset((a, b)))
        return out

    train, held = (pairs(p) for p in arith.data_paths(str(tmp_path)))
    assert len(train) == arith.ARITH_RECORDS
    assert len(held) == len(set(held)) == arith.HELD_OUT_PAIRS
    assert not set(train) & set(held)
    assert len(set(train)) > 100                        # the rest of the pairs are trained on
