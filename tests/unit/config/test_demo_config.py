"""configs/demo.py (the default of `rlflow train`): a local HF model folder that transformers
reads, with the task's tokenizer, built once into the cache folder."""

import json
import os

from rlflow.config import load_config_file, replace
from rlflow.models.lora import LoraSpec

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DEMO = os.path.join(REPO, "configs", "demo.py")


def test_demo_builds_a_transformers_readable_model_with_its_tokenizer(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path))
    cfg = load_config_file(DEMO)
    path = cfg.model.path
    assert os.path.dirname(path) == str(tmp_path)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".demo-model-")]  # tidied
    tok = AutoTokenizer.from_pretrained(path)
    hf_cfg = json.load(open(os.path.join(path, "config.json")))
    assert hf_cfg["vocab_size"] == len(tok)
    assert hf_cfg["eos_token_id"] in (tok.eos_token_id, [tok.eos_token_id])
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok("7>", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()
    # built once: loading the config again reuses the folder
    mtime = os.path.getmtime(os.path.join(path, "config.json"))
    assert load_config_file(DEMO).model.path == path
    assert os.path.getmtime(os.path.join(path, "config.json")) == mtime
    assert cfg.runtime.mode == "async" and cfg.data.source == "builtin"
    # the LoRA demo (--learner.lora.rank 8) resolves: adapters + the trained embedding and
    # final norm, at learner.lr (configs/demo.py)
    lora = replace(cfg, learner=replace(cfg.learner, lora=replace(cfg.learner.lora, rank=8)))
    spec = LoraSpec.from_config(lora.learner.lora)
    assert spec.rank == 8 and len(spec.projections) == 7
    assert spec.full_modules() == ("final_norm", "embed", "lm_head")
    assert lora.learner.lora.lr is None and not cfg.learner.lora.enabled


def test_an_unwritable_cache_folder_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """RLFLOW_CACHE_DIR under a file (as a read-only folder, which root ignores): rlflow train
    exits 2 naming the folder and the variable, no traceback."""
    from rlflow.console import cli

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "file" / "cache"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--learner.num-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlflow train: cannot write the demo model to {tmp_path}/file/cache "
                          f"(Not a directory); set RLFLOW_CACHE_DIR to a writable folder")
    assert "Traceback" not in err
