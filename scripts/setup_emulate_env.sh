#!/usr/bin/env bash
# Creates (or reuses) .venv-emulate: the CPU torch plus MindSpeed-MM's own Python dependencies (the `emulate`
# extra: transformers 4.57.x, datasets, peft, ...), for running real MindSpeed-MM jobs under `mindspeed-flow emulate`.
# Usage: bash scripts/setup_emulate_env.sh        (first run ~4-6 min, ~2.5 GB; later runs re-install the package only)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MSF_EMULATE_VENV:-.venv-emulate}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.msf-deps-$(cat setup.py scripts/constraints.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c scripts/constraints.txt -e ".[dev,emulate]"
  touch "$stamp"
else
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
echo "$VENV ready: $("$VENV/bin/python" -c 'import torch,transformers;print("torch",torch.__version__,"transformers",transformers.__version__)')"
