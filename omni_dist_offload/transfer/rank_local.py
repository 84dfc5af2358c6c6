"""The rank-local transfer: every rank holds whole blocks and copies them over its own link."""

from __future__ import annotations

from typing import Sequence

import torch

from ..hostmem import HostBuffer
from .protocol import TransferStreams, plain_slots

__all__ = ["RankLocalTransfer"]


class RankLocalTransfer:
    """Every rank holds whole blocks in host memory and copies them over its own link."""

    name = "rank-local"
    gather = None

    def __init__(self, buffers: Sequence[HostBuffer], streams: TransferStreams, device: torch.device,
                 num_slots: int, fallback_reason: str | None = None) -> None:
        self.buffers = list(buffers)
        self.fallback_reason = fallback_reason
        self._copy_stream = streams.copy
        # One slot fits the largest block; every block of every step reuses the same slots.
        self.slots = plain_slots(max(b.nbytes for b in self.buffers), num_slots, device)

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def device_nbytes(self, block: int) -> int:
        return self.buffers[block].nbytes

    def fill(self, block, dst, after, ready, marks=None) -> None:
        src = self.buffers[block].tensor
        stream = self._copy_stream
        if stream is None:
            if marks is not None:
                marks[0].record()
            dst.copy_(src)
            if marks is not None:
                marks[1].record()
            return
        stream.wait_event(after)
        if marks is not None:
            marks[0].record(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        ready.record(stream)
        if marks is not None:
            marks[1].record(stream)

    def close(self) -> None:
        self.slots = []

    def release(self) -> None:
        self.close()
        for b in self.buffers:
            b.release()
