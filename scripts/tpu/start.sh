#!/usr/bin/env bash
# Start the learner program on every host of the learner slice, then the sampler program on
# every host of the sampler slice. Both get the learner host 0 addresses (ring buffer and
# weight coordinator); each slice runs jax.distributed for its own hosts only. A multi-host
# slice type (v5p-16, v5litepod-16, v6e-16, ...) gets the program on each of its hosts
# (--dry-run prints what each host runs); a multi-host learner needs a gs:// --run-dir.
#   scripts/tpu/start.sh --zone us-west4-a --config configs/gsm8k_qwen2_5_0_5b.py
#       --model-dir /home/me/qwen [--run-dir gs://b/runs] [--dry-run] [-- --learner.lr 1e-6]
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
usage() { sed -n '2,8p' "${BASH_SOURCE[0]}"; usage_common; }
parse_flags "$@"
slice_shape "$LEARNER_TYPE" >/dev/null   # dies here (not in a subshell) on a bad type
slice_shape "$SAMPLER_TYPE" >/dev/null
learner_hosts="$(slice_hosts "$LEARNER_TYPE")"
sampler_hosts="$(slice_hosts "$SAMPLER_TYPE")"
if [ "$learner_hosts" -gt 1 ] && [[ "$RUN_DIR" != gs://* ]]; then
  die "--run-dir must be shared storage (gs://...) when the learner slice ($LEARNER_TYPE)" \
    "has $learner_hosts hosts: every host writes its checkpoint shards there"
fi

if [ -z "$TOKEN" ]; then
  TOKEN="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
  note "generated a random ring-buffer token (pass --token or RLFLOW_BUFFER_TOKEN to choose it)"
fi
# The token travels as a file (mode 0600, copied by scp) and is read by --buffer.token_file:
# never on a command line (ps) and never in a config.json (rlflow/secrets.py).
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

for role in learner sampler; do
  node="$LEARNER_NODE"; hosts="$learner_hosts"; type="$LEARNER_TYPE"
  if [ "$role" = sampler ]; then
    node="$SAMPLER_NODE"; hosts="$sampler_hosts"; type="$SAMPLER_TYPE"
  fi
  # scp paths are relative to the remote home: host_run.sh reads $HOME/.rlflow-buffer.token
  run gcloud compute tpus tpu-vm scp "$token_file" "$node:.rlflow-buffer.token" \
    "${GCLOUD_COMMON[@]}" --worker=all
  remote="env $(command_line "${env_words[@]}") bash \"$REMOTE_DIR/scripts/tpu/host_run.sh\""
  remote+=" start $role $(command_line "${train[@]}")"
  ssh_cmd "$node" all "$remote"
  if [ "$DRY_RUN" = 1 ]; then
    # what host_run.sh runs on each host (its slice position comes from the TPU metadata)
    for ((i = 0; i < hosts; i++)); do
      note "$role host $i of $hosts ($type): RLFLOW_JAX_COORDINATOR=${node}-HOST0_IP:$JAX_PORT" \
        "RLFLOW_NUM_PROCESSES=$hosts RLFLOW_PROCESS_ID=$i python -m rlflow.launch --role $role"
    done
  fi
done
note "follow the logs with scripts/tpu/logs.sh --zone $ZONE --name $NAME"
