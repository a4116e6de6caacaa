#!/usr/bin/env bash
# Sets up the venv (first run: ~2-3 min) and runs the whole test suite on this machine's CPUs.
# Usage: bash scripts/run_tests.sh [pytest args...]                 current pinned torch, in .venv
#        MSF_TORCH=2.7 bash scripts/run_tests.sh [pytest args...]   torch 2.7.1 + transformers 4.57.x, in .venv-torch27
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/torch_flavour.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The package's bytecode compiled once: the CLI and launcher tests start many interpreters, and with
# PYTHONDONTWRITEBYTECODE set (as on CI) each would compile it again. compileall writes .pyc whatever that says.
"$VENV/bin/python" -m compileall -q -j 0 mindspeed_flow patches >/dev/null 2>&1 || true
# Two test files at once (pytest-xdist; a file's tests stay in one worker): most tests wait on their forked ranks,
# gloo and process start-up as much as they compute. MSF_TEST_WORKERS=0 runs one test at a time.
exec "$VENV/bin/python" -m pytest -q -n "${MSF_TEST_WORKERS:-2}" --dist loadfile "$@"
