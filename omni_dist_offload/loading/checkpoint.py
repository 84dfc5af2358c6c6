"""Reading tensors out of safetensors files by byte range, without loading whole files.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range, then the raw bytes, row-major. :class:`SafetensorsCheckpoint`
parses the headers of a single file or of the shards an index JSON names, and reads any element
range of any tensor with positional reads (``os.preadv``) straight into the caller's buffer. No
file is memory-mapped: pages of a mapping would count in this process's resident set for as long
as the mapping lives, and 8 ranks mapping one checkpoint would each appear to hold all of it.
Reads are safe to run from several threads at once; each converts the dtype itself when the
checkpoint's differs from the run dtype (through a small scratch buffer, so conversion never
holds more than ``_SCRATCH_BYTES`` per thread).

:class:`CheckpointSource` fills a streamed block's host buffer (or this rank's shard of it) from such
a checkpoint, for blocks whose tensors were built as placeholders and never materialised.
"""

from __future__ import annotations

import errno
import functools

import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..layout import BlockLayout, TensorEntry

__all__ = [
    "CheckpointSource", "CheckpointError", "ModelLoadError", "SafetensorsCheckpoint", "TensorInfo", "check_pipeline_folder",
    "find_weight_files", "placeholder", "read_model_index",
]

#: safetensors dtype names.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    **({"F8_E4M3": torch.float8_e4m3fn} if hasattr(torch, "float8_e4m3fn") else {}),
    **({"F8_E5M2": torch.float8_e5m2} if hasattr(torch, "float8_e5m2") else {}),
}

#: Weight file names of diffusers models, then transformers models, each pair in the order its
#: library's ``from_pretrained`` looks for them: diffusers takes an index of shards before a single
#: file, transformers a single file before an index. A folder saved twice (sharded, then not, or
#: the other way) can hold both, and the cold start must read what the ordinary load reads.
WEIGHT_NAMES: tuple[tuple[str, str], ...] = (
    ("diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors"),
    ("model.safetensors", "model.safetensors.index.json"),
)

#: Checkpoint bytes one conversion step reads into its scratch buffer.
_SCRATCH_BYTES = 4 * 2**20

#: Bytes one positional read asks for at most (Linux caps a read at 2 GiB - 4 KiB).
_READ_BYTES = 1 << 30


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says what was tried."""


class CheckpointError(ModelLoadError):
    """A checkpoint file is missing, malformed, or does not match the model: a model that could
    not be loaded, whichever path read it (cold start or the ordinary load)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and absolute byte range."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def find_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of one model folder: the shards its index names, or its one file.

    Within each library's names the first that exists wins (:data:`WEIGHT_NAMES`), as in that
    library's own loader."""
    for first, second in WEIGHT_NAMES:
        for name in (first, second):
            if (folder / name).is_file():
                return _index_files(folder / name) if name.endswith(".index.json") else [folder / name]
    raise CheckpointError(
        f"{folder} has no safetensors weights (looked for {[n for pair in WEIGHT_NAMES for n in pair]}); "
        "save the model with safe_serialization (the default of save_pretrained)."
    )


def read_model_index(path: Path) -> dict[str, Any]:
    """A pipeline folder's ``model_index.json``, or a :class:`CheckpointError` naming what is wrong."""
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON ({type(exc).__name__}: {exc}); "
                              "download or save the pipeline again.") from exc
    bad = not isinstance(index, dict) or not isinstance(index.get("_class_name", ""), str) or any(
        isinstance(spec, list) and len(spec) == 2 and not all(x is None or isinstance(x, str) for x in spec)
        for name, spec in index.items() if not name.startswith("_"))
    if bad:
        raise CheckpointError(f"{path}: not a diffusers model_index.json (an object with a string "
                              "'_class_name' and one [library, class] pair per component); "
                              "download or save the pipeline again.")
    return index


