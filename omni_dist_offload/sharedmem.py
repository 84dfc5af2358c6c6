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
Tensors a caller took over a rank's mapping of the block while its ring ran (a ``state_dict()``)
would then read zeros: a rank that still has such tensors when it stops using the block (the
storage's use count says, beyond the ring's own views) first puts a private copy of the block in
place of its mapping, at the same address, and that copy goes with the last of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hmac
import mmap
import os
import posixpath
import re
import resource
import secrets
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .hostmem import huge_pages_wanted

__all__ = ["CopyLayout", "Offer", "SharedBlocks", "SharedMemoryError", "SharedSegment", "available_host_bytes",
           "job_name", "out_of_descriptors", "receive", "shared_memory_reason", "small_pages_note"]

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


#: Where :func:`available_host_bytes` reads. Module attributes, so tests can point them at a
#: fake tree.
_MEMINFO = "/proc/meminfo"
_PROC_CGROUP = "/proc/self/cgroup"
_MOUNTINFO = "/proc/self/mountinfo"
_CGROUP_ROOT = "/sys/fs/cgroup"
#: Per cgroup version: the files of a cgroup that hold its memory limit and its usage now.
_V2_FILES = ("memory.max", "memory.current")
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes")
#: v1 says "no limit" with a number near 2**63 (rounded down to a page).
_V1_UNLIMITED = 1 << 60


