"""Probe: CUDA VMM host memory (``cuMemCreate`` on a host NUMA node) shared between processes by a
POSIX descriptor, as a way to hold a ``shared`` host copy already page-locked.

    python3 benchmarks/probes/vmm_host_share.py vmm     # two processes, one GPU
    python3 benchmarks/probes/vmm_host_share.py local   # one rank-local copy, for comparison

Measured on nvidia-h200 (2026-12-01): rows in ../vmm-host-probe-h200.jsonl, read in
docs/performance.md ("Shared host copy").

Compares, for a copy of BLOCKS x BLOCK_MB:
  A. rank-local: private huge-page memory written by 8 threads, cudaHostRegister (one process)
  B. vmm shared: each of 2 processes cuMemCreate's its half, exports fds, imports the other's,
     writes its half; then H2D copy speed from own and imported memory.
"""
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCKS = int(os.environ.get("BLOCKS", 12))
BLOCK = int(os.environ.get("BLOCK_MB", 703)) * 2**20
THREADS = 8


def cu():
    lib = ctypes.CDLL("libcuda.so.1")
    return lib


def check(r, what):
    if r != 0:
        raise RuntimeError(f"{what} -> CUresult {r}")


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]


class Access(ctypes.Structure):
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def numa_of_gpu():
    lib = cu()
    v = ctypes.c_int(-1)
    r = lib.cuDeviceGetAttribute(ctypes.byref(v), 134, 0)  # CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID
    return r, v.value


def prop(numa):
    p = Prop()
    p.type = 1
    p.handle_types = 1
    p.loc_type = 3
    p.loc_id = numa
    return p


def granularity(numa):
    lib = cu()
    g = ctypes.c_size_t()
    check(lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop(numa)), 1), "granularity")
    return g.value


def map_handle(lib, handle, size, dev):
    ptr = ctypes.c_uint64()
    check(lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0),
                                  ctypes.c_uint64(0)), "reserve")
    check(lib.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(handle), ctypes.c_uint64(0)),
          "map")
    acc = (Access * 2)()
    acc[0].loc_type, acc[0].loc_id, acc[0].flags = 1, dev, 3
    acc[1].loc_type, acc[1].loc_id, acc[1].flags = 3, 0, 3
    check(lib.cuMemSetAccess(ptr, ctypes.c_size_t(size), acc, ctypes.c_size_t(2)), "setaccess")
    return ptr.value


def as_tensor(ptr, size):
    buf = (ctypes.c_char * size).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8)


def fill(dst, src):
    pieces = 64 * 2**20
    n = dst.numel()
    with ThreadPoolExecutor(THREADS) as ex:
        list(ex.map(lambda o: dst[o:o + pieces].copy_(src[o:o + pieces]), range(0, n, pieces)))


def h2d_gbps(host, dev):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2):
            dev.copy_(host, non_blocking=True)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            dev.copy_(host, non_blocking=True)
        b.record()
    b.synchronize()
    return 5 * host.numel() / (a.elapsed_time(b) / 1e3) / 1e9


def src_tensor(size):
    t = torch.empty(size, dtype=torch.uint8)
    t.random_(0, 255) if size < 2**28 else t.fill_(7)
    return t


