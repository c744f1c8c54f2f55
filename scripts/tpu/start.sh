#!/usr/bin/env bash
# Start the learner program on every host of the learner slice, then one sampler replica on
# every host of every sampler slice (RLFLOW_REPLICA = its index). All get the learner host 0
# addresses (ring buffer and weight coordinator); each slice runs jax.distributed for its own
# hosts only. Multi-host types (v5p-16, v5litepod-16, v6e-16, ...) are accepted (--dry-run
# prints what each host runs); a multi-host learner needs a gs:// --run-dir.
#   scripts/tpu/start.sh --zone us-west4-a --config configs/gsm8k_qwen2_5_0_5b.py
#       --model-dir /home/me/qwen [--run-dir gs://b/runs] [--dry-run] [-- --learner.lr 1e-6]
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
usage() { sed -n '2,8p' "${BASH_SOURCE[0]}"; usage_common; }
parse_flags "$@"
check_slices

ensure_token
# The token travels as a file (mode 0600, copied by scp) and is read by --buffer.token_file:
# never on a command line (ps) and never in a config.json (rlflow/config/secrets.py).
token_file="$(mktemp)"
trap 'rm -f "$token_file"' EXIT
chmod 600 "$token_file"
printf '%s\n' "$TOKEN" >"$token_file"
if [ -z "$LEARNER_IP" ]; then
  if [ "$DRY_RUN" = 1 ]; then
    note "the internal IP of learner host 0 comes from (--learner-ip skips it):"
    run gcloud compute tpus tpu-vm describe "$LEARNER_NODE" "${GCLOUD_COMMON[@]}" \
      --format='value(networkEndpoints[0].ipAddress)'
    LEARNER_IP="LEARNER_HOST0_IP"
  else
    LEARNER_IP="$(gcloud compute tpus tpu-vm describe "$LEARNER_NODE" "${GCLOUD_COMMON[@]}" \
      --format='value(networkEndpoints[0].ipAddress)')"
    [ -n "$LEARNER_IP" ] || die "no IP address for $LEARNER_NODE; is it ACTIVE?"
  fi
fi

env_words=("RLFLOW_BUFFER_ADDRESS=$LEARNER_IP:$BUFFER_PORT"
           "RLFLOW_COORDINATOR_ADDRESS=$LEARNER_IP:$COORDINATOR_PORT"
           "RLFLOW_JAX_PORT=$JAX_PORT")
if [ -n "$MODEL_DIR" ]; then env_words+=("RLFLOW_MODEL_PATH=$MODEL_DIR"); fi
train=(--config "$CONFIG" --buffer.bind_address "$LEARNER_IP" --buffer.port "$BUFFER_PORT")
if [ -n "$RUN_DIR" ]; then train+=(--run_dir "$RUN_DIR"); fi
train+=("${TRAIN_ARGS[@]}")

# Every sampler host is one replica: replica = slice * hosts per slice + worker.
replicas=$((SAMPLER_SLICES * sampler_hosts))
# The learner program spans every host of its slice (learner.num_hosts, rlflow.learner.hosts).
train+=(--learner.num_hosts "$learner_hosts" --sampler.num_replicas "$replicas")
note "$SAMPLER_SLICES sampler slice(s) of $SAMPLER_TYPE, $sampler_hosts host(s) each: $replicas replicas"

for node in "$LEARNER_NODE" "${SAMPLER_NODES[@]}"; do
  # scp paths are relative to the remote home: host_run.sh reads $HOME/.rlflow-buffer.token
  run gcloud compute tpus tpu-vm scp "$token_file" "$node:.rlflow-buffer.token" \
    "${GCLOUD_COMMON[@]}" --worker=all
done
remote="env $(command_line "${env_words[@]}") bash \"$REMOTE_DIR/scripts/tpu/host_run.sh\""
ssh_cmd "$LEARNER_NODE" all "$remote start learner $(command_line "${train[@]}")"
if [ "$DRY_RUN" = 1 ]; then
  # what host_run.sh runs on each learner host (its slice position comes from the TPU metadata)
  for ((i = 0; i < learner_hosts; i++)); do
    note "learner host $i of $learner_hosts ($LEARNER_TYPE):" \
      "RLFLOW_JAX_COORDINATOR=${LEARNER_NODE}-HOST0_IP:$JAX_PORT" \
      "RLFLOW_NUM_PROCESSES=$learner_hosts RLFLOW_PROCESS_ID=$i python -m rlflow.launcher.launch --role learner"
  done
fi
for ((s = 0; s < SAMPLER_SLICES; s++)); do
  for ((w = 0; w < sampler_hosts; w++)); do
    words=("${env_words[@]}" "RLFLOW_REPLICA=$((s * sampler_hosts + w))")
    remote="env $(command_line "${words[@]}") bash \"$REMOTE_DIR/scripts/tpu/host_run.sh\""
    ssh_cmd "${SAMPLER_NODES[$s]}" "$w" "$remote start sampler $(command_line "${train[@]}")"
    if [ "$DRY_RUN" = 1 ]; then
      note "sampler host $((s * sampler_hosts + w)) of $replicas ($SAMPLER_TYPE):" \
        "RLFLOW_REPLICA=$((s * sampler_hosts + w)) RLFLOW_NUM_PROCESSES=1 RLFLOW_PROCESS_ID=0" \
        "python -m rlflow.launcher.launch --role sampler"
    fi
  done
done
note "follow the logs with scripts/tpu/logs.sh --zone $ZONE --name $NAME"
