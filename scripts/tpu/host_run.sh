#!/usr/bin/env bash
# Runs ON a TPU host (start.sh / stop.sh / logs.sh call it over `gcloud ... ssh --worker=all`).
#   host_run.sh env ROLE                 print the environment the program gets on this host
#   host_run.sh start ROLE [TRAIN_ARGS]  resolve the config, start `python -m rlflow.launcher.launch`
#   host_run.sh stop ROLE                SIGTERM (the learner saves its exit checkpoint), then
#                                        SIGKILL after RLFLOW_STOP_GRACE_S seconds (default 120)
#   host_run.sh logs ROLE                follow this host's log of ROLE
# ROLE is learner or sampler. Input environment (set by start.sh, see docs/tpu.md):
#   RLFLOW_BUFFER_ADDRESS, RLFLOW_COORDINATOR_ADDRESS  host:port on learner host 0 (required)
#   RLFLOW_MODEL_PATH     HF model folder read by the reference configs (optional)
#   RLFLOW_JAX_PORT       jax.distributed coordinator port in this slice (default 8476)
#   RLFLOW_RUN_DIR        run_dir when TRAIN_ARGS has no --run_dir (default $HOME/rlflow-runs)
#   RLFLOW_METADATA_URL   metadata server (default: the GCE one; tests point it elsewhere)
#   RLFLOW_BUFFER_TOKEN_FILE  ring-buffer token file (default $HOME/.rlflow-buffer.token,
#                         copied by start.sh; made mode 0600); passed as --buffer.token_file,
#                         so the token is on no command line and in no config.json
# This host's slice comes from the TPU metadata server: worker-network-endpoints (every host
# of THIS slice; host 0 is the jax.distributed coordinator) and agent-worker-number.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LOGS="${RLFLOW_LOG_DIR:-$HOME/rlflow-logs}"
PY="${RLFLOW_PYTHON:-$ROOT/.venv/bin/python}"
METADATA_URL="${RLFLOW_METADATA_URL:-http://metadata.google.internal/computeMetadata/v1/instance/attributes}"

die() { echo "host_run.sh: $*" >&2; exit 2; }

metadata() {
  curl -sSf --retry 5 -H 'Metadata-Flavor: Google' "$METADATA_URL/$1" \
    || die "cannot read TPU metadata '$1' from $METADATA_URL"
}

# Exports RLFLOW_JAX_COORDINATOR, RLFLOW_NUM_PROCESSES and RLFLOW_PROCESS_ID for this slice.
slice_env() {
  local endpoints first
  endpoints="$(metadata worker-network-endpoints)"
  # entries are "name:id:ip" (older images) or a plain address; the last field is the address
  first="$(echo "$endpoints" | tr ',' '\n' | head -n 1 | awk -F: '{print $NF}')"
  [ -n "$first" ] || die "empty worker-network-endpoints"
  RLFLOW_NUM_PROCESSES="$(echo "$endpoints" | tr ',' '\n' | grep -c .)"
  RLFLOW_PROCESS_ID="$(metadata agent-worker-number)"
  RLFLOW_JAX_COORDINATOR="$first:${RLFLOW_JAX_PORT:-8476}"
  export RLFLOW_JAX_COORDINATOR RLFLOW_NUM_PROCESSES RLFLOW_PROCESS_ID
}

