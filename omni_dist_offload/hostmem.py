"""Host buffers that hold the streamed weights.

Buffers are ordinary CPU allocations, page-locked in place with ``cudaHostRegister`` once they
are filled. Allocating through ``pin_memory=True`` would round every block up to a power of two
in PyTorch's caching host allocator (a 703 MB Wan block would hold 1 GiB) and keep the memory
cached after release; registering in place costs exactly the bytes asked for and gives them back
on :meth:`HostBuffer.release`.

:class:`HostPinner` applies the config's ``pin_failure`` policy when a registration fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.utils.deterministic

from .config import PIN_FAILURES

__all__ = ["HUGE_PAGES_ENV", "HostBuffer", "HostPinner", "PinMemoryError", "huge_pages_wanted", "pin_instead"]

_PAGE = 4096
#: Threads that page-lock host buffers during setup (``pin_failure: "error"``).
PIN_THREADS = 4

_PIN_ADVICE = (
    "raise the memlock limit (ulimit -l; in a container --ulimit memlock=-1), free host memory, "
    'set "pin_failure": "pageable" to continue in pageable memory, or set "pin_memory": false '
    "(host-to-device copies from pageable memory run synchronously and several times slower)"
)


class PinMemoryError(RuntimeError):
    """Page-locking host memory failed (usually the memlock limit or host memory).

    ``what`` says what failed; the message adds what to do about it."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what

    def __str__(self) -> str:
        return f"{self.what}: {_PIN_ADVICE}."


class HostBuffer:
    """``nbytes`` of host memory as a flat ``uint8`` tensor, page-aligned.

    The buffer is page-aligned and page-rounded inside its own allocation, so the range that is
    registered never shares a page with another registration.
    """

    __slots__ = ("tensor", "pinned", "pinned_by", "_finalizer", "__weakref__")

    def __init__(self, nbytes: int) -> None:
        rounded = -(-nbytes // _PAGE) * _PAGE
        huge = nbytes >= _HUGE_PAGE and huge_pages_wanted()
        align = _HUGE_PAGE if huge else _PAGE
        with _unfilled():
            raw = torch.empty(rounded + align, dtype=torch.uint8, device="cpu")  # whatever the default device
        start = (-raw.data_ptr()) % align
        self.tensor = raw[start : start + nbytes]
        if huge:
            _advise_huge_pages(self.tensor.data_ptr(), rounded)
        self.pinned = False
        self.pinned_by: tuple[HostPinner, str, str] | None = None
        """``(pinner, component, block)`` when a :class:`HostPinner` page-locked it: the policy
        and the names :func:`pin_instead` applies to a copy that replaces it."""
        self._finalizer: weakref.finalize | None = None

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> HostBuffer:
        """A buffer over memory someone else allocated (a block's pages of a shared host copy),
        page-aligned: :meth:`pin` registers it in place, :meth:`release` only unregisters it."""
        if tensor.data_ptr() % _PAGE:
            raise ValueError("a wrapped host buffer must start at a page boundary")
        self = cls.__new__(cls)
        self.tensor, self.pinned, self.pinned_by, self._finalizer = tensor, False, None, None
        return self

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
            _clear_last_cuda_error()
            amount = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size} bytes"
            raise PinMemoryError(f"could not page-lock {amount} of host memory (CUDA error {int(err)})")
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


def pin_instead(old: HostBuffer, new: HostBuffer) -> None:
    """``new`` replaces ``old`` (a smaller copy of part of it, made when a residency plan keeps
    part of a block on the device): page-lock ``new`` if ``old`` was. ``old`` is unlocked first,
    so the two never need more locked memory than ``old`` had. If ``new`` cannot be locked, the
    policy of the :class:`HostPinner` that locked ``old`` decides (it ran at setup, so the user's
    ``pin_failure`` holds for this copy too): ``"pageable"`` keeps ``new`` pageable and warns
    once; ``"error"`` (or ``old`` locked by no pinner) locks ``old`` again and raises the
    :class:`PinMemoryError`, naming the component and block where the pinner knows them."""
    if not old.pinned:
        return
    pinner = old.pinned_by
    old.release()
    try:
        new.pin()
    except PinMemoryError as exc:
        if pinner is not None and pinner[0].on_failure == "pageable":
            pinner[0].continue_pageable(pinner[1], pinner[2], exc)
            return
        old.pin()
        if pinner is None:
            raise
        raise pinner[0].failure(pinner[1], pinner[2], exc) from exc
    new.pinned_by = pinner


