"""``rlflow export --run``: a trained policy's checkpoint leaves rlflow as a Hugging Face folder.

A tiny random HF model (``tests/hf_fixtures.py``) gets a tokenizer, is loaded with ``load_hf``
onto a 2 x 2 (fsdp x tensor) mesh of the fake CPU devices, takes 2 AdamW steps (the learner's
optimiser) on a toy next-token loss and is checkpointed after each step the way the learner
program does it (``rlflow/learner/program.py``: same items, run metadata with the resolved
config). The export goes through ``rlflow.console.cli.main`` and is loaded by ``transformers``.
"""

from __future__ import annotations

import json
import os
import shutil
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from safetensors import safe_open

from hf_fixtures import LLAMA3_ROPE, add_generation_settings, make_tiny_hf_model
from rlflow import checkpoint as ckpt_lib
from rlflow.console import cli
from rlflow.config import (CheckpointConfig, ExperimentConfig, LearnerConfig, MeshConfig,
                           ModelConfig)
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.learner.optimizer import make_optimizer
from rlflow.learner.step import init_state, state_shardings
from rlflow.mesh import make_mesh
from rlflow.models import load_hf
from tolerances import forward_atol

TOKENS = np.array([[1, 17, 200, 31, 4, 99, 250, 8, 64, 128, 5, 77]], np.int32)   # [1, 12]
MESH = MeshConfig(fsdp=2, tensor=2)


def _rlflow_logits(graphdef, params) -> np.ndarray:
    """Logits float32 [T, V] of ``TOKENS[0]`` under ``params`` (rlflow's decoder)."""
    model = nnx.merge(graphdef, jax.device_get(params))
    t = TOKENS.shape[1]
    return np.asarray(model(jnp.asarray(TOKENS), jnp.arange(t, dtype=jnp.int32)[None],
                            jnp.ones((1, t), bool)))[0]


def _hf_logits(path: str) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits[0].numpy()


def _atol(t, logits) -> float:
    """rlflow vs transformers logits of the base architecture (tests/tolerances.py)."""
    from rlflow.models.hf import read_decoder_config
    return forward_atol(read_decoder_config(t["base"]), TOKENS.shape[1],
                        float(np.abs(logits).max()))


def _experiment(run_dir: str, base: str) -> ExperimentConfig:
    return ExperimentConfig(
        name="run", run_dir=run_dir, model=ModelConfig(path=base),
        learner=LearnerConfig(lr=1e-2, num_steps=2, num_devices=MESH.num_devices, mesh=MESH),
        checkpoint=CheckpointConfig(every_steps=1, keep_last=5))


def _save(checkpointer, step, params, opt_state, cfg, mesh, *, final=False):
    """``LearnerProgram._checkpoint``: the items and metadata the learner program saves."""
    ck = ckpt_lib.LearnerCheckpoint(
        step=step, params=params, opt_state=opt_state, data_state={"next_index": 2 * step},
        extra={"accepted_groups": 2 * step}, metadata=ckpt_lib.run_metadata(cfg, mesh))
    metrics = {"loss": 1.0}
    if final:
        checkpointer.save_final(ck, metrics=metrics)
    else:
        assert checkpointer.save(ck, metrics=metrics)


