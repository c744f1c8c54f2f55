"""The suite runs from any environment with the test extra installed, not only the
repository's own ``.venv`` (a venv elsewhere, conda, a container).

A part of the suite is copied into a checkout without ``.venv`` and run by the Python of a
virtual environment created outside it. That environment sees this one's packages (a
``site.addsitedir`` line: what ``pip install -e ".[test]"`` would have installed) and holds
the test extra's console scripts in its own ``bin`` (as pip puts them there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TEST_EXTRA_TOOLS = ("shellcheck",)


def _tool(name):
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


@pytest.mark.slow
def test_suite_part_passes_from_a_venv_outside_the_repository(tmp_path):
    checkout = tmp_path / "checkout"                    # no .venv in it
    shutil.copytree(os.path.join(REPO, "scripts"), checkout / "scripts")
    shutil.copytree(os.path.join(REPO, "configs"), checkout / "configs")   # the slice check's
    parts = ("tests/conftest.py", "tests/tpu_slices.py", "tests/unit/scripts/test_tpu_scripts.py",
             "tests/unit/launcher/test_progress.py")
    for rel in parts:
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(REPO, rel), checkout / rel)
    shutil.copy(os.path.join(REPO, "pytest.ini"), checkout / "pytest.ini")
    assert not (checkout / ".venv").exists()

    env_dir = tmp_path / "elsewhere" / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True,
                   timeout=300)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], check=True,
                             capture_output=True, text=True, timeout=60).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(purelib, "_outer_env.pth"), "w") as f:
        f.write("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in sorted(ours))
                + "\n")
    for name in TEST_EXTRA_TOOLS:                      # console scripts live beside python
        src = _tool(name)
        assert src, f"{name} (test extra) is not installed in this environment"
        os.symlink(os.path.realpath(src), env_dir / "bin" / name)

    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if not os.path.realpath(p).startswith(os.path.realpath(REPO))
                           and not os.path.isfile(os.path.join(p, "shellcheck")))
    # the environment is active, as a user's is: its python3 first on PATH (the TPU scripts'
    # slice check runs rlflow with it, scripts/tpu/common.sh local_python)
    path = os.pathsep.join([str(env_dir / "bin"), path])
    env = dict(os.environ, PATH=path, PYTHONPATH=REPO)  # rlflow itself: this checkout
    env.pop("VIRTUAL_ENV", None)
    env.pop("RLFLOW_TEST_CPU_JSON", None)   # this session's profile: its plugin is not copied
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(p for p in parts if os.path.basename(p).startswith("test_")),
                           "-k", "shellcheck or start or eta or plain"],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout
