#!/usr/bin/env bash
# Stop the programs on every host: the sampler slice first, then the learner slice (SIGTERM;
# the learner writes its exit checkpoint; SIGKILL after a grace period). The slices stay.
#   scripts/tpu/stop.sh --zone us-west4-a [--role learner|sampler|both] [--dry-run]
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
usage() { sed -n '2,4p' "${BASH_SOURCE[0]}"; usage_common; }
parse_flags "$@"

for node in $(selected_nodes); do
  role="$(node_role "$node")"
  ssh_cmd "$node" all "bash \"$REMOTE_DIR/scripts/tpu/host_run.sh\" stop $role"
done
