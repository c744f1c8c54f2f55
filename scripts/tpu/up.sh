#!/usr/bin/env bash
# One command from nothing to a running pair: create.sh, install.sh, then start.sh, all with
# the same flags (see docs/tpu.md). With --dry-run it prints every command of the three.
#   scripts/tpu/up.sh --zone us-west4-a --model-gcs gs://b/qwen --model-dir /home/me/qwen
#       --run-dir gs://b/runs [--spot] [--dry-run] [-- --learner.num_steps 500]
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$here/common.sh"
usage() { sed -n '2,5p' "${BASH_SOURCE[0]}"; usage_common; }
parse_flags "$@"
bash "$here/create.sh" "$@"
bash "$here/install.sh" "$@"
bash "$here/start.sh" "$@"
