"""Host buffers that hold the streamed weights.

Buffers are ordinary CPU allocations, page-locked in place with ``cudaHostRegister`` once they
are filled. Allocating through ``pin_memory=True`` would round every block up to a power of two
in PyTorch's caching host allocator (a 703 MB Wan block would hold 1 GiB) and keep the memory
cached after release; registering in place costs exactly the bytes asked for and gives them back
on :meth:`HostBuffer.release`.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["HostBuffer", "PinMemoryError"]

_PAGE = 4096


class PinMemoryError(RuntimeError):
    """Page-locking host memory failed (usually the memlock limit or host memory)."""


class HostBuffer:
    """``nbytes`` of host memory as a flat ``uint8`` tensor, page-aligned.

    The buffer is page-aligned and page-rounded inside its own allocation, so the range that is
    registered never shares a page with another registration.
    """

    __slots__ = ("tensor", "pinned", "_finalizer", "__weakref__")

    def __init__(self, nbytes: int) -> None:
        rounded = -(-nbytes // _PAGE) * _PAGE
        raw = torch.empty(rounded + _PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _PAGE
        self.tensor = raw[start : start + nbytes]
        self.pinned = False
        self._finalizer: weakref.finalize | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def pin(self) -> None:
        """Page-lock the buffer so host-to-device copies run asynchronously at full speed."""
        if self.pinned or self.nbytes == 0:
            return
        ptr = self.tensor.data_ptr()
        size = -(-self.nbytes // _PAGE) * _PAGE
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            raise PinMemoryError(
                f"could not page-lock {size / 2**20:.1f} MiB of host memory (CUDA error "
                f"{int(err)}): raise the memlock limit (ulimit -l), free host memory, or set "
                '"pin_memory": false (host-to-device copies then run several times slower).'
            )
        self.pinned = True
        # Unregister before the memory goes back to the allocator, also if the owner forgets
        # to call release(): a freed page left registered would make a later register fail.
        self._finalizer = weakref.finalize(self, _unregister, self.tensor, ptr)

    def release(self) -> None:
        """Unpin. The caller guarantees no copy from this buffer is still in flight."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.pinned = False


def _unregister(tensor: torch.Tensor, ptr: int) -> None:
    del tensor  # kept alive by the finalizer until the range is unregistered
    torch.cuda.cudart().cudaHostUnregister(ptr)
