#!/usr/bin/env bash
# Delete the queued resources of the selected slices and their TPU VMs (--force), without
# a confirmation prompt. Run stop.sh first if the learner should write its exit checkpoint.
#   scripts/tpu/delete.sh --zone us-west4-a [--role learner|sampler|both] [--dry-run]
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
usage() { sed -n '2,4p' "${BASH_SOURCE[0]}"; usage_common; }
parse_flags "$@"

for node in $(selected_nodes); do
  run gcloud compute tpus queued-resources delete "${node}-qr" "${GCLOUD_COMMON[@]}" --force --quiet
done
