#!/usr/bin/env bash
# bash ci/fetch_sources.sh DEST [ARCHIVE.tar.gz]
# Fetches MindSpeed-MM, MindSpeed and Megatron-LM by commit (the ones the emulation and the patches are tested
# against) into DEST/<name>, writes each tree's .source_commit, and with ARCHIVE packs the three trees (no .git) in
# the layout scripts/run_mindspeed_mm_tests.sh unpacks (MSF_SOURCES_ARCHIVE). Needs git and the network; mirrors:
# MSF_MINDSPEED_MM_URL, MSF_MINDSPEED_URL, MSF_MEGATRON_LM_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:?usage: bash ci/fetch_sources.sh DEST [ARCHIVE.tar.gz]}
archive=${2:-}
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
args=(fetch "$dest")
if [ -n "$archive" ]; then args+=(--archive "$archive"); fi
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PY" -m mindspeed_flow.emulation.sources "${args[@]}"
