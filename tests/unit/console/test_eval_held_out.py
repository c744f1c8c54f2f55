"""`rlflow eval --run RUN --eval.path X` refuses the run's own training file under any other
spelling (a hard link, a symlink, a glob covering it), as `rlflow train` does before it
starts (issue 49 fault 3, a new user's report): exit 2, naming eval.path and the file.
The checkpoint reader is replaced by a stub: the check needs only the run's config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DEMO = os.path.join(REPO, "configs", "demo.py")


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run folder whose config.json trains on data/train.jsonl (evaluation off, as in a
    run without eval.every_steps), and a stubbed checkpoint reader."""
    from rlflow.config import load_config_file
    from rlflow.control.programs_common import save_config
    from rlflow.export import hf_folder

    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        with open(data / name, "w") as f:
            for i in range(3):
                f.write(json.dumps({"question": f"{name} {i}", "answer": str(i)}) + "\n")
    cfg = load_config_file(DEMO)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, source="jsonl", path=str(data / "train.jsonl")))
    run_dir = tmp_path / "runs" / "r1"
    save_config(cfg, str(run_dir / "config.json"))
    read = []

    def params_from_run(run, step, base_model=""):
        read.append(run)
        return SimpleNamespace(lora=None, base_model=cfg.model.path, params=None, step=2)

    monkeypatch.setattr(hf_folder, "params_from_run", params_from_run)
    return SimpleNamespace(dir=str(run_dir), data=data, read=read)


def test_eval_of_a_run_refuses_its_training_file_under_another_spelling(run, capsys):
    from rlflow.console import cli

    train = str(run.data / "train.jsonl")
    os.link(train, run.data / "linked.jsonl")
    os.symlink(train, run.data / "sym.jsonl")
    for spelling in (str(run.data / "linked.jsonl"), str(run.data / "sym.jsonl"),
                     str(run.data / "*.jsonl"), str(run.data / "t*n.jsonl")):
        status = cli.main(["eval", "--run", run.dir, "--eval.path", spelling])
        err = capsys.readouterr().err.splitlines()[-1]       # after the phase lines
        assert status == 2, (spelling, err)
        assert err.startswith(f"rlflow eval: eval.path: {spelling!r} reaches the training "
                              f"file "), (spelling, err)
        assert f"data.path={train!r}" in err and "held-out" in err, err


def test_eval_of_a_run_takes_a_file_that_is_not_trained_on(run):
    import argparse

    from rlflow.console.offline_eval import _config_and_params

    args = argparse.Namespace(run=run.dir, step=None, base_model="", config="",
                              model_path="")
    held = str(run.data / "test.jsonl")
    cfg, params, version = _config_and_params(args, ["--eval.path", held])
    assert cfg.eval.path == held and version == 2 and run.read == [run.dir]
