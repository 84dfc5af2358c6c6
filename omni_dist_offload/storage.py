"""8-bit host storage (``layer_options.<component>.storage_dtype``): which block tensors are
stored in 8 bits, and how a stored block becomes its device slot.

[Note: 8-bit storage]
The tensors stored in 8 bits are exactly those diffusers' layerwise casting stores so
(``ModelMixin.enable_layerwise_casting``, or ``apply_layerwise_casting`` for other modules): the
parameters of Linear, Conv and Embedding layers whose qualified name matches none of its skip
patterns (``pos_embed``, ``patch_embed``, ``norm``, ``^proj_in$``, ``^proj_out$``, the model's
``_skip_layerwise_casting_patterns`` and ``_keep_in_fp32_modules``; peft's adapter layers).
Both cast the model's weights with the same ``Tensor.to``, and both upcast them with it before
use, so outputs match bit for bit.

A block streamed with a storage dtype has two layouts: its *image* (the host copy, this rank's
shards, what crosses the link) and its *slot* (the compute dtype views the block runs on). The
8-bit tensors come first in both, in the same order, each image offset k times smaller than its
slot offset (k: compute bytes per stored byte), so one elementwise copy of the 8-bit run upcasts
every 8-bit tensor of the block at once; the other tensors follow with identical relative
offsets, one byte copy. Two kernels per block, on the copy stream, into the slot; the compute
stream sees ready weights (``transfer/casting.py``).

[Note: upcast per layer]
With ``upcast: "layer"`` a block's 8-bit tensors stay 8-bit on the device too: its layout is
planned in the stored dtype (``layout_block(per_layer=True)``), so the host copy, the slots, a
resident block and an allgather shard all hold the 8-bit bytes, and the ring streams the block
as it streams any other (it only ever moves bytes). Each layer that holds 8-bit tensors gets a
pre-forward hook that writes their upcast into one buffer the size of the largest such layer
(the same cast as the ``Tensor.to`` of diffusers' hook, with the same strides, on the compute
stream; nothing is allocated per layer) and points them at it, and a post-forward hook (run on
an exception too) that points them back at their 8-bit bytes, where the ring left them. So the
device holds one layer's weights in the compute dtype beside the 8-bit blocks, as diffusers'
layerwise casting does for a resident model, and outputs match it bit for bit. An edit
(``BlockRing.edit_block``, a LoRA fuse) sees the weights in the model's dtype and stores what it
leaves in 8 bits again. What it costs: every layer's cast runs on the compute stream, as in the
baseline (the ``"block"`` upcast runs on a stream of its own instead); diffusers' hook also
casts the weights back down after each use, which this one does not need (the 8-bit bytes are
still there): with every block on the device, Flux-12B runs at 0.95x of
``enable_layerwise_casting``'s forward at 1024 px. What it buys: a budget spends
8-bit bytes on its slots and resident blocks, against compute-dtype slots and staging buffers
for ``"block"`` (``docs/performance.md``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["BlockImage", "LayerUpcasts", "Run", "StoredLayers", "cast_tensors", "downcast", "layerwise_cast_modules",
           "store_outside_blocks", "upcast", "upcast_per_layer"]

# diffusers' layerwise casting rule and hook (hooks/layerwise_casting.py, hooks/_common.py),
# read from diffusers so the two never disagree.
from diffusers.hooks import layerwise_casting as _diffusers_casting
from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS as _LAYERS
from diffusers.hooks.layerwise_casting import (
    _LAYERWISE_CASTING_HOOK,
    apply_layerwise_casting_hook,
)
from diffusers.hooks.layerwise_casting import (
    DEFAULT_SKIP_MODULES_PATTERN as _DEFAULT_SKIP,
)

# The hook enable_layerwise_casting puts on LoRA layers beside its own (by name: not every
# diffusers the project takes has the constant).
_PEFT_AUTOCAST_DISABLE_HOOK = getattr(_diffusers_casting, "_PEFT_AUTOCAST_DISABLE_HOOK", "peft_autocast_disable")


@dataclass(frozen=True, slots=True)
class Run:
    """One contiguous stretch of a block: image bytes ``[image, image + image_nbytes)`` become
    slot bytes ``[slot, slot + slot_nbytes)``, converted from ``stored`` to ``compute``."""

    image: int
    image_nbytes: int
    slot: int
    slot_nbytes: int
    stored: torch.dtype
    compute: torch.dtype


@dataclass(frozen=True, slots=True)
class BlockImage:
    """How a block is stored when some of its tensors are stored in another dtype."""

    nbytes: int
    """Bytes of the image (the host copy of the whole block)."""
    offsets: tuple[int, ...]
    """Per entry of the block's layout, its offset in the image."""
    dtypes: tuple[torch.dtype, ...]
    """Per entry, the dtype it is stored in."""
    runs: tuple[Run, ...]


