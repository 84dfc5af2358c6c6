"""One host copy of a ring's blocks, shared by every rank of the host (``weight_transfer: "shared"``).

The host's first rank creates an anonymous shared-memory file (``memfd_create``: it has no name
in any filesystem, and ``/dev/shm``'s size does not limit it), sizes it, and hands its descriptor
to the host's other ranks over a unix socket in the abstract namespace. The socket's address and
a random key travel to the ranks over the job's own process group; a peer gets the descriptor
only by sending the key, so no process outside the job can (pids are not checked: ranks in other
pid namespaces are ranks all the same). Every rank maps the file; from then on the memory
lives exactly as long as some rank maps it or holds the descriptor: a normal exit, an exception
or a SIGKILL of any or every rank leaves nothing behind, and no later job can find it.

The file starts with a header: one byte per (block, rank), 1 while that rank streams the block
from the shared copy. A rank that stops using a block (it became resident there, the rank edited
it and keeps a copy of its own, or the rank released the ring) clears its byte under a lock on
the header; the last one out punches the block's pages out of the file, so memory no rank uses
goes back to the host at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hmac
import mmap
import os
import re
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Offer", "SharedBlocks", "SharedMemoryError", "SharedSegment", "available_host_bytes",
           "job_name", "receive", "shared_memory_reason"]

_PAGE = 4096
_FALLOC_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_SOCKET_NAME_MAX = 107  # sun_path holds 108 bytes, the first of them NUL in the abstract namespace
_KEY_BYTES = 32


class SharedMemoryError(RuntimeError):
    """The shared host copy could not be created or handed over."""


def shared_memory_reason() -> str | None:
    """Why this process cannot share host memory with its peers, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"shared host copies need Linux (memfd_create), and this is {sys.platform}"
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return "this Python has no os.memfd_create or socket.send_fds"
    return None


def job_name() -> str:
    """A short name for this job, the same on every rank: torchrun's run id, else the
    rendezvous address."""
    raw = os.environ.get("TORCHELASTIC_RUN_ID") or (
        f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)[:40]


def available_host_bytes() -> int | None:
    """Host memory a new allocation can take: ``MemAvailable``, capped by the memory limit of
    this process's cgroup (v2 or v1) where one is set; None where neither can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        with contextlib.suppress(OSError, ValueError):
            cap = open(limit).read().strip()
            if cap != "max" and int(cap) < 1 << 60:
                found.append(max(0, int(cap) - int(open(usage).read().strip())))
            break
    return min(found) if found else None


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // _PAGE) * _PAGE


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


class SharedSegment:
    """A shared-memory file of ``nbytes``, mapped read-write into this process, as a flat
    ``uint8`` tensor. The descriptor stays open: it carries the header lock and the hole punching."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        # Advice only: huge pages where the host lets shared memory have them (fewer faults
        # while filling, fewer pages to page-lock).
        _libc().madvise(ctypes.c_void_p(self.tensor.data_ptr()), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)

    @classmethod
    def create(cls, name: str, nbytes: int) -> SharedSegment:
        """A new file, readable and writable by this user only."""
        fd = os.memfd_create(name[:240], os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, nbytes)
            return cls(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise

    def punch(self, offset: int, nbytes: int) -> None:
        """Give the pages of ``[offset, offset + nbytes)`` back to the host (they read as zeros)."""
        start = _pages(offset)
        end = (offset + nbytes) // _PAGE * _PAGE
        if end > start:
            _libc().fallocate(self.fd, _FALLOC_PUNCH_HOLE, start, end - start)

    def populate(self, view: torch.Tensor) -> None:
        """Allocate the pages under ``view`` (a range of this mapping) and map them writable, in
        two calls instead of a page fault per page. Shared memory comes in 4 KiB pages unless the
        host turns on huge pages for it (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``):
        filled through faults it runs at a fraction of private memory's speed. ``fallocate``
        allocates the file's pages in bulk, ``MADV_POPULATE_WRITE`` maps them. Advice only: where
        either is missing, the faults do the work."""
        if not view.numel():
            return
        offset = view.data_ptr() - self.tensor.data_ptr()
        start = offset // _PAGE * _PAGE
        end = _pages(offset + view.numel())
        _libc().fallocate(self.fd, 0, start, end - start)
        _libc().madvise(ctypes.c_void_p(view.data_ptr()), ctypes.c_size_t(view.numel()), _MADV_POPULATE_WRITE)

    def allocated_bytes(self) -> int:
        """Bytes of host memory the file holds now (pages written and not punched)."""
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        """Close the descriptor. The mapping goes when the last tensor viewing it does."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Offer:
    """The host's first rank's side of the hand-over: a listening socket in the abstract
    namespace (it vanishes with this process, and with :meth:`close`) named after the job and a
    random token, and the key a peer must send to get the descriptor."""

    def __init__(self, job: str, component: str) -> None:
        name = f"omni-offload/{job}/{component}/{secrets.token_hex(8)}"[-(_SOCKET_NAME_MAX - 1):]
        self.address = "\0" + name
        self.key = secrets.token_bytes(_KEY_BYTES)
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.address)
            self._sock.listen()
        except BaseException:
            self._sock.close()
            raise

    def hand_over(self, fd: int, count: int, timeout_s: float) -> None:
        """Send ``fd`` to ``count`` peers that present the key; any other connection is closed
        unanswered. Raises :class:`SharedMemoryError` when fewer came within ``timeout_s``, or
        when the offer was closed first (from another thread: see :meth:`serve`)."""
        served = 0
        deadline = time.monotonic() + timeout_s
        while served < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SharedMemoryError(f"{count - served} of the host's ranks did not collect the shared "
                                        f"host copy within {timeout_s:.0f} s")
            self._sock.settimeout(min(left, 0.2))  # wakes up to notice close()
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                if self._closed:
                    raise SharedMemoryError("the offer was closed") from None
                continue
            except OSError as exc:
                raise SharedMemoryError(f"the offer was closed ({exc})") from None
            with conn:
                conn.settimeout(min(left, 5.0))
                try:
                    key = _recv_exactly(conn, _KEY_BYTES)
                except OSError:
                    continue
                if hmac.compare_digest(key, self.key):
                    socket.send_fds(conn, [b"fd"], [fd])
                    served += 1

    def serve(self, fd: int, count: int, timeout_s: float) -> threading.Thread:
        """:meth:`hand_over` on a thread of its own, so this rank can go on to hear from its
        peers whether they got it (a peer that fails does so without connecting). Stop it with
        :meth:`close`."""
        thread = threading.Thread(target=_quietly, args=(self.hand_over, fd, count, timeout_s),
                                  name="omni-offload-hand-over", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._closed = True
        self._sock.close()


def _quietly(fn, *args) -> None:
    with contextlib.suppress(SharedMemoryError, OSError):
        fn(*args)


def receive(address: str, key: bytes, timeout_s: float) -> int:
    """A non-first rank's side: present the key, get the descriptor."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(address)
        sock.sendall(key)
        _msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 1)
    if len(fds) != 1:
        raise SharedMemoryError("the host's first rank sent no descriptor (the key did not match)")
    os.set_inheritable(fds[0], False)
    return fds[0]


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


