# shellcheck shell=bash
# Shared body of the Ascend launch scripts (train_a2.sh, train_a3.sh; `mindspeed-flow launch-script` inlines it
# into the scripts it writes): CANN environment, node rank, the per-node torchrun line, and --dry-run, which prints
# every node's command and environment on any machine (no CANN, no NPU, nothing started).
#
# The sourcing script sets: HARDWARE (a label), NPUS_PER_NODE, MSF_HW_ENV (array of NAME=VALUE), and the plan block:
# JOB (mm | train), FLOW_RECIPE (mm), EXPERIMENT (train), NNODES, PARTS ("name:DPxTPxPPxCP ..." in rank order:
# each part takes the next contiguous block of global ranks), GLOBAL_BATCH, and the job variables below.

# MindSpeed-MM's launch environment (examples/qwen2.5vl/finetune_qwen2_5_vl_*.sh set the same values).
MSF_COMMON_ENV=(
  "CUDA_DEVICE_MAX_CONNECTIONS=1"
  "ASCEND_SLOG_PRINT_TO_STDOUT=0"
  "ASCEND_GLOBAL_LOG_LEVEL=3"
  "TASK_QUEUE_ENABLE=2"
  "COMBINED_ENABLE=1"
  "HCCL_CONNECT_TIMEOUT=1200"
  "NPU_ASD_ENABLE=0"
  "ASCEND_LAUNCH_BLOCKING=0"
  "ACLNN_CACHE_LIMIT=100000"
)

# The job's own settings (the sourcing script or the environment may set them first). mm: MindSpeed-MM's data and
# model configs, relative to its root as in its examples (the plan block sets them from the recipe's model; with
# no model there they must be given); train: the run folder.
: "${MM_DATA:=}" "${MM_MODEL:=}"
: "${MM_TOOL:=./mindspeed_mm/tools/tools.json}" "${LOAD_PATH:=}" "${SAVE_PATH:=save_dir}" "${MBS:=1}"
: "${SEQ_LENGTH:=1024}" "${VOCAB_SIZE:=152064}" "${LR:=1.0e-5}" "${TRAIN_ITERS:=10000}" "${SAVE_INTERVAL:=10000}"
: "${RUN_DIR:=runs/${EXPERIMENT:-flow}}" "${CANN_ENV:=/usr/local/Ascend/cann/set_env.sh}"

