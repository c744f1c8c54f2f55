#!/usr/bin/env bash
# Shared by the Cloud TPU scripts in this folder (sourced, not run): flag parsing, names,
# and `run`, which prints the exact command under --dry-run and runs it otherwise.
# Flags and environment are documented in docs/tpu.md.
# shellcheck disable=SC2034  # variables set here are read by the scripts that source this file

NAME="rlflow"
PROJECT=""
ZONE=""
LEARNER_TYPE="v5litepod-8"
SAMPLER_TYPE="v5litepod-8"
SAMPLER_SLICES=1           # sampler slices; every sampler host is one replica
RUNTIME_VERSION=""
PROVISIONING=""            # "", "spot" or "reserved"
CONFIG="configs/gsm8k_qwen2_5_0_5b.py"
MODEL_DIR=""               # HF model folder on every host (RLFLOW_MODEL_PATH)
MODEL_GCS=""               # gs:// folder copied to MODEL_DIR by install.sh
RUN_DIR=""                 # rlflow --run_dir (use gs://... when the learner has > 1 host)
BUFFER_PORT="5555"
COORDINATOR_PORT="5556"
JAX_PORT="8476"
TOKEN="${RLFLOW_BUFFER_TOKEN:-}"
LEARNER_IP=""
GIT_REF="HEAD"
PYTHON="python3.12"
JAX_VERSION=""
ROLE="both"
WORKER="0"
NO_WAIT=0
DRY_RUN=0
TRAIN_ARGS=()
# shellcheck disable=SC2016  # $HOME is expanded by the remote shell, on each TPU host
REMOTE_DIR='$HOME/rlflow'