def check_pipeline_folder(folder: Path, *, safetensors: bool = True) -> None:
    """A :class:`CheckpointError` naming the first index file of a pipeline folder that cannot
    be read: its ``model_index.json`` and (``safetensors``) each component's shard index, where
    the component's loader reads one (the weights file it picks, as :func:`find_weight_files`:
    transformers reads ``model.safetensors`` before an index beside it, which its own
    ``save_pretrained`` leaves behind when a sharded save is saved again whole). diffusers' own
    loader meets a damaged index deep inside, with an AttributeError or a TypeError."""
    index = read_model_index(folder / "model_index.json")
    if not safetensors:
        return
    for name in index:
        if name.startswith("_") or not (folder / name).is_dir():
            continue
        read = next((weights for pair in WEIGHT_NAMES for weights in pair if (folder / name / weights).is_file()),
                    None)
        if read is not None and read.endswith(".index.json"):
            _index_files(folder / name / read)


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError(f"'weight_map' is a {type(weight_map).__name__}, not an object of file names")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); "
                              "it needs a 'weight_map' of tensor name -> file: download it again.") from exc
    files = sorted({index.parent / name for name in weight_map.values()})
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index} names shard(s) that do not exist: {missing}; "
                              "download or copy the complete checkpoint.")
    return files


