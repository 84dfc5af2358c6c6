"""The weight-transfer protocol: how a block's bytes get from host memory into a device slot.

A transfer owns the host copy of one ring's blocks (whole blocks, or this rank's shards) and the
ring's device slots. The host copy exists once it is constructed; the ring asks for its slots
(:meth:`WeightTransfer.allocate_slots`), as many as its residency plan says, and again when the
plan changes. :meth:`WeightTransfer.fill` enqueues work and records the slot's ready event; it
never waits on the host. The ring decides which block goes into which slot and when
(``docs/design.md``, [Note: block ring timeline]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

__all__ = ["TransferStreams", "WeightTransfer", "plain_slots"]


@dataclass(frozen=True, slots=True)
class TransferStreams:
    """The side streams a transfer enqueues on; both None on the CPU, where every step
    completes before the call returns."""

    copy: "torch.cuda.Stream | None" = None
    """Host-to-device copies, so they run beside compute instead of behind it."""
    comm: "torch.cuda.Stream | None" = None
    """The gather of an allgather ring (NCCL all-gathers, or copy-engine pulls from the peers'
    slots), so it runs beside both compute and the host-to-device copies."""


class WeightTransfer(Protocol):
    """What a ring needs of a transfer. Its host copy is filled and page-locked by the caller
    before it is constructed; a block that stays resident from the start has none."""

    name: str
    """``"rank-local"``, ``"shared"`` or ``"allgather"`` (what runs, after any fallback)."""
    gather: str | None
    """What rebuilds a block from shards (``"copy-engine"``, ``"nccl"``, ``"gloo"``); None for
    rank-local."""
    fallback_reason: str | None
    """Why the asked-for transfer did not run, or None."""
    slots: list[torch.Tensor]
    """The ring's device slots (``uint8``, all of one size); empty until allocated."""

    def host_bytes(self) -> int:
        """Host bytes this rank holds for the ring."""

    def has_host_copy(self, block: int) -> bool:
        """Whether block ``block`` has a host copy (shard) to fill from."""

    def device_nbytes(self, block: int) -> int:
        """Slot bytes block ``block`` occupies once on the device."""

    def allocate_slots(self, nbytes: int, count: int) -> None:
        """Replace the slots by ``count`` slots of ``nbytes``. The caller has synchronised the
        device. Collective over the weight group where the slots are shared memory."""

    def drop(self, block: int) -> None:
        """Unpin and free block ``block``'s host copy: it stays on the device from now on."""

    def fill(self, block: int, dst: torch.Tensor, after: "torch.cuda.Event | None",
             ready: "torch.cuda.Event | None", marks=None, start: int = 0) -> None:
        """Enqueue filling ``dst`` with block ``block``: start once ``after`` has fired (the
        slot's previous tenant finished computing), record ``ready`` when the bytes are there.
        Without an accelerator (events are None) the fill is complete when it returns.
        ``marks``: when tracing, a (start, end) pair of trace marks to record around the fill.
        ``start``: fill ``dst`` with the block's bytes from this offset on (a block whose first
        tensors stay on the device); a transfer with a gather takes exactly the offset its
        shards were cut from (0, or where ``keep_part`` cut them)."""

    def write_back(self, block: int, src: torch.Tensor, start: int = 0) -> torch.Tensor | None:
        """Write block ``block``'s bytes from ``src`` (a device slot holding the block, or its
        bytes from ``start`` on, as :meth:`fill` left it, then edited) into its host copy: the
        whole block, or this rank's shard. Between forwards; returns when the host copy holds
        them. Returns the block's new host copy when the edit moved it (a block of a shared host
        copy gets a copy of its own on the rank that edits it), else None."""

    def close(self) -> None:
        """Drop what the transfer holds besides its host copy (slots, helper threads).
        Idempotent. The caller has synchronised the device."""

    def release(self) -> None:
        """:meth:`close`, then unpin and free the host copy."""


def plain_slots(nbytes: int, count: int, device: torch.device,
                writers: Sequence[torch.cuda.Stream | None] = ()) -> list[torch.Tensor]:
    """``count`` device slots of ``nbytes`` from PyTorch's allocator. ``writers``: the side
    streams that write into them. Each slot is recorded on those once, here: when a slot is
    freed (a new plan, ``remove()``, or a model dropped without it while a prefetch is still
    copying) the allocator then hands its memory out again only after the work queued on them
    so far, never under a copy in flight. Nothing per block."""
    slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
    for slot in slots:
        for stream in writers:
            if stream is not None:
                slot.record_stream(stream)
    return slots