usage_common() {
  cat <<'EOF'
Common flags (docs/tpu.md):
  --name NAME              prefix of the slices: NAME-learner, NAME-sampler (default rlflow)
  --project PROJECT        Google Cloud project (default: gcloud's core/project)
  --zone ZONE              zone of both slices (required)
  --learner-type TYPE      learner slice accelerator type (default v5litepod-8)
  --sampler-type TYPE      sampler slice accelerator type (default v5litepod-8); multi-host
                           types (v5litepod-16, v6e-16, ...) run one sampler replica per host
  --sampler-slices K       sampler slices NAME-sampler-0..K-1 (default 1: NAME-sampler)
  --runtime-version V      TPU VM image (default from the type: v5litepod -> v2-alpha-tpuv5-lite,
                           v6e -> v2-alpha-tpuv6e, v5p -> v2-alpha-tpuv5, v4 -> tpu-ubuntu2204-base)
  --spot | --reserved      provisioning model of the queued resources (default on-demand)
  --config PATH            rlflow config file, relative to the repository (default
                           configs/gsm8k_qwen2_5_0_5b.py)
  --model-dir DIR          Hugging Face model folder on every host (exported as RLFLOW_MODEL_PATH)
  --model-gcs GS_URL       copy this gs:// folder to --model-dir on every host (install.sh)
  --run-dir DIR            rlflow run_dir on the hosts (gs://bucket/runs for multi-host learners)
  --buffer-port N          ring-buffer port on learner host 0 (default 5555)
  --coordinator-port N     weight-coordinator port on learner host 0 (default 5556)
  --jax-port N             jax.distributed coordinator port inside each slice (default 8476)
  (token)                  the ring-buffer shared secret comes from $RLFLOW_BUFFER_TOKEN, else
                           a random one; it reaches the hosts as a mode-0600 file, never on a
                           command line (--token is refused: argv is visible in ps)
  --learner-ip IP          internal IP of learner host 0 (default: asked from gcloud)
  --git-ref REF            git ref shipped to the hosts by install.sh (default HEAD)
  --python EXE             Python on the hosts, >= 3.12 (default python3.12)
  --jax-version V          pin jax[tpu]==V on the hosts (default: what setup.py's tpu extra resolves)
  --role learner|sampler|both   slice(s) that logs.sh / stop.sh act on (default both)
  --worker N|all           host(s) whose log logs.sh streams (default 0)
  --no-wait                create.sh: do not wait for the queued resources to be ACTIVE
  --dry-run                print the exact commands instead of running them
  -- ARGS...               extra `rlflow train` overrides (e.g. -- --learner.lr 1e-6)
EOF
}

die() { echo "error: $*" >&2; exit 2; }

# need_value FLAG [VALUE ...]: VALUE must be there and must not be another flag (a missing
# value must never swallow the next flag, e.g. "--zone --dry-run" running for real).
need_value() {
  if [ $# -lt 2 ] || [ -z "$2" ] || [[ "$2" == --* ]]; then die "$1 needs a value"; fi
}

# rlflow train flags the slices decide (start.sh sets them from the slice types): after
# "--" they would silently lose to, or override, what the slices hold.
refuse_slice_flags() {
  local arg
  for arg in "${TRAIN_ARGS[@]}"; do
    case "$arg" in
      --sampler.num_replicas|--sampler.num_replicas=*|--sampler.num-replicas|--sampler.num-replicas=*)
        die "$arg after --: the replica count is the sampler hosts (--sampler-slices x hosts of --sampler-type), set by start.sh" ;;
      --learner.num_hosts|--learner.num_hosts=*|--learner.num-hosts|--learner.num-hosts=*)
        die "$arg after --: the learner hosts are those of --learner-type's slice, set by start.sh" ;;
    esac
  done
}

parse_flags() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --name) need_value "$@"; NAME="$2"; shift 2 ;;
      --project) need_value "$@"; PROJECT="$2"; shift 2 ;;
      --zone) need_value "$@"; ZONE="$2"; shift 2 ;;
      --learner-type) need_value "$@"; LEARNER_TYPE="$2"; shift 2 ;;
      --sampler-type) need_value "$@"; SAMPLER_TYPE="$2"; shift 2 ;;
      --sampler-slices) need_value "$@"; SAMPLER_SLICES="$2"; shift 2 ;;
      --runtime-version) need_value "$@"; RUNTIME_VERSION="$2"; shift 2 ;;
      --spot) PROVISIONING="spot"; shift ;;
      --reserved) PROVISIONING="reserved"; shift ;;
      --config) need_value "$@"; CONFIG="$2"; shift 2 ;;
      --model-dir) need_value "$@"; MODEL_DIR="$2"; shift 2 ;;
      --model-gcs) need_value "$@"; MODEL_GCS="$2"; shift 2 ;;
      --run-dir) need_value "$@"; RUN_DIR="$2"; shift 2 ;;
      --buffer-port) need_value "$@"; BUFFER_PORT="$2"; shift 2 ;;
      --coordinator-port) need_value "$@"; COORDINATOR_PORT="$2"; shift 2 ;;
      --jax-port) need_value "$@"; JAX_PORT="$2"; shift 2 ;;
      --token|--token=*)
        die "--token puts the secret in argv (visible in ps); export RLFLOW_BUFFER_TOKEN instead" ;;
      --learner-ip) need_value "$@"; LEARNER_IP="$2"; shift 2 ;;
      --git-ref) need_value "$@"; GIT_REF="$2"; shift 2 ;;
      --python) need_value "$@"; PYTHON="$2"; shift 2 ;;
      --jax-version) need_value "$@"; JAX_VERSION="$2"; shift 2 ;;
      --role) need_value "$@"; ROLE="$2"; shift 2 ;;
      --worker) need_value "$@"; WORKER="$2"; shift 2 ;;
      --no-wait) NO_WAIT=1; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) usage; exit 0 ;;
      --) shift; TRAIN_ARGS=("$@"); refuse_slice_flags; break ;;
      *) die "unknown flag $1 (see --help)" ;;
    esac
  done
  [ -n "$ZONE" ] || die "--zone is required"
  case "$ROLE" in learner|sampler|both) ;; *) die "--role must be learner, sampler or both, got $ROLE" ;; esac
  for port in "$BUFFER_PORT" "$COORDINATOR_PORT" "$JAX_PORT"; do
    [[ "$port" =~ ^[0-9]+$ ]] && [ "$port" -gt 0 ] && [ "$port" -lt 65536 ] \
      || die "ports must be integers in [1, 65535], got $port"
  done
  [[ "$NAME" =~ ^[a-z][-a-z0-9]*$ ]] || die "--name must be lowercase letters, digits and -, got $NAME"
  [[ "$SAMPLER_SLICES" =~ ^[0-9]+$ ]] && [ "$SAMPLER_SLICES" -ge 1 ] \
    || die "--sampler-slices must be an integer >= 1, got $SAMPLER_SLICES"
  LEARNER_NODE="${NAME}-learner"
  LEARNER_QR="${NAME}-learner-qr"
  SAMPLER_NODES=()
  if [ "$SAMPLER_SLICES" = 1 ]; then
    SAMPLER_NODES=("${NAME}-sampler")
  else
    for ((i = 0; i < SAMPLER_SLICES; i++)); do SAMPLER_NODES+=("${NAME}-sampler-$i"); done
  fi
  GCLOUD_COMMON=(--zone="$ZONE")
  if [ -n "$PROJECT" ]; then GCLOUD_COMMON+=(--project="$PROJECT"); fi
}

# The TPU VM image for an accelerator type (unless --runtime-version is given).
runtime_for() {
  if [ -n "$RUNTIME_VERSION" ]; then echo "$RUNTIME_VERSION"; return; fi
  case "$1" in
    v5litepod-*) echo "v2-alpha-tpuv5-lite" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v4-*) echo "tpu-ubuntu2204-base" ;;
    *) die "no default runtime for accelerator type $1; pass --runtime-version" ;;
  esac
}

