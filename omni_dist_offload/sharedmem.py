"""One host copy of a ring's blocks, shared by every rank of the host (``weight_transfer: "shared"``).

The host's first rank creates anonymous shared-memory files (``memfd_create``: they have no name
in any filesystem, and ``/dev/shm``'s size does not limit them), one per block and one for a
header, and hands their descriptors to the host's other ranks over a unix socket in the abstract
namespace. The socket's address and a random key travel to the ranks over the job's own process
group; a peer gets the descriptors only by sending the key, so no process outside the job can
(pids are not checked: ranks in other pid namespaces are ranks all the same). Every rank maps the
files; from then on the memory lives exactly as long as some rank maps it or holds a descriptor:
a normal exit, an exception or a SIGKILL of any or every rank leaves nothing behind, and no later
job can find it.

A file per block, not one for the copy: the kernel adds pages to a shared-memory file under that
file's locks, so ranks and threads filling one file take turns where, filling a file each, they
do not (on an H200 host whose shared memory comes in 4 KiB pages, two processes of four threads
writing 8 GiB: 1.6-1.9 s into one file, 0.9-1.1 s into twelve; ``tools/hostfill.py``). A
block's pages also go back to the host by emptying its file.

The header holds one byte per (block, rank), 1 while that rank streams the block from the shared
copy, and one per block that its writer sets once the block is filled, so the other ranks
page-lock their mappings of it while they are still writing their own part. A rank that stops
using a block (it became resident there, the rank edited it and keeps a copy of its own, or the
rank released the ring) clears its byte under a lock on the header; the last one out empties the
block's file (``fallocate PUNCH_HOLE``), so memory no rank uses goes back to the host at once.
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
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["CopyLayout", "Offer", "SharedBlocks", "SharedMemoryError", "SharedSegment", "available_host_bytes",
           "job_name", "receive", "shared_memory_reason", "small_pages_note"]

_PAGE = 4096
_FALLOC_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_SOCKET_NAME_MAX = 107  # sun_path holds 108 bytes, the first of them NUL in the abstract namespace
_KEY_BYTES = 32
_FDS_PER_MESSAGE = 250  # the kernel passes at most 253 descriptors in one message (SCM_MAX_FD)


class SharedMemoryError(RuntimeError):
    """The shared host copy could not be created or handed over."""


def shared_memory_reason() -> str | None:
    """Why this process cannot share host memory with its peers, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"shared host copies need Linux (memfd_create), and this is {sys.platform}"
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return "this Python has no os.memfd_create or socket.send_fds"
    return None


_THP = "/sys/kernel/mm/transparent_hugepage"


