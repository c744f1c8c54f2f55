"""CPU seconds per test and per test file: a pytest plugin for sizing the suite.

Wall time on a shared machine says little about what a test costs; CPU seconds do. With
``RLFLOW_TEST_CPU_JSON=<path>`` set, tests/conftest.py loads this plugin and each test's
setup + call + teardown is charged the user + system CPU seconds of this process and of its
waited-for children (``resource.getrusage(RUSAGE_SELF)`` + ``RUSAGE_CHILDREN``; a child
process a test starts counts once it has been waited for, as ``subprocess.run`` and
``Popen.wait`` do). Module- and session-scoped fixtures are charged to the first test that
builds them, so per-file totals include them.

The JSON (rewritten after every test, so an interrupted run keeps what it measured) is
``{"tests": {nodeid: cpu_s}, "files": {path: cpu_s}, "total_s": float}``; under
pytest-xdist each worker writes ``<path>.<worker id>`` and ``python tests/cpu_profile.py
<path>...`` merges files and prints the ranking.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import pytest


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children (float, s)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


class CpuProfile:
    def __init__(self, path: str):
        self.path = path
        self.tests: dict[str, float] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        start = cpu_seconds()
        yield
        self.tests[item.nodeid] = self.tests.get(item.nodeid, 0.0) + cpu_seconds() - start
        self._dump()

    def _dump(self):
        files: dict[str, float] = {}
        for nodeid, s in self.tests.items():
            f = nodeid.split("::", 1)[0]
            files[f] = files.get(f, 0.0) + s
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"tests": self.tests, "files": files,
                       "total_s": sum(self.tests.values())}, f, indent=1)
        os.replace(tmp, self.path)


def register(config):
    """Load the plugin when ``RLFLOW_TEST_CPU_JSON`` names an output file."""
    path = os.environ.get("RLFLOW_TEST_CPU_JSON")
    if not path:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        path = f"{path}.{worker}"
    config.pluginmanager.register(CpuProfile(os.path.abspath(path)), "rlflow-cpu-profile")


def merge(paths):
    """Merged ``{"tests", "files", "total_s"}`` of several dumps (later ones win per test)."""
    tests: dict[str, float] = {}
    for p in paths:
        with open(p, encoding="utf-8") as f:
            tests.update(json.load(f)["tests"])
    files: dict[str, float] = {}
    for nodeid, s in tests.items():
        f = nodeid.split("::", 1)[0]
        files[f] = files.get(f, 0.0) + s
    return {"tests": tests, "files": files, "total_s": sum(tests.values())}


if __name__ == "__main__":
    data = merge(sys.argv[1:])
    ranked = sorted(data["files"].items(), key=lambda kv: -kv[1])
    for f, s in ranked:
        print(f"{s:9.1f} s  {f}")
    print(f"{data['total_s']:9.1f} s  total CPU over {len(data['tests'])} tests, "
          f"{len(data['files'])} files")