class SafetensorsCheckpoint:
    """The tensors of one model's safetensors files, read by element range."""

    def __init__(self, files: Iterable[Path]) -> None:
        self.files = [Path(f) for f in files]
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for name, info in _read_header(path).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name!r} appears in both {self.tensors[name].path} "
                                          f"and {path}: the checkpoint is inconsistent.")
                self.tensors[name] = info
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    @classmethod
    def from_folder(cls, folder: Path | str) -> SafetensorsCheckpoint:
        return cls(find_weight_files(Path(folder)))

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint ({self.where()})") from None

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------
    def read_into(self, name: str, dst: torch.Tensor, start: int = 0, via: torch.dtype | None = None) -> None:
        """Fill ``dst`` (a contiguous CPU tensor of the run dtype) with the tensor's elements
        ``[start, start + dst.numel())`` in row-major order, converting the dtype if needed.
        ``via``: convert to this dtype first where it is neither the file's nor ``dst``'s (8-bit
        storage from a file in a third dtype rounds through the model's dtype, as loading the
        model and then casting it does), a scratch-sized slice at a time."""
        info = self.info(name)
        count = dst.numel()
        if start < 0 or start + count > info.numel:
            raise CheckpointError(f"{name}: elements [{start}, {start + count}) are outside its "
                                  f"{info.numel} elements")
        if not dst.is_contiguous() or dst.device.type != "cpu":
            raise ValueError("read_into needs a contiguous CPU destination")
        src_size = info.dtype.itemsize
        offset = info.start + start * src_size
        if info.dtype == dst.dtype:
            self._pread(info.path, dst.view(-1).view(torch.uint8), offset)
            return
        # Convert through a per-thread scratch buffer, a slice at a time: copy_ rounds exactly as
        # tensor.to(dtype) does, which is what the libraries' own loaders call.
        per = max(1, _SCRATCH_BYTES // src_size)
        scratch = self._scratch()
        staged = self._staging(via, per) if via is not None and via not in (info.dtype, dst.dtype) else None
        flat = dst.view(-1)
        for lo in range(0, count, per):
            n = min(per, count - lo)
            raw = scratch[: n * src_size]
            self._pread(info.path, raw, offset + lo * src_size)
            src = raw.view(info.dtype)
            if staged is not None:
                src = staged[:n].copy_(src)
            flat[lo : lo + n].copy_(src)

    def load(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """One whole tensor on the host, in ``dtype``."""
        info = self.info(name)
        out = torch.empty(info.shape, dtype=dtype, device="cpu")
        self.read_into(name, out)
        return out

    # -- internals ---------------------------------------------------------------------
    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError as exc:  # the header was read, so the file went away or the storage failed since
                        raise CheckpointError(
                            f"{path}: cannot be opened to read its tensors ({_os_error(exc)}), though its header "
                            f"was read at start-up: {_os_error_fix(exc)}") from exc
                    self._fds[path] = fd
        return fd

    def _pread(self, path: Path, dst: torch.Tensor, offset: int) -> None:
        """Read ``dst.numel()`` bytes at ``offset`` into ``dst`` (uint8), looping over short reads."""
        view = memoryview(dst.numpy()).cast("B")
        fd = self._fd(path)
        done = 0
        while done < len(view):
            part = view[done : done + _READ_BYTES]
            try:
                got = os.preadv(fd, [part], offset + done)
            except OSError as exc:  # EIO from a failing disk, ESTALE from a network file system
                raise CheckpointError(
                    f"{path}: reading {len(part)} bytes at byte {offset + done} failed ({_os_error(exc)}): "
                    f"{_os_error_fix(exc)}") from exc
            if got <= 0:
                raise CheckpointError(f"{path}: unexpected end of file at byte {offset + done}; "
                                      "the file is truncated, download it again.")
            done += got

    def _scratch(self) -> torch.Tensor:
        """This thread's conversion buffer, allocated once: allocating and freeing megabytes per
        read would raise glibc's mmap threshold and leave freed scratch in its heaps, which
        shows up as tens of MB of resident memory that is never given back."""
        buf = getattr(self._local, "scratch", None)
        if buf is None:
            buf = self._local.scratch = torch.empty(_SCRATCH_BYTES, dtype=torch.uint8, device="cpu")
        return buf

    def _staging(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """This thread's buffer of ``count`` elements of ``dtype`` for :meth:`read_into`'s ``via``,
        allocated once per dtype (as :meth:`_scratch`)."""
        buffers = getattr(self._local, "staging", None)
        if buffers is None:
            buffers = self._local.staging = {}
        buf = buffers.get(dtype)
        if buf is None or buf.numel() < count:
            buf = buffers[dtype] = torch.empty(count, dtype=dtype, device="cpu")
        return buf

    def where(self) -> str:
        """The checkpoint's files, for error messages."""
        return ", ".join(str(f) for f in self.files[:3]) + (" ..." if len(self.files) > 3 else "")


def _os_error(exc: OSError) -> str:
    """``EIO: Input/output error``: the error's symbol and text, for a message."""
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno is not None else type(exc).__name__
    return f"{name}: {exc.strerror or exc}"


def _os_error_fix(exc: OSError) -> str:
    """What to do about an error the operating system gave while the checkpoint was read."""
    if exc.errno == errno.ESTALE:
        return ("the network file system lost the file (replaced on the server, or the mount went away): remount "
                "it, or copy the checkpoint to a local disk, and start again.")
    if exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM):
        return "the file was removed or its permissions changed while loading: restore it and start again."
    return ("the storage returned an error (the kernel log, dmesg, says more): check the disk or network file "
            "system, or copy the checkpoint to a healthy disk (or download it again), and start again.")


def _read_header(path: Path) -> Mapping[str, TensorInfo]:
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * 2**20:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); download it again.") from exc
    base = 8 + length
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (its header is not a JSON object); "
                              "download it again.")
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end, shape = _entry(path, name, meta)
        dtype = DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {meta['dtype']!r}, which "
                                  f"this loader does not read (it reads {sorted(DTYPES)}).")
        info = TensorInfo(path, dtype, shape, base + begin, base + end)
        if info.stop - info.start != info.numel * dtype.itemsize or info.stop > size:
            raise CheckpointError(f"{path}: tensor {name!r} has a byte range that does not match its "
                                  "shape and dtype or lies past the end of the file; the file is damaged, "
                                  "download it again.")
        out[name] = info
    # What safetensors itself checks: the tensors tile the data section exactly, with no overlap
    # and no hole (an overlap would read one tensor's bytes as another's, a hole header bytes).
    at = base
    for name, info in sorted(out.items(), key=lambda kv: (kv[1].start, kv[1].stop)):
        if info.start != at:
            raise CheckpointError(
                f"{path}: tensor {name!r} starts at byte {info.start - base} of the data, where the tensors "
                f"before it end at {at - base} ({'an overlap' if info.start < at else 'a hole'}); the file is "
                "damaged, download it again.")
        at = info.stop
    if at != size:
        raise CheckpointError(f"{path}: the tensors end at byte {at} of {size}; the file is damaged, "
                              "download it again.")
    return out


def _entry(path: Path, name: str, meta: Any) -> tuple[int, int, tuple[int, ...]]:
    """``(begin, end, shape)`` of one header entry, checked for the types safetensors writes."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable safetensors file (tensor {name!r}: {what}); "
                               "download it again.")

    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= meta.keys():
        raise bad("its entry is not an object with dtype, shape and data_offsets")
    offsets, shape = meta["data_offsets"], meta["shape"]
    if not isinstance(meta["dtype"], str):
        raise bad(f"dtype {meta['dtype']!r} is not a string")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise bad(f"shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r} are not two increasing byte offsets")
    return offsets[0], offsets[1], tuple(shape)


#: Destination bytes of one read task; a large tensor is split so threads share it.
_TASK_BYTES = 64 * 2**20


def placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of ``shape`` and ``dtype`` backed by one element: what a block tensor is
    before its bytes are read. Floats read NaN, so a placeholder used by mistake shows up."""
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((), fill, dtype=dtype, device="cpu").expand(tuple(shape))


