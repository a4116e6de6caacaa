#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment and installs mindspeed-flow with its dev extra.
# Usage: bash scripts/setup_env.sh              -> .venv: torch (CPU, scripts/constraints.txt), transformers, ortools,
#                                                  hydra-core, pytest
#        MSF_TORCH=2.7 bash scripts/setup_env.sh -> .venv-torch27: torch 2.7.1 + transformers 4.57.x
#                                                  (scripts/constraints-torch27.txt), MindSpeed-MM's pair
# Idempotent: a second run only re-installs the package itself (editable), which takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch_flavour.sh
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.msf-deps-$(cat setup.py "$CONSTRAINTS" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  # setuptools >= 70.1 builds wheels by itself: the quick re-install below (--no-build-isolation) needs that, and
  # torch 2.7.1, unlike the current torch, does not pull a new setuptools into the venv.
  "$VENV/bin/python" -m pip install -q --upgrade pip "setuptools>=70.1"
  if [ "$MSF_TORCH" != current ]; then
    # PyPI's torch for an older release is the CUDA build (it runs on CPU) and pulls ~3 GB of CUDA libraries.
    # pip's HTTP cache keeps none of it here (the package proxy sends no caching headers), so the wheels are kept
    # in a wheelhouse of our own: `pip download` skips files already there, and torch installs from it offline.
    wheels=${MSF_WHEELHOUSE:-$HOME/.cache/mindspeed-flow/wheels-torch${MSF_TORCH//./}}
    mkdir -p "$wheels"
    torch_req=$(grep -E '^torch==' "$CONSTRAINTS")
    "$VENV/bin/python" -m pip download -q -d "$wheels" -c "$CONSTRAINTS" "$torch_req"
    "$VENV/bin/python" -m pip install -q --no-index --find-links "$wheels" -c "$CONSTRAINTS" "$torch_req"
  fi
  # Constraints pin torch (and, for older flavours, transformers); every other dependency comes from setup.py.
  "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e ".[dev]"
  touch "$stamp"
else
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
echo "$VENV ready: $("$VENV/bin/python" -c 'import torch,transformers,ortools,hydra;print("torch",torch.__version__,"transformers",transformers.__version__,"ortools",ortools.__version__,"hydra",hydra.__version__)')"
