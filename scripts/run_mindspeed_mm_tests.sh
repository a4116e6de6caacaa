#!/usr/bin/env bash
# Runs the MindSpeed-MM integration tests (pytest -m mindspeed_mm): real MindSpeed-MM / MindSpeed / Megatron-LM
# sources trained on CPU under the emulated torch_npu, unpatched and as flow jobs.
# Usage: bash scripts/run_mindspeed_mm_tests.sh [pytest args...]       (MSF_TORCH=2.7: on torch 2.7.1, MindSpeed-MM's pin)
# Sources: $MINDSPEED_MM_HOME, $MINDSPEED_HOME, $MEGATRON_HOME if set; else the pinned archive
# ../shared/third_party/mindspeed_mm_sources.tar.gz (or $MSF_SOURCES_ARCHIVE) is unpacked into a temporary folder
# (Megatron compiles a helper into its own tree, so the sources must be writable). Without either, the tests skip
# with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_emulate_env.sh
source scripts/torch_flavour.sh
VENV=${MSF_EMULATE_VENV:-${VENV/.venv/.venv-emulate}}
archive=${MSF_SOURCES_ARCHIVE:-../shared/third_party/mindspeed_mm_sources.tar.gz}
if [ -z "${MINDSPEED_MM_HOME:-}" ] && [ -f "$archive" ]; then
  src=$(mktemp -d -t msf-sources-XXXXXX)
  trap 'rm -rf "$src"' EXIT
  tar xzf "$archive" -C "$src"
  export MINDSPEED_MM_HOME="$src/MindSpeed-MM" MINDSPEED_HOME="$src/MindSpeed" MEGATRON_HOME="$src/Megatron-LM"
  echo "MindSpeed-MM sources unpacked from $archive into $src"
fi
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Bytecode compiled once: every rank of every job imports Megatron, MindSpeed, MindSpeed-MM and this package from
# source, and with PYTHONDONTWRITEBYTECODE set (as on CI) each would compile ~2,000 modules again. compileall writes
# the .pyc files whatever that variable says; an edited source is still recompiled in memory (mtime check).
compile_once() { "$VENV/bin/python" -m compileall -q -j 0 "$@" >/dev/null 2>&1 || true; }
compile_once mindspeed_flow patches ${MEGATRON_HOME:+"$MEGATRON_HOME/megatron"} \
  ${MINDSPEED_HOME:+"$MINDSPEED_HOME/mindspeed"} ${MINDSPEED_MM_HOME:+"$MINDSPEED_MM_HOME"}
# Megatron builds its C++ dataset helper into its own tree when a job starts (rank 0 runs `make` there, with the
# interpreter first on PATH, as `mindspeed-flow emulate` sets it): built once here, two jobs never run `make` in the
# same folder at once.
if [ -n "${MEGATRON_HOME:-}" ] && [ -f "$MEGATRON_HOME/megatron/core/datasets/Makefile" ]; then
  PATH="$(cd "$VENV/bin" && pwd):$PATH" make -s -C "$MEGATRON_HOME/megatron/core/datasets" >/dev/null
fi
# Two test files at once (MSF_TEST_WORKERS, 0: one at a time): one emulated job leaves about half of two cores idle
# (its ranks wait on each other and on the launcher). A file's tests stay in one worker: they share its jobs.
workers=${MSF_TEST_WORKERS:-2}
# Not exec: the EXIT trap removes the unpacked sources afterwards.
"$VENV/bin/python" -m pytest -q -m mindspeed_mm -n "$workers" --dist loadfile tests/mindspeed_mm \
  tests/test_patch_registry.py "$@"