# A sampler host is one replica, its own JAX program on this host's chips only (no
# jax.distributed over the slice): libtpu is told to use the local chips as a whole slice.
replica_env() {
  local devices
  shopt -s nullglob
  devices=(/dev/accel* /dev/vfio/[0-9]*)
  shopt -u nullglob
  RLFLOW_NUM_PROCESSES=1
  RLFLOW_PROCESS_ID=0
  RLFLOW_REPLICA="${RLFLOW_REPLICA:-$(metadata agent-worker-number)}"
  export RLFLOW_NUM_PROCESSES RLFLOW_PROCESS_ID RLFLOW_REPLICA
  if [ "$(metadata worker-network-endpoints | tr ',' '\n' | grep -c .)" -gt 1 ]; then
    export TPU_PROCESS_BOUNDS="1,1,1" TPU_PROCESS_ADDRESSES="localhost:${RLFLOW_JAX_PORT:-8476}"
    export TPU_PROCESS_PORT="${RLFLOW_JAX_PORT:-8476}" CLOUD_TPU_TASK_ID=0
    if [ "${#devices[@]}" -eq 4 ]; then export TPU_CHIPS_PER_PROCESS_BOUNDS="2,2,1"; fi
  fi
}

check_role() {
  case "${1:-}" in learner|sampler) ;; *) die "ROLE must be learner or sampler, got '${1:-}'" ;; esac
  : "${RLFLOW_BUFFER_ADDRESS:?RLFLOW_BUFFER_ADDRESS (host:port of the ring buffer) is required}"
  : "${RLFLOW_COORDINATOR_ADDRESS:?RLFLOW_COORDINATOR_ADDRESS (host:port of the weight coordinator) is required}"
}

if [ $# -lt 2 ]; then die "usage: host_run.sh env|start|stop|logs ROLE [TRAIN_ARGS...]"; fi
cmd="$1"; role="$2"
shift 2
mkdir -p "$LOGS"
pidfile="$LOGS/$role.pid"

case "$cmd" in
  env)
    check_role "$role"
    if [ "$role" = sampler ]; then replica_env; else slice_env; fi
    # a token in the environment is shown redacted (rlflow/config/secrets.py)
    env | grep '^RLFLOW_' | sed 's/^\(RLFLOW_BUFFER_TOKEN\)=.*/\1=<redacted>/' | sort
    ;;
  start)
    check_role "$role"
    if [ "$role" = sampler ]; then replica_env; else slice_env; fi
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      die "$role is already running (pid $(cat "$pidfile")); run stop.sh first"
    fi
    config_json="$LOGS/$role-config.json"
    args=("$@")
    token_file="${RLFLOW_BUFFER_TOKEN_FILE:-$HOME/.rlflow-buffer.token}"
    if [ -f "$token_file" ]; then
      chmod 600 "$token_file"
      args+=(--buffer.token_file "$token_file")
    fi
    case " ${args[*]} " in
      *" --run_dir "*|*" --run-dir "*) ;;
      *) args=(--run_dir "${RLFLOW_RUN_DIR:-$HOME/rlflow-runs}" "${args[@]}") ;;
    esac
    # Every host resolves the same config file + overrides (rlflow train's own parser).
    (cd "$ROOT" && "$PY" -c '
import sys
from rlflow.console.config_args import parse_train_args
from rlflow.control.programs_common import save_config
save_config(parse_train_args(sys.argv[2:]), sys.argv[1])
' "$config_json" "${args[@]}")
    export RLFLOW_ROLE="$role" RLFLOW_CONFIG="$config_json" PYTHONUNBUFFERED=1
    cd "$ROOT"
    nohup setsid "$PY" -m rlflow.launcher.launch --role "$role" --config "$config_json" \
      >"$LOGS/$role.log" 2>&1 </dev/null &
    echo $! >"$pidfile"
    echo "$(hostname): started $role (pid $!, process $RLFLOW_PROCESS_ID of $RLFLOW_NUM_PROCESSES), log $LOGS/$role.log"
    ;;
  stop)
    [ -f "$pidfile" ] || { echo "$(hostname): no $role pid file"; exit 0; }
    pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
      for _ in $(seq "${RLFLOW_STOP_GRACE_S:-120}"); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
      done
      if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"; fi
    fi
    rm -f "$pidfile"
    echo "$(hostname): stopped $role"
    ;;
  logs)
    exec tail -n 200 -F "$LOGS/$role.log"
    ;;
  *)
    die "unknown command '$cmd' (env, start, stop or logs)"
    ;;
esac
