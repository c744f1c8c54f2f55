#!/usr/bin/env bash
# Start the learner and the sampler as two xpk workloads (JobSets) on a GKE cluster: one pod
# per TPU host of each slice type, every pod running scripts/xpk/pod_run.sh with the same
# config and environment as scripts/tpu/start.sh. --dry-run also prints what each host runs.
#   scripts/xpk/start.sh --cluster c1 --zone us-east5-a --docker-image gcr.io/p/rlflow:1
#       --learner-type v5p-16 --run-dir gs://b/runs [--dry-run] [-- --learner.lr 1e-6]
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
usage() { sed -n '2,6p' "${BASH_SOURCE[0]}"; usage_xpk; }
parse_xpk_flags "$@"
[ -n "$DOCKER_IMAGE" ] || die "--docker-image is required"
check_slices
ensure_token
# The token reaches the pods through xpk's --env-file (mode 0600 here, removed at exit):
# never on a command line; pod_run.sh moves it into a 0600 file for --buffer.token_file.
env_file="$(mktemp)"
trap 'rm -f "$env_file"' EXIT
chmod 600 "$env_file"
printf 'RLFLOW_BUFFER_TOKEN=%s\n' "$TOKEN" >"$env_file"
# learner host 0 = pod 0 of job 0 of the learner JobSet (xpk names the replicated job slice-job)
LEARNER_ADDR="${LEARNER_IP:-${LEARNER_NODE}-slice-job-0-0.${LEARNER_NODE}}"

env_words=("RLFLOW_BUFFER_ADDRESS=$LEARNER_ADDR:$BUFFER_PORT"
           "RLFLOW_COORDINATOR_ADDRESS=$LEARNER_ADDR:$COORDINATOR_PORT"
           "RLFLOW_JAX_PORT=$JAX_PORT")
if [ -n "$MODEL_DIR" ]; then env_words+=("RLFLOW_MODEL_PATH=$MODEL_DIR"); fi
train=(--config "$CONFIG" --buffer.bind_address 0.0.0.0 --buffer.port "$BUFFER_PORT")
if [ -n "$RUN_DIR" ]; then train+=(--run_dir "$RUN_DIR"); fi

# Every sampler host is one replica (its own JAX program): K slices x hosts per slice.
replicas=$((SAMPLER_SLICES * sampler_hosts))
# learner.num_hosts: the learner program spans every host of its slice (rlflow.learner.hosts)
train+=(--learner.num_hosts "$learner_hosts" --sampler.num_replicas "$replicas"
        "${TRAIN_ARGS[@]}")   # user flags last: they win
note "$SAMPLER_SLICES sampler slice(s) of $SAMPLER_TYPE, $sampler_hosts host(s) each: $replicas replicas"

for role in learner sampler; do
  workload="$LEARNER_NODE"; hosts="$learner_hosts"; type="$LEARNER_TYPE"; slices=1
  if [ "$role" = sampler ]; then
    workload="${NAME}-sampler"; hosts="$sampler_hosts"; type="$SAMPLER_TYPE"
    slices="$SAMPLER_SLICES"
  fi
  pod_cmd="env $(command_line "${env_words[@]}") bash scripts/xpk/pod_run.sh $role"
  pod_cmd+=" $(command_line "${train[@]}")"
  run "$XPK" workload create "${XPK_COMMON[@]}" --workload="$workload" --tpu-type="$type" \
    --num-slices="$slices" --docker-image="$DOCKER_IMAGE" --env-file="$env_file" --command="$pod_cmd"
  if [ "$DRY_RUN" = 1 ]; then
    for ((s = 0; s < slices; s++)); do
      for ((i = 0; i < hosts; i++)); do
        if [ "$role" = learner ]; then
          note "learner host $i of $hosts ($type): TPU_WORKER_ID=$i ->" \
            "RLFLOW_JAX_COORDINATOR=${workload}-slice-job-0-0.${workload}:$JAX_PORT" \
            "RLFLOW_NUM_PROCESSES=$hosts RLFLOW_PROCESS_ID=$i python -m rlflow.launcher.launch --role learner"
        else
          note "sampler host $((s * hosts + i)) of $((slices * hosts)) ($type):" \
            "MEGASCALE_SLICE_ID=$s TPU_WORKER_ID=$i ->" \
            "RLFLOW_REPLICA=$((s * hosts + i)) RLFLOW_NUM_PROCESSES=1 RLFLOW_PROCESS_ID=0" \
            "python -m rlflow.launcher.launch --role sampler"
        fi
      done
    done
  fi
done
note "follow the logs with: $XPK workload list --cluster=$CLUSTER, kubectl logs"
