#!/usr/bin/env bash
# The test command: sets up .venv with the test extra, then runs the whole CPU test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k losses).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
exec .venv/bin/python -m pytest tests "$@"
