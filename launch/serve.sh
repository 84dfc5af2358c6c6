#!/usr/bin/env bash
# The generation service on all GPUs of this host: torchrun, one process per GPU; rank 0 answers
# HTTP, every rank generates (docs/serving.md).
#
#   launch/serve.sh --model Wan-AI/Wan2.2-T2V-A14B-Diffusers \
#       --diffusion-offload-config '{"mode":"layer","components":["dit"],"layer_options":{"dit":{"weight_transfer":"allgather"}}}'
#   NGPU=2 LOG_RANK=0,1 launch/serve.sh --model tiny-flux --port 8000
#
# Arguments go to `omni-offload serve`.
#   NGPU         processes on this host, 1 or more, or torchrun's auto, gpu, cpu or xpu (default: the GPUs CUDA_VISIBLE_DEVICES names, else those nvidia-smi lists, else 1)
#   LOG_RANK     comma-separated ranks whose INFO logs show (default 0); warnings show from all
#   TORCHRUN     the launcher (default torchrun)
# Stop it with SIGTERM to rank 0 (all ranks then exit 0, and torchrun with them): queued requests
# get 503 at once, running ones finish. SIGTERM or Ctrl-C to torchrun does the same, but torchrun
# exits 1, and kills the ranks after its shutdown timeout (30 s; --shutdown-timeout in TORCHRUN
# where your torch has it), cutting off generations running longer than that.
set -euo pipefail

# NGPU and count(), shared by the launch scripts.
source "$(dirname "${BASH_SOURCE[0]}")/ngpu.sh"
export LOG_RANK=${LOG_RANK:-0}
TORCHRUN=${TORCHRUN:-torchrun}

# NVLink multicast stays off: on shared GPU hosts a program using it can put every GPU of the
# host out of service. Set each to another value only on a machine of your own.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

# Works from a checkout that was not pip-installed.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec $TORCHRUN --nproc_per_node "$NGPU" --standalone -m omni_dist_offload serve "$@"