def skip_patterns(root: nn.Module) -> tuple[str, ...]:
    """The skip patterns diffusers' layerwise casting uses for ``root``: a diffusers model's
    ``enable_layerwise_casting`` adds the model's own and peft's adapter layers to the defaults;
    any other module gets the defaults (``apply_layerwise_casting(..., skip_modules_pattern="auto")``)
    and peft's adapter layers too, so that an adapter loaded before offloading is never rounded to
    8 bits, in a text encoder from transformers either (one loaded after is not stored at all:
    whether it is rounded must not depend on the order of the calls)."""
    patterns = tuple(_DEFAULT_SKIP)
    if hasattr(root, "_skip_layerwise_casting_patterns"):
        patterns += tuple(getattr(root, "_keep_in_fp32_modules", None) or ())
        patterns += tuple(getattr(root, "_skip_layerwise_casting_patterns", None) or ())
    try:
        from peft.tuners.loha.layer import LoHaLayer  # optional: peft adapters, skipped
        from peft.tuners.lokr.layer import LoKrLayer  # optional: as above
        from peft.tuners.lora.layer import LoraLayer  # optional: as above
    except ImportError:
        pass
    else:
        for layer in (LoHaLayer, LoKrLayer, LoraLayer):
            patterns += tuple(layer.adapter_layer_names)
    return tuple(set(patterns))


def cast_layers(root: nn.Module) -> list[nn.Module]:
    """The layers of ``root`` diffusers' layerwise casting stores in 8 bits: the Linear, Conv and
    Embedding layers whose qualified name matches none of its skip patterns, walked as diffusers
    walks them (a skipped name skips everything under it)."""
    patterns = skip_patterns(root)
    layers: list[nn.Module] = []
    # A loop, not a recursive closure: a nested function calling itself is a reference cycle,
    # which would hold the layers it found (and their weights) until a garbage collection.
    pending: list[tuple[nn.Module, str]] = [(root, "")]
    while pending:
        module, prefix = pending.pop()
        if any(re.search(p, prefix) for p in patterns):
            continue
        if isinstance(module, _LAYERS):
            layers.append(module)
            continue
        children = [(child, f"{prefix}.{name}" if prefix else name) for name, child in module.named_children()]
        pending.extend(reversed(children))  # depth first, in order, as diffusers walks them
    return layers


def cast_tensors(root: nn.Module, stored: torch.dtype) -> dict[int, torch.dtype]:
    """``id(tensor) -> stored dtype`` for every tensor of ``root`` that diffusers' layerwise
    casting would store in ``stored`` (the floating-point parameters and buffers of
    :func:`cast_layers`). Reads ``root``, changes nothing."""
    return {id(t): stored for layer in cast_layers(root)
            for t in (*layer.parameters(), *layer.buffers()) if t.is_floating_point()}


