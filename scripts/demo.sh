#!/usr/bin/env bash
# The main job: sets up .venv, then runs `rlflow train` on the built-in default config.
# Extra arguments go to `rlflow train` (e.g. scripts/demo.sh --learner.num-steps 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/rlflow train "$@"
