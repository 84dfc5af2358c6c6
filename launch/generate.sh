#!/usr/bin/env bash
# Data-parallel generation, one process per GPU, through torchrun and launch/generate.py.
#
#   launch/generate.sh                                  # all GPUs of this host, built-in tiny-wan
#   NGPU=8 launch/generate.sh --model Wan-AI/Wan2.2-T2V-A14B-Diffusers --prompts-file prompts.txt
#   NGPU=2 LOG_RANK=0,1 launch/generate.sh --prompt "a red fox" --prompt "a cat"
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NGPU=8 launch/generate.sh --prompts-file p.txt
#
# Arguments go to launch/generate.py (flags of `omni-offload generate`).
#   NGPU         processes on this host (default: the GPUs CUDA_VISIBLE_DEVICES names, else those nvidia-smi lists, else 1)
#   LOG_RANK     comma-separated ranks whose INFO logs show (default 0); warnings show from all
#   NNODES       hosts (default 1); above 1 also NODE_RANK, MASTER_ADDR and MASTER_PORT (29500)
#   TORCHRUN     the launcher (default torchrun)
set -euo pipefail

# The GPUs this process may use: CUDA_VISIBLE_DEVICES when set (a comma-separated list), else
# every GPU nvidia-smi lists.
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    gpus=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c '[^[:space:]]' || true)
else
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
NGPU=${NGPU:-${gpus:-0}}
if [ "$NGPU" -lt 1 ]; then NGPU=1; fi
export LOG_RANK=${LOG_RANK:-0}
NNODES=${NNODES:-1}
TORCHRUN=${TORCHRUN:-torchrun}

# NVLink multicast stays off: on shared GPU hosts a program using it can put every GPU of the
# host out of service. Set each to another value only on a machine of your own.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

if [ "$NNODES" -gt 1 ]; then
  rendezvous=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK (0..NNODES-1) on each host}"
              --master-addr "${MASTER_ADDR:?set MASTER_ADDR to the address of the NODE_RANK=0 host}"
              --master-port "${MASTER_PORT:-29500}")
else
  rendezvous=(--standalone)
fi

# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec $TORCHRUN --nproc_per_node "$NGPU" "${rendezvous[@]}" \
  "$(dirname "${BASH_SOURCE[0]}")/generate.py" "$@"