class CheckpointSource:
    """Fills the streamed blocks of one component from its checkpoint (a
    :class:`~omni_dist_offload.layout.BlockSource`).

    ``keys`` maps ``id(tensor)`` of every placeholder to its checkpoint key; tensors of a block
    that are not placeholders (buffers computed at construction, absent from checkpoints) are
    copied from the tensor itself. A placeholder's bytes are the checkpoint tensor's elements in
    row-major order, in the placeholder's dtype, which is the order :func:`layout_block` gives a
    contiguous tensor.
    """

    def __init__(self, checkpoint: SafetensorsCheckpoint, keys: Mapping[int, str], threads: int) -> None:
        self.checkpoint = checkpoint
        self.keys = dict(keys)
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None

    def owns(self, entry: TensorEntry) -> bool:
        return id(entry.tensor) in self.keys

    def elements(self, entry: TensorEntry, start: int, count: int) -> torch.Tensor | None:
        """Elements ``[start, start + count)`` of a placeholder entry (None for other entries)."""
        key = self.keys.get(id(entry.tensor))
        if key is None:
            return None
        out = torch.empty(count, dtype=entry.dtype, device="cpu")
        self.checkpoint.read_into(key, out, start)
        return out

    def fill(self, layout: BlockLayout, pieces: Sequence[tuple[int, int, int]], dst: torch.Tensor) -> None:
        """Write the block image's bytes ``[offset, offset + n)`` to ``dst[at : at + n]`` for every
        ``(offset, n, at)`` in ``pieces``; bytes past the block's end are zero. Reads run on
        ``threads`` threads; only the byte ranges asked for are read."""
        tasks = []
        image = layout.image
        end = layout.image_nbytes
        for lo, n, at in pieces:
            hi = lo + n
            for k, e in enumerate(layout.entries):
                # Where the entry sits in the block's image, and in what dtype (8-bit storage
                # stores some entries in another dtype: see storage.py).
                offset, dtype = (image.offsets[k], image.dtypes[k]) if image is not None else (e.offset, e.dtype)
                nbytes = e.nbytes // e.dtype.itemsize * dtype.itemsize
                a, b = max(lo, offset), min(hi, offset + nbytes)
                if a >= b:
                    continue
                out = dst[at + a - lo : at + b - lo]
                key = self.keys.get(id(e.tensor))
                if key is None:
                    tasks.append((_copy_storage_bytes, (e, a - offset, out, dtype)))
                    continue
                size = dtype.itemsize
                first = (a - offset) // size
                step = max(size, _TASK_BYTES // size * size)
                read = self.checkpoint.read_into
                model = e.tensor.dtype  # the model's dtype (an entry planned in 8 bits for upcast "layer" says 8 bits)
                if dtype != model and self.checkpoint.info(key).dtype not in (dtype, model):
                    # Stored in 8 bits from a file in a third dtype: through the model's dtype,
                    # as loading the model and then casting it rounds twice.
                    read = functools.partial(self.checkpoint.read_into, via=model)
                for s in range(0, b - a, step):
                    part = out[s : s + step]
                    tasks.append((read, (key, part.view(dtype), first + s // size)))
            if hi > end:
                dst[at + max(0, end - lo) : at + n].zero_()
        if self.threads == 1 or len(tasks) == 1:
            for fn, args in tasks:
                fn(*args)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="omni-offload-read")
        for future in [self._pool.submit(fn, *args) for fn, args in tasks]:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _copy_storage_bytes(entry: TensorEntry, start: int, out: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Bytes ``[start, start + len(out))`` of a real tensor as the block buffer stores it (in
    ``dtype`` where it is stored in another one)."""
    dtype = dtype or entry.dtype
    nbytes = entry.nbytes // entry.dtype.itemsize * dtype.itemsize
    image = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    shifted = TensorEntry(entry.name, entry.tensor, 0, nbytes, dtype, entry.shape, entry.stride, entry.origin)
    shifted.view_in(image).copy_(entry.tensor.detach().to(dtype))
    out.copy_(image[start : start + out.numel()])
