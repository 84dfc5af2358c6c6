"""The allgather transfer over a collective: every rank keeps one shard of each block, and the
device rebuilds the block with an all-gather (NCCL on GPUs, gloo in CPU tests).

Timeline: [Note: chunked shard all-gather] in ``docs/design.md``. The kernel-free variant for
GPUs that map each other's memory is :mod:`.copy_engine`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..hostmem import HostBuffer, pin_instead
from .groups import WeightGroup
from .protocol import TransferStreams, plain_slots
from .sharding import ShardPlan, plan_shards, shard_pieces, write_shard

__all__ = ["AllGatherTransfer"]

# Newer torch names the flat all-gather all_gather_single (the old name warns); older has only
# all_gather_into_tensor. Same semantics: output is the concatenation of the ranks' inputs.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class AllGatherTransfer:
    """Every rank holds one shard of each block; the device rebuilds the block by all-gather.

    See [Note: chunked shard all-gather] in ``docs/design.md``: chunk ``j``'s host-to-device
    copy of this rank's piece runs on the copy stream, its all-gather on the comm stream, so the
    gather of chunk ``j`` overlaps the copy of chunk ``j + 1``.
    """

    name = "allgather"
    fallback_reason = None

    def __init__(self, shards: Sequence[HostBuffer | None], plans: Sequence[ShardPlan], group: WeightGroup,
                 streams: TransferStreams, device: torch.device) -> None:
        # shards[i] is None for a block that stays on the device (no shard).
        self.shards = list(shards)
        self.plans = list(plans)
        self.group = group
        # What rebuilds the block: NCCL's kernels on GPUs, gloo's all-gather in CPU tests.
        self.gather = "nccl" if "nccl" in group.backend else group.backend
        self._copy_stream = streams.copy
        self._comm_stream = streams.comm
        # (slot offset, this rank's slice start, bytes per rank, host shard offset) per chunk,
        # computed once so the per-block path only slices.
        self._chunks = [self._chunk_table(p) for p in plans]
        # Per block, the bytes at its start that stay on the device for good (a residency plan's
        # partly kept block, :meth:`keep_part`): its shard and plan then cover only the rest.
        self._start = [0] * len(self.plans)
        # chunk_copied[j]: recorded on the copy stream when this rank's piece of chunk j is on
        # the device; the comm stream waits on it before gathering chunk j. Reused by every
        # fill: a wait captures the event's latest record when it is enqueued.
        most = max(len(c) for c in self._chunks)
        self._chunk_copied = [torch.cuda.Event() for _ in range(most)] if streams.copy is not None else []
        self._device = device
        self.slots: list[torch.Tensor] = []

    @staticmethod
    def _chunk_table(plan: ShardPlan) -> tuple[tuple[int, int, int, int], ...]:
        return tuple((offset, start, c, pos)
                     for (offset, _), (start, c, pos) in zip(plan.chunks, shard_pieces(plan), strict=True))

    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards if s is not None)

    def has_host_copy(self, block: int) -> bool:
        return self.shards[block] is not None

    def device_nbytes(self, block: int) -> int:
        return self._start[block] + self.plans[block].padded_nbytes

    def part_nbytes(self, block: int, nbytes: int) -> int:
        """Slot bytes the last ``nbytes`` of block ``block`` would take, gathered, if only they
        streamed (see :meth:`keep_part`)."""
        return self._part_plan(block, nbytes).padded_nbytes

    def _part_plan(self, block: int, nbytes: int) -> ShardPlan:
        # Chunks no larger than the whole block's: the same pipelining of copy and gather.
        whole = self.plans[block]
        return plan_shards(nbytes, whole.world, whole.rank, whole.world * max(c for _, c in whole.chunks))

    def keep_part(self, block: int, start: int, rest: torch.Tensor) -> None:
        """Block ``block``'s first ``start`` bytes stay on the device for good; from now on only
        the rest streams, from this rank's shard of the rest. ``rest``: the block's bytes from
        ``start`` to its end, whole (on the device, as a fill left them). Re-cutting the shards
        is what keeps the ranks even: each copies 1/N of what streams. This rank's shard of the
        whole block gives way to the new one, so host memory drops by its share of the kept
        bytes. Between forwards, on every rank of the group (the plan is agreed); the caller has
        synchronised. A failure leaves the block as it was."""
        if self._start[block]:
            raise ValueError(f"block {block} already keeps its first {self._start[block]} bytes on the device")
        old = self.shards[block]
        if old is None:
            raise ValueError(f"block {block} has no shard: it is resident, not streamed")
        plan = self._part_plan(block, rest.numel())
        shard = HostBuffer(plan.shard_nbytes)
        write_shard(plan, rest, shard.tensor)
        pin_instead(old, shard)
        self.shards[block], self.plans[block], self._start[block] = shard, plan, start
        self._chunks[block] = self._chunk_table(plan)

    def _check_start(self, block: int, start: int) -> None:
        """A gather moves whole blocks, or what a block keeps off the device (:meth:`keep_part`):
        its shards are cut from exactly that."""
        if start != self._start[block]:
            raise ValueError(f"an allgather transfer moves block {block} from byte {self._start[block]} on "
                             f"(its shards are cut from there), found start={start}")

    def allocate_slots(self, nbytes: int, count: int) -> None:
        # Every block of every step reuses these slots: allocated here, never per block.
        self.close()
        self.slots = self._allocate_slots(nbytes, count, self._device)

    def _allocate_slots(self, nbytes: int, count: int, device: torch.device) -> list[torch.Tensor]:
        return plain_slots(nbytes, count, device, (self._copy_stream, self._comm_stream))

    def drop(self, block: int) -> None:
        shard, self.shards[block] = self.shards[block], None
        if shard is not None:
            shard.release()

    def fill(self, block, dst, after, ready, marks=None, start=0) -> None:
        self._check_start(block, start)
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
        if after is not None:
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

    def write_back(self, block, src, start=0) -> None:
        self._check_start(block, start)
        shard = self.shards[block].tensor
        for _offset, mine, c, pos in self._chunks[block]:  # this rank's piece of every chunk
            shard[pos : pos + c].copy_(src[mine : mine + c])

    def close(self) -> None:
        self.slots = []

    def release(self) -> None:
        self.close()
        for s in self.shards:
            if s is not None:
                s.release()
