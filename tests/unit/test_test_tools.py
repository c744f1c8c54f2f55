"""The suite's own tools: xdist grouping of files that share a session run
(tests/conftest.py) and the CPU-seconds profile (tests/cpu_profile.py)."""

import json
import os
import subprocess
import sys

import conftest
import cpu_profile


class _Item:
    def __init__(self, path, fixturenames):
        self.fspath, self.fixturenames = path, fixturenames


def test_files_sharing_a_session_run_are_one_group_and_others_their_own():
    items = [_Item("/t/a.py", ["two_learner_hosts"]), _Item("/t/a.py", ["tmp_path"]),
             _Item("/t/b.py", ["two_learner_hosts", "tmp_path"]), _Item("/t/c.py", []),
             _Item("/t/d.py", ["gsm8k_model"]), _Item("/t/e.py", ["gsm8k_model", "sync_run"]),
             _Item("/t/f.py", ["sync_run"])]
    groups = conftest.xdist_groups(items)
    assert groups["/t/a.py"] == groups["/t/b.py"] != groups["/t/c.py"] == "/t/c.py"
    assert groups["/t/d.py"] == groups["/t/e.py"] == groups["/t/f.py"]   # joined through e.py
    assert len({groups["/t/a.py"], groups["/t/c.py"], groups["/t/d.py"]}) == 3


def test_cpu_seconds_count_a_waited_for_child(tmp_path):
    before = cpu_profile.cpu_seconds()
    subprocess.run([sys.executable, "-c", "x = 0\nfor i in range(3_000_000): x += i"],
                   check=True, timeout=300)
    child = cpu_profile.cpu_seconds() - before
    assert child > 0.05                     # 3e6 interpreted additions: well over 50 ms


def test_merge_sums_files_over_dumps_and_later_dumps_win(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"tests": {"t/x.py::one": 1.0, "t/x.py::two": 2.0}}))
    b.write_text(json.dumps({"tests": {"t/x.py::two": 5.0, "t/y.py::three": 0.5}}))
    got = cpu_profile.merge([str(a), str(b)])
    assert got["files"] == {"t/x.py": 6.0, "t/y.py": 0.5}
    assert got["total_s"] == 6.5 and os.path.isfile(a)


def test_under_xdist_loadgroup_each_file_runs_on_one_worker(tmp_path):
    """``-n 2 --dist loadgroup`` with tests/conftest.py's hooks: every test of a file runs on
    the same worker (pytest 9 ignored pytest-xdist's own id suffix, and the files' tests
    were spread over the workers)."""
    (tmp_path / "suite_hooks.py").write_text(      # tests/conftest.py's hooks, as a plugin
        f"import runpy\nglobals().update(runpy.run_path({conftest.__file__!r}))\n")
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(
            "import os, pytest\n"
            "@pytest.mark.parametrize('i', range(6))\n"
            "def test_x(i):\n"
            f"    with open({str(tmp_path / name)!r} + '.' + os.environ['PYTEST_XDIST_WORKER'],"
            " 'a') as f:\n"
            "        f.write(str(i))\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                           "-p", "no:cacheprovider", "-p", "suite_hooks", str(tmp_path)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("a", "b"):
        ran = sorted(p.name for p in tmp_path.glob(f"{name}.gw*"))
        assert len(ran) == 1, (name, ran)                  # one worker ran all of the file
        assert sorted((tmp_path / ran[0]).read_text()) == list("012345")
