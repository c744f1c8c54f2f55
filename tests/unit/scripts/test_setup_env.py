"""scripts/find_python.sh (used by scripts/setup_env.sh): the first Python >= 3.12 on PATH
(python3.12, python3.13, python3), else in pyenv's installed versions, else one line saying
what to install and exit 2; a candidate counts only when it runs and reports >= 3.12 (a pyenv
shim for an unselected version fails). Fake interpreters in fake PATH / pyenv folders; and
setup_env.sh refuses an unknown RLFLOW_JAX before it builds anything."""

import os
import shutil
import subprocess

import pytest

from repo_paths import REPO

FIND = os.path.join(REPO, "scripts", "find_python.sh")
SETUP = os.path.join(REPO, "scripts", "setup_env.sh")


def fake_python(path, version: str | None):
    """An executable that answers the version check like Python ``version`` ("3.11.7"), or
    fails like a pyenv shim whose version is not selected (``None``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if version is None:
        body = 'echo "pyenv: python3.12: command not found" >&2\nexit 127\n'
    else:
        major, minor = (int(x) for x in version.split(".")[:2])
        body = f'[ "{(major, minor) >= (3, 12)}" = True ] && exit 0 || exit 1\n'
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, 0o755)
    return str(path)


def run_find(tmp_path, path_dirs, home=None, pyenv_root=None):
    bin_ = tmp_path / "sysbin"            # the shell and tools the script needs, nothing else
    bin_.mkdir(exist_ok=True)
    for tool in ("bash", "sh", "ls", "grep", "sort", "cat"):
        if not (bin_ / tool).exists():
            os.symlink(shutil.which(tool), bin_ / tool)
    env = {"PATH": os.pathsep.join([*map(str, path_dirs), str(bin_)]),
           "HOME": str(home or tmp_path / "home")}
    if pyenv_root is not None:
        env["PYENV_ROOT"] = str(pyenv_root)
    return subprocess.run([str(bin_ / "bash"), FIND], env=env, capture_output=True, text=True,
                          timeout=60)


def test_python312_on_path_wins_over_an_older_python3(tmp_path):
    d = tmp_path / "path"
    fake_python(d / "python3", "3.11.7")
    want = fake_python(d / "python3.12", "3.12.1")
    r = run_find(tmp_path, [d])
    assert (r.returncode, r.stdout.strip()) == (0, want), r.stderr


def test_a_python3_of_313_on_path_is_taken(tmp_path):
    d = tmp_path / "path"
    want = fake_python(d / "python3", "3.13.0")
    r = run_find(tmp_path, [d])
    assert (r.returncode, r.stdout.strip()) == (0, want), r.stderr


def test_unselected_pyenv_shims_are_skipped_for_pyenvs_installed_312(tmp_path):
    """PATH: failing shims python3.12 / python3.13 and a python3 of 3.11 (this machine's
    pyenv set-up); ~/.pyenv/versions holds 3.11.7, 3.12.1 and 3.13.0: the oldest >= 3.12."""
    shims = tmp_path / "shims"
    fake_python(shims / "python3.12", None)
    fake_python(shims / "python3.13", None)
    fake_python(shims / "python3", "3.11.7")
    home = tmp_path / "home"
    versions = home / ".pyenv" / "versions"
    for v in ("3.11.7", "3.12.1", "3.13.0"):
        fake_python(versions / v / "bin" / "python3", v)
    os.makedirs(versions / "miniconda3-latest" / "bin")
    r = run_find(tmp_path, [shims], home=home)
    assert (r.returncode, r.stdout.strip()) == (0, str(versions / "3.12.1" / "bin" / "python3")), \
        r.stderr


def test_pyenv_root_from_the_environment(tmp_path):
    root = tmp_path / "elsewhere"
    want = fake_python(root / "versions" / "3.12.9" / "bin" / "python3", "3.12.9")
    r = run_find(tmp_path, [], pyenv_root=root)
    assert (r.returncode, r.stdout.strip()) == (0, want), r.stderr


def test_no_python_312_anywhere_is_one_line_and_exit_2(tmp_path):
    d = tmp_path / "path"
    fake_python(d / "python3", "3.11.7")
    fake_python(tmp_path / "home" / ".pyenv" / "versions" / "3.10.13" / "bin" / "python3",
                "3.10.13")
    r = run_find(tmp_path, [d])
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Python >= 3.12" in lines[0] and "install python3.12" in lines[0]


@pytest.mark.parametrize("value", ["gpu", "cuda12"])
def test_setup_env_refuses_an_unknown_jax_build(tmp_path, value):
    r = subprocess.run(["bash", SETUP], env={**os.environ, "RLFLOW_JAX": value},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 64
    assert f"RLFLOW_JAX='{value}' (expected cpu, tpu or cuda)" in r.stderr


def test_setup_env_refuses_an_old_venv_and_says_what_to_do(tmp_path):
    """A repository copy whose .venv is Python 3.11: one line naming the version and the
    fix, exit 2, nothing installed."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SETUP, repo / "scripts" / "setup_env.sh")
    fake = repo / ".venv" / "bin" / "python"
    os.makedirs(fake.parent)
    fake.write_text('#!/bin/sh\ncase "$2" in *print*) echo 3.11 ;; *) exit 1 ;; esac\n')
    fake.chmod(0o755)
    r = subprocess.run(["bash", str(repo / "scripts" / "setup_env.sh"), "test"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("setup_env.sh: .venv is Python 3.11, rlflow needs >= 3.12: "
                                "remove it (rm -rf .venv) and run this again")
