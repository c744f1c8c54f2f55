"""Issue 14 item 11: an export keeps the source folder's generation settings and the
config.json values rlflow does not own (a scalar ``eos_token_id`` stays a scalar)."""

import json
import os

import numpy as np
import pytest
import torch

from hf_fixtures import add_generation_settings, make_tiny_hf_model
from rlflow.console import cli
from rlflow.models.hf_settings import OWNED_CONFIG_KEYS, merge_config

TOKENS = torch.tensor([[1, 17, 200, 31, 4, 99, 250, 8]], dtype=torch.long)


def _json(path):
    with open(path) as f:
        return json.load(f)


def _logits(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits[0].numpy()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The issue's folder: config.json eos_token_id 2 (a scalar), generation_config.json with
    sampling settings and eos [2, 1]; plus config values rlflow has no field for."""
    src = make_tiny_hf_model("llama", str(tmp_path_factory.mktemp("src")))
    cfg = _json(os.path.join(src, "config.json"))
    cfg.update(eos_token_id=2, initializer_range=0.037, my_custom_key={"a": [1, 2]},
               use_cache=False)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = add_generation_settings(src, eos_token_id=[2, 1], pad_token_id=0, max_new_tokens=77)
    return src, cfg, gen


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_export_keeps_generation_settings_and_foreign_config_values(source, tmp_path, capsys,
                                                                     dtype):
    src, cfg_in, gen_in = source
    out = str(tmp_path / "out")
    args = ["export", "--model-path", src, "--out", out] + (["--dtype", dtype] if dtype else [])
    assert cli.main(args) == 0, capsys.readouterr()
    gen_out = _json(os.path.join(out, "generation_config.json"))
    assert gen_out == gen_in                     # every setting, the EOS list included
    cfg_out = _json(os.path.join(out, "config.json"))
    assert cfg_out["eos_token_id"] == 2          # not rlflow's merged [2, 1]
    assert cfg_out["initializer_range"] == 0.037 and cfg_out["my_custom_key"] == {"a": [1, 2]}
    assert cfg_out["use_cache"] is False
    assert cfg_out["torch_dtype"] == (dtype or "float32")
    for key in set(cfg_in) - OWNED_CONFIG_KEYS - {"dtype"}:
        assert cfg_out[key] == cfg_in[key], key
    if "dtype" in cfg_in:                        # transformers >= 4.56 writes "dtype"
        assert cfg_out["dtype"] == (dtype or "float32")

    from transformers import AutoConfig, GenerationConfig

    g = GenerationConfig.from_pretrained(out)
    assert (g.do_sample, g.temperature, g.top_p, g.top_k, g.repetition_penalty) == \
        (True, 0.7, 0.9, 20, 1.05)
    assert AutoConfig.from_pretrained(out).eos_token_id == 2
    if dtype is None:
        # float32 weights copied bit for bit: transformers computes the same logits exactly
        np.testing.assert_array_equal(_logits(out), _logits(src))


def test_merge_config_owned_keys_are_rlflows_the_rest_the_sources():
    ours = {"hidden_size": 64, "torch_dtype": "bfloat16", "eos_token_id": [2, 1],
            "use_cache": True, "rope_parameters": {"rope_type": "default"}}
    src = {"hidden_size": 32, "torch_dtype": "float32", "dtype": "float32", "eos_token_id": 2,
           "use_cache": False, "custom": 5}
    got = merge_config(ours, src)
    assert got == {"hidden_size": 64, "torch_dtype": "bfloat16", "dtype": "bfloat16",
                   "eos_token_id": 2, "use_cache": False, "custom": 5,
                   "rope_parameters": {"rope_type": "default"}}
    assert merge_config(ours, None) == ours


def test_without_source_generation_config_rlflow_writes_its_ids(source, tmp_path, capsys):
    src, _, _ = source
    bare = str(tmp_path / "bare")
    import shutil
    shutil.copytree(src, bare)
    os.remove(os.path.join(bare, "generation_config.json"))
    out = str(tmp_path / "out")
    assert cli.main(["export", "--model-path", bare, "--out", out]) == 0, capsys.readouterr()
    gen = _json(os.path.join(out, "generation_config.json"))
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 0 and "temperature" not in gen
