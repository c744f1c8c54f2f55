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
