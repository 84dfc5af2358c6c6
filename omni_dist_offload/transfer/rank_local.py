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

    def __init__(self, buffers: Sequence[HostBuffer | None], nbytes: Sequence[int], streams: TransferStreams,
                 device: torch.device, fallback_reason: str | None = None) -> None:
        # buffers[i] is None for a block that stays on the device (no host copy).
        self.buffers = list(buffers)
        self._nbytes = list(nbytes)
        self.fallback_reason = fallback_reason
        self._copy_stream = streams.copy
        self._device = device
        self.slots: list[torch.Tensor] = []

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b is not None)

    def has_host_copy(self, block: int) -> bool:
        return self.buffers[block] is not None

    def device_nbytes(self, block: int) -> int:
        return self._nbytes[block]

    def allocate_slots(self, nbytes: int, count: int) -> None:
        # Every block of every step reuses these slots: allocated here, never per block.
        self.slots = []
        self.slots = plain_slots(nbytes, count, self._device)

    def drop(self, block: int) -> None:
        buf, self.buffers[block] = self.buffers[block], None
        if buf is not None:
            buf.release()

    def fill(self, block, dst, after, ready, marks=None, start=0) -> None:
        src = self.buffers[block].tensor
        if start:  # a block whose first tensors stay on the device: only the rest moves
            src = src[start : start + dst.numel()]
        stream = self._copy_stream
        if stream is None:
            if marks is not None:
                marks[0].record()
            dst.copy_(src)
            if marks is not None:
                marks[1].record()
            return
        if after is not None:
            stream.wait_event(after)
        if marks is not None:
            marks[0].record(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        ready.record(stream)
        if marks is not None:
            marks[1].record(stream)

    def write_back(self, block, src, start=0) -> None:
        self.buffers[block].tensor[start : start + src.numel()].copy_(src)

    def close(self) -> None:
        self.slots = []

    def release(self) -> None:
        self.close()
        for b in self.buffers:
            if b is not None:
                b.release()
