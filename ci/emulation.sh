#!/usr/bin/env bash
# bash ci/emulation.sh      (the hosted CI's MindSpeed-MM job)
# MindSpeed-MM itself under the emulated NPU: fetches the pinned sources by commit (ci/fetch_sources.sh) unless
# MSF_SOURCES_ARCHIVE already names an archive of them, then runs `pytest -m mindspeed_mm` through
# scripts/run_mindspeed_mm_tests.sh (which builds .venv-emulate). MSF_TORCH=2.7 runs it on torch 2.7.1.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${MSF_SOURCES_ARCHIVE:-}" ] && [ -z "${MINDSPEED_MM_HOME:-}" ]; then
  work=$(mktemp -d -t msf-ci-sources-XXXXXX)
  trap 'rm -rf "$work"' EXIT
  bash ci/fetch_sources.sh "$work/trees" "$work/sources.tar.gz"
  export MSF_SOURCES_ARCHIVE="$work/sources.tar.gz"
fi
bash scripts/run_mindspeed_mm_tests.sh "$@"
