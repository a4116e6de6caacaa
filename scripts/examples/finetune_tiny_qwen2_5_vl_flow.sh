#!/bin/bash
# shellcheck disable=SC1091,SC2004,SC2034,SC2086  # MindSpeed-MM's example style: flag strings split on purpose
# A MindSpeed-MM Qwen2.5-VL fine-tuning launch in the shape of MindSpeed-MM's own examples/qwen2.5vl scripts,
# scaled to the tiny model of `python -m mindspeed_flow.emulation.tiny WORKDIR`. Run it from the MindSpeed-MM root:
#   bash /path/to/mindspeed-flow/scripts/examples/finetune_tiny_qwen2_5_vl.sh
# On a CPU machine: TINY_WORKDIR=... mindspeed-flow emulate --shell THIS_SCRIPT (emulated NPU, sources on the path).
# finetune_tiny_qwen2_5_vl_flow.sh is this script with one line changed: the same job, trained decoupled.
[ -f /usr/local/Ascend/cann/set_env.sh ] && source /usr/local/Ascend/cann/set_env.sh
[ -f /usr/local/Ascend/nnal/atb/set_env.sh ] && source /usr/local/Ascend/nnal/atb/set_env.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1
export ASCEND_GLOBAL_LOG_LEVEL=3
export HCCL_CONNECT_TIMEOUT=1200

NPUS_PER_NODE=${NPUS_PER_NODE:-2}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))

WORKDIR=${TINY_WORKDIR:?set TINY_WORKDIR to a folder made by python -m mindspeed_flow.emulation.tiny}
MM_DATA="$WORKDIR/data.json"
MM_MODEL="$WORKDIR/model.json"
MM_TOOL="./mindspeed_mm/tools/tools.json"
FLOW_RECIPE=${FLOW_RECIPE:-$(dirname "$0")/../../recipes/mindspeed_mm/tiny_enc1_dec_dp2.yaml}
TP=1
PP=1
CP=1
MBS=1
GRAD_ACC_STEP=2
# The global batch stays that of the 2-rank coupled job, so its flow version trains on the same batches.
DP=$((2/$TP/$PP/$CP))
GBS=$(($MBS*$GRAD_ACC_STEP*$DP))

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

GPT_ARGS="
    --use-mcore-models \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --context-parallel-size ${CP} \
    --micro-batch-size ${MBS} \
    --global-batch-size ${GBS} \
    --tokenizer-type NullTokenizer \
    --vocab-size 384 \
    --seq-length 128 \
    --make-vocab-size-divisible-by 1 \
    --normalization RMSNorm \
    --use-fused-rmsnorm \
    --swiglu \
    --use-fused-swiglu \
    --no-masked-softmax-fusion \
    --lr 1.0e-3 \
    --lr-decay-style constant \
    --weight-decay 0 \
    --train-iters ${TRAIN_ITERS:-5} \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --adam-beta2 0.999 \
    --seed 42 \
    --bf16 \
    --use-flash-attn \
    --variable-seq-lengths \
    --use-distributed-optimizer \
    --calculate-per-token-loss \
    --no-gradient-accumulation-fusion \
    --num-workers 0 \
    --distributed-timeout-minutes 20 \
"

MM_ARGS="
    --mm-data $MM_DATA \
    --mm-model $MM_MODEL \
    --mm-tool $MM_TOOL
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 10000 \
    --eval-interval 10000 \
    --eval-iters 0 \
    --ckpt-format torch \
"
torchrun $DISTRIBUTED_ARGS -m mindspeed_flow_patches.launch --flow-recipe $FLOW_RECIPE pretrain_vlm.py \
    $GPT_ARGS \
    $MM_ARGS \
    $OUTPUT_ARGS \
    --distributed-backend nccl
