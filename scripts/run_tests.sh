#!/usr/bin/env bash
# Sets up .venv (first run: ~2-3 min) and runs the whole test suite on this machine's CPUs.
# Usage: bash scripts/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
