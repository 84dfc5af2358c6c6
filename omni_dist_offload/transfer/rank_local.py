"""The rank-local transfer: every rank holds whole blocks and copies them over its own link."""

from __future__ import annotations

from typing import Sequence

import torch

from ..hostmem import HostBuffer, pin_instead
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
        # Per block, the block offset its host copy starts at: 0, or where keep_part cut it (the
        # bytes before stay on the device for good). Fills and write-backs address the block.
        self._start = [0] * len(self.buffers)
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
        self.slots = plain_slots(nbytes, count, self._device, (self._copy_stream,))

    def drop(self, block: int) -> None:
        buf, self.buffers[block] = self.buffers[block], None
        if buf is not None:
            buf.release()

    def keep_part(self, block: int, start: int, rest: torch.Tensor | None = None) -> torch.Tensor | None:
        """Block ``block``'s first ``start`` bytes stay on the device for good (a final residency
        plan's partly kept block): its host copy gives them up and holds the rest only, so host
        memory drops by them, as it does for a resident block. Returns the new host copy (the
        block's bytes from ``start`` on) for the ring to park the streamed tensors in. ``rest``
        (those bytes on the device, as the gathering transfer takes them) is not needed: the
        host copy holds them. Between forwards; the
        caller has synchronised. A failure leaves the block as it was."""
        if self._start[block]:
            raise ValueError(f"block {block} already keeps its first {self._start[block]} bytes on the device")
        old = self.buffers[block]
        if old is None:
            raise ValueError(f"block {block} has no host copy: it is resident, not streamed")
        if not 0 < start < old.nbytes:
            raise ValueError(f"block {block} cannot keep {start} of its {old.nbytes} bytes on the device")
        new = HostBuffer(old.nbytes - start)
        new.tensor.copy_(old.tensor[start:])
        pin_instead(old, new)
        self.buffers[block], self._start[block] = new, start
        return new.tensor

    def _host(self, block: int, start: int, nbytes: int) -> torch.Tensor:
        """Block ``block``'s ``nbytes`` of host copy from block offset ``start``."""
        begin = start - self._start[block]
        if begin < 0:
            raise ValueError(f"block {block}'s host copy starts at byte {self._start[block]} (the bytes before "
                             f"stay on the device), found start={start}")
        host = self.buffers[block].tensor
        return host if begin == 0 and nbytes == host.numel() else host[begin : begin + nbytes]

    def fill(self, block, dst, after, ready, marks=None, start=0) -> None:
        # A block whose first tensors stay on the device: only the rest moves.
        src = self._host(block, start, dst.numel())
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
        self._host(block, start, src.numel()).copy_(src)

    def close(self) -> None:
        self.slots = []

    def release(self) -> None:
        self.close()
        for b in self.buffers:
            if b is not None:
                b.release()
