"""This process's rank, for log lines: ``[rankN] `` under torchrun, nothing otherwise."""

from __future__ import annotations

import os

import torch

__all__ = ["current_rank", "rank_prefix"]


def current_rank() -> int:
    """Global rank: from the process group, else ``RANK`` (set by torchrun), else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def rank_prefix() -> str:
    """``"[rankN] "`` when running under torchrun or a process group, else empty."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"[rank{torch.distributed.get_rank()}] "
    rank = os.environ.get("RANK")
    return f"[rank{rank}] " if rank is not None else ""
