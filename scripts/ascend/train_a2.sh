#!/usr/bin/env bash
# NODE_RANK=<i> MASTER_ADDR=<node-0 ip> bash scripts/ascend/train_a2.sh [--dry-run]     (on each node; or HOSTFILE=...)
# A mindspeed-flow job on an Atlas 800T A2 cluster: nodes of 8 Ascend 910B NPUs (HCCS inside a node, RoCE across).
# JOB=mm runs a flow-patched MindSpeed-MM pretrain_vlm.py (encoder and decoder parts from FLOW_RECIPE); JOB=train
# runs `mindspeed-flow train experiment=EXPERIMENT`. `mindspeed-flow launch-script RECIPE.yaml --cluster a2`
# writes a copy of this script with the plan block filled from a plan; the defaults below are a 2-node example.
# Environment as in MindSpeed-MM's examples/qwen2.5vl/finetune_qwen2_5_vl_7b.sh (A2): CPU_AFFINITY_CONF=1.
set -euo pipefail

HARDWARE="Atlas 800T A2"
NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MSF_HW_ENV=("CPU_AFFINITY_CONF=1")

# >>> plan (each value can be overridden from the environment)
JOB=${JOB:-mm}
FLOW_RECIPE=${FLOW_RECIPE:-flow.yaml}
EXPERIMENT=${EXPERIMENT:-}
NNODES=${NNODES:-2}
PARTS=${PARTS:-"encoder:4x1x1x1 backbone:6x2x1x1"}
GLOBAL_BATCH=${GLOBAL_BATCH:-96}
# <<< plan

# @lib
# shellcheck source=scripts/ascend/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
msf_main "$@"
