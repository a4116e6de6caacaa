#!/usr/bin/env bash
# Sets up .venv (first run: ~2-3 min) and runs the decoupled training demo on this machine's CPUs:
# tiny Qwen2-VL, InfoVQA-like synthetic data, 1 encoder rank + 2 backbone DP ranks, 50 steps.
# Usage: bash scripts/run_demo.sh [hydra overrides...]     e.g.  bash scripts/run_demo.sh trainer.steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/torch_flavour.sh  # MSF_TORCH=2.7: the same demo on torch 2.7.1 (.venv-torch27)
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Each demo writes a new run directory (run directories are never overwritten): runs/demo-YYYYmmdd-HHMMSS.
exec "$VENV/bin/mindspeed-flow" train experiment=default "run_dir=runs/demo-$(date +%Y%m%d-%H%M%S)" "$@"
