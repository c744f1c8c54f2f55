#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs rlflow into it.
# Usage: scripts/setup_env.sh [extra]   (extra: "test" adds the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.rlflow-installed-${1:-runtime}"
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if [ -n "${1:-}" ]; then
    .venv/bin/python -m pip install -q -e ".[$1]"
  else
    .venv/bin/python -m pip install -q -e .
  fi
  touch "$stamp"
fi
