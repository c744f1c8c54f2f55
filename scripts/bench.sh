#!/usr/bin/env bash
# Runs every benchmarks/*.py with .venv/bin/python and writes one Markdown table of the
# figures they print (lines "RESULT <name> <value> <unit> [note...]", see benchmarks/README.md)
# to bench_results/summary.md and stdout. Each benchmark's full output goes to
# bench_results/<benchmark>.log. A benchmark that exits non-zero, times out, prints no
# RESULT line or a malformed one is shown as FAILED in the table, and the script exits 1.
#
# Usage: scripts/bench.sh [name ...]      (names: benchmark files without .py; default: all)
# Environment: BENCH_TIMEOUT (seconds per benchmark, default 1800), BENCH_OUT (output folder).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test

out="${BENCH_OUT:-bench_results}"
limit="${BENCH_TIMEOUT:-1800}"
mkdir -p "$out"
summary="$out/summary.md"

shopt -s nullglob
benches=()
for f in benchmarks/*.py; do
  name="$(basename "$f" .py)"
  case "$name" in _*) continue ;; esac      # shared helpers, not benchmarks
  if [ "$#" -eq 0 ]; then
    benches+=("$f")
  else
    for want in "$@"; do
      if [ "$want" = "$name" ]; then benches+=("$f"); fi
    done
  fi
done
if [ "$#" -gt 0 ] && [ "${#benches[@]}" -ne "$#" ]; then
  have=()
  for f in benchmarks/[!_]*.py; do have+=("$(basename "$f" .py)"); done
  echo "bench.sh: unknown benchmark among: $* (have: ${have[*]:-none})" >&2
  exit 2
fi

cell() {  # escape a value for a Markdown table cell
  printf '%s' "$1" | sed -e 's/|/\\|/g'
}

rows=()
failed=0
for f in "${benches[@]}"; do
  name="$(basename "$f" .py)"
  log="$out/$name.log"
  echo "== $name (log: $log)" >&2
  start=$(date +%s)
  set +e
  timeout "$limit" .venv/bin/python "$f" >"$log" 2>&1
  rc=$?
  set -e
  secs=$(( $(date +%s) - start ))
  ok_lines=0
  bad_lines=0
  while read -r tag rname value unit note; do
    [ "$tag" = "RESULT" ] || continue
    if [ -z "${unit:-}" ] || ! [[ "$value" =~ ^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]]; then
      rows+=("| $name | $(cell "$rname") | FAILED: malformed RESULT line (value '$(cell "$value")', unit '$(cell "${unit:-}")') | | |")
      failed=1
      bad_lines=$((bad_lines + 1))
      continue
    fi
    rows+=("| $name | $(cell "$rname") | $value | $(cell "$unit") | $(cell "${note:-}") |")
    ok_lines=$((ok_lines + 1))
  done < <(grep -E '^RESULT[[:space:]]' "$log" || true)
  if [ "$rc" -ne 0 ]; then
    why="exit code $rc"
    if [ "$rc" -eq 124 ]; then why="timed out after ${limit}s"; fi
    last="$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-160 || true)"
    rows+=("| $name | (run) | FAILED: $why after ${secs}s | | $(cell "$last") (see $log) |")
    failed=1
  elif [ "$ok_lines" -eq 0 ] && [ "$bad_lines" -eq 0 ]; then
    rows+=("| $name | (run) | FAILED: no RESULT lines | | see $log |")
    failed=1
  fi
done

{
  echo "# Benchmark results"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); host: $(hostname); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- python: $(.venv/bin/python -c 'import sys; print(sys.version.split()[0])'); jax: $(.venv/bin/python -c 'import jax; print(jax.__version__, jax.default_backend())' 2>/dev/null || echo unavailable)"
  echo
  if [ "${#benches[@]}" -eq 0 ]; then
    echo "No benchmarks found in benchmarks/*.py."
  else
    echo "| benchmark | result | value | unit | note |"
    echo "|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
  fi
} >"$summary"
cat "$summary"
echo "(written to $summary)" >&2
exit "$failed"
