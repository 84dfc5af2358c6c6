"""Changes made to streamed blocks after ``apply_offload``: LoRA adapters and the like.

diffusers and peft change a model in place. ``load_lora_weights`` (peft's injection) replaces a
block's linear layers by LoRA layers whose adapter weights are created beside the base weight:
for a streamed block, beside its parked host copy, where no forward can read them. ``fuse_lora``
adds the adapters into the base weights, on the base weight's device and through ``.data``.
A :class:`BlockWatch` follows both for every ring of a handle:

- a module, parameter or buffer registered under a block marks the block's ring
  (``adopt_pending``); before its next block runs, or its next edit, the ring moves the tensors
  no layout knows to the device, where they stay (:meth:`BlockRing.adopt_strays`);
- a tuner layer in a block (peft's ``BaseTunerLayer``, known by its ``merge``, ``unmerge`` and
  ``get_base_layer``), found at setup or registered later, has ``merge`` and ``unmerge`` run
  inside :meth:`BlockRing.edit_block`: on the device as on the resident model (so the fused
  bits match), then written back into the host copy, every rank's shard under allgather.

Step caches are tenants too: diffusers' block hooks (First Block Cache, MagCache, SeaCache,
layer skip) return without running a block's own forward when they decide to skip it.
:func:`skipped_by_hooks` reads that decision, already made when the block is called, so the
ring neither waits for nor copies a block that will not run ([Note: skipped blocks]).

It uses torch's global registration hooks while the watch lives, and knows peft's layers by
their methods and diffusers' hooks by their class names and state only: nothing here imports
peft or diffusers. See ``docs/design.md``, [Note: tenants].
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import operator
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from .ring import BlockRing

__all__ = ["DECIDING_HOOKS", "EDITED_METHODS", "FIXED_SKIPS", "PEFT_FUNCTIONS", "READING_METHODS", "REFUSED_METHODS",
           "REWRITING_METHODS", "SAVING_METHODS", "SKIPPING_HOOKS", "STATE_DICT_READERS", "TOGGLING_METHODS",
           "BlockWatch", "skipped_by_hooks"]

#: The tuner-layer methods that change a block's own weights, run inside ``edit_block``.
EDITED_METHODS = ("merge", "unmerge")

#: The tuner-layer methods after which a layer may be merged with its adapters disabled: peft's
#: forward then unmerges it, inside the block's forward, where no edit can run. The watch does that
#: unmerge itself just before the block's next forward that runs (:meth:`BlockWatch._unmerge_block`);
#: under a lockstep transfer, as the component's next forward starts (:meth:`BlockWatch._unmerge_disabled`).
TOGGLING_METHODS = ("enable_adapters", "merge")

#: Methods of any module in a block that read the block's weights to build new ones, run inside
#: ``edit_block`` too, so they read the weights on the device (where the parked copy holds
#: placeholders, under allgather or 8-bit storage, they would read NaN): diffusers' attention
#: ``fuse_projections`` (``fuse_qkv_projections``) concatenates q, k and v into a new layer,
#: which then stays on the device as an adopted tensor.
READING_METHODS = ("fuse_projections",)


def _is_tuner_layer(module: nn.Module) -> bool:
    return all(callable(getattr(module, name, None)) for name in (*EDITED_METHODS, "get_base_layer"))


def _cache_state(hook: Any) -> Any:
    """The state a cache hook reads in this forward, or None before its context is set (the
    hook then runs the block)."""
    manager = hook.state_manager
    return manager.get_state() if manager._context is not None else None


def _fbc_skips(hook: Any) -> bool:
    # FBCBlockHook: the head block decided in this forward; the others run iff should_compute.
    # (Its first forward sets the context before any other block runs.)
    state = _cache_state(hook)
    return state is not None and not state.should_compute


def _sea_skips(hook: Any) -> bool:
    state = _cache_state(hook)
    return state is not None and bool(state.skip_remaining)


def _layer_skips(hook: Any) -> bool:
    return math.isclose(hook.dropout, 1.0)


#: diffusers block hooks that may return without calling the block's forward, by class name,
#: and whether the hook will, read when the block is called: never for a head (leader) block,
#: whose hook decides while it runs.
SKIPPING_HOOKS: dict[str, Callable[[Any], bool]] = {
    "FBCBlockHook": _fbc_skips,
    "MagCacheBlockHook": _fbc_skips,  # same rule: the head decided, ``should_compute`` says
    "SeaCacheBlockHook": _sea_skips,
    "TransformerBlockSkipHook": _layer_skips,
}


#: The hooks of :data:`SKIPPING_HOOKS` whose decision is fixed before a forward starts.
FIXED_SKIPS = frozenset({"TransformerBlockSkipHook"})

#: diffusers' head (leader) block hooks, which decide while their block is called whether this
#: forward skips: on a DiT of one block, diffusers puts one beside that block's skipping hook,
#: whose state then still holds the last forward's decision. Such a block counts as running.
DECIDING_HOOKS = frozenset({"FBCHeadBlockHook", "MagCacheHeadHook", "SeaCacheLeaderBlockHook"})


def skipped_by_hooks(block: nn.Module, fixed_only: bool = False) -> bool:
    """Whether a diffusers hook on ``block`` will return without running its forward. Each hook
    calls the next one in, down to the block's forward, so one that skips skips the block. A
    state this does not understand counts as running: the ring then streams the block as usual.
    ``fixed_only``: ask only the hooks whose decision is fixed before the forward (for a block
    ahead of the one running). A block that also holds a head hook (:data:`DECIDING_HOOKS`)
    counts as running: its decision is not made yet."""
    registry = block.__dict__.get("_diffusers_hook")
    if registry is None:
        return False
    skips = False
    for hook in registry.hooks.values():
        kind = type(hook).__name__
        if kind in DECIDING_HOOKS:
            return False
        probe = SKIPPING_HOOKS.get(kind)
        if probe is not None and not skips and (not fixed_only or kind in FIXED_SKIPS):
            try:
                skips = bool(probe(hook))
            except (AttributeError, ValueError, TypeError):
                continue
    return skips


def _edited(ring: BlockRing, index: int, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return ring.edit_block(index, functools.partial(method, *args, **kwargs))


def _wrapping(wrapper: Callable[..., Any], owner: nn.Module, name: str, *bound: Any) -> "_Wrapped":
    """``wrapper`` around ``owner.name``, to set as ``owner``'s instance attribute ``name``."""
    return _Wrapped(wrapper, owner, name, bound)


