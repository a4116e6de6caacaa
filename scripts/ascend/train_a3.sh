#!/usr/bin/env bash
# NODE_RANK=<i> MASTER_ADDR=<node-0 ip> bash scripts/ascend/train_a3.sh [--dry-run]     (on each node; or HOSTFILE=...)
# A mindspeed-flow job on an Atlas 900 A3 SuperPoD: each node's 8 Ascend 910C packages show as 16 devices (one per
# die), all on the superpod's Unified Bus. JOB=mm runs a flow-patched MindSpeed-MM pretrain_vlm.py (encoder and
# decoder parts from FLOW_RECIPE); JOB=train runs `mindspeed-flow train experiment=EXPERIMENT`.
# `mindspeed-flow launch-script RECIPE.yaml --cluster a3` writes a copy with the plan block filled from a plan; the
# defaults below are a 4-node example. Environment as in MindSpeed-MM's examples/qwen2.5vl/finetune_qwen2_5_vl_72b.sh
# (A3: NPUS_PER_NODE=16, CPU_AFFINITY_CONF=2, expandable segments).
set -euo pipefail

HARDWARE="Atlas 900 A3 SuperPoD"
NPUS_PER_NODE=${NPUS_PER_NODE:-16}
MSF_HW_ENV=("CPU_AFFINITY_CONF=2" "PYTORCH_NPU_ALLOC_CONF=expandable_segments:True")

# >>> plan (each value can be overridden from the environment)
JOB=${JOB:-mm}
FLOW_RECIPE=${FLOW_RECIPE:-flow.yaml}
EXPERIMENT=${EXPERIMENT:-}
NNODES=${NNODES:-4}
PARTS=${PARTS:-"encoder:8x1x1x1 backbone:7x2x4x1"}
GLOBAL_BATCH=${GLOBAL_BATCH:-224}
# <<< plan

# @lib
# shellcheck source=scripts/ascend/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
msf_main "$@"