def _train_and_checkpoint(root: str, family: str, tie: bool) -> dict:
    """Base folder + a run folder with checkpoints after step 1 and step 2."""
    base = make_tiny_hf_model(family, os.path.join(root, "base"), tie=tie)
    build_char_tokenizer("0123456789+=", base)            # tokenizer files of the base model
    generation = add_generation_settings(base)             # sampling settings to carry through
    cfg = _experiment(os.path.join(root, "runs"), base)
    mesh = make_mesh(MESH, jax.devices()[:MESH.num_devices])
    model, _ = load_hf(base, mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    tx, _ = make_optimizer(cfg.learner)
    state = init_state(params, tx, mesh)
    tokens = jnp.asarray(TOKENS)
    positions = jnp.arange(TOKENS.shape[1], dtype=jnp.int32)[None]
    mask = jnp.ones(TOKENS.shape, bool)

    def loss_fn(p):                                        # toy loss: next-token NLL
        logits = nnx.merge(graphdef, p)(tokens, positions, mask)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    shardings = state_shardings(params, tx, mesh)     # the learner's layout, kept across steps

    @partial(jax.jit, out_shardings=(shardings.params, shardings.opt_state))
    def step(p, opt_state):
        grads = jax.grad(loss_fn)(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    snapshots = {0: jax.device_get(params)}
    params, opt_state = state.params, state.opt_state
    with ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(cfg.run_path), cfg.checkpoint) as ck:
        for s in (1, 2):
            params, opt_state = step(params, opt_state)
            snapshots[s] = jax.device_get(params)
            _save(ck, s, params, opt_state, cfg, mesh, final=s == 2)
        assert ck.all_steps() == [1, 2]
    assert int(opt_state[1][0].count) == 2
    return {"base": base, "run": cfg.run_path, "graphdef": graphdef, "params": snapshots,
            "cfg": cfg, "generation": generation}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cache = {}

    def get(family, tie):
        if (family, tie) not in cache:
            root = str(tmp_path_factory.mktemp(f"{family}_{tie}"))
            cache[family, tie] = _train_and_checkpoint(root, family, tie)
        return cache[family, tie]
    return get


def _export(args, capsys) -> tuple[int, str]:
    rc = cli.main(["export", *args])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def _json(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen2", True)])
def test_export_of_trained_run_loads_in_transformers_with_equal_logits(trained, tmp_path,
                                                                       capsys, family, tie):
    from transformers import AutoConfig

    t = trained(family, tie)
    out = str(tmp_path / "export")
    rc, text = _export(["--run", t["run"], "--out", out], capsys)
    assert rc == 0, text
    assert f"wrote {family} model to {out}" in text

    ours = _rlflow_logits(t["graphdef"], t["params"][2])       # latest step by default
    exported, base = _hf_logits(out), _hf_logits(t["base"])
    np.testing.assert_allclose(exported, ours, atol=_atol(t, ours), rtol=0)
    # the trained weights were exported, not the base model's
    base_ours = _rlflow_logits(t["graphdef"], t["params"][0])
    np.testing.assert_allclose(base, base_ours, atol=_atol(t, base_ours), rtol=0)
    assert np.abs(exported - base).max() > 1e-2

    cfg_out, cfg_base = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(t["base"])
    assert cfg_out.rope_parameters == cfg_base.rope_parameters
    assert cfg_out.tie_word_embeddings is cfg_base.tie_word_embeddings is tie
    assert cfg_out.eos_token_id == cfg_base.eos_token_id == [2, 3]
    raw = _json(os.path.join(out, "config.json"))
    assert raw["rope_theta"] == cfg_base.rope_parameters["rope_theta"]
    assert raw["tie_word_embeddings"] is tie and raw["torch_dtype"] == "float32"
    if family == "llama":
        assert raw["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    else:
        assert raw["rope_scaling"] is None
    # the base model's generation settings carry through unchanged (issue 14 item 11)
    gen = _json(os.path.join(out, "generation_config.json"))
    assert gen == t["generation"] and gen["eos_token_id"] == [2, 3] and gen["top_k"] == 20
    with safe_open(os.path.join(out, "model.safetensors"), framework="numpy") as f:
        assert ("lm_head.weight" in f.keys()) is (not tie)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(out, name)) as a, open(os.path.join(t["base"], name)) as b:
            assert a.read() == b.read()
    # every file readable as any file this process writes (safetensors' writer made 0600)
    modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
    assert set(modes.values()) == {modes["config.json"]}, modes


def test_step_flag_picks_that_checkpoint(trained, tmp_path, capsys):
    t = trained("llama", False)
    out = str(tmp_path / "step1")
    rc, text = _export(["--run", t["run"], "--step", "1", "--out", out], capsys)
    assert rc == 0, text
    exported = _hf_logits(out)
    ours = _rlflow_logits(t["graphdef"], t["params"][1])
    np.testing.assert_allclose(exported, ours, atol=_atol(t, ours), rtol=0)
    assert np.abs(exported - _rlflow_logits(t["graphdef"], t["params"][2])).max() > 1e-3


def test_dtype_bfloat16_writes_bf16_weights_of_the_checkpoint(trained, tmp_path, capsys):
    t = trained("qwen2", True)
    out = str(tmp_path / "bf16")
    rc, text = _export(["--run", t["run"], "--out", out, "--dtype", "bfloat16"], capsys)
    assert rc == 0, text
    assert _json(os.path.join(out, "config.json"))["torch_dtype"] == "bfloat16"
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        embed = f.get_tensor("model.embed_tokens.weight").float().numpy()
    trained_embed = np.asarray(t["params"][2]["embed"][...], np.float32)
    expected = trained_embed.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(embed, expected)
    assert not np.array_equal(embed, np.asarray(t["params"][0]["embed"][...], np.float32)
                              .astype(ml_dtypes.bfloat16).astype(np.float32))


# ------------------------------------------------------------------------------ errors
def test_run_folder_without_checkpoints(tmp_path, capsys):
    rc, text = _export(["--run", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "nope: not a folder" in text
    (tmp_path / "empty").mkdir()
    rc, text = _export(["--run", str(tmp_path / "empty"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "no complete checkpoint in" in text
    assert os.path.join(str(tmp_path / "empty"), "checkpoints") in text
    (tmp_path / "empty" / "checkpoints").mkdir()
    rc, text = _export(["--run", str(tmp_path / "empty"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "no complete checkpoint in" in text
    rc, text = _export(["--model-path", str(tmp_path), "--base-model", str(tmp_path),
                        "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "--base-model needs --run" in text
    assert not os.path.exists(tmp_path / "o")


def test_out_that_is_a_file_or_a_run_folder_is_refused_untouched(tmp_path, capsys):
    """``--out`` a file, or a run folder (its config.json would be replaced by the model's):
    exit 2 naming it, before anything is read or written."""
    (tmp_path / "empty").mkdir()
    a_file = tmp_path / "weights.bin"
    a_file.write_text("x")
    rc, text = _export(["--run", str(tmp_path / "empty"), "--out", str(a_file)], capsys)
    assert rc == 2 and f"--out {a_file} is a file" in text and "Traceback" not in text
    assert a_file.read_text() == "x"
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"run_id": "r"}')
    (run / "config.json").write_text('{"name": "the run\'s config"}')
    rc, text = _export(["--run", str(run), "--out", str(run)], capsys)
    assert rc == 2 and f"--out {run} is a run folder" in text
    assert (run / "config.json").read_text() == '{"name": "the run\'s config"}'
    assert sorted(os.listdir(run)) == ["config.json", "run.json"]


def test_unknown_step_lists_the_available_steps(trained, tmp_path, capsys):
    t = trained("llama", False)
    rc, text = _export(["--run", t["run"], "--step", "7", "--out", str(tmp_path / "o")], capsys)
    assert rc == 2
    assert "--step 7" in text and "available steps: [1, 2]" in text
    rc, text = _export(["--run", t["run"], "--out", t["base"]], capsys)
    assert rc == 2 and "--out must differ from the run's base model folder" in text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's loop
def test_a_damaged_checkpoint_is_named_with_the_step_to_export_instead(trained, tmp_path,
                                                                         capfd):
    """Its files altered on disk: one line naming the step folder, the file and the earlier
    step (not "do not match the base model", nor resume advice, nor the hundreds of lines
    of closed-event-loop tracebacks the failed read leaves behind)."""
    import glob
    import subprocess
    import sys

    t = trained("llama", False)
    run = str(tmp_path / "run")
    shutil.copytree(t["run"], run)
    for path in glob.glob(os.path.join(run, "checkpoints", "2", "params", "**", "d", "*"),
                          recursive=True):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
    rc = cli.main(["export", "--run", run, "--base-model", t["base"], "--out",
                   str(tmp_path / "o")])
    err = capfd.readouterr().err
    assert rc == 2
    assert f"{run}/checkpoints/2: checkpoint step 2 cannot be read (" in err
    assert "its files are damaged: export an earlier one with --step 1" in err
    assert "do not match the base model" not in err and "rerun" not in err
    assert not os.path.exists(tmp_path / "o")
    # the console script: that one line and nothing else
    proc = subprocess.run([sys.executable, "-m", "rlflow.console.cli", "export", "--run", run,
                           "--base-model", t["base"], "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("rlflow export: ") and proc.stderr.count("\n") == 1, \
        proc.stderr[:3000]
    rc = cli.main(["export", "--run", run, "--base-model", t["base"], "--step", "1",
                   "--out", str(tmp_path / "o1")])
    assert rc == 0, capfd.readouterr().err          # the earlier step still exports


def _edited_base(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    raw = _json(path)
    raw.update(changes)
    with open(path, "w") as f:
        json.dump(raw, f)
    return dst


def test_params_that_do_not_match_the_base_config_name_the_tensor(trained, tmp_path, capsys):
    t = trained("qwen2", True)
    wider = _edited_base(t["base"], str(tmp_path / "wider"), intermediate_size=128)
    rc, text = _export(["--run", t["run"], "--base-model", wider, "--out",
                        str(tmp_path / "o")], capsys)
    assert rc == 2 and "do not match the base model" in text
    # the layers are stored stacked: [L, F, E]
    assert "layers/mlp/down_kernel" in text and "(2, 96, 64)" in text and "(2, 128, 64)" in text
    untied = _edited_base(t["base"], str(tmp_path / "untied"), tie_word_embeddings=False)
    rc, text = _export(["--run", t["run"], "--base-model", untied, "--out",
                        str(tmp_path / "o")], capsys)
    assert rc == 2 and "lm_head" in text
    assert not os.path.exists(tmp_path / "o")


def test_missing_base_folder_asks_for_base_model(trained, tmp_path, capsys):
    t = trained("qwen2", True)
    moved = str(tmp_path / "moved_base")
    shutil.copytree(t["base"], moved)
    cfg = _experiment(str(tmp_path / "runs"), moved)
    params = t["params"][2]
    with ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(cfg.run_path), cfg.checkpoint) as ck:
        _save(ck, 2, params, None, cfg, None, final=True)
    shutil.rmtree(moved)
    out = str(tmp_path / "o")
    rc, text = _export(["--run", cfg.run_path, "--out", out], capsys)
    assert rc == 2 and f"model.path={moved!r}" in text and "--base-model" in text
    # the override finds the architecture and tokenizer elsewhere
    rc, text = _export(["--run", cfg.run_path, "--base-model", t["base"], "--out", out], capsys)
    assert rc == 0, text
    ours = _rlflow_logits(t["graphdef"], params)
    np.testing.assert_allclose(_hf_logits(out), ours, atol=_atol(t, ours), rtol=0)
