#!/usr/bin/env bash
# Install rlflow on every host of both slices: ship `git archive GIT_REF` of this repository,
# create ~/rlflow/.venv with Python 3.12, pip-install rlflow with its tpu extra (jax[tpu], libtpu;
# --jax-version pins jax); optionally copy the model folder from Cloud Storage to --model-dir.
#   scripts/tpu/install.sh --zone us-west4-a [--git-ref HEAD] [--model-gcs gs://b/qwen
#       --model-dir /home/me/qwen] [--dry-run] ...
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
usage() { sed -n '2,6p' "${BASH_SOURCE[0]}"; usage_common; }
parse_flags "$@"
if [ -n "$MODEL_GCS" ] && [ -z "$MODEL_DIR" ]; then die "--model-gcs needs --model-dir"; fi

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
archive="${TMPDIR:-/tmp}/${NAME}-src.tar.gz"
run git -C "$repo" archive --format=tar.gz --prefix=rlflow/ -o "$archive" "$GIT_REF"

venv="$REMOTE_DIR/.venv"
remote="set -e"
remote+="; command -v $PYTHON >/dev/null || (sudo apt-get update -q && sudo apt-get install -y -q $PYTHON $PYTHON-venv)"
remote+="; rm -rf $REMOTE_DIR && tar -xzf \"\$HOME/${NAME}-src.tar.gz\" -C \"\$HOME\""
remote+="; $PYTHON -m venv $venv"
remote+="; $venv/bin/pip install -q --upgrade pip"
pin=""
[ -z "$JAX_VERSION" ] || pin=" $(shell_quote "jax[tpu]==$JAX_VERSION")"
remote+="; $venv/bin/pip install -q -e \"${REMOTE_DIR}[tpu]\"$pin"
if [ -n "$MODEL_GCS" ]; then
  remote+="; mkdir -p $(shell_quote "$MODEL_DIR")"
  remote+=" && gcloud storage rsync --recursive $(shell_quote "$MODEL_GCS") $(shell_quote "$MODEL_DIR")"
fi

for node in "$LEARNER_NODE" "${SAMPLER_NODES[@]}"; do
  run gcloud compute tpus tpu-vm scp "$archive" "$node:${NAME}-src.tar.gz" "${GCLOUD_COMMON[@]}" \
    --worker=all
  ssh_cmd "$node" all "$remote"
done
