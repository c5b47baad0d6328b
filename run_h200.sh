#!/usr/bin/env bash
# kiln on 8xH200 (141 GB) per node: GRPO on APPS with Qwen2.5-Coder-7B-Instruct and a colocated vLLM per GPU.
#
#   ./run_h200.sh                                      # one node, 8 GPUs, the defaults below
#   ./run_h200.sh --lr 2e-6 --group-size 16            # any Args field of the script (see its --help)
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_h200.sh   # same command on every node, NODE_RANK 0..NNODES-1
#   SCRIPT=train_ppo.py ./run_h200.sh                  # another trainer with the same launcher
#   DRY_RUN=1 ./run_h200.sh ...                        # print the torchrun command and the resolved Args, start nothing
#
# The defaults go first and your arguments after them, so any default can be overridden (the last one wins).
set -euo pipefail
cd "$(dirname "$0")"

SCRIPT=${SCRIPT:-train_grpo.py}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PYTHON=${PYTHON:-python}

# Memory per H200: awake, vLLM holds the bf16 weights (15 GB) and its KV cache within 60% of the GPU, next to the
# sharded fp32 training state (params, grads, AdamW: about 15 GB per GPU for 7B over 8 GPUs). Asleep (level 2), it
# frees all of that, and training packs 16k tokens per micro batch with activation checkpointing.
defaults=(
    --model Qwen/Qwen2.5-Coder-7B-Instruct
    --data data/apps_train.parquet --eval-data data/apps_test.parquet
    --output-dir runs/grpo-apps-h200
    --engine vllm
    --prompts-per-step 64 --group-size 8
    --max-prompt-tokens 1024 --max-new-tokens 2048 --vllm-max-model-len 3072
    --temperature 1.0 --lr 1e-6
    --mixed-precision --activation-checkpointing full --micro-batch-tokens 16384
    --attn-implementation flex_attention --compile-layers
    --vllm-gpu-memory-utilization 0.6 --vllm-tensor-parallel-size 1
    --total-steps 200 --save-every 25 --eval-every 25 --seed 0
)

launch=(torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$SCRIPT" "${defaults[@]}" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${launch[@]}"
    echo
    exec "$PYTHON" "$SCRIPT" "${defaults[@]}" "$@" --dry-run
fi
exec "${launch[@]}"