class _Wrapped:
    """``wrapper(*bound, method, *args, **kwargs)`` for ``owner.name``, with the method's name
    and signature (callers inspect it: diffusers passes ``adapter_names`` to ``merge`` only where
    the signature takes it).

    It holds ``owner`` weakly and binds the method as it is called; callers give what else it
    refers to (rings, the watch, the layer) as weak references (``bound``: ``weakref.ref`` or a
    list of them), handed to ``wrapper`` as the objects. Set on ``owner`` itself, a bound method
    (or a ring, which holds the blocks) would make a cycle: a component the user drops would keep
    its layers, and their share of its host copy, until a garbage collection that may never come.
    A method already wrapped on the instance (``merge``: the edit, then the toggle) is kept as it
    is; it holds nothing strongly either. Once a referent is gone (its component with it), the
    method runs unwrapped: nothing is left to guard."""

    def __init__(self, wrapper: Callable[..., Any], owner: nn.Module, name: str, bound: Sequence[Any]) -> None:
        self._wrapper = wrapper
        self._owner = weakref.ref(owner)
        self._inner = owner.__dict__.get(name)
        try:  # the descriptor itself (a function, staticmethod, classmethod): bound at each call
            descriptor = inspect.getattr_static(type(owner), name) if self._inner is None else None
        except AttributeError:  # found another way (__getattr__): held as it is
            self._inner = getattr(owner, name)
            descriptor = None
        self._func = descriptor
        func = self._inner if self._inner is not None else getattr(type(owner), name)
        self._bound = tuple(bound)
        self.__name__ = getattr(func, "__name__", name)
        self.__qualname__ = getattr(func, "__qualname__", name)
        self.__doc__ = getattr(func, "__doc__", None)
        self.__module__ = getattr(func, "__module__", None)

    def _method(self) -> Callable[..., Any]:
        if self._inner is not None:
            return self._inner
        owner = self._owner()
        if owner is None:
            raise ReferenceError(
                f"{self.__name__}: the offloaded component it belongs to was dropped since this method was "
                "taken from it (an offloaded component's methods do not keep it alive): keep a reference to "
                "the component itself, and take the method from it when you call it")
        return self._func.__get__(owner, type(owner))

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # what inspect.signature follows
        try:
            return self._method()
        except ReferenceError:
            raise AttributeError("__wrapped__") from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        method = self._method()
        bound = [_deref(b) for b in self._bound]
        if any(b is None for b in bound):
            return method(*args, **kwargs)
        return self._wrapper(*bound, method, *args, **kwargs)


def _deref(value: Any) -> Any:
    """A weak reference's object, or a list of them (None if any is gone); anything else as is."""
    if isinstance(value, weakref.ref):
        return value()
    if isinstance(value, list):
        found = [v() for v in value]
        return None if any(v is None for v in found) else found
    return value


#: Methods of a component that may write into its blocks' tensors in place without the ring
#: seeing it (peft's hotswap copies a new adapter into the old one's tensors with
#: ``.data.copy_``, which bumps no version counter): after one, the slots are copied again. A
#: hotswap into adapters that park placeholders (loaded before offloading, on an allgather or
#: 8-bit ``"block"`` ring) is refused before it starts (:func:`_check_hotswap`); one that would
#: grow such an adapter's tensors (a larger rank, on any ring) is refused before peft swaps
#: (:func:`_grown_hotswap`). peft's own entry point, called directly, is followed too
#: (:data:`PEFT_FUNCTIONS`).
REWRITING_METHODS = ("load_lora_adapter",)


