#!/usr/bin/env bash
# Shared by the GKE / xpk scripts in this folder (sourced, not run): flag parsing, names, and
# `run` (prints the exact command under --dry-run, runs it otherwise). See docs/tpu.md (GKE).
# shellcheck disable=SC2034  # variables set here are read by the scripts that source this file

# shellcheck source-path=SCRIPTDIR source=../tpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../tpu/common.sh"   # run, note, die, slice_hosts, quoting

CLUSTER=""
DOCKER_IMAGE=""
XPK="xpk"

usage_xpk() {
  cat <<'USAGE'
Flags (GKE with xpk; the cluster exists already, e.g. `xpk cluster create`):
  --cluster NAME           GKE cluster (required)
  --project PROJECT        Google Cloud project
  --zone ZONE              zone of the cluster (required)
  --name NAME              workload prefix: NAME-learner, NAME-sampler (default rlflow)
  --learner-type TYPE      learner TPU type, e.g. v5p-16, v6e-16 (default v5litepod-8)
  --sampler-type TYPE      sampler TPU type (default v5litepod-8)
  --docker-image IMAGE     image with rlflow installed at /app (required for start.sh; Python >= 3.12,
                           pip install -e "/app[tpu]")
  --config PATH            rlflow config file inside the image (default configs/gsm8k_qwen2_5_0_5b.py)
  --model-dir DIR          model folder in the pods (RLFLOW_MODEL_PATH)
  --run-dir DIR            rlflow run_dir (gs://... : every learner host writes its shards)
  --buffer-port N / --coordinator-port N / --jax-port N   as scripts/tpu
  (token)                  ring-buffer secret from $RLFLOW_BUFFER_TOKEN, else random; sent to the
                           pods with xpk --env-file, never on a command line
  --learner-ip HOST        address of learner host 0 (default: its JobSet DNS name,
                           NAME-learner-slice-job-0-0.NAME-learner)
  --xpk EXE                the xpk command (default xpk)
  --dry-run                print the exact commands instead of running them
  -- ARGS...               extra `rlflow train` overrides
USAGE
}

# Splits the xpk-only flags off, then parses the rest with scripts/tpu's parse_flags.
parse_xpk_flags() {
  local rest=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --cluster) need_value "$@"; CLUSTER="$2"; shift 2 ;;
      --docker-image) need_value "$@"; DOCKER_IMAGE="$2"; shift 2 ;;
      --xpk) need_value "$@"; XPK="$2"; shift 2 ;;
      --) rest+=("$@"); break ;;
      *) rest+=("$1"); shift ;;
    esac
  done
  parse_flags "${rest[@]}"
  [ -n "$CLUSTER" ] || die "--cluster is required"
  XPK_COMMON=(--cluster="$CLUSTER" --zone="$ZONE")
  if [ -n "$PROJECT" ]; then XPK_COMMON+=(--project="$PROJECT"); fi
}