class HostPinner:
    """Page-locks host buffers as setup fills them, under the config's ``pin_failure`` policy.

    One per ``apply_offload`` call, shared by its rings. ``"error"``: a failure raises
    :class:`PinMemoryError` naming the component and block, and setup undoes itself.
    ``"pageable"``: the first failure warns once, and that buffer and every later one stay
    pageable; the limit that refused one block would refuse the next.
    """

    def __init__(self, enabled: bool, on_failure: str = "error") -> None:
        if on_failure not in PIN_FAILURES:
            raise ValueError(f"on_failure must be one of {list(PIN_FAILURES)}, found {on_failure!r}.")
        self.enabled = enabled
        self.on_failure = on_failure
        self.stopped_at: str | None = None
        """``"<component> block <name>"`` where pinning failed under ``"pageable"``, else None."""
        self._replaced_pageable = False  # continue_pageable has warned
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    @classmethod
    def for_device(cls, pin_memory: bool, on_failure: str, device: torch.device) -> HostPinner:
        """Pin only for a CUDA device: on the CPU path the "device" copy is host to host, and
        page-locking buys nothing."""
        return cls(pin_memory and device.type == "cuda", on_failure)

    def pin(self, buffer: HostBuffer, component: str, block: str) -> bool:
        """Page-lock the host copy of ``block`` of ``component``; True if it is now pinned."""
        if not self.enabled or self.stopped_at is not None:
            return False
        try:
            buffer.pin()
        except PinMemoryError as exc:
            if self.on_failure == "error":
                raise self.failure(component, block, exc) from exc
            self.stopped_at = f"{component} block {block}"
            warnings.warn(
                f"{component}: page-locking the host copy of block {block} failed: {exc.what}. "
                "Continuing in pageable host memory for this block and every block set up after "
                'it, as "pin_failure": "pageable" allows: their host-to-device copies run '
                "synchronously with respect to the host and several times slower, so streaming no "
                "longer hides behind compute. To pin, raise the memlock limit (ulimit -l) or free "
                'host memory; to not try, set "pin_memory": false.',
                RuntimeWarning, stacklevel=2,
            )
            return False
        buffer.pinned_by = (self, component, block)
        return True

    @staticmethod
    def failure(component: str, block: str, exc: PinMemoryError) -> PinMemoryError:
        """The error ``"error"`` raises: ``exc`` with the component and block it happened to."""
        return PinMemoryError(f"{component}: page-locking the host copy of block {block} failed: {exc.what}")

    def continue_pageable(self, component: str, block: str, exc: PinMemoryError) -> None:
        """Under ``"pageable"``: a host copy that replaced a page-locked one (:func:`pin_instead`)
        could not be locked, and stays pageable. Warns once per pinner (the limit that refused
        it will refuse the next one too); the copy works, only its copies are slower."""
        if self._replaced_pageable:
            return
        self._replaced_pageable = True
        warnings.warn(
            f"{component}: page-locking the new host copy of block {block} failed: {exc.what}. The residency "
            "plan keeps part of the block on the device, so its host copy was replaced by a smaller one, which "
            'stays in pageable host memory, as "pin_failure": "pageable" allows (one warning: later such '
            "copies stay pageable alike): its host-to-device copies run synchronously with respect to the host "
            "and several times slower. To pin, raise the memlock limit (ulimit -l) or free host memory; to "
            'not try, set "pin_memory": false.',
            RuntimeWarning, stacklevel=3,
        )

    def pin_later(self, buffer: HostBuffer, component: str, block: str) -> None:
        """:meth:`pin` on a background thread, so page-locking overlaps filling the next blocks
        (``cudaHostRegister`` releases the GIL). Registration scales with threads (on an H200
        host: 10.3 GB/s from one thread, 18.9 GB/s from eight), so under ``"error"`` up to
        :data:`PIN_THREADS` pin at once; under ``"pageable"`` one thread pins in order, so the
        policy still stops at the first failure. :meth:`wait` returns when all are done and
        raises the first error."""
        if not self.enabled or self.stopped_at is not None:
            return
        if self._pool is None:
            threads = PIN_THREADS if self.on_failure == "error" else 1
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="omni-offload-pin")
        self._pending.append(self._pool.submit(self.pin, buffer, component, block))

    def wait(self) -> None:
        """Wait for every :meth:`pin_later`; raise the first failure (after all have finished,
        so the caller can release every buffer safely)."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future in pending:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once all are done
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for queued pins (errors dropped: the caller is already unwinding or done) and
        stop the background thread."""
        with contextlib.suppress(BaseException):
            self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
