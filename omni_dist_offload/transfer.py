"""Weight transfers: how a block's bytes get from host memory into a device slot.

A transfer enqueues work and records the slot's ready event; it never waits on the host. The
ring decides which block goes into which slot and when (``docs/design.md``,
[Note: block ring timeline]; the allgather timeline is [Note: chunked shard all-gather]).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from .distributed import WeightGroup
from .hostmem import HostBuffer
from .sharding import ShardPlan, shard_pieces

__all__ = ["AllGatherTransfer", "CopyEngineGatherTransfer", "RankLocalTransfer", "WeightTransfer", "gather_transfer"]

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

    def make_slots(self, nbytes: int, count: int, device: torch.device) -> list[torch.Tensor]:
        """Allocate the ring's ``count`` device slots of ``nbytes`` each, once, at setup."""

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

    def make_slots(self, nbytes, count, device) -> list[torch.Tensor]:
        return _plain_slots(nbytes, count, device)

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
        # What rebuilds the block: NCCL's kernels on GPUs, gloo's all-gather in CPU tests.
        self.gather = "nccl" if "nccl" in group.backend else group.backend
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

    def make_slots(self, nbytes, count, device) -> list[torch.Tensor]:
        return _plain_slots(nbytes, count, device)

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

    def close(self) -> None:
        """Drop what the gather holds besides the host shards: nothing for the collective."""

    def release(self) -> None:
        for s in self.shards:
            s.release()


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
                 copy_stream: "torch.cuda.Stream", comm_stream: "torch.cuda.Stream", timeout_s: float,
                 name: str = "allgather") -> None:
        super().__init__(shards, plans, group, copy_stream, comm_stream)
        self.gather = "copy-engine"
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

    def make_slots(self, nbytes, count, device) -> list[torch.Tensor]:
        import torch.distributed._symmetric_memory as symm_mem

        pg, world = self.group.group, self.group.size
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            # Older torch needs the group registered first; newer torch deprecates the call.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(pg.group_name)
        flags_at = nbytes * count
        total = flags_at + _FLAG_BYTES * world * 2
        base = symm_mem.empty(total, dtype=torch.uint8, device=device)
        # Flags start at zero on every rank before any peer can write them: zeroed and
        # synchronised here, and rendezvous (collective) comes after.
        base[flags_at:].zero_()
        torch.cuda.synchronize(device)
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

    def fill(self, block, dst, after, ready, marks=None) -> None:
        src = self.shards[block].tensor
        ops, peers = self._ops, self._peers
        copy, comm = self._copy_stream, self._comm_stream
        # dst is a view into the symmetric allocation; every rank uses the same slot offsets.
        at = dst.storage_offset() - self._base.storage_offset()
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

    def release(self) -> None:
        self.close()
        super().release()


_FLAG_BYTES = 4
_U32 = 0xFFFFFFFF


class StreamMemOps:
    """``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` from the CUDA driver: a stream waits
    for (or writes) a 32-bit word in device memory, executed by the GPU's front end."""

    _lib = None

    def __init__(self) -> None:
        if StreamMemOps._lib is None:
            StreamMemOps._lib = _load_memops()
        self._wait, self._write = StreamMemOps._lib

    @staticmethod
    def available() -> bool:
        try:
            if StreamMemOps._lib is None:
                StreamMemOps._lib = _load_memops()
        except OSError:
            return False
        return True

    def wait_geq(self, stream: "torch.cuda.Stream", addr: int, value: int) -> None:
        # GEQ compares wrap-safely: (int32_t)(*addr - value) >= 0.
        _check(self._wait(stream.cuda_stream, addr, value & _U32, 0), "cuStreamWaitValue32")

    def write(self, stream: "torch.cuda.Stream", addr: int, value: int) -> None:
        # Flag 0 (CU_STREAM_WRITE_VALUE_DEFAULT): a memory fence precedes the write.
        _check(self._write(stream.cuda_stream, addr, value & _U32, 0), "cuStreamWriteValue32")


def _load_memops():
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    fns = []
    for names in (("cuStreamWaitValue32_v2", "cuStreamWaitValue32"),
                  ("cuStreamWriteValue32_v2", "cuStreamWriteValue32")):
        fn = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
        if fn is None:
            raise OSError(f"the CUDA driver has none of {list(names)}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns.append(fn)
    return tuple(fns)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")


class _Watchdog:
    """Stream waits have no timeout of their own: a rank that died or diverged would leave the
    others' streams waiting forever. A daemon thread watches the most recent fill; if it has
    not completed ``timeout_s`` after it was enqueued, the device cannot recover (the waits
    are in its queues), so the thread reports the ring and block and ends the process, which
    makes torchrun stop the job instead of leaving it hung."""

    def __init__(self, timeout_s: float, name: str) -> None:
        import threading

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
                import sys

                print(f"omni_dist_offload: {self.name}: block {last[1]} was not rebuilt within "
                      f"{self.timeout_s:g} s (collective_timeout_s): a rank of the weight group "
                      "died, or ran other blocks or another number of forwards. Ending this "
                      "process; every rank must run the same steps in lockstep.",
                      file=sys.stderr, flush=True)
                os._exit(70)


def gather_transfer(gather: str, shards: Sequence[HostBuffer], plans: Sequence[ShardPlan], group: WeightGroup,
                    copy_stream, comm_stream, timeout_s: float, name: str = "allgather") -> AllGatherTransfer:
    """The allgather transfer for a resolved ``gather`` (``"copy-engine"`` or the collective)."""
    if gather == "copy-engine":
        return CopyEngineGatherTransfer(shards, plans, group, copy_stream, comm_stream, timeout_s, name)
    return AllGatherTransfer(shards, plans, group, copy_stream, comm_stream)


def _plain_slots(nbytes: int, count: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
