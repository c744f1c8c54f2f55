#!/usr/bin/env bash
# Runs IN each pod of an xpk workload (start.sh's --command):
#   pod_run.sh ROLE [TRAIN_ARGS...]     resolve the config, exec `python -m rlflow.launcher.launch`
#   pod_run.sh --print-env ROLE         print the RLFLOW_ environment this pod would get
# The pod's place in its slice comes from the GKE TPU environment: TPU_WORKER_ID (this host)
# and TPU_WORKER_HOSTNAMES (every host of THIS slice, comma-separated; the first is the
# jax.distributed coordinator). RLFLOW_BUFFER_ADDRESS / RLFLOW_COORDINATOR_ADDRESS are set by
# start.sh; RLFLOW_JAX_PORT defaults to 8476; RLFLOW_PYTHON to python3. RLFLOW_BUFFER_TOKEN
# (from start.sh's --env-file) is moved into a 0600 file passed as --buffer.token_file and
# removed from the environment: it is on no command line and in no config.json.
set -euo pipefail

die() { echo "pod_run.sh: $*" >&2; exit 2; }

print_only=0
if [ "${1:-}" = --print-env ]; then print_only=1; shift; fi
role="${1:-}"
case "$role" in learner|sampler) ;; *) die "ROLE must be learner or sampler, got '$role'" ;; esac
shift
: "${RLFLOW_BUFFER_ADDRESS:?RLFLOW_BUFFER_ADDRESS (host:port of the ring buffer) is required}"
: "${RLFLOW_COORDINATOR_ADDRESS:?RLFLOW_COORDINATOR_ADDRESS (host:port of the weight coordinator) is required}"
: "${TPU_WORKER_HOSTNAMES:?TPU_WORKER_HOSTNAMES is not set: not a GKE TPU pod}"
: "${TPU_WORKER_ID:?TPU_WORKER_ID is not set: not a GKE TPU pod}"
IFS=',' read -r -a hosts <<<"$TPU_WORKER_HOSTNAMES"
[[ "$TPU_WORKER_ID" =~ ^[0-9]+$ ]] && [ "$TPU_WORKER_ID" -lt "${#hosts[@]}" ] \
  || die "TPU_WORKER_ID=$TPU_WORKER_ID is not an index into TPU_WORKER_HOSTNAMES (${#hosts[@]} hosts)"
RLFLOW_ROLE="$role"
if [ "$role" = learner ]; then
  # the learner slice is one multi-controller JAX program over all its hosts
  RLFLOW_NUM_PROCESSES="${#hosts[@]}"
  RLFLOW_PROCESS_ID="$TPU_WORKER_ID"
  RLFLOW_JAX_COORDINATOR="${hosts[0]}:${RLFLOW_JAX_PORT:-8476}"
  export RLFLOW_JAX_COORDINATOR
else
  # a sampler host is one replica, its own JAX program on this host's chips only:
  # replica = slice (MEGASCALE_SLICE_ID with --num-slices) * hosts per slice + worker
  RLFLOW_NUM_PROCESSES=1
  RLFLOW_PROCESS_ID=0
  RLFLOW_REPLICA=$(( ${MEGASCALE_SLICE_ID:-0} * ${#hosts[@]} + TPU_WORKER_ID ))
  export RLFLOW_REPLICA
  if [ "${#hosts[@]}" -gt 1 ]; then
    export TPU_PROCESS_BOUNDS="1,1,1" TPU_PROCESS_ADDRESSES="localhost:${RLFLOW_JAX_PORT:-8476}"
    export TPU_PROCESS_PORT="${RLFLOW_JAX_PORT:-8476}" CLOUD_TPU_TASK_ID=0
  fi
fi
export RLFLOW_NUM_PROCESSES RLFLOW_PROCESS_ID RLFLOW_ROLE
args=("$@")
if [ -n "${RLFLOW_BUFFER_TOKEN:-}" ]; then
  token_file="${RLFLOW_BUFFER_TOKEN_FILE:-${TMPDIR:-/tmp}/rlflow-buffer.token}"
  (umask 077 && printf '%s\n' "$RLFLOW_BUFFER_TOKEN" >"$token_file")
  chmod 600 "$token_file"
  unset RLFLOW_BUFFER_TOKEN
  args+=(--buffer.token_file "$token_file")
fi
if [ "$print_only" = 1 ]; then
  env | grep '^RLFLOW_' | sort
  echo "ARGS ${args[*]}"
  exit 0
fi

PY="${RLFLOW_PYTHON:-python3}"
config_json="${TMPDIR:-/tmp}/rlflow-$role-config.json"
# every pod resolves the same config file + overrides (rlflow train's own parser)
"$PY" -c '
import sys
from rlflow.console.config_args import parse_train_args
from rlflow.control.programs_common import save_config
save_config(parse_train_args(sys.argv[2:]), sys.argv[1])
' "$config_json" "${args[@]}"
export RLFLOW_CONFIG="$config_json" PYTHONUNBUFFERED=1
exec "$PY" -m rlflow.launcher.launch --role "$role" --config "$config_json"
