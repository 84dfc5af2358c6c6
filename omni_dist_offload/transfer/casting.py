"""A transfer for blocks stored in another dtype on the host (``storage_dtype``): the inner
transfer (rank-local or a gather) moves the stored image into a staging buffer on the device;
the upcast into the ring's slot runs on a stream of its own, so it overlaps both the running
block's compute and the next image's copy. See [Note: 8-bit storage] in ``storage.py``.

Per block, staging buffer j (two, alternating):
  copy stream:  [wait: staging j free] inner fill of staging j (H2D, and the gather under
                allgather) -> record staged[j]
  cast stream:  [wait: staged[j], slot free] upcast, two kernels, into the slot -> record ready,
                staging_free[j]
The copy stream never waits for an upcast: the next image goes into the other staging buffer,
so the link stays busy as it does without 8-bit storage.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..layout import BlockLayout
from ..storage import downcast, upcast
from .groups import agree_step
from .protocol import TransferStreams, WeightTransfer, plain_slots

__all__ = ["CastingTransfer"]

# Staging buffers on a GPU: the copy stream fills one while the cast stream upcasts the other.
_STAGING = 2


class CastingTransfer:
    """Wraps a transfer whose host copy holds block images in their stored dtypes."""

    def __init__(self, inner: WeightTransfer, layouts: Sequence[BlockLayout], storage_dtype: str,
                 streams: TransferStreams, device: torch.device, name: str = "") -> None:
        self.inner = inner
        self._name = name  # the component's, for messages
        self.layouts = tuple(layouts)
        self.storage_dtype = storage_dtype
        self.name, self.gather, self.fallback_reason = inner.name, inner.gather, inner.fallback_reason
        self._copy = streams.copy
        self._device = device
        cuda = streams.copy is not None
        # The upcasts run here, beside the copy stream (which moves the next image meanwhile)
        # and the compute stream (which runs the previous block); same priority as the copy.
        self._cast = torch.cuda.Stream(device) if cuda else None
        # staged[j]: recorded where the inner fill of staging j ends (its copy or comm stream);
        # the cast stream waits on it. staging_free[j]: recorded on the cast stream once the
        # upcast has read staging j; the next fill into it waits on it. Reused by every fill.
        self._staged = [torch.cuda.Event() for _ in range(_STAGING)] if cuda else []
        self._staging_free = [torch.cuda.Event() for _ in range(_STAGING)] if cuda else []
        self._staging: list[torch.Tensor] = []
        self._next = 0
        self.slots: list[torch.Tensor] = []
        self.held: dict[int, torch.Tensor] = {}
        """Blocks whose image stays on the device (the residency plan's resident blocks, kept
        in 8 bits as diffusers keeps a layerwise-cast model): their fill is the upcast alone."""

    def host_bytes(self) -> int:
        return self.inner.host_bytes()

    def has_host_copy(self, block: int) -> bool:
        return self.inner.has_host_copy(block)

    def device_nbytes(self, block: int) -> int:
        return self.layouts[block].nbytes

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the staging buffers now allocated (0 before the slots are)."""
        return sum(b.numel() for b in self._staging)

    def staging_nbytes(self) -> int:
        """Device bytes of one staging buffer: the largest image that streams, as the inner moves
        it (a held image never passes through one)."""
        return max((self.inner.device_nbytes(i) for i in range(len(self.layouts)) if i not in self.held), default=0)

    def allocate_slots(self, nbytes: int, count: int) -> None:
        # Allocated here, once per plan, never per block (as every transfer's slots).
        self.slots = []
        self._staging = []
        if count == 0:
            self.inner.allocate_slots(0, 0)
            return
        staging = _STAGING if self._copy is not None else 1
        self.inner.allocate_slots(self.staging_nbytes(), staging)
        self._staging = list(self.inner.slots)
        self.slots = plain_slots(nbytes, count, self._device, (self._copy, self._cast))

    def drop(self, block: int) -> None:
        self.inner.drop(block)

    def drop_slots(self) -> None:
        """Free the slots and the staging buffers; the held images and the host copy stay. Before
        a plan change, so the old plan's buffers are gone before the new plan's images come."""
        self.slots = []
        self._staging = []
        self.inner.close()

    def hold(self, blocks) -> None:
        """Keep exactly ``blocks``' images on the device. Between forwards, before the plan's
        slots are allocated (so the staging buffers can be sized to the images that still
        stream); synchronises; collective under allgather (every rank holds the same blocks, in
        the same order).

        Images no longer wanted go first (within the budget: their blocks stream from their host
        copies, which a plan that is not final keeps). Then every new image's buffer is
        allocated before the first fill, and under a gather the ranks of the weight group agree
        on it there (``groups.agree_step``): a rank whose device cannot hold them (out of memory)
        would otherwise leave the gathers while the others went on into them. Where any rank
        failed, every rank raises there, holding no new image. A failure after that (a gather)
        holds none either, but leaves the ranks out of step: the caller stops gathering."""
        wanted = set(blocks)
        self.held = {i: image for i, image in self.held.items() if i in wanted}
        new = sorted(wanted - set(self.held))
        if not new:
            return
        gather = self.inner.gather is not None
        images: dict[int, torch.Tensor] = {}
        error: BaseException | None = None
        try:
            for i in new:
                images[i] = torch.empty(self.inner.device_nbytes(i), dtype=torch.uint8, device=self._device)
        except Exception as exc:  # noqa: BLE001 - under a gather, told to the other ranks first
            if not gather:
                raise
            error, images = exc, {}
        if gather:
            what = f"{self._name}: holding" if self._name else "holding"
            agree_step(self.inner.group, self._device, error, f"{what} 8-bit images on the device")
        if self._copy is not None:
            # The new buffers may be memory the compute stream used last: the fills below write
            # them on the inner's streams.
            torch.cuda.synchronize(self._device)
        # The copy-engine gather fills only its own slots (mapped into every rank of the group):
        # one of the largest size, for this call only, allocated after the ranks agree in turn.
        # Any other transfer fills the held buffer itself.
        mapped = self.inner.gather == "copy-engine"
        try:
            if mapped:
                self._staging = []
                self.inner.allocate_slots(max(image.numel() for image in images.values()), 1)
            for i in new:
                dst = self.inner.slots[0][: images[i].numel()] if mapped else images[i]
                # fill() records its ready event; synchronised just below (plan time, never per block).
                ready = torch.cuda.Event() if self._copy is not None else None
                self.inner.fill(i, dst, None, ready)
                if ready is not None:
                    ready.synchronize()
                if mapped:
                    images[i].copy_(dst)
            if self._copy is not None:
                torch.cuda.synchronize(self._device)
        finally:
            if mapped:
                self.inner.close()
        self.held = {**self.held, **images}

    def fill(self, block, dst, after, ready, marks=None, start=0) -> None:
        if start:
            raise ValueError("a block stored in another dtype moves whole (start must be 0)")
        image = self.layouts[block].image
        need = self.inner.device_nbytes(block)
        if self._cast is None:  # CPU: every step completes before the call returns
            staged = self.held.get(block)
            staged = staged if staged is not None else (self._staging[0] if self._staging else self._scratch())[:need]
            if marks is not None:
                marks[0].record()
            if block not in self.held:
                self.inner.fill(block, staged, None, None)
            upcast(image, staged, dst)
            if marks is not None:
                marks[1].record()
            return
        copy, cast = self._copy, self._cast
        held = self.held.get(block)
        if held is not None:  # the image is on the device already: the upcast alone
            if after is not None:
                cast.wait_event(after)
            if marks is not None:
                marks[0].record(cast)
            with torch.cuda.stream(cast):
                upcast(image, held, dst)
            ready.record(cast)
            if marks is not None:
                marks[1].record(cast)
            return
        j = self._next
        self._next = (j + 1) % _STAGING
        if self._staging:
            staged = self._staging[j][:need]
        else:
            staged = self._scratch()[:need]
            # Freed when this returns, while the copy and cast streams still use it: the
            # allocator must not hand it out before they are done.
            staged.record_stream(copy)
            staged.record_stream(cast)
        copy.wait_event(self._staging_free[j])
        # The trace's transfer is the inner fill (what the link takes, on the inner's own
        # streams): not the upcast's wait for the slot below, which is compute the planner
        # already prices, nor the upcast, which overlaps the next image's copy.
        self.inner.fill(block, staged, None, self._staged[j], marks)
        cast.wait_event(self._staged[j])
        if after is not None:  # the slot's previous block has run (the upcast overwrites it)
            cast.wait_event(after)
        with torch.cuda.stream(cast):
            upcast(image, staged, dst)
        self._staging_free[j].record(cast)
        ready.record(cast)

    def _scratch(self, nbytes: int | None = None) -> torch.Tensor:
        # No staging buffer (or none large enough: a plan change bringing a block in): a buffer
        # of its own, outside the per-block path.
        return torch.empty(nbytes if nbytes is not None else self.staging_nbytes(), dtype=torch.uint8,
                           device=self._device)

    def write_back(self, block, src, start=0) -> None:
        if start:
            raise ValueError("a block stored in another dtype moves whole (start must be 0)")
        layout = self.layouts[block]
        staged = torch.zeros(self.inner.device_nbytes(block), dtype=torch.uint8, device=src.device)
        downcast(layout.image, src, staged)
        if block in self.held:
            self.held[block].copy_(staged)
        if self.inner.has_host_copy(block):
            self.inner.write_back(block, staged)

    def close(self) -> None:
        self.slots = []
        self._staging = []
        self.held = {}
        self.inner.close()

    def release(self) -> None:
        self.close()
        self.inner.release()
