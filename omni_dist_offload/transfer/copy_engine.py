"""The copy-engine gather: allgather with no kernel at all, for GPUs that map each other's
memory. Peer copies run on the copy engines; ranks synchronise through stream-ordered flags.

Timeline: [Note: copy-engine gather] in ``docs/design.md``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from typing import Sequence

import torch

try:  # CUDA symmetric memory is in torch >= 2.5; without it the weight group's facts say so
    import torch.distributed._symmetric_memory as symm_mem
except ImportError:  # pragma: no cover - older torch
    symm_mem = None

from ..hostmem import HostBuffer
from .allgather import AllGatherTransfer
from .groups import WeightGroup, agree_step
from .memops import StreamMemOps
from .protocol import TransferStreams
from .sharding import ShardPlan

__all__ = ["CopyEngineGatherTransfer"]

_FLAG_BYTES = 4


class CopyEngineGatherTransfer(AllGatherTransfer):
    """allgather with no kernel at all: peer copies on the copy engines, stream-ordered flags.

    The ring's slots live in one CUDA symmetric-memory allocation, mapped into every rank of the
    weight group, with a few flag words after them. Each rank copies its shard piece of a chunk
    into its own slot (copy stream), then raises its ``arrive`` flag in every peer's memory; each
    rank waits for the peers' flags and pulls their pieces straight out of their slots with
    device-to-device copies over NVLink (comm stream), then raises its ``done`` flag in every
    peer. Flags are written and awaited with stream memory operations (``cuStreamWriteValue32``,
    ``cuStreamWaitValue32``), which the GPU's front end executes: no thread block is launched,
    so no SM is taken from the model, not even one spinning in a barrier while the other rank
    catches up (Hopper's GEMM and attention kernels size their grids to every SM, so one held SM
    stretches them). See [Note: copy-engine gather] in ``docs/design.md``.
    """

    def __init__(self, shards: Sequence[HostBuffer], plans: Sequence[ShardPlan], group: WeightGroup,
                 streams: TransferStreams, device: torch.device, timeout_s: float,
                 name: str = "allgather") -> None:
        self._ops = StreamMemOps()
        self._timeout_s = timeout_s
        self._name = name
        self._handle = None
        self._base: torch.Tensor | None = None
        self._peer_views: list[torch.Tensor] = []
        # Sequence numbers, the same on every rank (fills run in lockstep): one per chunk
        # arrival, one per fill. Flags only grow (mod 2**32; the waits compare wrap-safely).
        self._arrived = 0
        self._filled = 0
        self._watchdog: _Watchdog | None = None
        super().__init__(shards, plans, group, streams, device)
        self.gather = "copy-engine"

    def _allocate_slots(self, nbytes: int, count: int, device: torch.device) -> list[torch.Tensor]:
        """The slots as one symmetric allocation mapped into every rank, with the flag words
        after them; collective over the weight group. The allocation may fail on one rank only
        (its device out of memory): the ranks agree on it before the rendezvous, so that every
        rank raises at once (``groups.agree_step``) rather than the others waiting in it."""
        pg, world = self.group.group, self.group.size
        flags_at = nbytes * count
        total = flags_at + _FLAG_BYTES * world * 2
        error: BaseException | None = None
        try:
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                # Older torch needs the group registered first; newer torch deprecates the call.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(pg.group_name)
            base = symm_mem.empty(total, dtype=torch.uint8, device=device)
            # Flags start at zero on every rank before any peer can write them: zeroed and
            # synchronised here, and rendezvous (collective) comes after. The sequence numbers
            # restart with them (every rank allocates its slots at the same point).
            self._arrived = self._filled = 0
            base[flags_at:].zero_()
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised (agree_step)
            error, base = exc, None
        agree_step(self.group, device, error, "allocating the copy-engine gather's slots")
        handle = symm_mem.rendezvous(base, pg)
        self._handle, self._base = handle, base
        # Each rank's whole allocation as seen from this device; fills slice it per chunk.
        self._peer_views = [handle.get_buffer(r, (total,), torch.uint8) for r in range(world)]
        ptrs = list(handle.buffer_ptrs)
        me = self.group.rank
        # Flag words: arrive[q] at flags_at + q * _FLAG_BYTES, done[q] after the arrive words;
        # rank q writes word q of every peer, each rank waits only on its own memory.
        self._arrive_local = [ptrs[me] + flags_at + q * _FLAG_BYTES for q in range(world)]
        self._done_local = [ptrs[me] + flags_at + (world + q) * _FLAG_BYTES for q in range(world)]
        self._arrive_remote = [ptrs[q] + flags_at + me * _FLAG_BYTES for q in range(world)]
        self._done_remote = [ptrs[q] + flags_at + (world + me) * _FLAG_BYTES for q in range(world)]
        self._peers = [(me - step) % world for step in range(1, world)]
        self._watchdog = _Watchdog(self._timeout_s, self._name)
        return [base[s * nbytes : (s + 1) * nbytes] for s in range(count)]

    def fill(self, block, dst, after, ready, marks=None, start=0) -> None:
        self._check_start(block, start)
        src = self.shards[block].tensor
        ops, peers = self._ops, self._peers
        copy, comm = self._copy_stream, self._comm_stream
        # dst is a view into the symmetric allocation; every rank uses the same slot offsets.
        at = dst.storage_offset() - self._base.storage_offset()
        if after is not None:
            copy.wait_event(after)
        # Peers may still be pulling this rank's piece of the slot's previous tenant: wait until
        # every peer has finished pulling from every earlier fill before overwriting it.
        for q in peers:
            ops.wait_geq(copy, self._done_local[q], self._filled)
        if marks is not None:
            marks[0].record(copy)
        for j, (offset, mine, c, pos) in enumerate(self._chunks[block]):
            self._arrived += 1
            with torch.cuda.stream(copy):
                dst[mine : mine + c].copy_(src[pos : pos + c], non_blocking=True)
            # This rank's piece of chunk j is in its slot: tell every peer (the write is
            # ordered after the copy and fenced, so a peer that sees it sees the bytes).
            for q in peers:
                ops.write(copy, self._arrive_remote[q], self._arrived)
            # The comm stream pulls chunk j only after this rank's own copy of it, and through
            # it after ``after``: the peers' pieces land in a slot that compute has released.
            self._chunk_copied[j].record(copy)
            comm.wait_event(self._chunk_copied[j])
            with torch.cuda.stream(comm):
                for q in peers:
                    ops.wait_geq(comm, self._arrive_local[q], self._arrived)
                    lo = offset + q * c
                    dst[lo : lo + c].copy_(self._peer_views[q][at + lo : at + lo + c], non_blocking=True)
        self._filled += 1
        for q in peers:  # this rank has read everything it needs of the peers' slots
            ops.write(comm, self._done_remote[q], self._filled)
        ready.record(comm)
        if marks is not None:
            marks[1].record(comm)
        self._watchdog.watch(ready, block)

    def close(self) -> None:
        """Stop the watchdog and drop the symmetric allocation; the host shards stay."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        self._peer_views = []
        self._handle = None
        self._base = None
        super().close()


