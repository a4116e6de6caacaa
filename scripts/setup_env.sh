#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment in .venv and installs mindspeed-flow with its dev extra.
# Usage: bash scripts/setup_env.sh            -> .venv with torch (CPU), transformers, ortools, hydra-core, pytest
# Idempotent: a second run only re-installs the package itself (editable), which takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MSF_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.msf-deps-$(cat setup.py scripts/constraints.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # Constraints pin torch to the CPU build; every other dependency comes from setup.py's extras.
  "$VENV/bin/python" -m pip install -q -c scripts/constraints.txt -e ".[dev]"
  touch "$stamp"
else
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
echo "$VENV ready: $("$VENV/bin/python" -c 'import torch,transformers,ortools,hydra;print("torch",torch.__version__,"transformers",transformers.__version__,"ortools",ortools.__version__,"hydra",hydra.__version__)')"
