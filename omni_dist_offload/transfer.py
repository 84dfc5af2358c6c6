"""Weight transfers: how a block's bytes get from host memory into a device slot.

A transfer enqueues work and records the slot's ready event; it never waits on the host. The
ring decides which block goes into which slot and when (see ``docs/design.md``,
[Note: block ring timeline]).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .hostmem import HostBuffer

__all__ = ["RankLocalTransfer", "WeightTransfer"]


class WeightTransfer(Protocol):
    name: str

    def host_bytes(self) -> int: ...

    def fill(self, block: int, dst: torch.Tensor, after: "torch.cuda.Event | None",
             ready: "torch.cuda.Event | None") -> None:
        """Enqueue filling ``dst`` with block ``block``: start once ``after`` has fired (the
        slot's previous tenant finished computing), record ``ready`` when the bytes are there."""

    def release(self) -> None: ...


class RankLocalTransfer:
    """Every rank holds whole blocks in host memory and copies them over its own link."""

    name = "rank-local"

    def __init__(self, buffers: Sequence[HostBuffer], copy_stream: "torch.cuda.Stream | None") -> None:
        self.buffers = list(buffers)
        # The copy stream exists so that host-to-device copies run beside compute instead of
        # queueing behind it; it is shared by every ring of one apply_offload call.
        self._copy_stream = copy_stream

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def fill(self, block, dst, after, ready) -> None:
        src = self.buffers[block].tensor
        stream = self._copy_stream
        if stream is None:  # no accelerator: a plain copy, already complete when it returns
            dst.copy_(src)
            return
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        ready.record(stream)

    def release(self) -> None:
        for b in self.buffers:
            b.release()
        self.buffers = []