def _rewriting(rings: Sequence[BlockRing], method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    adapter = _check_hotswap(rings, method, args, kwargs)
    if adapter is None:
        try:
            return method(*args, **kwargs)
        finally:
            for ring in rings:
                ring.forget_slots()
    # The new adapter's tensors are known only once diffusers has read and mapped them, when it
    # calls peft's hotswap (diverted: _peft_call), whose failure diffusers answers by deleting the
    # adapter: there a swap that does not fit is skipped instead, noted here, and refused once
    # diffusers returns (nothing else it does after a hotswap changes the model).
    pending = _PendingHotswap(rings, adapter)
    stack = _pending_hotswaps()
    stack.append(pending)
    try:
        result = method(*args, **kwargs)
    finally:
        stack.remove(pending)
        for ring in rings:
            ring.forget_slots()
    if pending.refusal is not None:
        raise pending.refusal
    return result


class _PendingHotswap:
    """A hotswap through a component's ``load_lora_adapter``, while diffusers runs it."""

    __slots__ = ("ring_ids", "adapter", "refusal")

    def __init__(self, rings: Sequence[BlockRing], adapter: str) -> None:
        self.ring_ids = frozenset(id(r) for r in rings)
        self.adapter = adapter
        self.refusal: RuntimeError | None = None


_PENDING = threading.local()


def _pending_hotswaps() -> list[_PendingHotswap]:
    stack = getattr(_PENDING, "stack", None)
    if stack is None:
        stack = _PENDING.stack = []
    return stack


def _pending_for(rings: Sequence[BlockRing], adapter: str) -> _PendingHotswap | None:
    """The hotswap of this thread's ``load_lora_adapter`` that a peft hotswap call belongs to."""
    ids = {id(r) for r in rings}
    for pending in reversed(_pending_hotswaps()):
        if pending.adapter == adapter and pending.ring_ids & ids:
            return pending
    return None


def _hotswapped(method: Callable[..., Any], args: tuple, kwargs: dict) -> str | None:
    """The adapter a ``load_lora_adapter(..., hotswap=True, adapter_name=...)`` call writes into,
    or None for any other call (one diffusers itself will refuse included)."""
    try:
        bound = inspect.signature(method).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    name = bound.get("adapter_name", bound.get("kwargs", {}).get("adapter_name"))
    return name if bound.get("hotswap") and isinstance(name, str) else None


def _adapter_entries(ring: BlockRing, adapter: str) -> list[str]:
    """The layout entries of ``ring`` that are peft LoRA tensors of ``adapter``
    (``...to_q.lora_A.<adapter>.weight``): an adapter loaded before ``apply_offload``."""
    found = []
    for layout in ring.layouts:
        for entry in layout.entries:
            parts = entry.name.split(".")
            if any(p == adapter and parts[k - 1].startswith("lora_") for k, p in enumerate(parts) if k):
                found.append(entry.name)
    return found


def _placeholder_reason(ring: BlockRing) -> tuple[str, bool]:
    """Why ``ring``'s streamed tensors hold placeholders between forwards, and whether it is
    8-bit storage (where upcast ``"layer"`` keeps real tensors)."""
    eight_bit = ring.storage_dtype is not None and ring.transfer.gather is None
    why = (f"stored in 8 bits ({ring.storage_dtype}, upcast \"block\")" if eight_bit else
           f"sharded over the ranks ({ring.transfer.name}): the block exists whole on no rank")
    return why, eight_bit


def _check_hotswap(rings: Sequence[BlockRing], method: Callable[..., Any], args: tuple, kwargs: dict) -> str | None:
    """The adapter a ``load_lora_adapter`` call hotswaps (None for any other call), refused
    here where it streams on a ring that parks placeholders or shares its host copy. Whether the
    new tensors fit the laid-out ones is checked where peft receives them (:func:`_grown_hotswap`)."""
    adapter = _hotswapped(method, args, kwargs)
    if adapter is not None:
        _refuse_unwritable_hotswap(rings, adapter)
    return adapter


def _grown_hotswap(model: nn.Module, rings: Sequence[BlockRing], adapter: str,
                   state_dict: Any) -> RuntimeError | None:
    """The refusal of a hotswap that would give a tensor laid out in ``rings`` (an adapter loaded
    before ``apply_offload``, which streams with its block) a shape it does not fit in, or None.
    peft copies a new tensor of the same shape or smaller in every dimension (a smaller rank, or
    one padded by ``enable_lora_hotswap``) into the old one in place, which the ring follows; a
    larger one (a higher rank) it swaps in with ``torch.utils.swap_tensors``: a tensor of a new
    shape, which the block's host copy and slots have no room for. ``state_dict``: peft's keys
    (``blocks.0.attn1.to_q.lora_A.<adapter>.weight``), relative to ``model``, as peft reads them."""
    if not isinstance(state_dict, dict):
        return None
    laid_out = {id(e.tensor): (ring, e) for ring in rings for layout in ring.layouts for e in layout.entries}
    grown = []
    for key, new in state_dict.items():
        if not isinstance(key, str) or not isinstance(new, torch.Tensor):
            continue
        try:
            old = operator.attrgetter(key)(model)
        except AttributeError:
            continue  # peft names the key it does not find
        found = laid_out.get(id(old))
        if found is None:
            continue  # not laid out (loaded after apply_offload: on the device, where any swap lands)
        entry = found[1]
        if new.dim() != len(entry.shape) or any(n > o for n, o in zip(new.shape, entry.shape)):
            grown.append((found[0], entry, new))
    if not grown:
        return None
    ring, entry, new = grown[0]
    return RuntimeError(
        f"{ring.component.name}: hotswapping adapter '{adapter}' would change {entry.name} from "
        f"{tuple(entry.shape)} to {tuple(new.shape)} ({len(grown)} of its tensors grow): the adapter was "
        "loaded before apply_offload, so its tensors stream with their block, laid out in the ring's host "
        "copy at the shapes they had, and a larger tensor (a higher rank) does not fit there. Nothing was "
        "changed. Call enable_lora_hotswap(target_rank=...) (the largest rank you will swap in) before the "
        "first adapter is loaded, so later swaps fit; or load the adapter after apply_offload (it then stays "
        "on the device, and any hotswap works); or call handle.remove() first, hotswap, then apply_offload "
        "again.")


def _refuse_unwritable_hotswap(rings: Sequence[BlockRing], adapter: str) -> None:
    """A hotswap copies the new adapter into the old one's tensors in place. An adapter loaded
    before ``apply_offload`` streams with its block. Where the ring parks placeholders between
    forwards (allgather, 8-bit ``"block"`` storage) torch refuses that copy part way, and
    diffusers' cleanup then deletes the adapter; where the ranks of a host share the block's host
    copy (``shared``), the copy would land in every rank's weights, behind their slots, though
    only this rank swapped. Refused here, before anything changes."""
    for ring in rings:
        shared = ring.transfer.name == "shared"
        if not (ring.parks_placeholders or shared):
            continue
        found = _adapter_entries(ring, adapter)
        if not found:
            continue  # loaded after apply_offload: adopted on the device, where the copy lands
        if ring.parks_placeholders:
            why, eight_bit = _placeholder_reason(ring)
            why = f"{why}, and between forwards its tensors hold placeholders that cannot be written"
        else:
            why, eight_bit = ("in the host copy that every rank on this host shares (shared), so the swap would "
                              "change the other ranks' weights too"), False
        raise RuntimeError(
            f"{ring.component.name}: hotswapping adapter '{adapter}' would write into {found[0]} ({len(found)} "
            f"tensors in all): it was loaded before apply_offload, so it streams with its block, {why}. Nothing "
            "was changed. Call handle.remove() first, hotswap, then apply_offload again; or load the adapter "
            "after apply_offload (it then stays on the device, and hotswaps in place)"
            + ("; or use upcast 'layer'." if eight_bit else "."))


def _refuse_placeholder_export(rings: Sequence[BlockRing], adapter: str, what: str) -> None:
    """Exporting an adapter reads its tensors between forwards: one loaded before
    ``apply_offload`` on a ring that parks placeholders would be written as NaN (safetensors
    refuses the placeholders' shared storage; other formats write them). Refused, naming what
    works; an adapter loaded after ``apply_offload`` lives on the device and exports as usual."""
    for ring in rings:
        if not ring.parks_placeholders:
            continue
        found = _adapter_entries(ring, adapter)
        if not found:
            continue
        why, eight_bit = _placeholder_reason(ring)
        raise RuntimeError(
            f"{ring.component.name}: {what} would read adapter '{adapter}' from placeholders ({found[0]}, "
            f"{len(found)} tensors in all): it was loaded before apply_offload, so it streams with its block, "
            f"{why}, and between forwards its tensors hold no values. Nothing was written. Export the adapter "
            "from the file it was loaded from, or before apply_offload; or call handle.remove() first"
            f"{' (on every rank)' if not eight_bit else ''}, export, then apply_offload again"
            + ("; or use upcast 'layer', whose adapters hold their values." if eight_bit else "."))


#: peft functions that reach streamed blocks without a method of the component to wrap, each
#: with its check. peft's hotswap writes with ``.data.copy_`` (no version counter sees it): after
#: it the slots are copied again, as after :data:`REWRITING_METHODS`; an export reads placeholders.
#: Callers bind these functions by name (``from peft.utils.hotswap import ...``), often before
#: ``apply_offload``, so the function objects themselves are diverted while a watch is open
#: (:func:`_divert_peft`), and given back when the last one closes.
PEFT_FUNCTIONS = {
    ("peft.utils.hotswap", "hotswap_adapter_from_state_dict"): "hotswap",
    ("peft.utils.save_and_load", "get_peft_model_state_dict"): "export",
}


def _rings_in(model: Any) -> list[BlockRing]:
    """The watched rings whose component is ``model`` or inside it (a PeftModel, a compiled
    wrapper's ``_orig_mod``)."""
    watches = _open_watches()
    if not isinstance(model, nn.Module) or not watches:
        return []
    rings: list[BlockRing] = []
    for sub in model.modules():
        for watch in watches:
            rings.extend(r for ref in watch._rings_of.get(sub, ()) if (r := ref()) is not None)
    return rings


def _peft_call(kind: str, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)  # peft names what is wrong
    bound.apply_defaults()
    arguments = bound.arguments
    rings = _rings_in(arguments.get("model"))
    adapter = arguments.get("adapter_name")
    if not rings or not isinstance(adapter, str):
        return original(*args, **kwargs)
    if kind == "export":
        if arguments.get("state_dict") is None:  # the model's own tensors are read
            _refuse_placeholder_export(rings, adapter, "get_peft_model_state_dict")
        return original(*args, **kwargs)
    _refuse_unwritable_hotswap(rings, adapter)
    refusal = _grown_hotswap(arguments["model"], rings, adapter, arguments.get("state_dict"))
    if refusal is not None:
        pending = _pending_for(rings, adapter)
        if pending is None:
            raise refusal  # called directly: nothing has changed yet
        # Inside diffusers' load_lora_adapter, whose failure cleanup would delete the adapter:
        # nothing is swapped, and _rewriting raises once diffusers returns.
        pending.refusal = refusal
        return None
    try:
        return original(*args, **kwargs)
    finally:
        for ring in rings:
            ring.forget_slots()


_NAME = "<diverted function>"


def _peft_trampoline(*args: Any, **kwargs: Any) -> Any:
    # Only its code is used: it becomes the diverted function's (the name constant replaced by
    # that function's name), run in peft's module globals, where _divert_peft put the call.
    return globals()["_omni_dist_offload_diverted"]["<diverted function>"](*args, **kwargs)


# (function, its own code, defaults, keyword defaults) of each diverted peft function.
_DIVERTED: list[tuple[types.FunctionType, types.CodeType, Any, Any]] = []


def _divert_peft() -> None:
    """Route calls of :data:`PEFT_FUNCTIONS` through :func:`_peft_call`. Only once peft is
    imported: an adapter that streams with its block was loaded through peft before
    ``apply_offload``; one loaded after stays on the device, where neither a hotswap nor an
    export needs the ring."""
    if _DIVERTED or "peft" not in sys.modules:
        return
    for (module_name, name), kind in PEFT_FUNCTIONS.items():
        try:
            fn = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue  # another peft: nothing of its own to divert
        if not isinstance(fn, types.FunctionType) or fn.__closure__ is not None:
            continue
        original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, None)
        original.__kwdefaults__ = fn.__kwdefaults__
        for attr in ("__annotations__", "__qualname__", "__doc__", "__module__"):  # inspect shows peft's own
            setattr(original, attr, getattr(fn, attr))
        # The trampoline's code looks its target up by the function's name, in peft's globals.
        trampoline = _peft_trampoline.__code__
        names = {"co_name": name, **({"co_qualname": name} if hasattr(trampoline, "co_qualname") else {})}
        code = trampoline.replace(co_consts=tuple(name if c == _NAME else c for c in trampoline.co_consts), **names)
        table = fn.__globals__.setdefault("_omni_dist_offload_diverted", {})
        table[name] = functools.partial(_peft_call, kind, original)
        _DIVERTED.append((fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__))
        fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, None, None
        fn.__wrapped__ = original  # inspect.signature shows peft's own


