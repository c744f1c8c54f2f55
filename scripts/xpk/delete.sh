#!/usr/bin/env bash
# Delete the learner and/or sampler workloads (--role learner|sampler|both).
#   scripts/xpk/delete.sh --cluster c1 --zone us-east5-a [--role sampler] [--dry-run]
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
usage() { sed -n '2,3p' "${BASH_SOURCE[0]}"; usage_xpk; }
parse_xpk_flags "$@"
for workload in $(selected_nodes); do
  run "$XPK" workload delete "${XPK_COMMON[@]}" --workload="$workload"
done
