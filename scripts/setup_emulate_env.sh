#!/usr/bin/env bash
# Creates (or reuses) the venv that runs real MindSpeed-MM jobs under `mindspeed-flow emulate`: the project, its
# torch (as setup_env.sh, MSF_TORCH picks the flavour) and MindSpeed-MM's own Python dependencies (the `emulate`
# extra: transformers 4.57.x, datasets, peft, ...).
# Usage: bash scripts/setup_emulate_env.sh                -> .venv-emulate (current torch, CPU build)
#        MSF_TORCH=2.7 bash scripts/setup_emulate_env.sh  -> .venv-emulate-torch27 (torch 2.7.1, MindSpeed-MM's pin)
# First run ~3-6 min and ~2.5 GB; later runs re-install the package only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch_flavour.sh
VENV=${MSF_EMULATE_VENV:-${VENV/.venv/.venv-emulate}}
# setup_env.sh builds the venv with the flavour's torch (offline from its wheelhouse for older releases) and the
# dev extra; the emulate extra comes on top, under the same constraints.
MSF_VENV=$VENV bash scripts/setup_env.sh >/dev/null
stamp="$VENV/.msf-emulate-$(cat setup.py "$CONSTRAINTS" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e ".[dev,emulate]"
  touch "$stamp"
fi
echo "$VENV ready: $("$VENV/bin/python" -c 'import torch,transformers;print("torch",torch.__version__,"transformers",transformers.__version__)')"
