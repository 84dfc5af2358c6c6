#!/usr/bin/env bash
# The benchmark under torchrun, one process per GPU: every variant runs on every rank in
# lockstep (allgather needs it), timings are the slowest rank's, and rank 0 prints and writes.
#
#   NGPU=2 launch/bench.sh --preset flux-12b --blocks 19 --px 1024 --json flux.json --png flux.png
#   NGPU=2 launch/bench.sh --preset wan-14b --frames 81 --warmup 1 --repeats 4 --timeline tl.png
#   NGPU=2 launch/bench.sh --transfer-mib 700 --chunk-mib 32 64 --repeats 7
#   NGPU=2 OMNI_OFFLOAD_ALLOW_GLOO=1 launch/bench.sh --preset tiny-wan --frames 5 \
#       --height 32 --width 32                                        # CPU smoke run (gloo)
#
# Arguments go to `omni-offload bench` (python -m omni_dist_offload.tools.bench); see its --help.
#   NGPU      processes on this host, 1 or more, or torchrun's auto, gpu, cpu or xpu (default: the GPUs CUDA_VISIBLE_DEVICES names, else those nvidia-smi lists, else 1)
#   LOG_RANK  ranks whose output torchrun shows (default: all; only rank 0 prints results)
#   TORCHRUN  the launcher (default torchrun; e.g. "python3 -m torch.distributed.run")
set -euo pipefail

# NGPU and count(), shared by the launch scripts.
source "$(dirname "${BASH_SOURCE[0]}")/ngpu.sh"
TORCHRUN=${TORCHRUN:-torchrun}
filter=()
if [ -n "${LOG_RANK:-}" ]; then filter=(--local-ranks-filter "$LOG_RANK"); fi

# NVLink multicast stays off: on shared GPU hosts a program using it can put every GPU of the
# host out of service. Set each to another value only on a machine of your own.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

# The checkout first on the path, so a checkout that was not pip-installed runs too.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec $TORCHRUN --standalone --nproc_per_node "$NGPU" "${filter[@]}" -m omni_dist_offload.tools.bench "$@"