class _Watchdog:
    """Stream waits have no timeout of their own: a rank that died or diverged would leave the
    others' streams waiting forever. A daemon thread watches the most recent fill; if it has
    not completed ``timeout_s`` after it was enqueued, the device cannot recover (the waits
    are in its queues), so the thread reports the ring and block and ends the process, which
    makes torchrun stop the job instead of leaving it hung."""

    def __init__(self, timeout_s: float, name: str) -> None:
        self.timeout_s = timeout_s
        self.name = name
        self._last: tuple[torch.cuda.Event, int, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-offload-watchdog", daemon=True)
        self._thread.start()

    def watch(self, event: "torch.cuda.Event", block: int) -> None:
        self._last = (event, block, time.monotonic())

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            last = self._last
            if last is None or last[0].query():
                continue
            waited = time.monotonic() - last[2]
            if waited > self.timeout_s and not self._stop.is_set():
                print(f"omni_dist_offload: {self.name}: block {last[1]} was not rebuilt within "
                      f"{self.timeout_s:g} s (collective_timeout_s): a rank of the weight group "
                      "died, called remove() alone, or ran other blocks or another number of "
                      "forwards. Ending this process; every rank must run the same steps in lockstep.",
                      file=sys.stderr, flush=True)
                os._exit(70)
