"""Host layout of a block: every parameter and buffer at an aligned offset in one byte buffer.

A block's tensors, whatever their dtypes, are packed into one flat ``uint8`` buffer. Each
tensor keeps its shape and strides: it is stored in its own memory order, from its first element
to its last (its *span*), and viewed with its own strides, so the views rebuilt on the device
have exactly the strides of the original, and kernels (which pick their memory format from the
strides) see what they saw before offloading. A dense tensor (contiguous, or any other order
without gaps: a transposed weight, a ``channels_last`` convolution, strides of size-1
dimensions included) spans its elements exactly; a view with gaps (``weight[:, ::2]``) spans the
gaps too (bytes no view reads, as the alignment padding between tensors). See :func:`_placement`
for the tensors that cannot keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .config import OffloadConfigError
from .storage import BlockImage, Run

__all__ = [
    "ALIGNMENT", "BlockLayout", "BlockSource", "TensorEntry", "align", "bind", "check_ownership", "distinct",
    "layout_block", "quantized_refusal", "restore_blocks", "restored",
]

#: Offset alignment of every tensor in a block buffer, in bytes.
ALIGNMENT = 256


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One distinct tensor of a block and where it lives in the block buffer."""

    name: str
    """Qualified name within the component (``blocks.3.attn1.to_q.weight``)."""
    tensor: torch.Tensor
    """The parameter or buffer object; it is kept, only its ``.data`` moves."""
    offset: int
    nbytes: int
    """Bytes from its first element to its last in the block buffer (its span): the tensor's
    bytes for a dense one; a tensor with gaps spans them too."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    """The strides it is viewed with: the tensor's own (except where :func:`_placement` says)."""
    origin: torch.device
    """Device the tensor was on before offloading (restored there if setup fails)."""
    inference: bool = False
    """Whether it was an inference tensor (made under ``torch.inference_mode()``): its storage
    is given back alike, whatever mode ``remove()`` runs in (:func:`restored`)."""

    def view_in(self, buffer: torch.Tensor, base: int = 0) -> torch.Tensor:
        """This tensor as a view into a block buffer (host or device); ``base``: the block
        offset where ``buffer`` starts (a buffer holding only the block's later tensors)."""
        start = self.offset - base
        return _strided(buffer[start : start + self.nbytes].view(self.dtype), self)

    def distinct(self, view: torch.Tensor) -> torch.Tensor:
        """``view`` (of this entry's shape: :meth:`view_in`, or the tensor itself) with each of
        the entry's places once (see :func:`distinct`)."""
        return distinct(view, self.stride)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The packed layout of one block."""

    index: int
    """Position in the ring."""
    name: str
    module: nn.Module
    entries: tuple[TensorEntry, ...]
    nbytes: int
    """Buffer size, alignment padding included."""
    image: BlockImage | None = None
    """How the block is stored on the host when some tensors are stored in another dtype
    (``storage_dtype``); None: the host copy is the buffer above, byte for byte."""

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def stored_tensor_bytes(self) -> int:
        """Bytes of the block's tensors as its host copy stores them."""
        if self.image is None:
            return self.tensor_bytes
        return sum(e.nbytes // e.dtype.itemsize * d.itemsize for e, d in zip(self.entries, self.image.dtypes))

    @property
    def image_nbytes(self) -> int:
        """Bytes of the host copy of the whole block."""
        return self.image.nbytes if self.image is not None else self.nbytes

    def image_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Every entry as a view into the block's host image (in its stored dtype)."""
        if self.image is None:
            return [e.view_in(buffer) for e in self.entries]
        return [_stored_view(e, buffer, offset, dtype)
                for e, offset, dtype in zip(self.entries, self.image.offsets, self.image.dtypes, strict=True)]


class BlockSource(Protocol):
    """Where the bytes of a component's blocks come from when its tensors are placeholders
    (cold start: :class:`omni_dist_offload.loading.checkpoint.CheckpointSource` reads them from
    safetensors files). ``apply_offload(block_sources=...)`` takes one per component."""

    def elements(self, entry: TensorEntry, start: int, count: int) -> torch.Tensor | None:
        """Elements ``[start, start + count)`` of an entry in row-major order, or None to read
        them from the tensor itself."""

    def fill(self, layout: BlockLayout, pieces: Sequence[tuple[int, int, int]], dst: torch.Tensor) -> None:
        """Write the block image's bytes ``[offset, offset + n)`` to ``dst[at : at + n]`` for
        every ``(offset, n, at)`` in ``pieces``; bytes past the block's end are zero."""


#: In a block's layout, tensors smaller than this share of its largest come first (see
#: :func:`layout_block`).
TINY_SHARE = 1 / 64


def layout_block(index: int, name: str, block: nn.Module, cast: Mapping[int, torch.dtype] | None = None,
                 per_layer: bool = False) -> BlockLayout:
    """Plan the buffer of one block. Reads the block, changes nothing. ``cast``: tensors (by
    ``id``) stored in another dtype on the host (``storage.cast_tensors``); they come first,
    see [Note: 8-bit storage] in ``storage.py``. ``per_layer`` (``upcast: "layer"``): those
    tensors are also 8-bit on the device, so the block's buffer is laid out in their stored
    dtype, as if the model held them so (it will: [Note: upcast per layer])."""
    found = []
    seen: set[int] = set()
    for mod_name, mod in block.named_modules(remove_duplicate=False):
        for registry in (mod._parameters, mod._buffers):
            for attr, t in registry.items():
                if t is None or id(t) in seen:  # a tied tensor is stored once
                    continue
                seen.add(id(t))
                qual = f"{name}.{mod_name}.{attr}" if mod_name else f"{name}.{attr}"
                if is_traceable_wrapper_subclass(t):
                    # Its values live in inner tensors (torchao's quantize_ applied by hand, a
                    # DTensor): it has no storage of its own to lay out, and torch would fail on
                    # the first read of one with an error that names nothing.
                    raise quantized_refusal(f"tensor {qual}", f"{type(t).__module__}.{type(t).__qualname__}, a "
                                            "tensor subclass")
                if t.is_meta:
                    raise OffloadConfigError(
                        f"{qual} is on the meta device: load real weights before offloading "
                        "(e.g. call to_empty() and load a state dict, or build the model with "
                        "from_pretrained without leaving weights on 'meta')."
                    )
                stored = cast.get(id(t), t.dtype) if cast else t.dtype
                dtype = stored if per_layer else t.dtype
                stride, span = _placement(qual, t, stored)
                found.append((qual, t, dtype, stride, span * dtype.itemsize))
    # Largest tensors first (ties in module order). A streamed block can keep a leading part on
    # the device and stream the rest ([Note: residency planner]); with the small tensors last,
    # the streamed part can be sized in small steps, which is where it must be small: where a
    # block copies much slower than it computes, only a small part hides under the compute.
    # Tensors of no size to speak of (biases, norm weights) go before all of them: any kept
    # part keeps them, so a streamed part is a few weights, each rebound at every use.
    sizes = [nbytes for *_, nbytes in found]
    tiny = max(sizes, default=0) * TINY_SHARE
    order = sorted(range(len(found)), key=lambda k: (sizes[k] >= tiny, -sizes[k]))
    entries = []
    offset = 0
    for k in order:
        qual, t, dtype, stride, nbytes = found[k]
        entries.append(TensorEntry(qual, t, offset, nbytes, dtype, tuple(t.shape), stride, t.device,
                                   t.is_inference()))
        offset = align(offset + nbytes)
    if cast and not per_layer and any(id(e.tensor) in cast for e in entries):
        return _stored_layout(index, name, block, entries, cast)
    return BlockLayout(index, name, block, tuple(entries), offset)


def _stored_layout(index: int, name: str, block: nn.Module, entries: list[TensorEntry],
                   cast: Mapping[int, torch.dtype]) -> BlockLayout:
    """The layout of a block some of whose tensors are stored in another dtype: those first,
    grouped by (stored, compute) dtype, each group one run whose slot offsets are its image
    offsets times the size ratio; then the rest, one run of identical relative offsets."""
    groups: dict[tuple[torch.dtype, torch.dtype], list[TensorEntry]] = {}
    plain = []
    for e in entries:
        stored = cast.get(id(e.tensor))
        if stored is None or stored == e.dtype:
            plain.append(e)
        else:
            groups.setdefault((stored, e.dtype), []).append(e)
    placed: list[TensorEntry] = []
    offsets: list[int] = []
    dtypes: list[torch.dtype] = []
    runs = []
    image = slot = 0
    for (stored, compute), members in groups.items():
        ratio = compute.itemsize // stored.itemsize
        if ratio * stored.itemsize != compute.itemsize or ratio < 1:
            raise OffloadConfigError(f"{name}: {compute} cannot be stored as {stored} (its size is not "
                                     "a multiple): drop storage_dtype for this component.")
        image0, slot0 = image, slot
        for e in members:
            at = slot0 + (image - image0) * ratio
            placed.append(TensorEntry(e.name, e.tensor, at, e.nbytes, e.dtype, e.shape, e.stride, e.origin,
                                      e.inference))
            offsets.append(image)
            dtypes.append(stored)
            image = align(image + e.nbytes // ratio)
        runs.append(Run(image0, image - image0, slot0, (image - image0) * ratio, stored, compute))
        slot = align(slot0 + (image - image0) * ratio)
    image0, slot0 = image, slot
    for e in plain:
        placed.append(TensorEntry(e.name, e.tensor, slot0 + image - image0, e.nbytes, e.dtype,
                                  e.shape, e.stride, e.origin, e.inference))
        offsets.append(image)
        dtypes.append(e.dtype)
        image = align(image + e.nbytes)
    if image > image0:
        runs.append(Run(image0, image - image0, slot0, image - image0, torch.uint8, torch.uint8))
    slot = slot0 + image - image0
    return BlockLayout(index, name, block, tuple(placed), slot,
                       BlockImage(image, tuple(offsets), tuple(dtypes), tuple(runs)))


def _stored_view(entry: TensorEntry, buffer: torch.Tensor, offset: int, dtype: torch.dtype) -> torch.Tensor:
    nbytes = entry.nbytes // entry.dtype.itemsize * dtype.itemsize
    return _strided(buffer[offset : offset + nbytes].view(dtype), entry)


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGNMENT`."""
    return -(-n // ALIGNMENT) * ALIGNMENT


def quantized_refusal(what: str, method: str) -> OffloadConfigError:
    """The refusal of a quantized model or tensor (``what``), quantized by ``method``."""
    return OffloadConfigError(
        f"{what} is quantized ({method}): layerwise offloading streams ordinary tensors, and a quantized "
        "layer's weights are not those (its packed data and scales live in a tensor subclass or beside "
        "the layer). Load the model without quantization_config (and without quantizing it by hand: torchao's "
        "quantize_) and stream it as it is, or with layer_options.<component>.storage_dtype 'float8_e4m3fn' "
        "for 8-bit host storage.")


def _placement(qual: str, t: torch.Tensor, stored: torch.dtype) -> tuple[tuple[int, ...], int]:
    """The strides ``t`` is viewed with in its block buffer, and the elements it spans there.

    Its own strides, spanning from its first element to its last (gaps included), with these
    exceptions, which are stored densely in their dimensions' memory order:

    - stored in another dtype (``stored``, 8-bit storage): the strides ``Tensor.to`` gives, what
      diffusers' layerwise casting stores and upcasts (its own where dense), so outputs match it;
    - one value broadcast over every dimension (all strides 0): also what a cold start's block
      tensors are until their bytes are read, row-major from the checkpoint;
    - expanded along some dimensions (stride 0 there, an ``expand``ed buffer): its writers (the
      fill of the host copy, a cold start's, an edit written back) copy into its view, which torch
      refuses where elements share a place; until they copy through :meth:`TensorEntry.distinct`,
      it is stored as ``Tensor.to`` would give it, its values kept and its strides not.

    Elements that overlap otherwise (strides from ``as_strided``) are refused, naming it."""
    n = t.numel()
    if n <= 1:
        return tuple(t.stride()), n
    dims = [(t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) != 1]
    span = _span(dims)
    if span == n or (span is not None and stored == t.dtype):
        return tuple(t.stride()), span
    if stored == t.dtype and all(stride != 0 for stride, _ in dims):
        raise OffloadConfigError(
            f"{qual} has strides {tuple(t.stride())} for its shape {tuple(t.shape)}: its elements overlap (or "
            "interleave in an order a block buffer cannot keep), so streaming cannot store them as they are. "
            "Make it an ordinary tensor before apply_offload: give the module a .contiguous() (or .clone()) "
            "copy of it (a parameter: nn.Parameter(t.contiguous())), or leave this component out of "
            "'components'.")
    if all(stride == 0 for stride, _ in dims):
        return _contiguous(t.shape), n
    return tuple(torch.empty_like(t, dtype=stored, device="meta").stride()), n


def _span(dims: Sequence[tuple[int, int]]) -> int | None:
    """How many elements (first to last) the ``(stride, size)`` dimensions (sizes over one)
    reach, if no two elements share a place: with the strides sorted, each must pass every place
    the smaller ones reach. None otherwise (a stride 0 included)."""
    reach = 0
    for stride, size in sorted(dims):
        if stride <= reach:
            return None
        reach += (size - 1) * stride
    return reach + 1


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _strided(flat: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """``entry``'s tensor over ``flat``, its elements in memory order."""
    return flat.as_strided(entry.shape, entry.stride, flat.storage_offset())


def distinct(t: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """``t`` along the dimensions where ``stride`` (the strides of the tensor ``t`` is copied into
    or out of, ``t``'s shape) is 0 (an expanded tensor) at index 0 only: the places such a tensor
    holds, each once. torch refuses to write to a tensor whose elements share a place, so a copy
    into one goes ``distinct(dst, dst.stride()).copy_(distinct(src, dst.stride()))``."""
    for d, (size, step) in enumerate(zip(t.shape, stride)):
        if step == 0 and size > 1:
            t = t.narrow(d, 0, 1)
    return t


def bind(entries: Sequence[TensorEntry], tensors: Sequence[torch.Tensor]) -> None:
    """Point every entry at new storage. Parameters and buffers stay the same Python objects
    (``.data`` swaps the storage underneath), so tied tensors follow and identity is kept."""
    for entry, tensor in zip(entries, tensors):
        entry.tensor.data = tensor


def restore_blocks(
    layouts: Sequence[BlockLayout],
    host_views: Sequence[Sequence[torch.Tensor]],
    device: torch.device | None,
) -> None:
    """Give each block tensor ordinary storage again, bitwise equal to its host copy, on
    ``device`` (None: the device it was on before offloading)."""
    for layout, views in zip(layouts, host_views):
        bind(layout.entries, [restored(e, v, device) for e, v in zip(layout.entries, views)])


def restored(entry: TensorEntry, view: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A copy of ``view`` in storage of its own, with the strides ``entry``'s tensor had, on
    ``device`` (None: where it was), an inference tensor exactly where it was one before
    offloading (whatever mode the caller runs in: ``remove()`` under ``inference_mode`` must
    not leave the model's weights unusable for autograd)."""
    with torch.inference_mode(entry.inference):
        out = torch.empty_strided(entry.shape, entry.stride, dtype=view.dtype,
                                  device=device if device is not None else entry.origin)
        entry.distinct(out).copy_(entry.distinct(view))
        return out


def check_ownership(
    layouts: Iterable[tuple[str, Sequence[BlockLayout]]],
    modules: dict[str, nn.Module],
) -> None:
    """Reject tensors shared between blocks, or between a block and anything outside it.

    A shared tensor cannot live in two places: streaming it with one block would leave the other
    owner reading a host tensor or another block's weights.
    """
    block_of_module: dict[int, str] = {}
    block_of_tensor: dict[int, tuple[str, str]] = {}
    block_of_storage: dict[tuple[str, int], tuple[str, str]] = {}
    block_root: dict[int, str] = {}
    for comp, blocks in layouts:
        for layout in blocks:
            where = f"{comp}.{layout.name}"
            block_root[id(layout.module)] = where
            for mod in layout.module.modules():
                other = block_of_module.setdefault(id(mod), where)
                if other != where:
                    raise OffloadConfigError(
                        f"module {type(mod).__name__} is shared by {other} and {where}: a block "
                        "must own its modules. Give each block its own copy, or keep the model resident."
                    )
            for e in layout.entries:
                block_of_tensor[id(e.tensor)] = (where, f"{comp}.{e.name}")
                if e.nbytes:
                    key = (str(e.tensor.device), e.tensor.untyped_storage().data_ptr())
                    first = block_of_storage.setdefault(key, (where, f"{comp}.{e.name}"))
                    if first[0] != where:  # distinct tensors over one storage, in two blocks
                        raise OffloadConfigError(
                            f"tensor {first[1]} (streamed with block {first[0]}) is shared with "
                            f"{comp}.{e.name} (block {where}): they are views of one storage, which "
                            "streaming would split in two. Untie the weights (clone one of them) or "
                            "leave this component out of 'components'.")
    block_at: dict[str, str] = {}  # the paths a block is registered at -> "component.block"
    for comp, root in modules.items():
        for mod_name, mod in root.named_modules(remove_duplicate=False):
            # Inside a block by where it is registered, not by what it is: a block's module
            # registered again outside the blocks (``self.final_norm = self.blocks[-1].norm``)
            # runs there without the block's hooks, on its parked host copy. A block itself may
            # be registered twice (an aliased block list): its hooks run either way.
            path = f"{comp}.{mod_name}" if mod_name else comp
            if id(mod) in block_root:  # parents come before their children
                block_at[path] = block_root[id(mod)]
            here = _block_on_path(path, block_at)
            other = block_of_module.get(id(mod))
            if other is not None and other != here:
                raise OffloadConfigError(
                    f"module {comp}.{mod_name} is also {other}'s module {type(mod).__name__}: a streamed "
                    "block's module cannot be used outside the block (it would run on the block's parked "
                    "host copy). Give it its own copy, or leave this component out of 'components'.")
            for registry in (mod._parameters, mod._buffers):
                for attr, t in registry.items():
                    if t is None:
                        continue
                    owner = block_of_tensor.get(id(t))
                    # A tensor subclass outside the blocks (a layer quantized by hand) has no
                    # storage of its own to compare (the blocks' are refused by layout_block).
                    if owner is None and t.numel() and not t.is_meta and not is_traceable_wrapper_subclass(t):
                        owner = block_of_storage.get((str(t.device), t.untyped_storage().data_ptr()))
                    if owner is not None and owner[0] != here:
                        user = f"{comp}.{mod_name}.{attr}" if mod_name else f"{comp}.{attr}"
                        raise OffloadConfigError(
                            f"tensor {owner[1]} (streamed with block {owner[0]}) is shared with "
                            f"{user} ({'block ' + here if here else 'a resident module'}): a "
                            "streamed tensor must belong to one block. Untie the weights (clone "
                            "one of them) or leave this component out of 'components'."
                        )


def _block_on_path(path: str, block_at: Mapping[str, str]) -> str | None:
    """The streamed block registered at a prefix of ``path`` (``comp.blocks.3.attn`` ->
    ``comp.blocks.3``), or None."""
    while path:
        if path in block_at:
            return block_at[path]
        path = path.rpartition(".")[0]
    return None