# "HOSTS CHIPS_PER_HOST" of an accelerator type. v4-N / v5p-N count TensorCores (2 per chip,
# 4 chips per host); v5litepod-N / v6e-N count chips (up to 8 on one host, 4 per host above).
slice_shape() {
  local type="$1" n="${1##*-}"
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -gt 0 ] || die "accelerator type $type: expected NAME-SIZE"
  case "$type" in
    v4-*|v5p-*)
      [ "$n" -ge 8 ] && [ $((n % 8)) = 0 ] || die "accelerator type $type: size must be a multiple of 8"
      echo "$((n / 8)) 4" ;;
    v5litepod-*|v6e-*)
      # the slice shapes Cloud TPU offers: 1x1, 2x2, 2x4 on one host; 4x4 ... 16x16 (4 chips a host)
      case "$n" in
        1|4|8) echo "1 $n" ;;
        16|32|64|128|256) echo "$((n / 4)) 4" ;;
        *) die "accelerator type $type: size must be one of 1, 4, 8 (one host) or 16, 32, 64, 128, 256" ;;
      esac ;;
    *) die "unknown accelerator type $type (v4-N, v5p-N, v5litepod-N or v6e-N)" ;;
  esac
}

slice_hosts() { local shape; shape="$(slice_shape "$1")"; echo "${shape% *}"; }

# The Python that runs rlflow's checks where these scripts run (not on the hosts):
# $RLFLOW_LOCAL_PYTHON, else the repository's .venv, else python3.
local_python() {
  local repo
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  if [ -n "${RLFLOW_LOCAL_PYTHON:-}" ]; then echo "$RLFLOW_LOCAL_PYTHON"
  elif [ -x "$repo/.venv/bin/python" ]; then echo "$repo/.venv/bin/python"
  else echo python3; fi
}

# Check both slice types and set learner_hosts / sampler_hosts; a multi-host learner writes
# its checkpoint shards from every host, so its run folder must be shared storage. Then the
# config (--config and the flags after --, loaded as `rlflow train` will on the hosts) must
# fit the slices: learner.num_devices = the learner slice's chips, learner.num_hosts its
# hosts, sampler.num_devices = one sampler host's chips (rlflow/console/slices.py). Called by
# create.sh and start.sh, so that nothing is created or started for a config that cannot run.
check_slices() {
  local shape repo py rc=0
  slice_shape "$LEARNER_TYPE" >/dev/null   # dies here (not in a subshell) on a bad type
  slice_shape "$SAMPLER_TYPE" >/dev/null
  learner_hosts="$(slice_hosts "$LEARNER_TYPE")"
  sampler_hosts="$(slice_hosts "$SAMPLER_TYPE")"
  if [ "$learner_hosts" -gt 1 ] && [[ "$RUN_DIR" != gs://* ]]; then
    die "--run-dir must be shared storage (gs://...) when the learner slice ($LEARNER_TYPE)" \
      "has $learner_hosts hosts: every host writes its checkpoint shards there"
  fi
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  py="$(local_python)"
  shape="$(slice_shape "$LEARNER_TYPE")"; local learner_chips="${shape#* }"
  shape="$(slice_shape "$SAMPLER_TYPE")"; local sampler_chips="${shape#* }"
  PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" -m rlflow.console.slices \
    --learner "$LEARNER_TYPE" "$learner_hosts" "$learner_chips" \
    --sampler "$SAMPLER_TYPE" "$sampler_hosts" "$sampler_chips" \
    --sampler-slices "$SAMPLER_SLICES" --config "$CONFIG" -- \
    --learner.num_hosts "$learner_hosts" \
    --sampler.num_replicas "$((SAMPLER_SLICES * sampler_hosts))" "${TRAIN_ARGS[@]}" || rc=$?
  case "$rc" in
    0) ;;
    2) exit 2 ;;                              # the check printed what does not fit
    *) die "the slice check ($py -m rlflow.console.slices) failed (exit $rc); it needs rlflow" \
         "and its dependencies where these scripts run (set RLFLOW_LOCAL_PYTHON)" ;;
  esac
}

# The run's ring-buffer token: RLFLOW_BUFFER_TOKEN, else a random one (never printed).
ensure_token() {
  if [ -z "$TOKEN" ]; then
    TOKEN="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
    note "generated a random ring-buffer token (export RLFLOW_BUFFER_TOKEN to choose it)"
  fi
}

# Quote one word for a POSIX shell, leaving plain words as they are.
shell_quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# The words as one shell command line.
command_line() {
  local out="" word
  for word in "$@"; do out+="$(shell_quote "$word") "; done
  printf '%s' "${out% }"
}

# Print the command (--dry-run) or run it.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    command_line "$@"; echo
  else
    echo "+ $(command_line "$@")" >&2
    "$@"
  fi
}

note() { echo "# $*"; }

# gcloud compute tpus tpu-vm ssh NODE --worker=W --command=CMD
ssh_cmd() {
  local node="$1" worker="$2" remote="$3"
  run gcloud compute tpus tpu-vm ssh "$node" "${GCLOUD_COMMON[@]}" --worker="$worker" \
    --command="$remote"
}

# The program a slice runs: learner or sampler (NAME-sampler, NAME-sampler-<k>).
node_role() {
  if [ "$1" = "$LEARNER_NODE" ]; then echo learner; else echo sampler; fi
}

# Slices the current --role selects.
selected_nodes() {
  case "$ROLE" in
    learner) echo "$LEARNER_NODE" ;;
    sampler) echo "${SAMPLER_NODES[*]}" ;;
    both) echo "${SAMPLER_NODES[*]} $LEARNER_NODE" ;;
  esac
}