def available_host_bytes() -> int | None:
    """Host memory a new allocation can take: ``MemAvailable``, capped by the room left under
    each memory limit on the way from this process's cgroup (``/proc/self/cgroup``: v2, and v1's
    memory controller) up to the root of its hierarchy (a limit minus that cgroup's usage: the
    pages a shared copy allocates are charged to this cgroup and to each above it). None where
    nothing can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError):
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    found += _cgroup_room()
    return min(found) if found else None


def _cgroup_room() -> list[int]:
    """The room under every memory limit set on this process's cgroup or an ancestor of it."""
    try:
        with open(_PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:  # as before: where this process's cgroup is unknown, the hierarchies' roots
        lines = ["0::/", "0:memory:/"]
    mounts = _cgroup_mounts()
    room: list[int] = []
    seen: set[str] = set()
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":  # cgroup v2 (the unified hierarchy)
            kind, files, default = "cgroup2", _V2_FILES, _CGROUP_ROOT
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            kind, files, default = "memory", _V1_FILES, f"{_CGROUP_ROOT}/memory"
        else:
            continue
        # Where the hierarchy is mounted (mountinfo), and the usual place in case that says nothing.
        for root, point in [*mounts.get(kind, []), ("/", default)]:
            here = _under(path, root)
            if here is None:
                continue
            top = point.rstrip("/") or "/"
            cgroup = posixpath.normpath(top + here) if here != "/" else top
            while True:
                if cgroup not in seen:
                    seen.add(cgroup)
                    left = _room_in(cgroup, files)
                    if left is not None:
                        room.append(left)
                if cgroup == top or len(cgroup) <= len(top):
                    break
                cgroup = posixpath.dirname(cgroup)
    return room


def _under(path: str, root: str) -> str | None:
    """``path`` (a cgroup, as ``/proc/self/cgroup`` names it) relative to a mount of its
    hierarchy whose root is ``root``, starting with ``/``; None when the mount does not hold it."""
    if not path.startswith("/") or ".." in path.split("/"):  # outside this cgroup namespace
        return None
    root = root.rstrip("/")
    if not root:
        return path
    if path == root:
        return "/"
    return path[len(root):] if path.startswith(root + "/") else None


def _room_in(cgroup: str, files: tuple[str, str]) -> int | None:
    """A cgroup's memory limit less its usage, or None when it has none (or it cannot be read)."""
    try:
        with open(f"{cgroup}/{files[0]}") as f:
            cap = f.read().strip()
        if cap == "max" or int(cap) >= _V1_UNLIMITED:
            return None
        limit = int(cap)
    except (OSError, ValueError):
        return None
    usage = 0
    with contextlib.suppress(OSError, ValueError):
        with open(f"{cgroup}/{files[1]}") as f:
            usage = int(f.read().strip())
    # The usage counts the page cache (checkpoints just read, mmapped safetensors), which the
    # kernel gives back under pressure: less its inactive file pages, the "working set" that
    # kubelet and docker compare with the limit.
    return max(0, limit - max(0, usage - _inactive_file(cgroup, files)))


def _inactive_file(cgroup: str, files: tuple[str, str]) -> int:
    """A cgroup's reclaimable file cache (``memory.stat``): v2 ``inactive_file``, v1
    ``total_inactive_file`` (its subtree's, as its usage is); 0 where it cannot be read."""
    keys = ("inactive_file",) if files == _V2_FILES else ("total_inactive_file", "inactive_file")
    found: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError):
        with open(f"{cgroup}/memory.stat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in keys:
                    found[name] = int(value)
    return next((found[k] for k in keys if k in found), 0)


def _cgroup_mounts() -> dict[str, list[tuple[str, str]]]:
    """``"cgroup2"`` and ``"memory"`` (v1) -> their mounts as (root within the hierarchy, mount
    point), from ``/proc/self/mountinfo``; empty where it cannot be read."""
    mounts: dict[str, list[tuple[str, str]]] = {}
    with contextlib.suppress(OSError):
        with open(_MOUNTINFO) as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if not sep or len(fields) < 5 or len(tail) < 3:
                    continue
                root, point = _unescape(fields[3]), _unescape(fields[4])
                if tail[0] == "cgroup2":
                    mounts.setdefault("cgroup2", []).append((root, point))
                elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
                    mounts.setdefault("memory", []).append((root, point))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // _PAGE) * _PAGE


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    libc.mremap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2


def _storage_users(tensor: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold ``tensor``'s storage, itself included."""
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1  # not the storage object made here


class SharedSegment:
    """A shared-memory file of ``nbytes``, mapped read-write into this process, as a flat
    ``uint8`` tensor. The descriptor stays open: it carries the header lock and the hole punching.

    The mapping is made with ``mmap(2)`` itself, not Python's ``mmap`` (which keeps a duplicate
    of the descriptor for as long as the mapping lives), and goes when the last tensor viewing
    it does: it takes no descriptor of its own, and one that a caller keeps (a ``state_dict()``)
    holds no descriptor open either."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.private = False
        """Whether this process's mapping holds a private copy now (:meth:`keep_private`)."""
        libc, length = _libc(), _pages(nbytes)
        start = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if start in (None, _MAP_FAILED):
            code = ctypes.get_errno()
            raise OSError(code, f"could not map a shared file of {nbytes} bytes: {os.strerror(code)}")
        try:
            memory = (ctypes.c_uint8 * nbytes).from_address(start)
            self.tensor = torch.frombuffer(memory, dtype=torch.uint8)
        except BaseException:
            libc.munmap(start, length)
            raise
        # The tensor's storage holds ``memory``: once no tensor views it, it goes, and unmaps.
        weakref.finalize(memory, libc.munmap, start, length).atexit = False
        # Advice only: huge pages where the host lets shared memory have them (fewer faults
        # while filling, fewer pages to page-lock), unless OMNI_OFFLOAD_HUGE_PAGES=0.
        if huge_pages_wanted():
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

    def keep_private(self) -> None:
        """Put a private copy of the mapping's bytes in its place, at the same address: every
        tensor that views it reads the same values from then on, and no longer the file, so
        the file's pages may go (:meth:`punch`, or another process's) without them turning to
        zeros. The copy goes when the last tensor viewing it does (it unmaps with the mapping).
        The kernel swaps the mappings in one step (``mremap``): a reader at that moment reads
        the old or the new, both the same bytes."""
        if self.private:
            return
        libc, length = _libc(), _pages(self.nbytes)
        start = self.tensor.data_ptr()
        copy = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if copy in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"could not copy a shared block's {length} bytes: "
                                              f"{os.strerror(ctypes.get_errno())}")
        try:
            ctypes.memmove(copy, start, self.nbytes)
            if libc.mremap(copy, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, start) in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        except BaseException:
            libc.munmap(copy, length)
            raise
        self.private = True

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
    truncated = False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(address)
            sock.sendall(key)
            try:
                while len(fds) < count:
                    msg, got, flags, _addr = socket.recv_fds(sock, 1, _FDS_PER_MESSAGE)
                    fds += got
                    # The kernel drops the descriptors this process cannot take (no free
                    # descriptor under its limit) and says so with MSG_CTRUNC.
                    truncated = truncated or bool(flags & getattr(socket, "MSG_CTRUNC", 0))
                    if not msg or truncated:
                        break
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                raise SharedMemoryError(out_of_descriptors(
                    f"it took {len(fds)} of the {count} descriptors the host's first rank sent", count, exc)) from exc
            if len(fds) != count and (truncated or _no_descriptor_left(sock)):
                raise SharedMemoryError(out_of_descriptors(
                    f"it took {len(fds)} of the {count} descriptors the host's first rank sent", count))
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


def _no_descriptor_left(sock: socket.socket) -> bool:
    """Whether this process has reached its limit of open files (errno says so)."""
    try:
        os.close(os.dup(sock.fileno()))
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    return False


def out_of_descriptors(what: str, files: int, exc: OSError | None = None) -> str:
    """Why this rank, not the one that sent them, could not take a copy's ``files``."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    return (f"this rank may have run out of file descriptors: {what}{f' ({exc})' if exc is not None else ''}, "
            f"and its limit of open files (ulimit -n) is {limit}. Each rank holds a descriptor per file of "
            f"each shared copy ({files} for this one: a header and a file per block): raise ulimit -n on "
            "this rank")


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
        # Per block, the tensors this rank's ring made over its mapping (:meth:`view`,
        # :meth:`adopt`), weakly: any other tensor over it is a caller's (a state_dict).
        self._own: list[list[weakref.ref]] = [[] for _ in range(n)]

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
            with torch.inference_mode():  # see _locked
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
        """This rank's mapping of ``block``'s bytes (None where the copy does not hold it)."""
        file = self.files[block]
        if file is None:
            return None
        view = file.tensor[: self.layout.sizes[block]]
        self.adopt(block, (view,))
        return view

    def adopt(self, block: int, tensors: Sequence[torch.Tensor]) -> None:
        """``tensors`` (views of ``block``'s mapping, such as the ring's parked tensors) are
        this rank's own: :meth:`leave` does not count them as tensors a caller still holds."""
        refs = [r for r in self._own[block] if r() is not None]
        refs += [weakref.ref(t) for t in tensors]
        self._own[block] = refs

    def outside_views(self, block: int) -> int:
        """How many tensors over ``block``'s mapping in this process are not this rank's own
        (:meth:`adopt`): tensors a caller took from the block's parameters (``state_dict()``,
        ``param.data``), or parameters still pointing at it. Counted from the storage's use
        count, which every tensor over it adds one to."""
        file = self.files[block]
        if file is None:
            return 0
        own = {id(file.tensor)}
        for ref in self._own[block]:
            if (t := ref()) is not None:
                # A view made through a tensor autograd does not see as one (``.view(dtype)``
                # to another element size) keeps that tensor alive as its base.
                own.update((id(t), id(t._base)) if t._base is not None else (id(t),))
        return max(0, _storage_users(file.tensor) - len(own))

    def populate(self, block: int, view: torch.Tensor) -> None:
        """Allocate the pages of ``view``, a range of :meth:`view` of ``block``."""
        self.files[block].populate(view)

    def mark_written(self, block: int) -> None:
        """Its writer has filled ``block``: the other ranks may page-lock it without allocating
        its pages against the writer (a hint only; page-locking is correct at any time)."""
        with torch.inference_mode():  # see _locked
            self._written[block] = 1

    def written(self, block: int) -> bool:
        return bool(self._written[block])

    def uses(self, block: int) -> bool:
        """Whether this rank streams ``block`` from the shared copy."""
        return self.files[block] is not None and bool(self._flags[block, self.me])

    def leave(self, block: int) -> None:
        """This rank no longer reads ``block`` here (it has unregistered its pages); the last
        rank to leave gives the pages back. Tensors a caller still holds over this rank's
        mapping of it (a ``state_dict()`` taken while the ring ran) keep their values: the
        mapping becomes a private copy first (:meth:`SharedSegment.keep_private`), which goes
        with them."""
        file = self.files[block]
        if file is None or file.fd < 0:
            return
        if self._flags[block, self.me] and not file.private and self.outside_views(block):
            file.keep_private()  # while this rank's byte still keeps the pages from being punched
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
        """Hold the lock on the header's per-rank bytes. Writes to the header run in inference
        mode: its tensor is an inference tensor where setup ran in that mode (a model built
        under it), and may still be written from outside it (``remove()``)."""
        header = len(self.layout.sizes) * self.layout.ranks
        fcntl.lockf(self.header.fd, fcntl.LOCK_EX, header, 0)
        try:
            with torch.inference_mode():
                yield
        finally:
            fcntl.lockf(self.header.fd, fcntl.LOCK_UN, header, 0)
