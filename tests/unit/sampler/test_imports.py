"""Every rlflow module imports on its own in a fresh interpreter (no import cycle depends on
which module a user imports first)."""

import os
import pkgutil
import subprocess
import sys

import rlflow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

# Each module in its own interpreter, all in one child process: importing rlflow modules
# first drags in JAX etc., so a fresh `python -c` per module keeps each one isolated.
CHECK = """
import subprocess, sys
failed = []
for name in sys.argv[1:]:
    r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True,
                       text=True, env=dict(__import__("os").environ, JAX_PLATFORMS="cpu"))
    if r.returncode:
        failed.append(f"{name}: {r.stderr.strip().splitlines()[-1]}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""

# Entry points users import (the import-time cost is dominated by JAX; the rest imports the
# data side, where the cycle was).
ENTRY_POINTS = ["rlflow.data.rewarder", "rlflow.data.rewards", "rlflow.data.reward_workers",
                "rlflow.data.pipeline", "rlflow.system.plugins", "rlflow.config",
                "rlflow.console.cli",
                "rlflow.run.identity", "rlflow.launcher.run_watch", "rlflow.launcher.launch",
                "rlflow.launcher.supervisor", "rlflow.run.metrics", "rlflow.config.secrets",
                "rlflow.console.checks", "rlflow.launcher.progress"]


def test_entry_points_import_in_a_fresh_interpreter_each():
    names = {m.name for m in pkgutil.walk_packages(rlflow.__path__, "rlflow.")}
    assert set(ENTRY_POINTS) <= names
    r = subprocess.run([sys.executable, "-c", CHECK] + ENTRY_POINTS, cwd=REPO,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_sampler_program_imports_without_tensorflow():
    """JetStream's engine_api imports token_utils -> seqio -> TensorFlow (~6.5 s of CPU per
    sampler start) for a default method rlflow overrides; rlflow.sampler.jetstream_api loads
    token_utils lazily, so the sampler program never imports TensorFlow, not even when
    something probes every module the way ``inspect.stack()`` does (importing torch does)."""
    code = ("import inspect, sys, rlflow.sampler.program\n"
            "from rlflow.sampler.jetstream_api import engine_api\n"
            "assert issubclass(engine_api.Engine, object)\n"
            "inspect.stack()\n"
            "print(sorted(m for m in ('tensorflow', 'seqio') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_lazy_import_runs_the_module_on_first_attribute_read(tmp_path, monkeypatch):
    from rlflow.sampler.jetstream_api import lazy_import

    pkg = tmp_path / "lazypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "heavy.py").write_text("import builtins\nbuiltins.LAZY_RAN = True\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazypkg.heavy", raising=False)
    import builtins

    monkeypatch.setattr(builtins, "LAZY_RAN", False, raising=False)
    module = lazy_import("lazypkg.heavy")
    from lazypkg import heavy                # found on the package: still not run
    assert heavy is module and builtins.LAZY_RAN is False
    # dunder probes (inspect.getmodule reads __file__ of every module) do not run it either
    assert heavy.__file__ == str(pkg / "heavy.py") and not hasattr(heavy, "__wrapped__")
    assert builtins.LAZY_RAN is False
    assert heavy.VALUE == 7 and builtins.LAZY_RAN is True
    assert not hasattr(heavy, "__getattr__")        # the loaded module is the plain one
    assert lazy_import("lazypkg.heavy") is module
    monkeypatch.delitem(sys.modules, "lazypkg.heavy")
    monkeypatch.delitem(sys.modules, "lazypkg")
