#!/usr/bin/env bash
# Data-parallel generation, one process per GPU, through torchrun and launch/generate.py.
#
#   launch/generate.sh                                  # all GPUs of this host, built-in tiny-wan
#   NGPU=8 launch/generate.sh --model Wan-AI/Wan2.2-T2V-A14B-Diffusers --prompts-file prompts.txt
#   NGPU=2 LOG_RANK=0,1 launch/generate.sh --prompt "a red fox" --prompt "a cat"
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NGPU=8 launch/generate.sh --prompts-file p.txt
#
# Arguments go to launch/generate.py (flags of `omni-offload generate`).
#   NGPU         processes on this host, 1 or more, or torchrun's auto, gpu, cpu or xpu (default: the GPUs CUDA_VISIBLE_DEVICES names, else those nvidia-smi lists, else 1)
#   LOG_RANK     comma-separated ranks whose INFO logs show (default 0); warnings show from all
#   NNODES       hosts, 1 or more (default 1); above 1 also NODE_RANK (0..NNODES-1), MASTER_ADDR and MASTER_PORT (29500)
#   TORCHRUN     the launcher (default torchrun)
set -euo pipefail

# NGPU and count(), shared by the launch scripts.
source "$(dirname "${BASH_SOURCE[0]}")/ngpu.sh"
export LOG_RANK=${LOG_RANK:-0}
NNODES=${NNODES:-1}
count NNODES "$NNODES" "hosts"
TORCHRUN=${TORCHRUN:-torchrun}

# NVLink multicast stays off: on shared GPU hosts a program using it can put every GPU of the
# host out of service. Set each to another value only on a machine of your own.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

# A < B, for A and B decimal digits without leading zeros of any length (past 2**63, test's -lt
# fails, and a failed test reads as false): the shorter is the smaller, then the first digit apart.
below() {
  (( ${#1} < ${#2} )) || { (( ${#1} == ${#2} )) && [[ $1 < $2 ]]; }
}

if [ "$NNODES" != 1 ]; then  # a positive integer (checked above), of any length
  if [[ ! ${NODE_RANK:-} =~ ^(0|[1-9][0-9]*)$ ]] || ! below "$NODE_RANK" "$NNODES"; then
    echo "$(basename "$0"): error: NODE_RANK='${NODE_RANK:-}' is not a host of NNODES=$NNODES: set NODE_RANK (0..$((NNODES - 1))) on each host." >&2
    exit 2
  fi
  if [ -z "${MASTER_ADDR:-}" ]; then
    echo "$(basename "$0"): error: MASTER_ADDR is not set: set it on each host to the address of the NODE_RANK=0 host." >&2
    exit 2
  fi
  rendezvous=(--nnodes "$NNODES" --node-rank "$NODE_RANK"
              --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}")
else
  if [ -n "${NODE_RANK:-}" ] && [ "$NODE_RANK" != 0 ]; then
    # A second host whose NNODES was left out would run every prompt alone, writing outputs that
    # host 0 writes too.
    echo "$(basename "$0"): error: NODE_RANK='$NODE_RANK' with NNODES=1: set NNODES to the number of hosts on every host, or unset NODE_RANK on a one-host run." >&2
    exit 2
  fi
  rendezvous=(--standalone)
fi

# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec $TORCHRUN --nproc_per_node "$NGPU" "${rendezvous[@]}" \
  "$(dirname "${BASH_SOURCE[0]}")/generate.py" "$@"