#: Set to 0 to keep host buffers on 4 KiB pages.
HUGE_PAGES_ENV = "OMNI_OFFLOAD_HUGE_PAGES"


def huge_pages_wanted() -> bool:
    """Whether host buffers ask for transparent huge pages (Linux, unless turned off)."""
    return sys.platform.startswith("linux") and os.environ.get(HUGE_PAGES_ENV, "1") != "0"


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


# Serialises the switch below among this module's own allocations (threads that set up rings
# side by side); it cannot serialise other code reading torch's flag meanwhile (see _unfilled).
_FILL_LOCK = threading.Lock()


@contextlib.contextmanager
def _unfilled():
    """Allocations in this block skip ``torch.use_deterministic_algorithms``' fill of
    uninitialized memory. A host buffer is written by its fill before anything reads it (the
    padding between tensors, and the gaps a tensor with gaps spans, are never read as values),
    so the fill only costs: it touches
    every page before the huge-page advice (up to twice ``host_bytes`` resident, for ~2 MiB
    blocks) and writes the model's bytes once more. The flag is process-wide: another thread that
    allocates while it is off gets unfilled memory too (torch has no per-thread switch), for the
    microseconds an ``empty`` takes; it is restored at once, also if the allocation fails."""
    if not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory):
        yield
        return
    with _FILL_LOCK:
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            yield
        finally:
            torch.utils.deterministic.fill_uninitialized_memory = True


def _advise_huge_pages(ptr: int, nbytes: int) -> None:
    """Ask for transparent huge pages before the buffer is first touched: filling 28 GB then
    takes 512 times fewer page faults. Advice only: ignored where THP is off."""
    _libc().madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)


def _unregister(tensor: torch.Tensor, ptr: int) -> None:
    del tensor  # kept alive by the finalizer until the range is unregistered
    if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
        _clear_last_cuda_error()


def _clear_last_cuda_error() -> None:
    """Reset this thread's last CUDA runtime error after a failed ``cudaHostRegister`` or
    ``cudaHostUnregister`` (reported by its return value, and handled there). The runtime also
    keeps it as the thread's last error, which torch's next kernel launch check on this thread
    reads and raises as its own ("part or all of the requested memory range is already
    mapped"), failing an unrelated kernel: a forward after a re-plan whose smaller host copy
    could not be locked under "pageable", or a caller's after catching the PinMemoryError.
    torch exposes no ``cudaGetLastError``; it is called in the runtime library torch loaded
    (found in the process's mappings, so that it is the same runtime and its state). Where
    none is found (a runtime linked in statically), nothing is done."""
    fn = _cuda_get_last_error()
    if fn is not None:
        fn()


@functools.cache
def _cuda_get_last_error():
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line and "/" in line})
        for path in paths:
            fn = ctypes.CDLL(path).cudaGetLastError
            fn.restype = ctypes.c_int
            return fn
    except (OSError, AttributeError):
        pass
    return None
