#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 (setup.py's python_requires) for rlflow's venv.
# Looks on PATH (python3.12, python3.13, python3), then in pyenv's installed versions
# ($(pyenv root)/versions/<v>/bin/python3, or $PYENV_ROOT, or ~/.pyenv), the oldest
# version >= 3.12 first (the one CI tests).
# A candidate counts only when it runs and reports a version >= 3.12 (a pyenv shim for a
# version that is not selected fails to run, and is skipped).
# Exit status: 0 with the path on stdout; 2 with one line on stderr saying what to install.
set -uo pipefail
ok() {  # runs, and is >= 3.12
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}
for name in python3.12 python3.13 python3; do
  exe="$(command -v "$name" 2>/dev/null)" || continue
  if ok "$exe"; then
    echo "$exe"
    exit 0
  fi
done
roots=()
if command -v pyenv >/dev/null 2>&1; then
  r="$(pyenv root 2>/dev/null)" && [ -n "$r" ] && roots+=("$r")
fi
roots+=("${PYENV_ROOT:-$HOME/.pyenv}")
for root in "${roots[@]}"; do
  [ -d "$root/versions" ] || continue
  # oldest version first (sort -V), CPython "X.Y.Z" folders only
  while IFS= read -r v; do
    exe="$root/versions/$v/bin/python3"
    if [ -x "$exe" ] && ok "$exe"; then
      echo "$exe"
      exit 0
    fi
  done < <(for d in "$root"/versions/3.*; do
             b="${d##*/}"
             if [[ "$b" =~ ^3\.[0-9]+\.[0-9]+$ ]]; then echo "$b"; fi
           done | sort -V)
done
echo "rlflow needs Python >= 3.12: install python3.12 (e.g. 'apt-get install python3.12 python3.12-venv' or 'pyenv install 3.12'), or set PYTHON=/path/to/python3.12" >&2
exit 2
