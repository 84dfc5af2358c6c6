"""Process-group start-up for torchrun jobs: the one way every entry point joins (or skips) it.

With one process :func:`maybe_init_dist` does nothing but pick the device, so the same code
runs alone and under torchrun (``maybe_init_dist`` in gpt-fast's sense).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistContext", "destroy_dist", "maybe_init_dist"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DistContext:
    """Where this process sits in the torchrun job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    """``nccl``, ``gloo``, or ``None`` when no process group was created (one process)."""
    device: torch.device = torch.device("cpu")
    """This rank's device: ``cuda:LOCAL_RANK`` (current) on a GPU host, else the CPU."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def maybe_init_dist(device: str | torch.device | None = None) -> DistContext:
    """Join the torchrun process group when there is more than one process; else do nothing.

    On CUDA the rank's device is ``cuda:LOCAL_RANK`` (set as current) and the backend NCCL;
    on the CPU (or with ``device="cpu"``) the backend is gloo."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    dev = torch.device("cpu")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} has no GPU: this host has {torch.cuda.device_count()}; "
                "start at most that many processes per node (torchrun --nproc_per_node)."
            )
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    if world_size == 1:
        return DistContext(rank=rank, world_size=1, local_rank=local_rank, device=dev)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=dev if use_cuda else None)
    logger.info("joined %d ranks (%s)", world_size, backend)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device=dev)


def destroy_dist(ctx: DistContext) -> None:
    """Leave the process group that :func:`maybe_init_dist` joined, if any."""
    if ctx.backend is not None and dist.is_initialized():
        dist.destroy_process_group()
