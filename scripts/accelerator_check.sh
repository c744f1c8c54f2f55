#!/usr/bin/env bash
# Accelerator check (issue 43 item 8): finds this machine's accelerator (an NVIDIA GPU through
# nvidia-smi, a TPU through /dev/accel* or /dev/vfio/<n>), makes its own virtual environment
# .venv-accel (Python >= 3.12), installs rlflow with the extra of that accelerator's jax build
# (pip install -e ".[cuda]" for jax[cuda13], ".[tpu]" for jax[tpu] and libtpu), prints
# jax.devices(), and runs benchmarks/accelerator.py (the learner step and the sampler at the
# Qwen2.5-0.5B / 1.5B architectures, 4K-16K tokens per row: step time, tokens/s, MFU, HBM),
# its output teed to bench_results/accelerator_<UTC date>.txt.
#
# Usage: scripts/accelerator_check.sh [--dry-run] [-- benchmark flags ...]
#   --dry-run   print the commands (one a line, shell-quoted; notes start with #), run none
#   -- ...      passed to benchmarks/accelerator.py (e.g. -- --archs qwen05b --lengths 4096)
# Exit status: 2 when no accelerator is found (unless ACCEL_CHECK_ALLOW_CPU=1); else the
# first failing command's.
# Environment:
#   ACCEL_CHECK_ALLOW_CPU=1   without an accelerator, run on CPU with jax[cpu] and the
#                             benchmark's --tiny sizes (a smoke test of the whole path)
#   ACCEL_CHECK_JAX_EXTRA     rlflow's jax extra to install instead of the one found (cuda,
#                             tpu, cpu)
#   ACCEL_CHECK_PYTHON        interpreter for the venv (default: scripts/find_python.sh's
#                             Python >= 3.12)
#   ACCEL_CHECK_VENV          venv folder (default .venv-accel)
#   ACCEL_CHECK_OUT           results folder (default bench_results)
#   ACCEL_CHECK_DEV           device folder searched for a TPU (default /dev)
set -euo pipefail
cd "$(dirname "$0")/.."

dry=0
bench_args=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --) shift; bench_args+=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "accelerator_check.sh: unknown argument '$1' (benchmark flags go after --)" >&2
       exit 64 ;;
  esac
  shift
done

run() {  # print (dry run) or run one command
  if [ "$dry" -eq 1 ]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

dev="${ACCEL_CHECK_DEV:-/dev}"
accel=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  accel=gpu
elif compgen -G "$dev/accel*" >/dev/null || compgen -G "$dev/vfio/[0-9]*" >/dev/null; then
  accel=tpu
fi
case "$accel" in
  gpu) extra=cuda; found="NVIDIA GPU: $(nvidia-smi -L | head -n 1)" ;;
  tpu) extra=tpu; found="TPU: $({ compgen -G "$dev/accel*" || compgen -G "$dev/vfio/[0-9]*"; } | tr '\n' ' ')" ;;
  *)
    if [ "${ACCEL_CHECK_ALLOW_CPU:-0}" != 1 ]; then
      echo "accelerator_check.sh: no accelerator found (no working nvidia-smi, no $dev/accel*," \
           "no $dev/vfio/<n>); ACCEL_CHECK_ALLOW_CPU=1 runs the check on CPU (tiny sizes)" >&2
      exit 2
    fi
    accel=cpu; extra=cpu; found="no accelerator: CPU (ACCEL_CHECK_ALLOW_CPU=1)"
    bench_args=(--tiny "${bench_args[@]}")
    ;;
esac
extra="${ACCEL_CHECK_JAX_EXTRA:-$extra}"
py="${ACCEL_CHECK_PYTHON:-}"
venv="${ACCEL_CHECK_VENV:-.venv-accel}"
out="${ACCEL_CHECK_OUT:-bench_results}"
results="$out/accelerator_$(date -u +%Y-%m-%d_%H%M%S).txt"
vpy="$venv/bin/python"

case "$extra" in
  cpu|tpu|cuda) ;;
  *) echo "accelerator_check.sh: ACCEL_CHECK_JAX_EXTRA='$extra' (expected cpu, tpu or cuda)" >&2
     exit 64 ;;
esac
if [ -z "$py" ]; then
  py="$(bash scripts/find_python.sh)" || exit $?
fi
echo "# found $found; rlflow[$extra] into $venv with $py; results: $results"
if [ "$dry" -eq 0 ] && ! command -v "$py" >/dev/null 2>&1; then
  echo "accelerator_check.sh: $py not found (ACCEL_CHECK_PYTHON names another)" >&2
  exit 1
fi
if [ "$dry" -eq 1 ] || [ ! -x "$vpy" ]; then
  run "$py" -m venv "$venv"
fi
run "$vpy" -m pip install -q --upgrade pip
run "$vpy" -m pip install -q -e ".[$extra]"
# jax falls back to CPU (with a warning) when its plugin cannot start: refuse that here
run "$vpy" -c 'import sys, jax; print(jax.devices()); b = jax.default_backend(); sys.exit(0 if b == sys.argv[1] else f"jax backend is {b}, not {sys.argv[1]}")' "$accel"
if [ "$dry" -eq 1 ]; then
  printf '%q ' "$vpy" benchmarks/accelerator.py "${bench_args[@]}"
  printf '2>&1 | tee %q\n' "$results"
else
  mkdir -p "$out"
  "$vpy" benchmarks/accelerator.py "${bench_args[@]}" 2>&1 | tee "$results"
  echo "# results written to $results" >&2
fi
