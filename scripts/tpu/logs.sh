#!/usr/bin/env bash
# Stream the program logs of one host (--worker, default 0) of each selected slice
# (--role learner|sampler|both), each line prefixed with its slice. Ctrl-C stops streaming only.
#   scripts/tpu/logs.sh --zone us-west4-a [--role learner] [--worker all] [--dry-run]
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
usage() { sed -n '2,4p' "${BASH_SOURCE[0]}"; usage_common; }
parse_flags "$@"

pids=()
for node in $(selected_nodes); do
  role="$(node_role "$node")"
  remote="bash \"$REMOTE_DIR/scripts/tpu/host_run.sh\" logs $role"
  if [ "$DRY_RUN" = 1 ]; then
    ssh_cmd "$node" "$WORKER" "$remote"
  else
    ssh_cmd "$node" "$WORKER" "$remote" 2>&1 | sed -u "s/^/[$role] /" &
    pids+=("$!")
  fi
done
if [ "${#pids[@]}" -gt 0 ]; then wait "${pids[@]}"; fi
