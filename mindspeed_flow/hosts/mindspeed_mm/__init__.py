"""The MindSpeed-MM host: an existing MindSpeed-MM job trains with the image encoder and the text decoder on
separate ranks, each part with its own DP/TP/PP, after a one-line change to its launch script.

    recipe.py     FLOW.yaml -> the parts, checked against the launched world and the job's model.json
    context.py    this rank's part; Megatron's parallel state built per part (sub-worlds); the flow groups
    data.py       MindSpeed-MM's dataset over whole global batches, planned per step by the packing scheduler
    schedule.py   the encoder step, the decoder step around Megatron's schedule, global tokens and grad norm;
                  embeddings and gradients move through the pool's planned mode (`mindspeed_flow.pool.planned`)
    host.py       the providers handed to MindSpeed-MM's `pretrain`
    checkpoint.py per-part Megatron checkpoints; loading a coupled checkpoint into the parts
    convert.py    `mindspeed-flow convert-checkpoint` (coupled <-> parts)
    fsdp2.py      MindSpeed-MM's FSDP2 trainer as a flow job (vision tower and LLM as two FSDP2 parts)
    transformers_entry.py  `pretrain_transformers.py` as a flow job (Megatron's loop, each part its own FSDP2)
    entries.py    which of these an entry script runs, and its check before launch

The patches that connect these to MindSpeed-MM live in `patches/flow.py` (installed as `mindspeed_flow_patches`);
nothing here imports mindspeed, mindspeed_mm or megatron at module top.
"""

# MindSpeed-MM's FSDP2 trainer, a flow entry of its own (fsdp2.py); here so the launcher can route on it without
# importing torch.
FSDP2_TRAINER_SCRIPT = "mindspeed_mm/fsdp/train/trainer.py"
# MindSpeed-MM's Megatron loop over an HF-style model sharded by torch FSDP2 (transformers_entry.py).
TRANSFORMERS_SCRIPT = "pretrain_transformers.py"
# Every entry a flow job runs: the Megatron VLM path first, then the two FSDP2 paths.
FLOW_ENTRY_SCRIPTS = ("pretrain_vlm.py", TRANSFORMERS_SCRIPT, FSDP2_TRAINER_SCRIPT)