class StoredLayers:
    """Layers of a diffusers model outside its streamed blocks, stored in 8 bits by diffusers'
    own layerwise casting hook (see :func:`store_outside_blocks`)."""

    def __init__(self) -> None:
        self.layers: list[tuple[nn.Module, torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        # id(tensor) -> whether it was an inference tensor before it was stored: diffusers' hook
        # recasts it at every forward, in whatever mode the forward runs.
        self.inference: dict[int, bool] = {}
        # Where each stored layer sits (see :func:`_place`): (parent, attribute, what held it at
        # setup, its qualified name), read by the root's pre-forward check (:class:`_LateAdapters`).
        self.places: list[tuple[nn.Module, str, nn.Module, str]] = []
        self.root_name = ""
        self._check = None

    def commit(self) -> None:
        """Setup succeeded: the original tensors are no longer needed."""
        self.layers = [(m, compute, []) for m, compute, _ in self.layers]

    def undo(self) -> None:
        """A failed setup: hooks off, the original tensors back."""
        self._unwatch()
        for module, _compute, originals in self.layers:
            unhook_layerwise_casting(module)
            for t, data in originals:
                t.data = data
        self.layers = []

    def unstore(self) -> None:
        """``remove()``: hooks off, the layers upcast to their compute dtype, as the blocks are
        (every 8-bit-stored weight comes back with its 8-bit value, so the model computes what
        it computed while offloaded)."""
        self._unwatch()
        while self.layers:  # one layer at a time: a call that failed part way goes on from there
            module, compute, _originals = self.layers[0]
            unhook_layerwise_casting(module)
            for t in (*module.parameters(), *module.buffers()):
                if t.is_floating_point():
                    _upcast(t, compute, self.inference.get(id(t), t.is_inference()))
            self.layers.pop(0)

    def discard(self) -> None:
        """``discard()``: hooks off, the layers left as they are (their component does not run
        again), so nothing of the offload is left on the model."""
        self._unwatch()
        for module, _compute, _originals in self.layers:
            unhook_layerwise_casting(module)
        self.layers = []

    def watch(self, root: nn.Module) -> None:
        """Refuse, at each forward of ``root`` and before anything runs, an adapter added after
        setup to a stored layer (:class:`_LateAdapters`)."""
        names = {id(m): n for n, m in root.named_modules()}
        by_name = dict(root.named_modules())
        self.root_name = type(root).__name__
        for layer, _compute, _originals in self.layers:
            self.places.append(_place(names[id(layer)], by_name))
        # First among the root's pre-hooks: a refusal comes before the rings' hooks start a forward.
        self._check = root.register_forward_pre_hook(_LateAdapters(self), prepend=True)

    def _unwatch(self) -> None:
        if self._check is not None:
            self._check.remove()
            self._check = None
        self.places = []


def _place(name: str, by_name: Mapping[str, nn.Module]) -> tuple[nn.Module, str, nn.Module, str]:
    """Where a stored layer sits: the layer itself, or the outermost tuner layer (peft's LoRA
    wrapper, known by its ``get_base_layer``) it is the base layer of, as its parent's attribute."""
    while "." in name:
        parent = name.rpartition(".")[0]
        if not callable(getattr(by_name[parent], "get_base_layer", None)):
            break
        name = parent
    parent, _, attr = name.rpartition(".")
    return by_name[parent], attr, by_name[name], name


class _LateAdapters:
    """The root's forward pre-hook of :class:`StoredLayers`. An adapter peft adds after setup to a
    layer diffusers' hook stores in 8 bits (Flux's ``x_embedder``) is created in the base
    weight's dtype, 8 bits, and cannot compute there; diffusers' own ``enable_layerwise_casting``
    fails alike (with torch's error, mid-forward). Refused before the forward starts, naming it,
    until it is gone. A dictionary read per stored layer while none is wrapped."""

    __slots__ = ("stored",)

    def __init__(self, stored: StoredLayers) -> None:
        self.stored = stored

    def __call__(self, module: nn.Module, args: object) -> None:
        _refuse_late_adapters(self.stored)


@torch.compiler.disable
def _refuse_late_adapters(stored: StoredLayers) -> None:
    late: list[tuple[str, str]] = []  # (tensor, layer)
    for parent, attr, held, name in stored.places:
        now = parent._modules.get(attr)
        if now is None or (now is held and not callable(getattr(now, "get_base_layer", None))):
            continue  # the layer itself, unwrapped: nothing was added to it
        late += [(f"{name}.{n}", name) for n, t in (*now.named_parameters(), *now.named_buffers())
                 if id(t) not in stored.inference and t.is_floating_point() and t.dtype.itemsize == 1]
    if late:
        (first, layer), layers = late[0], sorted({layer for _, layer in late})
        raise RuntimeError(
            f"{stored.root_name}: {first} ({len(late)} tensors in all, on {', '.join(layers)}) came after "
            f"offloading, in 8 bits: {layer} is outside the streamed blocks and stored in 8 bits (diffusers' "
            "layerwise casting hook), and an adapter loaded on it after apply_offload takes its 8-bit dtype, "
            "which it cannot compute in (diffusers' own enable_layerwise_casting fails alike). Load the adapter "
            f"before apply_offload, or leave {', '.join(layers)} out of its target modules, or drop "
            "storage_dtype; or delete it (delete_adapters, unload_lora_weights) to run again. Nothing was changed.")


class LayerUpcasts:
    """The per-layer upcast hooks of ``upcast: "layer"`` ([Note: upcast per layer]) on the layers
    inside streamed blocks; the blocks' 8-bit tensors themselves belong to the ring."""

    def __init__(self, hooks: list, tensors: list[tuple[torch.Tensor, torch.dtype]],
                 layers: list[tuple[nn.Module, _UpcastHook]] | None = None) -> None:
        self._hooks = hooks
        self._tensors = tensors
        self._layers = layers or []

    def settle(self) -> None:
        """Point a layer whose forward a ``KeyboardInterrupt`` cut short (its post-forward never
        ran) at its 8-bit tensors again, before anything reads them (``remove()``)."""
        for layer, hook in self._layers:
            if hook.stored:
                hook.settle(layer)

    def commit(self) -> None:
        """Setup succeeded: nothing to let go (the ring keeps the originals until then)."""

    def compute_dtypes(self) -> dict[int, torch.dtype]:
        """``id(tensor) -> the model's dtype`` of every 8-bit tensor of the blocks."""
        return {id(t): compute for t, compute in self._tensors}

    def undo(self) -> None:
        """A failed setup: hooks off (the ring gives the tensors their original storage back)."""
        self._unhook()
        self._tensors = []

    def unstore(self) -> None:
        """``remove()``, after the ring has restored the blocks (8-bit, on the device): hooks off,
        every 8-bit tensor upcast to its compute dtype, as ``"block"`` leaves the model."""
        self._unhook()
        while self._tensors:  # one at a time: a call that failed part way goes on from there
            t, compute = self._tensors[0]
            _upcast(t, compute, t.is_inference())  # as the ring restored it
            self._tensors.pop(0)

    def discard(self) -> None:
        """``discard()``: hooks off (with the upcast buffers they hold), the tensors left as they
        are (their component does not run again)."""
        self._unhook()
        self._tensors = []

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._layers = []


def _upcast(t: torch.Tensor, compute: torch.dtype, inference: bool) -> None:
    """``t`` in ``compute`` for good, an inference tensor if ``inference`` (it was one before
    offloading), whatever mode ``remove()`` runs in."""
    with torch.inference_mode(inference):
        t.data = t.data.to(compute)


def upcast_per_layer(root: nn.Module, cast: Mapping[int, torch.dtype], in_blocks: set[int],
                     device: torch.device) -> LayerUpcasts:
    """Hook every layer of ``root`` inside a streamed block that holds tensors stored in 8 bits
    (``cast``), so that it runs on their upcast ([Note: upcast per layer]). Reads the tensors'
    compute dtype now, before the ring points them at their 8-bit bytes, and allocates on
    ``device`` the one buffer every layer's upcast is written to."""
    layers, tensors = [], []
    for layer in cast_layers(root):
        names = tuple(name for name, t in (*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False))
                      if id(t) in cast and id(t) in in_blocks)
        if names:
            compute = getattr(layer, names[0]).dtype
            tensors += [(getattr(layer, name), compute) for name in names]
            layers.append((layer, names, compute, sum(_aligned(getattr(layer, n).numel() * compute.itemsize)
                                                      for n in names)))
    # Layers run one after another on the compute stream, so one buffer holds the upcast of
    # whichever runs: the next layer's upcast is ordered after this one's kernels, and nothing
    # is allocated per layer.
    scratch = torch.empty(max((size for *_, size in layers), default=0), dtype=torch.uint8, device=device)
    hooks: list = []
    pending: list[tuple[nn.Module, _UpcastHook]] = []
    for layer, names, compute, _size in layers:
        hook = _UpcastHook(names, compute, scratch)
        hooks += [layer.register_forward_pre_hook(hook.pre), layer.register_forward_hook(hook.post, always_call=True)]
        pending.append((layer, hook))
    return LayerUpcasts(hooks, tensors, pending)


def _aligned(n: int) -> int:
    return -(-n // 256) * 256


class _UpcastHook:
    """One layer's pair of hooks: its 8-bit tensors upcast for its forward, then back."""

    __slots__ = ("names", "compute", "scratch", "stored")

    def __init__(self, names: tuple[str, ...], compute: torch.dtype, scratch: torch.Tensor) -> None:
        self.names = names
        self.compute = compute
        self.scratch = scratch
        self.stored: list[torch.Tensor] = []

    def pre(self, module: nn.Module, args: object) -> None:
        if self.stored:
            # The last forward was cut short by a KeyboardInterrupt, which skips even always_call
            # hooks (see settle).
            self.settle(module)
        stored = self.stored = []
        at = 0
        for name in self.names:
            t = getattr(module, name)
            data = t.data
            stored.append(data)
            n = data.numel() * self.compute.itemsize
            # The upcast keeps the 8-bit tensor's strides, as Tensor.to does (so the layer's
            # kernels, and their results, are those of diffusers' upcast).
            up = self.scratch[at : at + n].view(self.compute).as_strided(data.shape, data.stride())
            up.copy_(data)
            t.data = up
            at += _aligned(n)

    def post(self, module: nn.Module, args: object, output: object) -> None:
        for name, data in zip(self.names, self.stored):
            getattr(module, name).data = data
        self.stored = []

    def settle(self, module: nn.Module) -> None:
        """After a forward cut short between :meth:`pre` and :meth:`post`: a tensor still on the
        upcast buffer (which later layers overwrite) goes back to its 8-bit tensor, which is
        where it was in a block kept on the device. A streamed block's tensors the ring has
        rebound since (to their parked views, or a slot): those stay, and the stale views go."""
        start, end = self.scratch.data_ptr(), self.scratch.data_ptr() + self.scratch.numel()
        for name, data in zip(self.names, self.stored):
            t = getattr(module, name)
            if start <= t.data_ptr() < end:
                t.data = data
        self.stored = []


def unhook_layerwise_casting(module: nn.Module) -> None:
    """Take diffusers' layerwise casting hooks off ``module`` (not its children), leaving its
    tensors as they are: the casting hook (diffusers' hook refuses to undo its cast, it would
    lose precision, so the caller puts the tensors it wants back itself), and the
    ``peft_autocast_disable`` hook ``enable_layerwise_casting`` puts on each LoRA layer beside
    it (left on, the LoRA layer keeps skipping peft's input cast, and the next
    ``enable_layerwise_casting`` refuses to register it again)."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None:
        return
    removed = False
    for name in (_PEFT_AUTOCAST_DISABLE_HOOK, _LAYERWISE_CASTING_HOOK):
        hook = registry.get_hook(name)
        if hook is None:
            continue
        hook.deinitalize_hook = lambda m: m  # the casting hook's own raises (it will not undo its cast)
        registry.remove_hook(name, recurse=False)
        # diffusers leaves the hook and its function reference holding each other (and the
        # module's bound forward): cycles through the module that only a garbage collection frees.
        hook.fn_ref = None
        removed = True
    if not removed:
        return
    # diffusers also leaves an empty registry and the class's forward bound on the instance.
    if not registry.hooks:
        del module._diffusers_hook
    forward = vars(module).get("forward")
    if getattr(forward, "__self__", None) is module and \
            getattr(forward, "__func__", None) is getattr(type(module), "forward", None):
        del module.forward


def store_outside_blocks(root: nn.Module, cast: Mapping[int, torch.dtype], in_blocks: set[int]) -> StoredLayers:
    """diffusers' own layerwise casting hook on the layers of a diffusers model outside its
    streamed blocks that the rule stores in 8 bits, so the whole model is stored as
    ``enable_layerwise_casting`` stores it (and its ``dtype`` still reads the compute dtype,
    which pipelines cast their latents to). Other modules (text encoders from transformers)
    keep their non-block layers as they are. An adapter added to one of these layers after
    setup is refused at the next forward (:class:`_LateAdapters`). A failure part way takes the
    hooks installed so far off again."""
    stored = StoredLayers()
    if not hasattr(root, "enable_layerwise_casting"):
        return stored
    try:
        for layer in cast_layers(root):
            tensors = [t for t in (*layer.parameters(), *layer.buffers()) if id(t) in cast]
            if tensors and not any(id(t) in in_blocks for t in tensors):
                compute = tensors[0].dtype
                stored.layers.append((layer, compute, [(t, t.data) for t in tensors]))
                stored.inference.update((id(t), t.is_inference()) for t in tensors)
                apply_layerwise_casting_hook(layer, cast[id(tensors[0])], compute, non_blocking=False)
        if stored.layers:
            stored.watch(root)
    except BaseException:
        # The caller has not got ``stored`` yet, so its rollback cannot undo it: the hooks
        # installed so far come off here, and the layers get their tensors back.
        stored.undo()
        raise
    return stored


def layerwise_cast_modules(root: nn.Module) -> list[str]:
    """The qualified names of ``root``'s modules that already carry diffusers' layerwise casting
    hook (``enable_layerwise_casting``, ``apply_layerwise_casting``): ``storage_dtype`` would store
    them a second time (``apply.py`` refuses that before setup). Reads ``root``, changes nothing."""
    return [name or "(the model itself)" for name, m in root.named_modules()
            if (registry := getattr(m, "_diffusers_hook", None)) is not None
            and registry.get_hook(_LAYERWISE_CASTING_HOOK) is not None]


def upcast(image: BlockImage, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The block's slot bytes into ``dst`` from its image bytes in ``src`` (both on one device),
    on the current stream: one elementwise copy per 8-bit run, one byte copy for the rest."""
    _convert(image, src, dst, up=True)


def downcast(image: BlockImage, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The block's image bytes into ``dst`` from its slot bytes in ``src``: :func:`upcast`
    backwards (an edited block stored again; 8-bit tensors round as ``Tensor.to`` rounds)."""
    _convert(image, src, dst, up=False)


def _convert(image: BlockImage | None, src: torch.Tensor, dst: torch.Tensor, up: bool) -> None:
    if image is None:  # a block with nothing stored in 8 bits: its image is its slot
        n = min(src.numel(), dst.numel())
        dst[:n].copy_(src[:n])
        return
    for run in image.runs:
        stored = (run.image, run.image_nbytes, run.stored)
        slot = (run.slot, run.slot_nbytes, run.compute)
        (a0, an, ad), (b0, bn, bd) = (stored, slot) if up else (slot, stored)
        a, b = src[a0 : a0 + an], dst[b0 : b0 + bn]
        if run.stored == run.compute:
            b.copy_(a)
        else:
            b.view(bd).copy_(a.view(ad))
