"""Stream memory operations of the CUDA driver: a stream waits for (or writes) a 32-bit word in
device memory, executed by the GPU's front end with no kernel. The copy-engine gather
synchronises ranks with them; the weight group's facts say whether the driver has them."""

from __future__ import annotations

import ctypes

import torch

__all__ = ["StreamMemOps"]

_U32 = 0xFFFFFFFF


class StreamMemOps:
    """``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` from the CUDA driver: a stream waits
    for (or writes) a 32-bit word in device memory, executed by the GPU's front end."""

    _lib = None

    def __init__(self) -> None:
        if StreamMemOps._lib is None:
            StreamMemOps._lib = _load_memops()
        self._wait, self._write = StreamMemOps._lib

    @staticmethod
    def available() -> bool:
        try:
            if StreamMemOps._lib is None:
                StreamMemOps._lib = _load_memops()
        except OSError:
            return False
        return True

    def wait_geq(self, stream: "torch.cuda.Stream", addr: int, value: int) -> None:
        # GEQ compares wrap-safely: (int32_t)(*addr - value) >= 0.
        _check(self._wait(stream.cuda_stream, addr, value & _U32, 0), "cuStreamWaitValue32")

    def write(self, stream: "torch.cuda.Stream", addr: int, value: int) -> None:
        # Flag 0 (CU_STREAM_WRITE_VALUE_DEFAULT): a memory fence precedes the write.
        _check(self._write(stream.cuda_stream, addr, value & _U32, 0), "cuStreamWriteValue32")


def _load_memops():
    lib = ctypes.CDLL("libcuda.so.1")
    fns = []
    for names in (("cuStreamWaitValue32_v2", "cuStreamWaitValue32"),
                  ("cuStreamWriteValue32_v2", "cuStreamWriteValue32")):
        fn = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
        if fn is None:
            raise OSError(f"the CUDA driver has none of {list(names)}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns.append(fn)
    return tuple(fns)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")