def small_pages_note(thp: str = _THP) -> str | None:
    """A line saying why a shared copy fills slower than rank-local host buffers here, when this
    host keeps shared memory in 4 KiB pages (``shmem_enabled`` ``never`` or ``deny``, and no
    2 MiB setting of its own); None when it can have huge pages or the setting cannot be read."""
    def chosen(path: str) -> str | None:
        with contextlib.suppress(OSError):
            found = re.search(r"\[(\w+)\]", Path(path).read_text())
            return found.group(1) if found else None
        return None

    top = chosen(f"{thp}/shmem_enabled")
    pmd = chosen(f"{thp}/hugepages-2048kB/shmem_enabled")
    mode = top if top == "deny" or pmd in (None, "inherit") else pmd
    if mode not in ("never", "deny"):
        return None
    return (f"this host keeps shared memory in 4 KiB pages ({thp}/shmem_enabled: {top}), so a shared "
            "host copy fills and page-locks slower than rank-local buffers, which get 2 MiB pages; "
            "with 'advise' it gets huge pages too")


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
        """Allocate the pages under ``view`` (a range of this mapping) and map them writable in
        one call (``MADV_POPULATE_WRITE``) instead of a page fault per page. Shared memory comes
        in 4 KiB pages unless the host turns on huge pages for it
        (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``), and filled through faults it runs
        at a fraction of private memory's speed. Advice only: where the kernel lacks it, the
        faults do the work. (``fallocate`` would allocate them too, but under the file's lock:
        threads populating one file would take turns.)"""
        if view.numel():
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
    random token, and the key a peer must send to get the descriptors."""

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

    def hand_over(self, fds: Sequence[int], count: int, timeout_s: float) -> None:
        """Send ``fds`` to ``count`` peers that present the key; any other connection is closed
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
                    for i in range(0, len(fds), _FDS_PER_MESSAGE):
                        socket.send_fds(conn, [b"f"], list(fds[i : i + _FDS_PER_MESSAGE]))
                    served += 1

    def serve(self, fds: Sequence[int], count: int, timeout_s: float) -> threading.Thread:
        """:meth:`hand_over` on a thread of its own, so this rank can go on to hear from its
        peers whether they got it (a peer that fails does so without connecting). Stop it with
        :meth:`close`."""
        thread = threading.Thread(target=_quietly, args=(self.hand_over, fds, count, timeout_s),
                                  name="omni-offload-hand-over", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._closed = True
        self._sock.close()


def _quietly(fn, *args) -> None:
    with contextlib.suppress(SharedMemoryError, OSError):
        fn(*args)


def receive(address: str, key: bytes, count: int, timeout_s: float) -> list[int]:
    """A non-first rank's side: present the key, get ``count`` descriptors."""
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(address)
            sock.sendall(key)
            while len(fds) < count:
                msg, got, _flags, _addr = socket.recv_fds(sock, 1, _FDS_PER_MESSAGE)
                fds += got
                if not msg:
                    break
        for fd in fds:
            os.set_inheritable(fd, False)
        if len(fds) != count:
            raise SharedMemoryError(f"the host's first rank sent {len(fds)} of {count} descriptors "
                                    "(the key did not match, or it stopped)")
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


@dataclass(frozen=True, slots=True)
class CopyLayout:
    """What a ring's shared copy holds: each block's bytes, or None for a block no rank of the
    host streams, and how many ranks the header keeps a byte for."""

    sizes: tuple[int | None, ...]
    ranks: int

    @property
    def header_nbytes(self) -> int:
        """The header's pages: one byte per (block, rank) and one per block, rounded up to a page."""
        return _pages(len(self.sizes) * (self.ranks + 1) or 1)

    @property
    def nbytes(self) -> int:
        """Host memory the copy takes: the header and every block, in whole pages."""
        return self.header_nbytes + sum(_pages(max(s, 1)) for s in self.sizes if s is not None)

    @property
    def files(self) -> int:
        """Descriptors a peer receives: the header's, then one per block the copy holds."""
        return 1 + sum(s is not None for s in self.sizes)


class SharedBlocks:
    """One ring's blocks in shared files (a header and a file per block), as seen from rank
    ``me`` (0 .. ranks - 1 on the host)."""

    def __init__(self, header: SharedSegment, files: Sequence[SharedSegment | None], layout: CopyLayout,
                 me: int) -> None:
        self.header = header
        self.files = list(files)
        self.layout = layout
        self.me = me
        n, r = len(layout.sizes), layout.ranks
        self._flags = header.tensor[: n * r].view(n, r)
        self._written = header.tensor[n * r : n * (r + 1)]

    @classmethod
    def create(cls, name: str, layout: CopyLayout, users: Sequence[Sequence[int]]) -> SharedBlocks:
        """The host's first rank: new files, readable and writable by this user only, and the
        header saying that ``users[b]`` (host ranks) stream block ``b``."""
        made: list[SharedSegment] = []
        try:
            made.append(SharedSegment.create(f"{name}:header", layout.header_nbytes))
            files: list[SharedSegment | None] = []
            for b, size in enumerate(layout.sizes):
                if size is not None:
                    made.append(SharedSegment.create(f"{name}:{b}", max(size, 1)))
                files.append(made[-1] if size is not None else None)
            blocks = cls(made[0], files, layout, 0)
            blocks._flags.zero_()
            for b, who in enumerate(users):
                for r in who:
                    blocks._flags[b, r] = 1
            return blocks
        except BaseException:
            for segment in made:
                segment.close()
            raise

    @classmethod
    def open(cls, fds: Sequence[int], layout: CopyLayout, me: int) -> SharedBlocks:
        """A peer: map the descriptors :meth:`fds` sent (this object owns them from here, and
        closes them all if mapping fails)."""
        made: list[SharedSegment] = []
        try:
            if len(fds) != layout.files:
                raise SharedMemoryError(f"got {len(fds)} descriptors for a copy of {layout.files} files")
            made.append(SharedSegment(fds[0], layout.header_nbytes))
            files: list[SharedSegment | None] = []
            for size in layout.sizes:
                if size is not None:
                    made.append(SharedSegment(fds[len(made)], max(size, 1)))
                files.append(made[-1] if size is not None else None)
            return cls(made[0], files, layout, me)
        except BaseException:
            for segment in made:
                segment.close()
            for fd in fds[len(made):]:
                os.close(fd)
            raise

    def fds(self) -> list[int]:
        """The descriptors to hand to a peer, in the order :meth:`open` maps them."""
        return [self.header.fd] + [f.fd for f in self.files if f is not None]

    def view(self, block: int) -> torch.Tensor | None:
        file = self.files[block]
        return None if file is None else file.tensor[: self.layout.sizes[block]]

    def populate(self, block: int, view: torch.Tensor) -> None:
        """Allocate the pages of ``view``, a range of :meth:`view` of ``block``."""
        self.files[block].populate(view)

    def mark_written(self, block: int) -> None:
        """Its writer has filled ``block``: the other ranks may page-lock it without allocating
        its pages against the writer (a hint only; page-locking is correct at any time)."""
        self._written[block] = 1

    def written(self, block: int) -> bool:
        return bool(self._written[block])

    def uses(self, block: int) -> bool:
        """Whether this rank streams ``block`` from the shared copy."""
        return self.files[block] is not None and bool(self._flags[block, self.me])

    def leave(self, block: int) -> None:
        """This rank no longer reads ``block`` here (it has unregistered its pages); the last
        rank to leave gives the pages back."""
        file = self.files[block]
        if file is None or file.fd < 0:
            return
        with self._locked():
            if not self._flags[block, self.me]:
                return
            self._flags[block, self.me] = 0
            if not bool(self._flags[block].any()):
                file.punch(0, _pages(file.nbytes))
                if not bool(self._flags.any()):  # no rank reads any block: the header goes too
                    self.header.punch(0, self.header.nbytes)

    def leave_all(self) -> None:
        for b in range(len(self.files)):
            self.leave(b)

    def share_bytes(self) -> int:
        """This rank's share of the live copy: each block it streams from here, divided by the
        number of ranks that do."""
        share = 0.0
        for b, size in enumerate(self.layout.sizes):
            if size is not None and self._flags[b, self.me]:
                share += size / int(self._flags[b].sum())
        return round(share)

    def live_bytes(self) -> int:
        """Bytes of the blocks some rank of the host still streams from the shared copy."""
        return sum(size for b, size in enumerate(self.layout.sizes)
                   if size is not None and bool(self._flags[b].any()))

    def allocated_bytes(self) -> int:
        """Host memory the files hold now (pages written and not given back)."""
        return sum(f.allocated_bytes() for f in [self.header, *self.files] if f is not None and f.fd >= 0)

    def close(self) -> None:
        """Leave every block, then close the descriptors. Idempotent."""
        if self.header.fd >= 0:
            self.leave_all()
            for file in [*self.files, self.header]:
                if file is not None:
                    file.close()

    @contextlib.contextmanager
    def _locked(self):
        header = len(self.layout.sizes) * self.layout.ranks
        fcntl.lockf(self.header.fd, fcntl.LOCK_EX, header, 0)
        try:
            yield
        finally:
            fcntl.lockf(self.header.fd, fcntl.LOCK_UN, header, 0)