def _restore_peft() -> None:
    for fn, code, defaults, kwdefaults in _DIVERTED:
        fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, kwdefaults
        fn.__dict__.pop("__wrapped__", None)
        fn.__globals__.pop("_omni_dist_offload_diverted", None)
    _DIVERTED.clear()


#: Methods of a component that write its weights out: refused while its blocks' tensors hold
#: placeholders between forwards (allgather: the block exists whole on no rank; 8-bit blocks:
#: the host holds the 8-bit image), which they would write as the weights. ``save_lora_adapter``
#: (diffusers) only for an adapter that streams with its block.
SAVING_METHODS = ("save_pretrained", "save_lora_adapter")


def _saving(rings: Sequence[BlockRing], method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if method.__name__ == "save_lora_adapter":
        try:
            bound = inspect.signature(method).bind(*args, **kwargs)
        except TypeError:
            return method(*args, **kwargs)  # diffusers names what is wrong
        bound.apply_defaults()
        adapter = bound.arguments.get("adapter_name")
        if isinstance(adapter, str):
            _refuse_placeholder_export(rings, adapter, "save_lora_adapter")
        return method(*args, **kwargs)
    for ring in rings:
        if ring.parks_placeholders:
            raise RuntimeError(
                f"{ring.component.name}: save_pretrained would write placeholders for its streamed blocks: "
                f"between forwards their tensors hold no values on this rank ({ring.transfer.name}"
                f"{', stored in 8 bits' if ring.storage_dtype else ''}). Call handle.remove() first (on every "
                "rank under allgather: it gathers the blocks back), then save; or save before apply_offload.")
    return method(*args, **kwargs)


#: Methods of a component that write its weights in: refused, before anything is written, where
#: they would write a streamed tensor that holds a placeholder between forwards (allgather, 8-bit
#: ``"block"``): torch refuses such a write only once it has copied every tensor before it. Where
#: a ring cannot see the writes (a model built under ``torch.inference_mode()``: inference tensors
#: keep no version counter), its slots are forgotten afterwards, as after a hotswap.
LOADING_METHODS = ("load_state_dict",)


def _loading(rings: Sequence[BlockRing], method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return _checked_load(rings, method, *args, **kwargs)
    finally:
        # Also after a load torch refused at the end (missing keys, strict): it copied the rest.
        # A ring that sees writes by their version counters copies again only what changed.
        for ring in rings:
            if not ring._versioned and not ring.parks_placeholders:
                ring.forget_slots()


def _checked_load(rings: Sequence[BlockRing], method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        bound = inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return method(*args, **kwargs)  # torch names what is wrong
    state_dict = bound.arguments.get("state_dict")
    if isinstance(state_dict, Mapping):
        for ring in rings:
            if not ring.parks_placeholders:
                continue
            streamed = {e.name for layout in ring.layouts if layout.index not in ring.resident
                        for e in layout.entries}
            hits = [key for key in state_dict if key in streamed]
            if hits:
                more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
                raise RuntimeError(
                    f"{ring.component.name}: load_state_dict would write {hits[0]}{more}, which streams and holds a "
                    f"placeholder between forwards on this rank ({ring.transfer.name}"
                    f"{', stored in 8 bits' if ring.storage_dtype else ''}); torch would refuse that write only after "
                    "copying the tensors before it. Nothing was changed. Load the weights before apply_offload, or "
                    "call handle.remove() first (on every rank under allgather), load, then apply_offload again.")
    return method(*args, **kwargs)


#: Libraries whose own ``state_dict()`` calls on a component read its keys, shapes and devices
#: (diffusers' ``load_lora_adapter`` builds its LoRA config from them, Flux's LoRA loading checks
#: shapes) or only its adapter tensors: no placeholder notice for them. Their calls that write
#: weights out are refused where they would write placeholders (:data:`SAVING_METHODS`,
#: :data:`PEFT_FUNCTIONS`).
STATE_DICT_READERS = frozenset({"diffusers", "peft", "transformers"})


class _PlaceholderNotice:
    """A streamed block's ``state_dict`` post-hook, on a ring whose streamed tensors hold
    placeholders between forwards (allgather, 8-bit ``"block"``; :attr:`BlockRing.parks_placeholders`):
    a ``state_dict()`` then holds their shape and dtype but NaN (0 for integers) for their values,
    and ``torch.save`` writes that without a word. The first time one reaches a state dict that
    user code asked for, it warns, naming the component and what to do; the values are left as
    they are. Not the upcast of an 8-bit image (which is exact): every ``state_dict()`` would then
    hold the whole component in its compute dtype in host memory (for Wan-14B in bf16, 28 GB beside
    its 14 GB 8-bit copy), also diffusers' own calls that read only keys and shapes, at every LoRA
    load. Never raises: diffusers reads ``state_dict()`` while loading LoRAs. Weak: the block holds
    the hook, and the ring holds the block."""

    __slots__ = ("_watch", "_ring", "_index", "_from_public_api")

    def __init__(self, watch: "weakref.ref[BlockWatch]", ring: "weakref.ref[BlockRing]", index: int) -> None:
        self._watch = watch
        self._ring = ring
        self._index = index

    def __call__(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        try:
            watch, ring = self._watch(), self._ring()
            if watch is None or ring is None or ring in watch._told_placeholders:
                return
            key = _placeholder_key(ring, self._index, module, state_dict, prefix)
            if key is None:
                return
            caller, level = _state_dict_caller()
            if caller in STATE_DICT_READERS or caller == _PACKAGE:  # (our own tools know what they read)
                return
            watch._told_placeholders.add(ring)
            why, eight_bit = _placeholder_reason(ring)
            warnings.warn(
                f"{ring.component.name}: state_dict() holds placeholders for the tensors of its streamed blocks "
                f"(such as {key}), not their values: they are {why}, and between forwards each holds its shape "
                "and dtype only (NaN for floats, 0 for integers); torch.save writes those. Call handle.remove() "
                f"first{' (on every rank: it gathers the blocks back)' if not eight_bit else ''}, then read or save "
                "the weights (save_pretrained refuses while they are placeholders); or save them before "
                "apply_offload" + ("; or use upcast 'layer', whose streamed tensors hold their 8-bit values."
                                   if eight_bit else ".") + " (Warned once per component.)",
                RuntimeWarning, stacklevel=level)
        except Exception:  # noqa: BLE001 - a notice only: state_dict() must work whatever it meets
            return


def _placeholder_key(ring: BlockRing, index: int, block: nn.Module, state_dict: Any, prefix: str) -> str | None:
    """The first key of ``state_dict`` (saved under ``prefix``) that holds a placeholder of
    ``ring``'s block ``index`` (``block``), or None."""
    if index in ring.resident or not isinstance(state_dict, Mapping):
        return None  # a resident block's tensors are views of its device buffer: its values
    laid_out = {id(e.tensor) for e in ring.layouts[index].entries}
    for name, tensor in (*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)):
        key = prefix + name
        if id(tensor) in laid_out and key in state_dict and _is_placeholder(state_dict[key]):
            return key
    return None


def _is_placeholder(value: Any) -> bool:
    """Whether ``value`` (a state dict's, detached or not) is a placeholder as the ring parks them
    (``apply._placeholder``): a host tensor whose storage is one element, NaN (0 for integers)."""
    if not isinstance(value, torch.Tensor) or value.numel() == 0 or value.device.type != "cpu" \
            or value.untyped_storage().nbytes() != value.element_size():
        return False
    first = value.detach()[(0,) * value.dim()]  # a view: the storage's one element
    return bool(first.isnan()) if first.is_floating_point() or first.is_complex() else not bool(first)


_PACKAGE = __name__.partition(".")[0]


def _state_dict_caller() -> tuple[str, int]:
    """Who called the ``state_dict()`` under way, for the hook that calls this: the top-level
    package of the first frame above the hook outside torch (``Module.state_dict`` recursing, a
    compiled wrapper), and the ``stacklevel`` that points the hook's warning there. Walks the
    stack only where a placeholder was found and no notice given yet."""
    frame, level = sys._getframe(2), 2
    while frame is not None:
        top = (frame.f_globals.get("__name__") or "").partition(".")[0]
        if top != "torch":
            return top, level
        frame, level = frame.f_back, level + 1
    return "", 1


#: Methods of a component refused outright after ``apply_offload``: diffusers'
#: ``enable_layerwise_casting`` recasts the block weights in place to a dtype the ring did not lay
#: them out in, so every later forward would fail.
REFUSED_METHODS = ("enable_layerwise_casting",)


def _refused(rings: Sequence[BlockRing], method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    name = rings[0].component.name
    raise RuntimeError(
        f"{name}: {method.__name__}() after apply_offload is refused, and nothing was changed: it would "
        "cast the streamed blocks' weights in place to a dtype their host copy and slots were not laid "
        "out in, and every later forward would fail. For 8-bit storage while offloading, set "
        f"layer_options.{rings[0].component.category}.storage_dtype (\"float8_e4m3fn\" or \"float8_e5m2\"; "
        "CLI --storage-dtype) in the offload config; or call handle.remove() first, then "
        f"{method.__name__}(), then apply_offload without storage_dtype.")


class BlockWatch:
    """Follows the blocks of ``rings`` until :meth:`close`."""

    def __init__(self, rings: Sequence[BlockRing]) -> None:
        # Weak: a module dropped from a block (an unloaded LoRA layer) leaves no entry behind,
        # and a new module at a reused address is never mistaken for it. The ring is weak too:
        # it holds the module, which would keep its own entry (and component) alive for good.
        self._owner: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[BlockRing], int]] = \
            weakref.WeakKeyDictionary()
        self._wrapped: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # Per component root (lockstep rings), or per block (the others), the pre-forward hook
        # that unmerges its disabled merged layers, while one is due (see _schedule_unmerge).
        # Blocks weakly: a block dropped from its list takes its hook with it.
        self._unmerge_hooks: dict[int, Any] = {}
        self._block_unmerges: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        # The blocks' state_dict hooks where the ring parks placeholders (_PlaceholderNotice), and
        # the rings already told of (one notice each).
        self._state_dict_hooks: list[Any] = []
        self._told_placeholders: weakref.WeakSet[BlockRing] = weakref.WeakSet()
        for ring in rings:
            ring.skip_probe = skipped_by_hooks
            ring.skip_ahead_probe = functools.partial(skipped_by_hooks, fixed_only=True)
            for layout in ring.layouts:
                self._follow(layout.module, ring, layout.index)
                if ring.parks_placeholders:
                    # On each block, not the component alone: a block's own state_dict() holds them too.
                    self._state_dict_hooks.append(layout.module.register_state_dict_post_hook(
                        _PlaceholderNotice(weakref.ref(self), weakref.ref(ring), layout.index)))
        # Components by root module (a component may have several rings: one per block list).
        # Weak: a component the pipeline drops goes, wrappers and all.
        self._roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._rings_of: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref[BlockRing]]] = \
            weakref.WeakKeyDictionary()
        for root in {id(r.component.module): r.component.module for r in rings}.values():
            mine = [r for r in rings if r.component.module is root]
            self._rings_of[root] = [weakref.ref(r) for r in mine]
            for names, wrapper in ((REWRITING_METHODS, _rewriting), (SAVING_METHODS, _saving),
                                   (LOADING_METHODS, _loading), (REFUSED_METHODS, _refused)):
                for name in names:
                    if callable(getattr(root, name, None)) and name not in root.__dict__:
                        setattr(root, name, _wrapping(wrapper, root, name, [weakref.ref(r) for r in mine]))
            self._roots.add(root)
        _watch(self)

    def close(self) -> None:
        """Stop watching; tuner layers get their own ``merge`` and ``unmerge`` back. Idempotent.
        A layer left merged with its adapters disabled is unmerged by peft's own forward, as on a
        model never offloaded."""
        _unwatch(self)
        for hook in [*self._unmerge_hooks.values(), *self._block_unmerges.values(), *self._state_dict_hooks]:
            hook.remove()
        self._state_dict_hooks = []
        self._unmerge_hooks = {}
        self._block_unmerges = weakref.WeakKeyDictionary()
        for layer in list(self._wrapped):
            for name in (*EDITED_METHODS, *TOGGLING_METHODS, *READING_METHODS):
                layer.__dict__.pop(name, None)
        self._wrapped = weakref.WeakSet()
        for root in list(self._roots):
            for name in (*REWRITING_METHODS, *SAVING_METHODS, *LOADING_METHODS, *REFUSED_METHODS):
                root.__dict__.pop(name, None)
        self._roots = weakref.WeakSet()
        self._rings_of = weakref.WeakKeyDictionary()
        self._owner = weakref.WeakKeyDictionary()

    def _follow(self, module: nn.Module, ring: BlockRing, index: int) -> None:
        for sub in module.modules():
            self._owner[sub] = (weakref.ref(ring), index)
            if sub in self._wrapped:
                continue
            names = [*(EDITED_METHODS if _is_tuner_layer(sub) else ()),
                     *(name for name in READING_METHODS if callable(getattr(sub, name, None)))]
            for name in names:
                # An instance attribute shadows the class's method; close() deletes it.
                setattr(sub, name, _wrapping(_edited, sub, name, weakref.ref(ring), index))
            if _is_tuner_layer(sub):
                # After these, the layer may be merged with its adapters disabled (see
                # TOGGLING_METHODS): merge here is the edit just set, wrapped once more.
                for name in TOGGLING_METHODS:
                    if callable(getattr(sub, name, None)):
                        setattr(sub, name, _wrapping(_toggled, sub, name, weakref.ref(self),
                                                     weakref.ref(sub), weakref.ref(ring)))
            if names:
                self._wrapped.add(sub)

    # peft's LoRA forward unmerges a merged layer whose adapters are disabled (``disable_lora``
    # or ``disable_adapter_layers`` after ``fuse_lora``/``merge_adapter``, or in the other
    # order), inside the layer's own forward, inside the block's, where the ring cannot edit the
    # block. Here the layer's block gets a one-off pre-forward hook, ahead of the ring's own:
    # before the block's next forward, between blocks (no block is bound then), it unmerges the
    # block's disabled merged layers through the same edit as ``unfuse_lora`` (so the bits
    # match), unless a step cache skips that block (``ring.skip_probe``): as in peft, a layer
    # that does not run stays merged (a later ``enable_lora``, ``unload_lora`` or hotswap finds
    # it so). Not earlier: enabling the adapters again before a forward leaves the layer merged,
    # as peft does. Under a lockstep transfer an edit is collective and each rank's cache
    # decides on its own, so there every such layer is unmerged as the component's next forward
    # starts, on every rank alike, whether or not its block then runs.
    def _schedule_unmerge(self, layer: nn.Module, ring: BlockRing) -> None:
        if not _merged_while_disabled(layer):
            return
        if _lockstep(ring):
            root = ring.component.module
            if id(root) not in self._unmerge_hooks:
                # First among the root's pre-forward hooks: before the ring's own mark a forward's start.
                self._unmerge_hooks[id(root)] = root.register_forward_pre_hook(
                    _UnmergeDisabled(weakref.ref(self), weakref.ref(root)), prepend=True)
            return
        owner = self._owner.get(layer)
        if owner is None or owner[0]() is not ring:
            return
        block = ring.layouts[owner[1]].module
        if block not in self._block_unmerges:
            # Prepended: ahead of the ring's pre-forward (which binds the block, after which no
            # edit can run) and of the block's other hooks.
            self._block_unmerges[block] = block.register_forward_pre_hook(
                _UnmergeBlock(weakref.ref(self), weakref.ref(ring)), prepend=True)

    def _unmerge_block(self, ring: BlockRing, block: nn.Module) -> None:
        """Before ``block`` of ``ring`` runs (a rank-local or shared ring): unmerge its
        watched tuner layers that are merged with their adapters disabled, in module order, then
        drop the hook that called this; if a step cache skips the block, leave them (and the
        hook) for a forward that runs it. Only while an unmerge is due: the edit synchronises,
        once, as ``unfuse_lora`` would; the per-block path is otherwise untouched."""
        probe = ring.skip_probe
        if probe is not None and probe(block):
            return
        for sub in block.modules():
            if sub in self._wrapped and _merged_while_disabled(sub):
                sub.unmerge()  # the edit set by _follow
        hook = self._block_unmerges.pop(block, None)
        if hook is not None:
            hook.remove()  # torch iterates a copy of the hooks: safe inside one

    def _unmerge_disabled(self, root: nn.Module) -> None:
        """Unmerge the watched tuner layers of ``root``'s lockstep rings that are merged with
        their adapters disabled, in module order (the same on every rank: an edit is collective
        there), then drop the hook that called this."""
        for sub in root.modules():
            if sub in self._wrapped and _merged_while_disabled(sub):
                owner = self._owner.get(sub)
                ring = owner[0]() if owner is not None else None
                if ring is not None and _lockstep(ring):
                    sub.unmerge()  # the edit set by _follow
        hook = self._unmerge_hooks.pop(id(root), None)
        if hook is not None:
            hook.remove()  # torch iterates a copy of the hooks: safe inside one

    # Called (through the global hooks below) for every registration in the process, so they
    # return at once unless the parent is in a watched block.
    def _on_module(self, module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        owner = self._owner.get(module)
        ring = owner[0]() if owner is not None else None
        if ring is None or submodule is None:
            return
        ring.adopt_pending = True
        self._follow(submodule, ring, owner[1])

    def _on_tensor(self, module: nn.Module, name: str, tensor: Any) -> None:
        owner = self._owner.get(module)
        ring = owner[0]() if owner is not None else None
        if ring is not None and tensor is not None:
            ring.adopt_pending = True


def _merged_while_disabled(layer: nn.Module) -> bool:
    """A tuner layer that peft's forward would unmerge: merged, with its adapters disabled."""
    return bool(getattr(layer, "disable_adapters", False) and getattr(layer, "merged", False))


def _lockstep(ring: BlockRing) -> bool:
    """Whether every rank of ``ring`` moves the same blocks in the same order (a gather): then
    an edit is a collective too."""
    return ring.transfer.gather is not None


def _toggled(watch: "BlockWatch", layer: nn.Module, ring: BlockRing, method: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
    result = method(*args, **kwargs)
    watch._schedule_unmerge(layer, ring)
    return result


class _UnmergeDisabled:
    """A component root's forward pre-hook while some layer of its lockstep rings' blocks is
    merged with its adapters disabled (:meth:`BlockWatch._schedule_unmerge`). Weak: the root
    holds the hook."""

    __slots__ = ("_watch", "_root")

    def __init__(self, watch: "weakref.ref[BlockWatch]", root: "weakref.ref[nn.Module]") -> None:
        self._watch = watch
        self._root = root

    # Run eagerly: an edit synchronises and rebinds tensors, which no compiled graph may hold.
    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any) -> None:
        watch, root = self._watch(), self._root()
        if watch is not None and root is not None:
            watch._unmerge_disabled(root)


class _UnmergeBlock:
    """A block's forward pre-hook while some layer of it is merged with its adapters disabled
    (:meth:`BlockWatch._schedule_unmerge`), on a ring that is not lockstep. Weak: the block holds
    the hook, and the ring holds the block."""

    __slots__ = ("_watch", "_ring")

    def __init__(self, watch: "weakref.ref[BlockWatch]", ring: "weakref.ref[BlockRing]") -> None:
        self._watch = watch
        self._ring = ring

    # Run eagerly, as the ring's own hooks: an edit synchronises and rebinds tensors, which no
    # compiled graph may hold.
    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any) -> None:
        watch, ring = self._watch(), self._ring()
        if watch is not None and ring is not None:
            watch._unmerge_block(ring, module)


