"""How a block's bytes are split across the ranks of a weight group, and a digest of layouts.

A block buffer of ``B`` bytes is cut into chunks. In chunk ``j`` (``N * c_j`` bytes at slot
offset ``o_j``) rank ``r`` owns ``[o_j + r * c_j, o_j + (r + 1) * c_j)``, so each chunk's
all-gather fills a contiguous range of the device slot in place, its local input a view into
its output. Each rank's host shard is its pieces of all chunks, back to back. ``c_j`` is a
multiple of 256 bytes, so every rank's slice starts on a 256-byte boundary; bytes past ``B``
are zero padding.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..layout import ALIGNMENT, BlockLayout, TensorEntry, align

__all__ = ["ShardPlan", "layout_digest", "plan_shards", "sample_digest", "shard_pieces", "write_shard"]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One block's split over ``world`` ranks, seen from ``rank``."""

    world: int
    rank: int
    chunks: tuple[tuple[int, int], ...]
    """(slot offset, bytes per rank) of every chunk."""

    @property
    def padded_nbytes(self) -> int:
        """Device bytes the gathered block occupies (its slot size)."""
        return sum(self.world * c for _, c in self.chunks)

    @property
    def shard_nbytes(self) -> int:
        """Host bytes this rank keeps for the block."""
        return sum(c for _, c in self.chunks)


def plan_shards(nbytes: int, world: int, rank: int, chunk_bytes: int) -> ShardPlan:
    """Split ``nbytes`` into chunks of at most ``chunk_bytes`` (gathered size) over ``world`` ranks."""
    per_rank_max = max(ALIGNMENT, chunk_bytes // world // ALIGNMENT * ALIGNMENT)
    chunks = []
    offset = 0
    remaining = max(nbytes, 1)
    while remaining > 0:
        c = min(per_rank_max, align(-(-remaining // world)))
        chunks.append((offset, c))
        offset += world * c
        remaining -= world * c
    return ShardPlan(world, rank, tuple(chunks))


def shard_pieces(plan: ShardPlan) -> list[tuple[int, int, int]]:
    """This rank's pieces of the block: (offset in the block image, bytes, offset in the shard)."""
    pieces = []
    pos = 0
    for offset, c in plan.chunks:
        pieces.append((offset + plan.rank * c, c, pos))
        pos += c
    return pieces


def write_shard(plan: ShardPlan, image: torch.Tensor, shard: torch.Tensor) -> None:
    """Copy this rank's pieces of a full block image (``uint8``, any length up to the padded
    size) into its host shard, zero-filling what lies past the image."""
    for start, c, pos in shard_pieces(plan):
        piece = shard[pos : pos + c]
        have = max(0, min(c, image.numel() - start))
        if have:
            piece[:have].copy_(image[start : start + have])
        if have < c:
            piece[have:].zero_()


def layout_digest(layouts: Sequence[BlockLayout]) -> list[str]:
    """One short digest per block of everything that must match across ranks: names, dtypes,
    shapes, strides, offsets and sizes, and how the host image stores them (``storage_dtype``:
    the stored dtypes, their offsets and the image's size), since ranks share the image's bytes."""
    out = []
    for layout in layouts:
        h = hashlib.sha256(f"{layout.name}|{layout.nbytes}".encode())
        for e in layout.entries:
            h.update(f"|{e.name}:{e.dtype}:{e.shape}:{e.stride}:{e.offset}:{e.nbytes}".encode())
        if layout.image is not None:
            image = layout.image
            h.update(f"|image:{image.nbytes}:{image.offsets}:{[str(d) for d in image.dtypes]}".encode())
        out.append(h.hexdigest()[:16])
    return out


def sample_digest(layouts: Sequence[BlockLayout], sample_bytes: int = 64,
                  elements: Callable[[TensorEntry, int, int], torch.Tensor | None] | None = None) -> list[str]:
    """One short digest per block of a few bytes of every tensor, at its start, middle and end:
    cheap evidence that all ranks hold the same weights (ranks that built random weights without
    a common seed, or loaded other checkpoints, would otherwise assemble blocks from different
    models, silently). ``elements(entry, start, count)`` returns an entry's elements in row-major
    order (default, or None: read from the tensor itself; a checkpoint-backed entry reads them
    from its file)."""
    out = []
    for layout in layouts:
        pieces = []
        for e in layout.entries:
            numel = e.tensor.numel()
            k = min(numel, max(1, sample_bytes // max(1, e.tensor.element_size())))
            flat = None  # the tensor's own elements, flattened once (a copy where it has gaps)
            for start in sorted({0, (numel - k) // 2, numel - k}):
                window = elements(e, start, k) if elements is not None else None
                if window is None:
                    flat = e.tensor.detach().reshape(-1) if flat is None else flat
                    window = flat[start: start + k]
                pieces.append(window.contiguous().view(torch.uint8).reshape(-1))
        sample = torch.cat([p.to("cpu") for p in pieces]) if pieces else torch.empty(0, dtype=torch.uint8, device="cpu")
        out.append(hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16])
    return out