@dataclass(frozen=True, slots=True)
class BlockSpans:
    """Where each block of a ring sits in its shared file: ``(offset, nbytes)``, or None for a
    block no rank of the host streams; the header's size comes first."""

    spans: tuple[tuple[int, int] | None, ...]
    ranks: int
    nbytes: int

    @property
    def header_nbytes(self) -> int:
        """The header's pages: one byte per (block, rank), rounded up to a page."""
        return _pages(max(len(self.spans) * self.ranks, 1))

    @classmethod
    def plan(cls, sizes: Sequence[int | None], ranks: int) -> BlockSpans:
        """Blocks back to back after the header, each at a page boundary (so each is registered,
        and punched, in whole pages of its own)."""
        offset = _pages(max(len(sizes) * ranks, 1))
        spans = []
        for size in sizes:
            if size is None:
                spans.append(None)
                continue
            spans.append((offset, size))
            offset += _pages(max(size, 1))
        return cls(tuple(spans), ranks, max(offset, _PAGE))


class SharedBlocks:
    """One ring's blocks in a shared file, as seen from rank ``me`` (0 .. ranks - 1 on the host)."""

    def __init__(self, segment: SharedSegment, layout: BlockSpans, me: int) -> None:
        self.segment = segment
        self.layout = layout
        self.me = me
        n, r = len(layout.spans), layout.ranks
        self._flags = segment.tensor[: n * r].view(n, r)

    def init_header(self, users: Sequence[Sequence[int]]) -> None:
        """The first rank, before anyone else maps the file: ``users[b]``, the host ranks that
        stream block ``b`` from it."""
        self._flags.zero_()
        for b, who in enumerate(users):
            for r in who:
                self._flags[b, r] = 1

    def view(self, block: int) -> torch.Tensor | None:
        span = self.layout.spans[block]
        return None if span is None else self.segment.tensor[span[0] : span[0] + span[1]]

    def uses(self, block: int) -> bool:
        """Whether this rank streams ``block`` from the shared copy."""
        return self.layout.spans[block] is not None and bool(self._flags[block, self.me])

    def leave(self, block: int) -> None:
        """This rank no longer reads ``block`` here (it has unregistered its pages); the last
        rank to leave gives the pages back."""
        span = self.layout.spans[block]
        if span is None or self.segment.fd < 0:
            return
        with self._locked():
            if not self._flags[block, self.me]:
                return
            self._flags[block, self.me] = 0
            if not bool(self._flags[block].any()):
                self.segment.punch(span[0], _pages(span[1]))  # its pages are its own
                if not bool(self._flags.any()):  # no rank reads any block: the header goes too
                    self.segment.punch(0, self.layout.header_nbytes)

    def leave_all(self) -> None:
        for b in range(len(self.layout.spans)):
            self.leave(b)

    def share_bytes(self) -> int:
        """This rank's share of the live copy: each block it streams from here, divided by the
        number of ranks that do."""
        share = 0.0
        for b, span in enumerate(self.layout.spans):
            if span is not None and self._flags[b, self.me]:
                share += span[1] / int(self._flags[b].sum())
        return round(share)

    def live_bytes(self) -> int:
        """Bytes of the blocks some rank of the host still streams from the shared copy."""
        return sum(span[1] for b, span in enumerate(self.layout.spans)
                   if span is not None and bool(self._flags[b].any()))

    def close(self) -> None:
        """Leave every block, then close the descriptor. Idempotent."""
        if self.segment.fd >= 0:
            self.leave_all()
            self.segment.close()

    @contextlib.contextmanager
    def _locked(self):
        header = len(self.layout.spans) * self.layout.ranks
        fcntl.lockf(self.segment.fd, fcntl.LOCK_EX, header, 0)
        try:
            yield
        finally:
            fcntl.lockf(self.segment.fd, fcntl.LOCK_UN, header, 0)
