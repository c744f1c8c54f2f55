#!/usr/bin/env bash
# The test command: sets up .venv with the test extra, then runs the CPU test suite.
#   scripts/test.sh            both tiers (what .ci/run runs)
#   scripts/test.sh --unit     the unit tier, tests/unit/<package>/ (no `rlflow train` processes)
#   scripts/test.sh --e2e      the end-to-end tier, tests/e2e/ (real runs, fault injection)
# Other arguments go to pytest (e.g. scripts/test.sh --unit -k losses).
set -euo pipefail
cd "$(dirname "$0")/.."
paths=()
args=()
for a in "$@"; do
  case "$a" in
    --unit) paths+=(tests/unit) ;;
    --e2e) paths+=(tests/e2e) ;;
    *) args+=("$a") ;;
  esac
done
[ ${#paths[@]} -gt 0 ] || paths=(tests)
bash scripts/setup_env.sh test
# Tests run on as many pytest-xdist workers as the machine has cores, at most 4
# (RLFLOW_TEST_WORKERS overrides; 0 runs them in this one process). Each file stays on one
# worker (tests/conftest.py groups them), so file- and session-scoped fixtures are built once.
workers="${RLFLOW_TEST_WORKERS:-$(python3 -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
exec .venv/bin/python -m pytest "${paths[@]}" -n "$workers" --dist loadgroup ${args[@]+"${args[@]}"}