# torch's registration hooks are global and live as long as the process: a hook that held a
# watch would keep its rings, their modules and the whole pipeline alive once the handle is
# dropped without remove(). One hook per kind, registered while some watch is open, reaches the
# open watches through a weak set: a dropped handle's watch (and with it the model) is collected.
_WATCHES: weakref.WeakSet[BlockWatch] = weakref.WeakSet()
_GLOBAL_HOOKS: list[Any] = []
# Watches open and close in one thread while another iterates them (a registration, a diverted
# peft call on a model of its own): a set that changes size under an iteration raises. Changed
# and copied under this lock; collection of a dropped watch is deferred by the WeakSet itself.
_WATCHES_LOCK = threading.Lock()


def _open_watches() -> list[BlockWatch]:
    with _WATCHES_LOCK:
        return list(_WATCHES)


def _on_module_registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    for watch in _open_watches():
        watch._on_module(module, name, submodule)


def _on_tensor_registered(module: nn.Module, name: str, tensor: Any) -> None:
    for watch in _open_watches():
        watch._on_tensor(module, name, tensor)


def _watch(watch: BlockWatch) -> None:
    with _WATCHES_LOCK:
        _WATCHES.add(watch)
        _divert_peft()
        if not _GLOBAL_HOOKS:
            _GLOBAL_HOOKS[:] = [
                register_module_module_registration_hook(_on_module_registered),
                register_module_parameter_registration_hook(_on_tensor_registered),
                register_module_buffer_registration_hook(_on_tensor_registered),
            ]


def _unwatch(watch: BlockWatch) -> None:
    with _WATCHES_LOCK:
        _WATCHES.discard(watch)
        if not _WATCHES:  # from close(), never from inside a registration (torch iterates the hooks)
            for hook in _GLOBAL_HOOKS:
                hook.remove()
            _GLOBAL_HOOKS.clear()
            _restore_peft()