msf_usage() {
  cat <<USAGE
usage: $0 [--dry-run]
  Launches this node's ranks of a ${HARDWARE} job (${JOB}: $([ "$JOB" = mm ] && echo "flow-patched MindSpeed-MM \
pretrain_vlm.py, recipe $FLOW_RECIPE" || echo "mindspeed-flow train experiment=$EXPERIMENT")).
  Run it on every node with NODE_RANK set (or HOSTFILE: one IP per line, the first is the master), MASTER_ADDR
  (default: the HOSTFILE's first line), MASTER_PORT (default 6000). CANN_ENV: CANN's set_env.sh.
  FLOW_RECIPE and the save / load / run folders must be on storage every node shares.
  mm: MM_MODEL, MM_DATA (default: the recipe's model's MindSpeed-MM example configs), MM_TOOL, SAVE_PATH,
  LOAD_PATH (a checkpoint to fine-tune from: --finetune --no-load-optim --no-load-rng; LOAD_PATH=SAVE_PATH
  resumes the run), MBS, SEQ_LENGTH, VOCAB_SIZE, LR, TRAIN_ITERS, SAVE_INTERVAL. train: RUN_DIR, MSF_DEVICE.
  EXTRA_ARGS: more arguments for the job, split on white space (no quoting).
  FLOW_SOCKET_IFNAME: the network interface for gloo and HCCL (sets GLOO_SOCKET_IFNAME, HCCL_SOCKET_IFNAME).
  LOG_DIR: each node also writes its output to LOG_DIR/train_<date>_node<rank>.log (default: ./logs).
  --dry-run  print every node's command and environment, start nothing (works on any machine)
USAGE
}

msf_fail() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# "name:DPxTPxPPxCP" -> the part's rank count
msf_part_size() {
  local dims=${1#*:} size=1 d
  local -a axes
  IFS=x read -r -a axes <<<"$dims"
  for d in "${axes[@]}"; do size=$((size * d)); done
  echo "$size"
}

msf_world_of_parts() {
  local total=0 entry
  for entry in $PARTS; do total=$((total + $(msf_part_size "$entry"))); done
  echo "$total"
}

# The parts' ranks on node $1, e.g. "encoder 0-3, backbone 4-7".
msf_parts_on_node() {
  local lo=$(($1 * NPUS_PER_NODE)) start=0 out="" entry size a b
  local hi=$((lo + NPUS_PER_NODE - 1))
  for entry in $PARTS; do
    size=$(msf_part_size "$entry")
    a=$((start > lo ? start : lo))
    b=$((start + size - 1 < hi ? start + size - 1 : hi))
    if [ "$a" -le "$b" ]; then out+="${out:+, }${entry%%:*} $a-$b"; fi
    start=$((start + size))
  done
  echo "$out"
}

msf_node_rank() {
  if [ -n "${NODE_RANK:-}" ]; then echo "$NODE_RANK"; return; fi
  if [ "$NNODES" -eq 1 ]; then echo 0; return; fi
  [ -n "${HOSTFILE:-}" ] || msf_fail "set NODE_RANK, or HOSTFILE (one node IP per line) to look it up"
  local ip
  for ip in $(hostname -I); do
    awk -v ip="$ip" '$1 == ip { print NR - 1; found = 1; exit } END { exit !found }' "$HOSTFILE" && return
  done
  msf_fail "none of this node's addresses ($(hostname -I)) is in HOSTFILE=$HOSTFILE"
}

# MSF_CMD := node $1's command.
msf_command() {
  MSF_CMD=(torchrun --nproc_per_node "$NPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$1"
           --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
  if [ "$JOB" = mm ]; then
    local tp=1 pp=1 cp=1 dp
    if [ "${PARTS#coupled:}" != "$PARTS" ]; then
      # A coupled plan is the unpatched MindSpeed-MM job: Megatron's own sizes from PARTS, no flow launcher.
      IFS=x read -r dp tp pp cp <<<"${PARTS#coupled:}"
      : "$dp"
      MSF_CMD+=(pretrain_vlm.py)
    else
      # A flow job's per-part TP/PP/DP come from FLOW_RECIPE; the job's own Megatron sizes stay 1.
      MSF_CMD+=(-m mindspeed_flow_patches.launch --flow-recipe "$FLOW_RECIPE" pretrain_vlm.py)
    fi
    MSF_CMD+=(--use-mcore-models --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp")
    if [ "$cp" -gt 1 ]; then MSF_CMD+=(--context-parallel-size "$cp" --context-parallel-algo ulysses_cp_algo); fi
    MSF_CMD+=(--micro-batch-size "$MBS" --global-batch-size "$GLOBAL_BATCH" --seq-length "$SEQ_LENGTH"
      --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE" --make-vocab-size-divisible-by 1
      --normalization RMSNorm --use-fused-rmsnorm --swiglu --use-fused-swiglu --no-masked-softmax-fusion
      --use-flash-attn --bf16 --variable-seq-lengths --calculate-per-token-loss --use-distributed-optimizer
      --lr "$LR" --lr-decay-style cosine --weight-decay 0 --train-iters "$TRAIN_ITERS" --clip-grad 1.0
      --adam-beta1 0.9 --adam-beta2 0.999 --no-gradient-accumulation-fusion --seed 42
      --distributed-backend nccl --mm-data "$MM_DATA" --mm-model "$MM_MODEL" --mm-tool "$MM_TOOL"
      --log-interval 1 --save-interval "$SAVE_INTERVAL" --eval-interval "$SAVE_INTERVAL" --eval-iters 0
      --save "$SAVE_PATH" --ckpt-format torch --tensorboard-dir "$SAVE_PATH/tensorboard"
      --distributed-timeout-minutes 20)
    if [ -n "$LOAD_PATH" ] && [ "$LOAD_PATH" = "$SAVE_PATH" ]; then MSF_CMD+=(--load "$LOAD_PATH")  # resume
    elif [ -n "$LOAD_PATH" ]; then MSF_CMD+=(--load "$LOAD_PATH" --finetune --no-load-optim --no-load-rng); fi
  else
    MSF_CMD+=(-m mindspeed_flow.cli train "experiment=$EXPERIMENT" "run_dir=$RUN_DIR")
  fi
  if [ -n "${EXTRA_ARGS:-}" ]; then
    local -a extra
    read -r -a extra <<<"$EXTRA_ARGS"
    MSF_CMD+=("${extra[@]}")
  fi
}

msf_main() {
  local dry_run=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) dry_run=1 ;;
      -h | --help) msf_usage; exit 0 ;;
      *) msf_fail "unknown argument '$1' (see --help)" ;;
    esac
    shift
  done
  case "$JOB" in mm | train) ;; *) msf_fail "JOB=$JOB: must be mm or train" ;; esac
  local world parts_world
  world=$((NNODES * NPUS_PER_NODE))
  parts_world=$(msf_world_of_parts)
  [ "$world" -eq "$parts_world" ] || msf_fail "NNODES=$NNODES x NPUS_PER_NODE=$NPUS_PER_NODE = $world ranks, but \
the plan's parts ($PARTS) need $parts_world"
  if [ -z "${MASTER_ADDR:-}" ]; then
    if [ -n "${HOSTFILE:-}" ]; then MASTER_ADDR=$(awk 'NF { print $1; exit }' "$HOSTFILE")
    elif [ "$NNODES" -eq 1 ]; then MASTER_ADDR=localhost
    elif [ "$dry_run" -eq 1 ]; then MASTER_ADDR='<MASTER_ADDR>'
    else msf_fail "set MASTER_ADDR (the node-0 address) or HOSTFILE"
    fi
  fi
  MASTER_PORT=${MASTER_PORT:-6000}
  local -a env_list=("${MSF_COMMON_ENV[@]}" "${MSF_HW_ENV[@]}")
  if [ -n "${FLOW_SOCKET_IFNAME:-}" ]; then
    env_list+=("GLOO_SOCKET_IFNAME=$FLOW_SOCKET_IFNAME" "HCCL_SOCKET_IFNAME=$FLOW_SOCKET_IFNAME")
  fi
  [ "$JOB" = train ] && env_list+=("MSF_DEVICE=${MSF_DEVICE:-npu}")
  local workdir=$PWD
  [ "$JOB" = mm ] && workdir=${MINDSPEED_MM_HOME:-<MINDSPEED_MM_HOME>}
  if [ "$dry_run" -eq 1 ]; then
    MM_MODEL=${MM_MODEL:-<MM_MODEL>} MM_DATA=${MM_DATA:-<MM_DATA>}
    echo "# $HARDWARE: $NNODES node(s) x $NPUS_PER_NODE NPUs = $world ranks; job: $JOB; parts: $PARTS"
    echo "source $CANN_ENV"
    printf 'export %s\n' "${env_list[@]}"
    echo "cd $workdir"
    local node
    for ((node = 0; node < NNODES; node++)); do
      msf_command "$node"
      echo "# node $node: ranks $((node * NPUS_PER_NODE))-$(((node + 1) * NPUS_PER_NODE - 1)): $(msf_parts_on_node "$node")"
      printf '%q ' "${MSF_CMD[@]}"
      echo
    done
    return 0
  fi
  [ -f "$CANN_ENV" ] || msf_fail "CANN_ENV=$CANN_ENV: no such file (point it at CANN's set_env.sh)"
  # shellcheck disable=SC1090  # CANN's own script, at a path only known on the cluster
  source "$CANN_ENV"
  local kv
  for kv in "${env_list[@]}"; do export "${kv?}"; done
  local node_rank log
  node_rank=$(msf_node_rank)
  mkdir -p "${LOG_DIR:=$PWD/logs}"
  log="$(cd "$LOG_DIR" && pwd)/train_$(date +%Y%m%d_%H%M%S)_node${node_rank}.log"
  if [ "$JOB" = mm ]; then
    [ -f "$FLOW_RECIPE" ] || msf_fail "FLOW_RECIPE=$FLOW_RECIPE: no such file on this node ($HOSTNAME): put it on \
storage every node shares (mindspeed-flow plan --out writes one)"
    if [ -z "$MM_MODEL" ] || [ -z "$MM_DATA" ]; then
      msf_fail "set MM_MODEL and MM_DATA (MindSpeed-MM's model.json and data.json): the recipe names no Qwen2.5-VL \
model this script knows"
    fi
    FLOW_RECIPE="$(cd "$(dirname "$FLOW_RECIPE")" && pwd)/$(basename "$FLOW_RECIPE")"  # before leaving this folder
    [ -d "${MINDSPEED_MM_HOME:-}" ] || msf_fail "set MINDSPEED_MM_HOME to the MindSpeed-MM checkout"
    cd "$MINDSPEED_MM_HOME" || exit 2
  fi
  msf_command "$node_rank"
  echo "[$HARDWARE] node $node_rank of $NNODES: ranks $(msf_parts_on_node "$node_rank"); log: $log"
  "${MSF_CMD[@]}" 2>&1 | tee "$log"
  exit "${PIPESTATUS[0]}"
}
