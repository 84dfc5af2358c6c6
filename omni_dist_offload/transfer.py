"""Weight transfers: how a block's bytes get from host memory into a device slot.

A transfer enqueues work and records the slot's ready event; it never waits on the host. The
ring decides which block goes into which slot and when (``docs/design.md``,
[Note: block ring timeline]; the allgather timeline is [Note: chunked shard all-gather]).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from .distributed import WeightGroup
from .hostmem import HostBuffer
from .sharding import ShardPlan, shard_pieces

__all__ = ["AllGatherTransfer", "RankLocalTransfer", "WeightTransfer"]

# Newer torch names the flat all-gather all_gather_single (the old name warns); older has only
# all_gather_into_tensor. Same semantics: output is the concatenation of the ranks' inputs.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class WeightTransfer(Protocol):
    name: str
    fallback_reason: str | None

    def host_bytes(self) -> int:
        """Host bytes this rank holds for the ring."""

    def device_nbytes(self, block: int) -> int:
        """Slot bytes block ``block`` occupies once on the device."""

    def fill(self, block: int, dst: torch.Tensor, after: "torch.cuda.Event | None",
             ready: "torch.cuda.Event | None", marks=None) -> None:
        """Enqueue filling ``dst`` with block ``block``: start once ``after`` has fired (the
        slot's previous tenant finished computing), record ``ready`` when the bytes are there.
        Without an accelerator (events are None) the fill is complete when it returns.
        ``marks``: when tracing, a (start, end) pair of trace marks to record around the fill."""

    def release(self) -> None:
        """Unpin host memory. The caller has synchronised the device."""


class RankLocalTransfer:
    """Every rank holds whole blocks in host memory and copies them over its own link."""

    name = "rank-local"

    def __init__(self, buffers: Sequence[HostBuffer], copy_stream: "torch.cuda.Stream | None",
                 fallback_reason: str | None = None) -> None:
        self.buffers = list(buffers)
        self.fallback_reason = fallback_reason
        self._copy_stream = copy_stream

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

    def release(self) -> None:
        for b in self.buffers:
            b.release()


class AllGatherTransfer:
    """Every rank holds one shard of each block; the device rebuilds the block by all-gather.

    See [Note: chunked shard all-gather] in ``docs/design.md``: chunk ``j``'s host-to-device
    copy of this rank's piece runs on the copy stream, its all-gather on the comm stream, so the
    gather of chunk ``j`` overlaps the copy of chunk ``j + 1``.
    """

    name = "allgather"
    fallback_reason = None

    def __init__(self, shards: Sequence[HostBuffer], plans: Sequence[ShardPlan], group: WeightGroup,
                 copy_stream: "torch.cuda.Stream | None", comm_stream: "torch.cuda.Stream | None") -> None:
        self.shards = list(shards)
        self.plans = list(plans)
        self.group = group
        self._copy_stream = copy_stream
        self._comm_stream = comm_stream
        # (slot offset, this rank's slice start, bytes per rank, host shard offset) per chunk,
        # computed once so the per-block path only slices.
        self._chunks = [self._chunk_table(p) for p in plans]
        # chunk_copied[j]: recorded on the copy stream when this rank's piece of chunk j is on
        # the device; the comm stream waits on it before gathering chunk j. Reused by every
        # fill: a wait captures the event's latest record when it is enqueued.
        most = max(len(c) for c in self._chunks)
        self._chunk_copied = [torch.cuda.Event() for _ in range(most)] if copy_stream is not None else []

    @staticmethod
    def _chunk_table(plan: ShardPlan) -> tuple[tuple[int, int, int, int], ...]:
        return tuple((offset, start, c, pos)
                     for (offset, _), (start, c, pos) in zip(plan.chunks, shard_pieces(plan), strict=True))

    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def device_nbytes(self, block: int) -> int:
        return self.plans[block].padded_nbytes

    def fill(self, block, dst, after, ready, marks=None) -> None:
        src = self.shards[block].tensor
        group, world = self.group.group, self.group.size
        copy, comm = self._copy_stream, self._comm_stream
        if copy is None:  # CPU (gloo): each call completes before it returns
            if marks is not None:
                marks[0].record()
            for offset, mine, c, pos in self._chunks[block]:
                dst[mine : mine + c].copy_(src[pos : pos + c])
                _all_gather(dst[offset : offset + world * c], dst[mine : mine + c], group=group)
            if marks is not None:
                marks[1].record()
            return
        copy.wait_event(after)
        if marks is not None:
            marks[0].record(copy)
        for j, (offset, mine, c, pos) in enumerate(self._chunks[block]):
            local = dst[mine : mine + c]
            with torch.cuda.stream(copy):
                local.copy_(src[pos : pos + c], non_blocking=True)
            self._chunk_copied[j].record(copy)
            comm.wait_event(self._chunk_copied[j])
            with torch.cuda.stream(comm):
                # In place: the local input is a view into the output.
                _all_gather(dst[offset : offset + world * c], local, group=group)
        ready.record(comm)
        if marks is not None:
            marks[1].record(comm)

    def release(self) -> None:
        for s in self.shards:
            s.release()
