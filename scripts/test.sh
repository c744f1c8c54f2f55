#!/usr/bin/env bash
# The test command: sets up .venv with the test extra, then runs the whole CPU test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k losses).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
# Tests run on as many pytest-xdist workers as the machine has cores, at most 4
# (RLFLOW_TEST_WORKERS overrides; 0 runs them in this one process). Each file stays on one
# worker (tests/conftest.py groups them), so file- and session-scoped fixtures are built once.
workers="${RLFLOW_TEST_WORKERS:-$(python3 -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
exec .venv/bin/python -m pytest tests -n "$workers" --dist loadgroup "$@"
