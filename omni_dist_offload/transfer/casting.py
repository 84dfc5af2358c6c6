"""A transfer for blocks stored in another dtype on the host (``storage_dtype``): the inner
transfer (rank-local or a gather) moves the stored image into a staging buffer on the device;
the upcast into the ring's slot runs right after, on the copy stream, so it overlaps the running
block's compute like the copy does. See [Note: 8-bit storage] in ``storage.py``.

Per block: [wait: slot free] inner fill of the staging buffer (H2D, and the gather under
allgather) -> [wait: staged] upcast, two kernels, into the slot -> record ready. One staging
buffer serves every block: the next fill's writes into it queue behind this upcast on the copy
stream (a gather's comm stream waits on events the copy stream records after it).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..layout import BlockLayout
from ..storage import downcast, upcast
from .protocol import TransferStreams, WeightTransfer, plain_slots

__all__ = ["CastingTransfer"]


class CastingTransfer:
    """Wraps a transfer whose host copy holds block images in their stored dtypes."""

    def __init__(self, inner: WeightTransfer, layouts: Sequence[BlockLayout], storage_dtype: str,
                 streams: TransferStreams, device: torch.device) -> None:
        self.inner = inner
        self.layouts = tuple(layouts)
        self.storage_dtype = storage_dtype
        self.name, self.gather, self.fallback_reason = inner.name, inner.gather, inner.fallback_reason
        self._copy = streams.copy
        self._device = device
        # Recorded where the inner fill ends (its copy or comm stream); the copy stream waits on
        # it before upcasting. Reused by every fill, as the inner transfers reuse theirs.
        self._staged = torch.cuda.Event() if streams.copy is not None else None
        self._staging: torch.Tensor | None = None
        self.slots: list[torch.Tensor] = []

    def host_bytes(self) -> int:
        return self.inner.host_bytes()

    def has_host_copy(self, block: int) -> bool:
        return self.inner.has_host_copy(block)

    def device_nbytes(self, block: int) -> int:
        return self.layouts[block].nbytes

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the staging buffer now allocated (0 before the slots are)."""
        return self._staging.numel() if self._staging is not None else 0

    def staging_nbytes(self) -> int:
        """Device bytes of the staging buffer (the largest stored block, as the inner moves it)."""
        return max(self.inner.device_nbytes(i) for i in range(len(self.layouts)))

    def allocate_slots(self, nbytes: int, count: int) -> None:
        # Allocated here, once per plan, never per block (as every transfer's slots).
        self.slots = []
        if count == 0:
            self.inner.allocate_slots(0, 0)
            self._staging = None
            return
        self.inner.allocate_slots(self.staging_nbytes(), 1)
        self._staging = self.inner.slots[0]
        self.slots = plain_slots(nbytes, count, self._device)

    def drop(self, block: int) -> None:
        self.inner.drop(block)

    def fill(self, block, dst, after, ready, marks=None, start=0) -> None:
        if start:
            raise ValueError("a block stored in another dtype moves whole (start must be 0)")
        layout = self.layouts[block]
        image = layout.image
        staging = self._staging if self._staging is not None else self._scratch()
        staged = staging[: self.inner.device_nbytes(block)]
        copy = self._copy
        if copy is None:  # CPU: every step completes before the call returns
            if marks is not None:
                marks[0].record()
            self.inner.fill(block, staged, None, None)
            upcast(image, staged, dst)
            if marks is not None:
                marks[1].record()
            return
        if after is not None:  # the slot's previous block has run (the upcast overwrites it)
            copy.wait_event(after)
        if marks is not None:
            marks[0].record(copy)
        self.inner.fill(block, staged, None, self._staged)
        copy.wait_event(self._staged)
        with torch.cuda.stream(copy):
            upcast(image, staged, dst)
        ready.record(copy)
        if marks is not None:
            marks[1].record(copy)

    def _scratch(self) -> torch.Tensor:
        # No slots yet (a plan change bringing a block in before any are allocated): a buffer of
        # its own, outside the per-block path.
        return torch.empty(self.staging_nbytes(), dtype=torch.uint8, device=self._device)

    def write_back(self, block, src, start=0) -> None:
        if start:
            raise ValueError("a block stored in another dtype moves whole (start must be 0)")
        layout = self.layouts[block]
        staged = torch.zeros(self.inner.device_nbytes(block), dtype=torch.uint8, device=src.device)
        downcast(layout.image, src, staged)
        self.inner.write_back(block, staged)

    def close(self) -> None:
        self.slots = []
        self._staging = None
        self.inner.close()

    def release(self) -> None:
        self.close()
        self.inner.release()
