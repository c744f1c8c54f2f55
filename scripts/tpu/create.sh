#!/usr/bin/env bash
# Create the Cloud TPU slices as queued resources, one for the learner program and
# --sampler-slices K for the sampler replicas, and wait until all are ACTIVE.
#   scripts/tpu/create.sh --zone us-west4-a [--learner-type v5litepod-16]
#       [--sampler-type v5litepod-8] [--spot] [--dry-run] ...
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
usage() { sed -n '2,5p' "${BASH_SOURCE[0]}"; usage_common; }
parse_flags "$@"
check_slices      # the config's devices, hosts and meshes against the slices, before creating

create_qr() {
  local qr="$1" node="$2" type="$3" extra=() runtime
  runtime="$(runtime_for "$type")" || exit 2     # die inside $(...) ends only the subshell
  case "$PROVISIONING" in
    spot) extra+=(--spot) ;;
    reserved) extra+=(--reserved) ;;
  esac
  run gcloud compute tpus queued-resources create "$qr" "${GCLOUD_COMMON[@]}" \
    --node-id="$node" --accelerator-type="$type" --runtime-version="$runtime" \
    "${extra[@]}"
}

wait_active() {
  local qr="$1" state
  if [ "$DRY_RUN" = 1 ]; then
    note "repeated every 30 s until the state is ACTIVE (FAILED or SUSPENDED stops the script):"
    run gcloud compute tpus queued-resources describe "$qr" "${GCLOUD_COMMON[@]}" \
      --format='value(state.state)'
    return
  fi
  while true; do
    state="$(gcloud compute tpus queued-resources describe "$qr" "${GCLOUD_COMMON[@]}" \
      --format='value(state.state)')"
    echo "$qr: $state" >&2
    case "$state" in
      ACTIVE) return ;;
      FAILED|SUSPENDED) die "queued resource $qr is $state" ;;
    esac
    sleep 30
  done
}

create_qr "$LEARNER_QR" "$LEARNER_NODE" "$LEARNER_TYPE"
for node in "${SAMPLER_NODES[@]}"; do
  create_qr "$node-qr" "$node" "$SAMPLER_TYPE"
done
if [ "$NO_WAIT" = 0 ]; then
  wait_active "$LEARNER_QR"
  for node in "${SAMPLER_NODES[@]}"; do wait_active "$node-qr"; done
fi
