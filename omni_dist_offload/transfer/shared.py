"""The shared transfer: the ranks of a host keep one host copy of every block between them
(``sharedmem.py``), and each rank copies whole blocks from it over its own link, as rank-local
does, never waiting for another rank."""

from __future__ import annotations

import weakref
from typing import Mapping, Sequence

import torch

from ..hostmem import HostBuffer, HostPinner
from ..sharedmem import SharedBlocks
from .protocol import TransferStreams
from .rank_local import RankLocalTransfer

__all__ = ["SharedTransfer"]


class SharedTransfer(RankLocalTransfer):
    """Whole blocks from a host copy shared with the host's other ranks.

    ``buffers[i]`` wraps this rank's mapping of block ``i`` (page-locked by this rank), or None
    for a block that stays on the device. A block this rank edits (``write_back``: a LoRA fused
    into it) gets a host copy of its own first: the other ranks keep reading the weights they
    had, and the shared pages go once no rank reads them.
    """

    name = "shared"

    def __init__(self, blocks: SharedBlocks, buffers: Sequence[HostBuffer | None], nbytes: Sequence[int],
                 streams: TransferStreams, device: torch.device, pinner: HostPinner, component: str,
                 block_names: Sequence[str]) -> None:
        super().__init__(buffers, nbytes, streams, device)
        self.blocks = blocks
        self._own: set[int] = set()
        self._pinner = pinner
        self._component = component
        self._names = list(block_names)
        # A component dropped from its pipeline (``pipe.text_encoder = None``) takes its ring and
        # this transfer with it, without release(): this rank then leaves the shared copy (its
        # pages go once no rank reads them) and closes the descriptors, as release() does. Host
        # work only; each pinned buffer unregisters itself first (HostBuffer's own finalizer, or
        # here). Not at exit: the process's end unmaps and closes everything.
        self._finalizer = weakref.finalize(self, _leave, self.buffers, blocks)
        self._finalizer.atexit = False

    @property
    def host_ranks(self) -> int:
        return self.blocks.layout.ranks

    def host_bytes(self) -> int:
        """This rank's share of the shared copy, plus the blocks it holds a copy of its own of."""
        return self.blocks.share_bytes() + sum(self.buffers[i].nbytes for i in self._own if self.buffers[i] is not None)

    def shared_bytes(self) -> int:
        """The host's shared copy of the ring: the blocks some rank still streams from it."""
        return self.blocks.live_bytes()

    def drop(self, block: int) -> None:
        super().drop(block)  # unregisters this rank's pages first
        if block in self._own:
            self._own.discard(block)
        else:
            self.blocks.leave(block)

    def keep_part(self, block: int, start: int, rest: torch.Tensor | None = None) -> None:
        """The shared copy stays whole: the host's other ranks may stream all of the block.
        Returns None (nothing moved), so the ring keeps the kept part's host bytes in use."""
        return None

    def write_back(self, block, src, start=0) -> torch.Tensor | None:
        moved = None
        if block not in self._own:
            shared = self.buffers[block]
            if torch.equal(shared.tensor[start : start + src.numel()], src.to("cpu")):
                # Nothing changed (a ring of inference tensors, which keep no version counter,
                # writes back every block it held): the block stays in the host's one copy,
                # rather than one private copy of it per rank.
                return None
            own = HostBuffer(shared.nbytes)
            own.tensor.copy_(shared.tensor)
            # Under pin_failure "error" a failure raises here, before anything changed.
            self._pinner.pin(own, self._component, self._names[block])
            self.buffers[block] = own
            self._own.add(block)
            shared.release()
            self.blocks.leave(block)
            moved = own.tensor
        super().write_back(block, src, start)
        return moved

    def leave_after(self, tensors: Mapping[int, torch.Tensor]) -> None:
        """:meth:`release` will unregister this rank's pages at once, but leave the shared copy
        only once every tensor of ``tensors`` (by id) is gone: the parameters of a dropped
        component, which view it until the module's attributes are cleared. Leaving while they
        did would copy each block to keep them valid; a tensor a caller still holds then keeps
        the pages until it goes."""
        pending = set(tensors)
        # Not when this transfer goes any more (the ring, and this transfer with it, go before
        # the module's parameters do): when the last of them goes.
        detached = self._finalizer.detach() if pending else None
        if detached is None:  # nothing views the copy, or this rank has left it already
            return
        _, leave, args, _ = detached

        # The last tensor still holds its storage while its callback runs: if it viewed a block,
        # that block alone is copied (what it viewed then is not known for sure: a caller may
        # have rebound it, and a view of it would be lost if it were not counted).
        def gone(key: int) -> None:
            pending.discard(key)
            if not pending:
                leave(*args)

        for key, tensor in tensors.items():
            weakref.finalize(tensor, gone, key).atexit = False

    def release(self) -> None:
        super().release()
        self._finalizer()  # does nothing once leave_after has taken it


def _leave(buffers: list[HostBuffer | None], blocks: SharedBlocks) -> None:
    for buf in buffers:  # unregister this rank's pages before leaving them (as drop() does)
        if buf is not None:
            buf.release()
    blocks.close()
