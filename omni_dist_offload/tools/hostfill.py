"""How fast this host fills host memory, by kind: what bounds the setup of a ``shared`` host copy.

    python -m omni_dist_offload.tools.hostfill --gib 8 --procs 2 --threads 4 --repeat 2

Each row: ``procs`` processes of ``threads`` threads write ``gib`` GiB between them, in 64 MiB
pieces copied from a private source, into

- ``private``: anonymous memory asking for huge pages (``MADV_HUGEPAGE``), as a rank-local host
  buffer is (one process: each rank fills a copy of its own);
- ``shared-one-file``: one shared-memory file for every block, as a shared copy was first laid out;
- ``shared-file-per-block``: a file per block (12 blocks), as :mod:`omni_dist_offload.sharedmem`
  lays it out;

shared memory with the pages written through faults, populated first (``MADV_POPULATE_WRITE``,
as the shared copy's setup does) or allocated first (``fallocate``); private memory through
faults, by ``procs x threads`` threads of one process. The first line says how the host
keeps shared memory (``shmem_enabled``: ``[never]`` means 4 KiB pages). Nothing here uses the
accelerator; each row is timed from a barrier to the last process's end.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import multiprocessing as mp
import os
import platform
import queue
import threading
import time
from pathlib import Path
from typing import Sequence

from ..runtime.flags import OneLineParser, UsageError, positive_float, positive_int, report_usage_error
from ..runtime.proc import exit_with
from ..sharedmem import SharedSegment, available_host_bytes, shared_memory_reason

_PIECE = 64 * 2**20
_BLOCKS = 12
_KINDS = ("private", "shared-one-file", "shared-file-per-block")
_HOW = ("faults", "populate", "fallocate")


def host_facts() -> dict:
    """Kernel, cores and how this host gives out huge pages."""
    facts: dict = {"kernel": platform.release(), "cpus": os.cpu_count()}
    for key, path in (("shmem_enabled", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
                      ("thp_enabled", "/sys/kernel/mm/transparent_hugepage/enabled")):
        try:
            facts[key] = Path(path).read_text().strip()
        except OSError as exc:
            facts[key] = f"unreadable ({exc.strerror})"
    return facts


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _fill(rank: int, procs: int, threads: int, kind: str, how: str, files: list[SharedSegment],
          block_bytes: int, barrier, results) -> None:
    """One process: write its blocks (every ``procs``-th), ``threads`` threads taking pieces.
    The calls that do the work (``memmove``, ``madvise``, ``fallocate``) let go of the GIL."""
    piece = min(_PIECE, block_bytes)
    source = mmap.mmap(-1, piece, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    source.write((os.urandom(2**20) * -(-piece // 2**20))[:piece])
    private = []
    work = []  # (shared file or None, base address, offset in the file, bytes)
    for b in range(rank, _BLOCKS, procs):
        if kind == "private":
            buf = mmap.mmap(-1, block_bytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf.madvise(mmap.MADV_HUGEPAGE)
            private.append(buf)
            file, base, start = None, _address(buf), 0
        else:
            file = files[0] if kind == "shared-one-file" else files[b]
            start = b * block_bytes if kind == "shared-one-file" else 0
            base = file.tensor.data_ptr()
        work += [(file, base, start + off, min(piece, block_bytes - off)) for off in range(0, block_bytes, piece)]
    lock, pieces = threading.Lock(), iter(work)

    def worker() -> None:
        while True:
            with lock:
                piece = next(pieces, None)
            if piece is None:
                return
            file, base, off, n = piece
            if file is not None and how == "fallocate":
                os.posix_fallocate(file.fd, off, n)
            elif file is not None and how == "populate":
                file.populate(file.tensor[off : off + n])
            ctypes.memmove(base + off, _address(source), n)

    barrier.wait(timeout=120)
    start_s = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    results.put((time.perf_counter() - start_s, sum(p[3] for p in work)))


def measure(kind: str, how: str, gib: float, procs: int, threads: int) -> dict:
    """One row: ``procs`` x ``threads`` filling ``gib`` GiB of ``kind`` memory."""
    block_bytes = max(int(gib * 2**30) // _BLOCKS // 4096 * 4096, 4096)
    files: list[SharedSegment] = []
    ctx = mp.get_context("fork")  # the children inherit the files' mappings
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers: list = []
    try:
        if kind == "shared-one-file":
            files.append(SharedSegment.create("omni-offload:hostfill", block_bytes * _BLOCKS))
        elif kind == "shared-file-per-block":
            for b in range(_BLOCKS):
                files.append(SharedSegment.create(f"omni-offload:hostfill:{b}", block_bytes))
        workers = [ctx.Process(target=_fill, args=(r, procs, threads, kind, how, files, block_bytes, barrier, results))
                   for r in range(procs)]
        for w in workers:
            w.start()
        done = []
        while len(done) < procs:
            try:
                done.append(results.get(timeout=0.5))
            except queue.Empty:
                if dead := [w.exitcode for w in workers if w.exitcode not in (None, 0)]:
                    raise RuntimeError(f"a filling process ended with exit code {dead[0]}") from None
        for w in workers:
            w.join()
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join()
        for f in files:
            f.close()
    seconds, nbytes = max(d[0] for d in done), sum(d[1] for d in done)
    return {"kind": kind, "how": how, "procs": procs, "threads": threads, "gib": round(nbytes / 2**30, 3),
            "seconds": round(seconds, 3), "gbps": round(nbytes / seconds / 1e9, 2)}


PROG = "python -m omni_dist_offload.tools.hostfill"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=positive_float, default=8.0, help="bytes written per row, all processes together")
    p.add_argument("--procs", type=positive_int, default=2, help="processes (ranks of one host)")
    p.add_argument("--threads", type=positive_int, default=4, help="threads per process")
    p.add_argument("--kinds", nargs="+", choices=_KINDS, default=list(_KINDS))
    p.add_argument("--how", nargs="+", choices=_HOW, default=list(_HOW))
    p.add_argument("--repeat", type=positive_int, default=1)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every row was measured; 2 for bad flags, or flags this host cannot run (one line
    on stderr, before anything is written)."""
    try:
        args = build_parser().parse_args(argv)
        _check_host(args)
    except UsageError as exc:
        return report_usage_error(PROG, exc)
    print(json.dumps(host_facts()), flush=True)
    for _ in range(args.repeat):
        for kind in args.kinds:
            # Private memory is one rank's own copy: one process writes it all.
            procs = 1 if kind == "private" else args.procs
            for how in args.how:
                if kind == "private" and how != "faults":
                    continue  # huge pages fault in fast; there is no file to allocate
                print(json.dumps(measure(kind, how, args.gib, procs, args.threads * (args.procs if procs == 1 else 1))),
                      flush=True)
    return 0


def _check_host(args: argparse.Namespace) -> None:
    """Flags this host cannot run: more memory than it has, shared memory where there is none."""
    free = available_host_bytes()
    if not math.isfinite(args.gib) or (free is not None and args.gib * 2**30 > 0.9 * free):
        room = f"the {free / 2**30:.1f} GiB of host memory available" if free is not None else "any host's memory"
        raise UsageError(f"--gib {args.gib:g} is more than 90% of {room}; ask for less")
    if any(k.startswith("shared") for k in args.kinds) and (reason := shared_memory_reason()):
        raise UsageError(f"--kinds: cannot measure shared memory here: {reason} (--kinds private measures "
                         "private memory only)")


if __name__ == "__main__":
    exit_with(main)