def worker(rank, sock, q):
    try:
        torch.cuda.init()
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")
        lib = cu()
        numa_r, numa = numa_of_gpu()
        numa = max(numa, 0)
        g = granularity(numa)
        size = -(-BLOCK // g) * g
        mine = [b for b in range(BLOCKS) if b % 2 == rank]
        src = src_tensor(BLOCK)
        out = {"rank": rank, "numa": numa, "numa_r": numa_r, "granularity": g}
        t0 = time.perf_counter()
        handles, fds = {}, []
        for b in mine:
            h = ctypes.c_uint64()
            check(lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop(numa)), ctypes.c_uint64(0)),
                  "create")
            handles[b] = h.value
            fd = ctypes.c_int(-1)
            check(lib.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(h.value), 1, ctypes.c_uint64(0)),
                  "export")
            fds.append(fd.value)
        t1 = time.perf_counter()
        ptrs = {b: map_handle(lib, handles[b], size, 0) for b in mine}
        t2 = time.perf_counter()
        for b in mine:
            fill(as_tensor(ptrs[b], BLOCK), src)
        t3 = time.perf_counter()
        socket.send_fds(sock, [b"x"], fds)
        _, theirs, _, _ = socket.recv_fds(sock, 10, 64)
        t4 = time.perf_counter()
        other = [b for b in range(BLOCKS) if b % 2 != rank]
        for b, fd in zip(other, theirs):
            h = ctypes.c_uint64()
            check(lib.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), 1), "import")
            os.close(fd)
            handles[b] = h.value
            ptrs[b] = map_handle(lib, h.value, size, 0)
        t5 = time.perf_counter()
        sock.send(b"d")
        sock.recv(1)
        out.update(create_s=t1 - t0, map_s=t2 - t1, write_s=t3 - t2, exchange_s=t4 - t3, import_s=t5 - t4,
                   total_s=t5 - t0)
        # check content and speed
        dev = torch.empty(BLOCK, dtype=torch.uint8, device="cuda")
        out["own_gbps"] = h2d_gbps(as_tensor(ptrs[mine[0]], BLOCK), dev)
        out["their_gbps"] = h2d_gbps(as_tensor(ptrs[other[0]], BLOCK), dev)
        torch.cuda.synchronize()
        out["their_equal"] = bool(torch.equal(dev.cpu(), src))
        out["cpu_read_equal"] = bool(torch.equal(as_tensor(ptrs[other[-1]], BLOCK), src))
        out["is_pinned"] = bool(as_tensor(ptrs[other[0]], BLOCK).is_pinned())
        mi = open("/proc/self/status").read()
        out["rss"] = [l for l in mi.splitlines() if l.startswith(("VmRSS", "RssShmem", "VmLck", "VmPin"))]
        sock.send(b"e")
        sock.recv(1)
        q.put(out)
    except Exception as e:  # noqa
        q.put({"rank": rank, "error": repr(e)})


def rank_local():
    torch.zeros(1, device="cuda")
    sys.path.insert(0, os.getcwd())
    from omni_dist_offload.hostmem import HostBuffer
    src = src_tensor(BLOCK)
    t0 = time.perf_counter()
    bufs = [HostBuffer(BLOCK) for _ in range(BLOCKS)]
    for b in bufs:
        fill(b.tensor, src)
    t1 = time.perf_counter()
    for b in bufs:
        r = torch.cuda.cudart().cudaHostRegister(b.tensor.data_ptr(), b.tensor.numel(), 0)
        assert int(r) == 0, r
    t2 = time.perf_counter()
    dev = torch.empty(BLOCK, dtype=torch.uint8, device="cuda")
    g = h2d_gbps(bufs[0].tensor, dev)
    for b in bufs:
        torch.cuda.cudart().cudaHostUnregister(b.tensor.data_ptr())
    # cudaHostAlloc reference
    t3 = time.perf_counter()
    pinned = [torch.empty(BLOCK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    t4 = time.perf_counter()
    return {"rank_local_fill_s": t1 - t0, "rank_local_pin_s": t2 - t1, "rank_local_total_s": t2 - t0,
            "rank_local_gbps": g, "pin_memory_2_blocks_s": t4 - t3}


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "local":
        print(json.dumps(rank_local()))
    else:
        ctx = mp.get_context("spawn")
        a, b = socket.socketpair()
        q = ctx.Queue()
        ps = [ctx.Process(target=worker, args=(r, s, q)) for r, s in ((0, a), (1, b))]
        for p in ps:
            p.start()
        outs = [q.get(timeout=300) for _ in ps]
        for p in ps:
            p.join()
        print(json.dumps(sorted(outs, key=lambda o: o["rank"])))
