"""The block ring: the per-component coordinator and its hooks.

One :class:`BlockRing` per streamed component. Every block of the component is in the ring,
either **resident** (its tensors are views into a device buffer of its own, for good) or
**streamed** through the ring's device slots. With ``S`` slots, before streamed block ``i`` runs
the compute stream waits until ``i`` is in a slot and the ring prefetches the next ``S - 1``
streamed blocks (wrapping to the first after the last) into the other slots, round robin; after
block ``i`` runs, its slot is marked free on the compute stream and the block's parameters point
back at their host copies. The timeline and its invariants are in ``docs/design.md``,
[Note: block ring timeline]; which blocks stay resident and how many slots there are is the
residency plan ([Note: residency planner]), which can change once, between two forwards.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
import threading
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.nn.utils import parametrize as _parametrize

from .layout import BlockLayout, bind, restored
from .plan import StreamedComponent
from .residency import ResidencyPlan, RingCosts, image_slot_bytes
from .trace import RingTracer
from .transfer.groups import IN_STEP, agree_step
from .transfer.protocol import WeightTransfer

__all__ = ["NUM_SLOTS", "BlockRing", "check_not_cuda_graphs"]

_T = TypeVar("_T")
_EMPTY = -1
_RESIDENT = -2
_SKIPPED = -3  # the running "block" was skipped by a hook: it holds no slot
#: Device slots of a ring without a residency plan: the block that runs, and the next one arriving.
NUM_SLOTS = 2


def _compile_config(module: torch.nn.Module) -> Mapping | None:
    """The inductor options ``module`` was compiled with: ``nn.Module.compile()`` (and diffusers'
    ``compile_repeated_blocks``) keep the compiled callable as ``_compiled_call_impl``;
    ``torch.compile(module)`` returns an ``OptimizedModule`` that answers itself. None when not
    compiled, or compiled by a backend other than inductor."""
    fn = getattr(module, "_compiled_call_impl", None)
    if fn is None and hasattr(module, "_orig_mod"):
        fn = module
    get = getattr(fn, "get_compiler_config", None)
    if get is None:
        return None
    try:
        return get()
    except Exception:  # a private API: a torch that answers otherwise is treated as not compiled
        return None


def _compile_backend(module: torch.nn.Module) -> str | None:
    """The name of the backend ``module`` was compiled with (``"inductor"``, ``"cudagraphs"``),
    or None: not compiled, or a torch whose compiled callables answer otherwise (dynamo keeps the
    backend in the callback of the context the callable closes over: private, so best effort)."""
    try:
        if hasattr(module, "_orig_mod"):
            context = getattr(module, "dynamo_ctx", None)
        else:
            fn = getattr(module, "_compiled_call_impl", None)
            if fn is None:
                return None
            context = inspect.getclosurevars(fn).nonlocals.get("self")
        backend = getattr(context, "callback", None)
        for _ in range(8):  # the callback wraps the backend in a few layers
            inner = getattr(backend, "_torchdynamo_orig_backend", None)
            if inner is None or inner is backend:
                break
            backend = inner
        name = getattr(backend, "compiler_name", None)
        return name if isinstance(name, str) else None
    except Exception:  # noqa: BLE001 - a private API: treated as not known
        return None


def _is_compiled(module: torch.nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


def check_not_cuda_graphs(name: str, module: torch.nn.Module) -> None:
    """Refuse a module compiled with CUDA graphs (``mode="reduce-overhead"``, or
    ``options={"triton.cudagraphs": True}``) before it runs streamed.

    A CUDA graph replays the addresses it recorded, and a streamed block's weights are at a
    different slot address from one call to the next (and, under a plan, from one block to the
    next): torch would re-record or replay stale weights. The regional resident model fails in
    CUDA-graph trees too (a block's output is overwritten by the next block's replay), so there
    is no reference this stack could match. Layers compiled inside the block count too, as does
    dynamo's ``backend="cudagraphs"``."""
    for sub_name, sub in module.named_modules():
        if not _is_compiled(sub):
            continue
        config = _compile_config(sub)
        if (config is not None and config.get("triton.cudagraphs")) or _compile_backend(sub) == "cudagraphs":
            where = f"{name}'s {sub_name}" if sub_name else name
            raise RuntimeError(
                f"{where} was compiled with CUDA graphs (mode=\"reduce-overhead\", the inductor option "
                "triton.cudagraphs, or backend=\"cudagraphs\"), which streamed blocks cannot replay: their "
                "weights move between device slots. Compile with the default mode or "
                "mode=\"max-autotune-no-cudagraphs\" (regional: model.compile_repeated_blocks(), or "
                "torch.compile on each block).")


def _keep_in(name: str, tensor: torch.Tensor, view: torch.Tensor, stored: bool = False) -> None:
    """An edit may have given ``tensor`` new storage (``weight.data = merged``): copy what it
    holds into ``view``, the storage the ring owns for it. ``stored``: ``view`` holds it in 8 bits
    (``upcast: "layer"``), cast on the copy."""
    data = tensor.data
    if data.data_ptr() == view.data_ptr() and data.stride() == view.stride():
        return
    if data.shape != view.shape or (data.dtype != view.dtype and not stored):
        raise RuntimeError(f"{name}: an edit changed it to {tuple(data.shape)} {data.dtype}, from "
                           f"{tuple(view.shape)} {view.dtype}; a streamed tensor keeps its shape and dtype.")
    view.copy_(data)


def _list_slot(root: torch.nn.Module, name: str) -> tuple[dict, str]:
    """The ``_modules`` dict of the list holding block ``name`` (a dotted path under ``root``,
    such as ``blocks.0``) and the block's key in it."""
    parent, _, key = name.rpartition(".")
    return (root.get_submodule(parent) if parent else root)._modules, key


def refuse_copy(what: str) -> TypeError:
    """The error for ``copy.deepcopy`` or pickling of an offloaded model: a copy of the ring would
    share its host memory, streams and threads with the original, or lose them (pinned pages,
    shared-memory segments, a rank's shard)."""
    return TypeError(
        f"{what}: an offloaded model cannot be copied (copy.copy or copy.deepcopy) or pickled (its blocks' weights live in "
        "the ring's host memory and device slots, which a copy would share or lose). Copy the model "
        "before apply_offload, or call remove() on its handle first, copy, then apply_offload to each "
        "copy; to save weights, use state_dict() or save_pretrained().")


class _Hook:
    """A hook of the ring, excluded from torch.compile (see ``install_hooks``), run under the
    ring's lock: a hook reads and claims the ring's slots in several steps, and a copy in between
    lets another thread's hook run (see ``_refuse_concurrent``). An object rather than the
    function ``torch.compiler.disable`` returns, so that pickling the model (``torch.save(model)``)
    reaches :func:`refuse_copy`'s message instead of a local function's."""

    __slots__ = ("_call", "_ring", "_lock")

    def __init__(self, ring: "BlockRing", fn: Callable[..., Any]) -> None:
        self._call = fn
        self._ring = ring
        self._lock = ring._lock

    # Disabled as a whole: a compiled block (``fullgraph=True`` too) calls it eagerly, lock and all.
    @torch.compiler.disable
    def __call__(self, *args: Any) -> Any:
        with self._lock:
            return self._call(*args)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refuse_copy(self._ring.component.name)


class _NoBackward:
    """Autograd's saved-tensor hooks for one streamed block run with autograd on. Its weights
    sit in a device slot that later blocks reuse, so a backward pass would read their weights
    (wrong gradients, no error). What autograd saves in the block is dropped (memory no backward
    can use) and a backward that reaches it raises.

    Pushed by the block's pre-forward, popped by its post-forward. An interrupt (Ctrl-C) skips
    the post-forward, and by then other code may have pushed hooks of its own, so the ring does
    not pop them later: the ring's next forward, or ``remove()``, turns them off (``active``),
    and they pass tensors through from then on."""

    __slots__ = ("_message", "active")

    def __init__(self, message: str) -> None:
        self._message = message
        self.active = True

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return None if self.active else tensor

    def unpack(self, packed: torch.Tensor | None) -> torch.Tensor:
        if packed is None:
            raise RuntimeError(self._message)
        return packed


def _running(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is on this thread's stack below the block call whose hook
    asks (a block called from inside it), rather than cut short (an interrupt that skipped its
    post-forward). Walks the frames: only on that rare path."""
    frame = sys._getframe(1)
    calls = 0
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            calls += 1  # the first is the call of the block whose pre-forward runs
            if calls > 1 and frame.f_locals.get("self") is module:
                return True
        frame = frame.f_back
    return False


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _in_call(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward (its hooks included) is on this thread's stack. Walks the
    frames: only on rare paths."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def _on_top(guard: _NoBackward) -> bool:
    """Whether ``guard``'s hooks are the top of this thread's stack of saved-tensor hooks (then
    popping them pops nothing else). Asked of a private torch function: without it, no."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        hooks = top(False) if top is not None else None
    except (RuntimeError, TypeError):
        return False
    return hooks is not None and hooks[0] == guard.pack and hooks[1] == guard.unpack


#: Bytes of an edited block compared across the weight group per collective (_check_same_edit).
_EDIT_CHUNK = 16 << 20


def _weight_group(transfer: Any) -> Any:
    """The weight group of an allgather transfer (under an 8-bit upcast too), else None."""
    return getattr(transfer, "group", None) or getattr(getattr(transfer, "inner", None), "group", None)


class BlockRing:
    """Streams the non-resident blocks of one component through ``num_slots`` device slots."""

    def __deepcopy__(self, memo: dict) -> Any:
        raise refuse_copy(self.component.name)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refuse_copy(self.component.name)

    def __init__(
        self,
        component: StreamedComponent,
        layouts: Sequence[BlockLayout],
        transfer: WeightTransfer,
        device: torch.device,
        parked: Sequence[Sequence[torch.Tensor] | None],
        resident: Mapping[int, torch.Tensor] | None = None,
        num_slots: int = NUM_SLOTS,
    ) -> None:
        """``parked[i]``: what block ``i``'s tensors point at between uses (views into its host
        buffer, or placeholders under allgather); None for a block with no host copy.
        ``resident``: block index -> the device buffer a resident block's tensors are views into
        (the caller filled it)."""
        self.component = component
        self.layouts = tuple(layouts)
        self.transfer = transfer
        self.device = device
        self._cuda = device.type == "cuda"
        # Set by apply_offload: frees this ring when its component is dropped (weakref.finalize).
        self._on_drop: Any = None
        self._parked = [tuple(v) if v is not None else None for v in parked]
        self._device_blocks: dict[int, torch.Tensor] = dict(resident or {})
        # Whether the ring's tensors are inference tensors: only when the model's own are (a
        # model built under torch.inference_mode(), whose parameters cannot point at ordinary
        # storage); apply_offload sets up in that mode, and later plans and writes follow it.
        self._inference = torch.is_inference_mode_enabled()
        for i, buf in self._device_blocks.items():
            bind(self.layouts[i].entries, [e.view_in(buf) for e in self.layouts[i].entries])
        # Streamed blocks start parked (a block whose host copy is plain may have pointed at it
        # while a ring of 8-bit images parks every block on placeholders).
        for i, views in enumerate(self._parked):
            if views is not None and i not in self._device_blocks:
                bind(self.layouts[i].entries, views)
        self.resident: frozenset[int] = frozenset(self._device_blocks)
        # Streamed blocks that keep their first tensors on the device (a residency plan's
        # partly kept blocks): block -> how many leading entries stay, and the device buffer
        # holding them. Only the rest of such a block streams; its slot views start past them.
        self._kept: dict[int, int] = {}
        self._kept_bufs: dict[int, torch.Tensor] = {}
        self._device_versions: dict[int, tuple[int, ...]] = {}
        for i in self._device_blocks:
            self._note_device_versions(i)
        # The partly kept blocks whose kept bytes left the host copy (a final plan's: under a
        # gather always, rank-local when the plan settles): their kept part is on the device only.
        self._kept_off_host: set[int] = set()
        self.plan: ResidencyPlan | None = None
        """The residency plan in force, when a planner made it (see ``apply.py``)."""
        # A ring of 8-bit images (its transfer holds images on the device) runs every block,
        # kept ones too, from a slot.
        self._images = hasattr(transfer, "hold")
        if self._images:
            num_slots = max(num_slots, NUM_SLOTS)
        self.costs: RingCosts | None = None
        """What the planner measured (per block compute and copy ms), once it has."""
        self.budget: int | None = None
        """The device bytes this ring's plan may use, when it has a budget."""
        # Whether the parked views are this rank's own plain host copy, so a tensor written in
        # place between forwards (load_state_dict) changes what the ring streams; elsewhere they
        # are placeholders (sharded, 8-bit) or a copy other ranks read too. Such writes are seen
        # by the tensors' version counters, which inference tensors do not keep (and outside
        # inference mode nothing can write to those).
        self._writable = transfer.name == "rank-local" and not self.parks_placeholders
        # A shared copy is written in place alike (every rank of the host reads the write; each
        # rank that makes it copies again what its own slots hold).
        self._versioned = (self._writable or (transfer.name == "shared" and not self.parks_placeholders)) \
            and not self._inference
        self._configure(num_slots)
        # The block between its pre- and post-forward, and its slot (blocks do not nest), and
        # the thread running it.
        self._current = _EMPTY
        self._current_slot = _EMPTY
        self._current_thread: threading.Thread | None = None
        # Held by every hook (``_Hook``): with several threads calling the model, one hook's
        # check that no other block runs and its claim of a slot are one step. Reentrant: a
        # hook never calls another, but a deadlock would be the worst way to find one that does.
        self._lock = threading.RLock()
        # The last forward was cut short (an exception, or an interrupt that skipped the
        # post-forward): the next on-demand fetch is expected, not an ordering problem.
        self._disrupted = False
        self._warm = False
        self._warned_miss = False
        self._warned_grad = False
        self._warned_adopt = False
        # With autograd on, the running streamed block's saved-tensor hooks: the context that
        # pushed them, its ``_NoBackward`` and the thread (whose stack of hooks it is).
        self._grad_guard: tuple[Any, _NoBackward, threading.Thread] | None = None
        self._hooks: list = []
        self._root_hooks: list = []
        self._lockstep_hooks: list = []
        # Per block, the id of its post-forward hook and how many forward hooks it had when
        # that hook was last made the final one (see install_hooks).
        self._post_ids: list[int] = [-1] * len(self.layouts)
        self._hooks_seen: list[int] = [-1] * len(self.layouts)
        # What the pre-forward checks for CUDA graphs (a user may compile after apply_offload):
        # the block's compiled callable, the entry in its ModuleList (which torch.compile(block)
        # may have replaced with a wrapper) and the component's compiled callable. An identity
        # test each per block; a real check only when one changes.
        root = component.module
        self._list_slots = [_list_slot(root, l.name) for l in self.layouts]
        self._compile_seen: list[tuple[object, object, object]] = [(None, None, None)] * len(self.layouts)
        # Tensors added to the blocks after setup (a LoRA adapter loaded after apply_offload)
        # are not in any layout: the ring does not stream them. ``adopt_pending`` is set by
        # whoever saw one added (``tenants.BlockWatch``); the next block to run, or the next
        # edit, moves them to the device first (:meth:`adopt_strays`).
        self._entry_ids = frozenset(id(e.tensor) for l in self.layouts for e in l.entries)
        self.adopt_pending = False
        # Whether a hook on a block will return without running the block's own forward (a
        # step cache deciding to skip it): the ring then neither waits for nor binds the block.
        # Set by ``tenants.BlockWatch``; None: every block runs. See [Note: skipped blocks].
        self.skip_probe: Callable[[torch.nn.Module], bool] | None = None
        # The same for decisions fixed before a forward starts (a layer-skip hook): the prefetch
        # passes over blocks it says will not run. A cache's per-step decision is not known
        # that early, so only this one is asked about blocks ahead.
        self.skip_ahead_probe: Callable[[torch.nn.Module], bool] | None = None
        # Whether every rank must move the same blocks in the same order (the fill is a
        # collective): then a skipped block's fills still happen, only its wait is dropped.
        self._lockstep = transfer.gather is not None
        # Lockstep only ([Note: a forward cut short in lockstep]): whether a forward of the
        # component is under way, how far its fills have got (the position in ``streamed`` of
        # the next block whose pre-forward has not finished), and why the weight group can no
        # longer be used (a fill, i.e. a collective, failed), if it cannot.
        self._fills = 0  # fills made (lockstep: the same count on every rank; remove() compares)
        self._in_forward = False
        self._post_ran = False  # _root_post ran for the forward under way
        self._nested = 0  # the component's forward called from inside itself (rare)
        self._reached = 0
        self._broken: str | None = None
        self._on_forward: Callable[[BlockRing], bool] | None = None
        self.tracer: RingTracer | None = None
        self.setup_s: float | None = None
        """Seconds spent filling and page-locking the host copy (set by ``apply_offload``)."""
        self.storage_dtype: str | None = None
        """The 8-bit format the blocks are stored in (set by ``apply_offload``), or None."""
        self.upcast: str | None = None
        """With a storage dtype, where it is upcast: ``"block"`` or ``"layer"``."""
        self.upcasts: dict[int, torch.dtype] = {}
        """``upcast: "layer"``: the model's dtype of each tensor (by ``id``) its blocks hold in 8
        bits (set by ``apply_offload``); an edit sees them in it."""

    def _configure(self, num_slots: int) -> None:
        """Slots, their views and events for the current resident set. Setup only: allocates."""
        n = len(self.layouts)
        self.streamed = tuple(i for i in range(n) if i not in self.resident)
        count = num_slots if self.streamed else 0
        if self.streamed and count < 2:
            raise ValueError(f"{self.component.name}: a ring that streams needs at least 2 slots, found {num_slots}")
        base = [self.kept_bytes(i) for i in range(n)]
        moving = [self.layouts[i].entries[self._kept.get(i, 0):] for i in range(n)]
        nbytes = max((self.transfer.device_nbytes(i) - base[i] for i in self.streamed), default=0)
        # The slots are allocated once per plan and reused for every block of every step: the
        # per-block path allocates nothing and never returns memory to the allocator.
        self.transfer.allocate_slots(nbytes, count)
        self.slots = self.transfer.slots
        self.num_slots = count
        # Per block, the entries that move between host and slot (all of them unless the block
        # keeps a leading part on the device), their slot views and their parked views.
        self._moving = moving
        self._base = base
        self._slot_views = [[tuple(e.view_in(slot, base[i]) for e in moving[i]) if i in self.streamed
                             else None for i in range(n)] for slot in self.slots]
        self._fill_views = [[slot[: self.transfer.device_nbytes(i) - base[i]] for i in range(n)] for slot in self.slots]
        self._parked_moving = [p[self._kept.get(i, 0):] if p is not None else None for i, p in enumerate(self._parked)]
        # [Note: changes between forwards]. The moving tensors themselves, where their parked
        # views start, and per slot the version of each tensor when the slot was filled.
        self._moving_tensors = [tuple(e.tensor for e in m) for m in moving]
        self._parked_ptrs = [tuple(v.data_ptr() for v in p) if p is not None else None for p in self._parked_moving]
        self._fill_versions = [[0] * max(map(len, moving), default=0) for _ in range(count)]
        # ready[s]: recorded by the transfer when slot s holds its block; the compute stream
        # waits on it before the block runs. free[s]: recorded on the compute stream after the
        # block in slot s ran; the transfer waits on it before overwriting slot s.
        self._ready = [torch.cuda.Event() if self._cuda else None for _ in range(count)]
        self._free = [torch.cuda.Event() if self._cuda else None for _ in range(count)]
        self._slot_block = [_EMPTY] * count
        self._next_slot = 0
        # The streamed blocks to have in slots while block i runs: the next count - 1 after it.
        position = {b: k for k, b in enumerate(self.streamed)}
        m = len(self.streamed)
        self._ahead = [tuple(self.streamed[(position[i] + d) % m] for d in range(1, min(count, m)))
                       if i in position else () for i in range(n)]
        # What a prefetch for block i must not overwrite: i itself and the blocks ahead of it.
        self._keep = [(i, *ahead) for i, ahead in enumerate(self._ahead)]
        # The streamed block after streamed block i (wrapping), and the first one (see _skip).
        self._after = [self.streamed[(position[i] + 1) % m] if i in position else _EMPTY for i in range(n)]
        self._first = self.streamed[0] if self.streamed else _EMPTY
        self._position = [position.get(i, -1) for i in range(n)]
        self._reached = len(self.streamed)  # no forward under way owes fills (a re-plan ends one)

    def enable_trace(self) -> None:
        """Record per-block timing marks from now on (see ``trace.py``), framed by the
        component's forward: a block that runs twice, or blocks that run in another order,
        stay in one forward's report."""
        self.tracer = RingTracer([l.name for l in self.layouts], self._fill_bytes(), self._cuda, self.device)
        self._frame_forwards()

    def _fill_bytes(self) -> list[int]:
        """Per block, the bytes a fill copies into its slot (what the trace's bandwidth divides):
        its 8-bit image on a ring of images, else the block less the part kept on the device."""
        if self._images:
            return [self.transfer.inner.device_nbytes(i) for i in range(len(self.layouts))]
        return [self.transfer.device_nbytes(i) - self.kept_bytes(i) for i in range(len(self.layouts))]

    # -- hooks ---------------------------------------------------------------------------
    # Every hook is excluded from torch.compile: it swaps storage and records events, which
    # must run eagerly around a compiled block rather than be traced into its graph.
    def install_hooks(self) -> None:
        # The pre-forward goes first and the post-forward last, so that the block's other hooks
        # (a user's, registered before or after apply_offload) see the weights it computes with,
        # as on the resident model. Hooks registered later are appended after the post-forward;
        # the pre-forward moves it back to the end when their number changes (_hooks_seen).
        for layout in self.layouts:
            self._hooks.append(layout.module.register_forward_pre_hook(
                _Hook(self, functools.partial(self._pre_forward, layout.index)), prepend=True))
            # always_call: a block that raises (or is interrupted) still releases its slot.
            post = layout.module.register_forward_hook(
                _Hook(self, functools.partial(self._post_forward, layout.index)), always_call=True)
            self._hooks.append(post)
            self._post_ids[layout.index] = post.id
            self._hooks_seen[layout.index] = len(layout.module._forward_hooks)
        if self._lockstep and not self._lockstep_hooks:
            root = self.component.module
            self._lockstep_hooks = [
                root.register_forward_pre_hook(_Hook(self, self._lockstep_pre)),
                # always_call: on an exception too, when the forward's fills must be completed.
                root.register_forward_hook(_Hook(self, self._lockstep_post), always_call=True)]

    def _keep_post_forward_last(self, i: int, module: torch.nn.Module) -> None:
        hooks = module._forward_hooks
        key = self._post_ids[i]
        if key in hooks:
            hooks.move_to_end(key)
        self._hooks_seen[i] = len(hooks)

    def watch_forwards(self, callback: Callable[["BlockRing"], bool]) -> None:
        """Call ``callback(ring)`` after every complete forward of the component until it returns
        True. Marks the forward's start and end for the tracer (the planner's measurements)."""
        self._on_forward = callback
        self._frame_forwards()

    def _frame_forwards(self) -> None:
        if not self._root_hooks:
            root = self.component.module
            self._root_hooks = [root.register_forward_pre_hook(_Hook(self, self._root_pre)),
                                root.register_forward_hook(_Hook(self, self._root_post))]

    def remove_hooks(self) -> None:
        for h in [*self._hooks, *self._root_hooks, *self._lockstep_hooks]:
            h.remove()
        self._hooks = []
        self._root_hooks = []
        self._lockstep_hooks = []

    # -- lockstep: a forward cut short on one rank ---------------------------------------
    # [Note: a forward cut short in lockstep] Under a lockstep transfer every fill is a
    # collective, paired with the other ranks' fills by order only. A forward that raises on
    # one rank (a bad input, an out-of-memory in one block) and is caught there (a server
    # answering one request with an error) would leave that rank's fills behind the others':
    # from its next forward on, its gathers would pair with other blocks' gathers and rebuild
    # blocks from mixed shards, silently, wherever the blocks are the same size. So the forward
    # is completed: the fills it had still to make are made (no block runs), in the order a
    # complete forward makes them, and the exception goes on. Every rank that raises does the
    # same, so a deterministic error on every rank leaves them in step as well. Per forward (the
    # component's hooks), never per block. A failed fill (a collective that timed out, a peer
    # gone) cannot be completed: the ring refuses to run from then on, with the reason.
    def _lockstep_pre(self, module, args) -> None:
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if self._in_forward:
            if _running(module):
                self._nested += 1
                return
            # The last forward never reached its post-forward: torch skips even always_call
            # hooks on a KeyboardInterrupt. Its fills are completed now, before this one's.
            self._finish_cut_short(module, args, next_started=True)
        self._in_forward = True
        self._post_ran = False
        self._nested = 0
        self._reached = 0

    def _lockstep_post(self, module, args, output) -> None:
        if self._nested:
            self._nested -= 1
            return
        if not self._in_forward:
            return
        self._finish_cut_short(module, args)

    def _finish_cut_short(self, module, args, next_started: bool = False) -> None:
        """End the forward under way as the other ranks end theirs: its remaining fills, and the
        per-forward callback (the residency planner's, whose agreement is a collective too), which
        ``_root_post`` runs only after a forward that returned."""
        self._release_interrupted()
        if self._broken is None and self._reached < len(self.streamed):
            self._complete_forward()
        self._in_forward = False
        if self._post_ran or not self._root_hooks:
            return
        if not next_started:
            self._root_post(module, args, None)
        elif self._on_forward is not None and self._on_forward(self):  # the tracer has begun the next one
            self._on_forward = None

    def _release_interrupted(self) -> None:
        if self._current != _EMPTY and self._current_thread is threading.current_thread():
            self._unguard_backward(pop=False)
            self._release(self._current, self._current_slot)

    def _complete_forward(self) -> None:
        """Make the fills the current forward has still to make, without running a block."""
        self._in_forward = False
        self._disrupted = True
        with torch.no_grad():
            for k in range(self._reached, len(self.streamed)):
                b = self.streamed[k]
                if self._slot_of(b) == _EMPTY:
                    self._fetch_missing(b)
                self._prefetch(b)
                self._reached = k + 1

    def _root_pre(self, module, args) -> None:
        if self.tracer is not None:
            self.tracer.forward_start(self._stream())

    def _root_post(self, module, args, output) -> None:
        # Hooks stay installed (removing one while torch iterates them is not safe); once the
        # callback is done they only mark the forward for a tracer, if any.
        self._post_ran = True
        if self.tracer is not None:
            self.tracer.forward_end(self._stream())
        if self._on_forward is not None and self._on_forward(self):
            self._on_forward = None

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self._cuda else None

    # -- per-block path: no host synchronisation, no allocation -------------------------
    def _pre_forward(self, i: int, module, args) -> None:
        if torch.jit.is_tracing() or torch.compiler.is_exporting():
            self._refuse_capture(i)
        hooks = module._forward_hooks
        if len(hooks) != self._hooks_seen[i] or (hooks and next(reversed(hooks)) != self._post_ids[i]):
            self._keep_post_forward_last(i, module)
        if self.adopt_pending:
            self.adopt_strays()
        entries, key = self._list_slots[i]
        seen = self._compile_seen[i]
        if (module._compiled_call_impl is not seen[0] or entries.get(key) is not seen[1]
                or self.component.module._compiled_call_impl is not seen[2]):
            self._check_compiled(i, module)
        if self._current != _EMPTY:
            owner = self._current_thread
            if owner is not threading.current_thread() and owner is not None and owner.is_alive():
                self._refuse_concurrent(i)
            if owner is threading.current_thread() and _running(self.layouts[self._current].module):
                self._refuse_nested(i)
            # The last block's post-forward never ran: torch calls always_call hooks on
            # Exception only, so a KeyboardInterrupt skips it. Release that block now.
            self._unguard_backward(pop=False)
            self._release(self._current, self._current_slot)
            self._disrupted = True
        self._current_thread = threading.current_thread()
        if self.skip_probe is not None and i not in self.resident and self.skip_probe(module):
            self._skip(i)
            if self._lockstep:
                self._reached = self._position[i] + 1
            return
        tracer = self.tracer
        if i in self.resident:
            if tracer is not None and self.skip_probe is not None and self.skip_probe(module):
                # A cache skips it: left out of the trace, so this forward is not measured
                # (measured_costs needs every block), as for a skipped streamed block.
                self._current, self._current_slot = i, _SKIPPED
                return
            if tracer is not None:
                stream = self._stream()
                tracer.before_wait(i, stream)
                tracer.after_wait(i, stream)
            self._current, self._current_slot = i, _RESIDENT
            return
        stream = self._stream()
        for t, ptr in zip(self._moving_tensors[i], self._parked_ptrs[i]):
            if t.data_ptr() != ptr:  # given new storage between forwards: rare, reads only until then
                self._take_new_storage(i)
                break
        slot = self._slot_of(i)
        if slot != _EMPTY and self._versioned:
            versions = self._fill_versions[slot]
            for k, t in enumerate(self._moving_tensors[i]):
                if t._version != versions[k]:  # its host copy was written since the slot was filled
                    self._slot_block[slot] = _EMPTY
                    self._disrupted = True  # fetched again, on demand, without a warning
                    slot = _EMPTY
                    break
        if slot == _EMPTY:
            slot = self._fetch_missing(i)
        if tracer is not None:
            tracer.before_wait(i, stream)
        if self._cuda:
            stream.wait_event(self._ready[slot])
        if tracer is not None:
            tracer.after_wait(i, stream)
        bind(self._moving[i], self._slot_views[slot][i])
        self._current, self._current_slot = i, slot
        self._prefetch(i)
        if self._lockstep:
            self._reached = self._position[i] + 1
        if torch.is_grad_enabled():  # rare: pipelines run under no_grad
            self._guard_backward(i)

    def _refuse_capture(self, i: int) -> None:
        """Block ``i`` runs under torch.export or torch.jit.trace: the program would keep what
        the block's tensors point at then (host copies, or placeholders) as its weights, and
        would not stream. Nothing has changed yet."""
        how = "torch.jit.trace" if torch.jit.is_tracing() else "torch.export"
        raise RuntimeError(
            f"{self.component.name}: block {self.layouts[i].name} ran under {how}. An exported or "
            "traced program holds every weight as a constant of its own and does not stream, and "
            "between uses streamed weights point at host copies or placeholders. Export or trace the "
            "model before apply_offload, or call remove() on the offload handle first.")

    def _refuse_nested(self, i: int) -> None:
        """Block ``i`` was called from inside the forward of the running block. Nothing has
        changed yet; the outer block releases its slot as its forward unwinds."""
        raise RuntimeError(
            f"{self.component.name}: block {self.layouts[i].name} was called from inside block "
            f"{self.layouts[self._current].name}'s forward. Streamed blocks run one at a time, each "
            "from a device slot that the next block reuses, so one block may not run another. Declare "
            "a block that runs others as one block (list only the outer blocks in "
            "_layerwise_offload_blocks_attrs), or keep this component resident.")

    def _refuse_concurrent(self, i: int) -> None:
        """Block ``i`` starts while another thread's block of this ring is running: the two
        forwards would take each other's slots. Nothing has changed yet."""
        raise RuntimeError(
            f"{self.component.name}: block {self.layouts[i].name} started in one thread while block "
            f"{self.layouts[self._current].name} of the same component was running in another. A "
            "streamed component runs one forward at a time (its slots hold the forward's blocks): "
            "hold a lock around each call of the offloaded model or pipeline (Omni.generate does), "
            "or give each thread its own. (If that other thread's forward was interrupted, run one "
            "forward from it first.)")

    def _prefetch(self, i: int) -> None:
        """Have the blocks after ``i`` in slots (round robin), keeping ``i``'s."""
        ahead, keep = self._ahead[i], self._keep[i]
        probe = self.skip_ahead_probe
        if probe is not None and not self._lockstep:
            for b in ahead:
                if probe(self.layouts[b].module):  # rare (a layer skip): work out what runs
                    ahead = self._running_ahead(i, probe)
                    keep = (i, *ahead)
                    break
        for nxt in ahead:
            if self._slot_of(nxt) == _EMPTY:
                self._fill(nxt, self._take_slot(keep))

    def _running_ahead(self, i: int, probe: Callable[[torch.nn.Module], bool]) -> tuple[int, ...]:
        """The next ``num_slots - 1`` streamed blocks after ``i`` that ``probe`` does not skip
        in this forward; from the next forward's first block on, every block counts."""
        want = len(self._ahead[i])
        found: list[int] = []
        b = i
        while len(found) < want:
            b = self._after[b]
            if b == self._first:  # the next forward: its blocks in order, up to i
                for x in (b, *self._ahead[b]):
                    if len(found) == want or x == i:
                        break
                    if x not in found:
                        found.append(x)
                break
            if not probe(self.layouts[b].module):
                found.append(b)
        return tuple(found)

    def _skip(self, i: int) -> None:
        """Streamed block ``i`` will not run (a hook returns without calling its forward): no
        wait, no bind. Rank-local, nothing is copied for it either; when the next block does
        run, it is made ready now if the prefetch left it out. Under a lockstep transfer every
        rank moves every block regardless of what its own caches decided (ranks may decide
        differently, and the fills are collectives): the fills go on as if ``i`` ran."""
        self._current, self._current_slot = i, _SKIPPED
        if self._lockstep:
            if self._slot_of(i) == _EMPTY:  # keeps every rank's fills in the same order
                self._fetch_missing(i)
            self._prefetch(i)
            return
        nxt = self._after[i]
        # The next streamed block: the first of the next forward always runs; a later one of
        # this forward runs unless its hooks say otherwise (then its own pre-forward decides).
        if nxt >= 0 and self._slot_of(nxt) == _EMPTY and (
                nxt == self._first or not self.skip_probe(self.layouts[nxt].module)):
            self._fill(nxt, self._take_slot(self._keep[nxt]))

    def _check_compiled(self, i: int, module: torch.nn.Module) -> None:
        """Something was compiled since block ``i`` last ran: refuse CUDA graphs (see
        :func:`check_not_cuda_graphs`) before the ring changes anything."""
        entries, key = self._list_slots[i]
        entry, root = entries.get(key), self.component.module
        name = f"{self.component.name} block {self.layouts[i].name}"
        check_not_cuda_graphs(name, module)
        if entry is not None and entry is not module:
            check_not_cuda_graphs(name, entry)
        check_not_cuda_graphs(self.component.name, root)
        if self.upcast == "layer" and any(m is not None and _is_compiled(m) for m in (module, entry, root)):
            raise RuntimeError(
                f"{name} was compiled, and its 8-bit weights are upcast per layer (upcast \"layer\"): "
                "the upcast hooks swap each layer's tensors inside the block, which a compiled graph "
                "does not follow. Use upcast \"block\" (the default) with torch.compile, or do not compile.")
        self._compile_seen[i] = (module._compiled_call_impl, entry, root._compiled_call_impl)

    def _post_forward(self, i: int, module, args, output) -> None:
        # The pre-forward did not get as far as binding (or refused this thread): nothing to release.
        if self._current != i or self._current_thread is not threading.current_thread():
            if output is None and self._current == _EMPTY:  # the block raised before it was bound
                self._disrupted = True
            return
        if self._current_slot == _SKIPPED:
            self._current = self._current_slot = _EMPTY
            return
        if self.tracer is not None:
            self.tracer.after_compute(i, self._stream())
        if output is None:  # torch passes no output when the block raised
            self._disrupted = True
        if self._grad_guard is not None:  # rare: autograd on
            self._unguard_backward(pop=True)
        self._release(i, self._current_slot)

    def _release(self, i: int, slot: int) -> None:
        """Block ``i`` is done with ``slot``: mark the slot free on the compute stream and point
        the block's tensors back at their parked storage."""
        self._current = self._current_slot = _EMPTY
        if slot == _RESIDENT or slot == _SKIPPED:
            return
        if self._cuda:
            self._free[slot].record(torch.cuda.current_stream(self.device))
        bind(self._moving[i], self._parked_moving[i])
        if torch.is_autocast_enabled(self.device.type):
            # Autocast keeps the low-precision copy of every float32 parameter it casts until
            # the outermost autocast region ends, keyed by the parameter: for streamed blocks
            # that would hold a copy of every block's weights on the device, the memory
            # offloading frees. Dropped after each streamed block; a recast is bitwise the same.
            # torch has no per-tensor eviction: the non-block and resident copies go too and are
            # cast again at their next use (docs/design.md, peak device memory).
            torch.clear_autocast_cache()
        if getattr(_parametrize, "_cache_enabled", 0):
            # Likewise parametrize.cached(): it keeps each parametrized weight it computed, which
            # may be a view of the slot (then later blocks' bytes) or a device copy.
            _parametrize._cache.clear()

    def _slot_of(self, block: int) -> int:
        for s in range(self.num_slots):
            if self._slot_block[s] == block:
                return s
        return _EMPTY

    def _take_slot(self, keep: tuple[int, ...] = ()) -> int:
        """The next slot round robin that holds none of ``keep`` (the running block and those to
        come next: after an interrupted fill the order can be off by one; this keeps it safe)."""
        for k in range(self.num_slots):
            slot = (self._next_slot + k) % self.num_slots
            if self._slot_block[slot] not in keep:
                self._next_slot = (slot + 1) % self.num_slots
                return slot
        raise AssertionError("no free slot")  # unreachable: keep holds at most num_slots blocks, one being filled

    def _fill(self, block: int, slot: int) -> None:
        if self._inference and not torch.is_inference_mode_enabled():
            # Inference slots take writes only in inference mode (a pipeline's forwards run
            # under no_grad): rare, a model built under inference_mode.
            with torch.inference_mode():
                return self._fill(block, slot)
        # Mark the slot empty first: if the enqueue is interrupted, the slot must not claim
        # to hold its former block.
        self._slot_block[slot] = _EMPTY
        try:
            marks = self.tracer.transfer_marks(block) if self.tracer is not None else None
            self.transfer.fill(block, self._fill_views[slot][block], self._free[slot], self._ready[slot], marks,
                               start=self._base[block])
        except RuntimeError as exc:  # e.g. a gloo collective timed out: say which ring and block
            failed = (
                f"{self.component.name}: moving block {self.layouts[block].name} with the "
                f"{self.transfer.name} transfer failed: {exc}. With allgather, a rank that died, "
                "called remove() on its handle, or ran other blocks or another number of forwards, "
                "stalls the others: every rank must run the same steps in lockstep (and remove() "
                "together)."
            )
            if self._lockstep:
                # The other ranks' collectives no longer pair with this rank's: nothing the ring
                # moves from now on could be trusted.
                self._broken = (f"{self.component.name}: an earlier fill of this ring failed, so its "
                                "weight group can no longer move blocks in lockstep; end the job on "
                                f"every rank and start it again. The failure: {failed}")
            raise RuntimeError(failed) from exc
        self._slot_block[slot] = block
        self._fills += 1
        if self._versioned:
            versions = self._fill_versions[slot]
            for k, t in enumerate(self._moving_tensors[block]):
                versions[k] = t._version

    def _take_new_storage(self, i: int) -> None:
        """Some of block ``i``'s streamed tensors point elsewhere than their parked host views:
        the model was changed between forwards by giving them new storage (``tensor.data =``,
        ``model.to(...)``, peft's hotswap of a grown adapter). A rank-local ring with plain host
        copies takes new values of the same dtype and shape into its host copy (``pipe.to(
        "cuda")`` after offloading costs one copy back per tensor, once); anything else is refused,
        before anything changes. Between forwards; may synchronise."""
        changed = [(k, t.data) for k, (t, ptr) in enumerate(zip(self._moving_tensors[i], self._parked_ptrs[i]))
                   if t.data_ptr() != ptr]
        views = self._parked_moving[i]
        for k, new in changed:
            view, name = views[k], self._moving[i][k].name
            if new.dtype != view.dtype or new.shape != view.shape:
                raise RuntimeError(
                    f"{self.component.name}: {name} became {new.dtype} {tuple(new.shape)} after apply_offload "
                    f"(it is streamed as {view.dtype} {tuple(view.shape)}; e.g. model.to(dtype) or a "
                    "tensor.data = ... of another dtype or shape). A streamed tensor lives in the ring's host "
                    "copy: cast the model before apply_offload, or call remove() first and apply again.")
            if not self._writable:
                raise RuntimeError(
                    f"{self.component.name}: {name} was given new storage after apply_offload (tensor.data = "
                    f"..., or model.to(device), which apply_offload does not need: it places what does not stream "
                    f"itself), which a {self.transfer.name} ring{' of 8-bit images' if self._images else ''} "
                    "cannot take in: its host copy is shared or sharded or stored in 8 bits. Change weights "
                    "before apply_offload, through LoRA's fuse/unfuse (edited on the device and written back), "
                    "or call remove() first and apply again.")
        with torch.inference_mode(self._inference), torch.no_grad():
            for k, new in changed:
                views[k].copy_(new)
        bind(self._moving[i], views)
        self.forget_slots()

    def forget_slots(self) -> None:
        """Between forwards: what the slots hold is copied again before it runs (a host copy was
        changed in a way the ring cannot see, e.g. a ``.data.copy_``; see ``tenants.py``)."""
        if self._current == _EMPTY and self._slot_block:
            self._slot_block = [_EMPTY] * self.num_slots
            self._disrupted = True
        self._device_versions.clear()  # and blocks kept on the device may differ from their host copies

    def _fetch_missing(self, i: int) -> int:
        """Block ``i`` was not prefetched: the first block ever, the first after a forward that
        was cut short, or blocks ran out of order (warned once). The prefetched blocks are
        dropped (their slots are refilled in order from here)."""
        if not self.slots and self.transfer.gather is None:
            # A plan change could not allocate them (see _configure_new_slots): once more. Not
            # under a gather, whose slots may be mapped into every rank of its group at once.
            with contextlib.suppress(Exception), torch.inference_mode(self._inference), torch.no_grad():
                self._configure(NUM_SLOTS)
        if not self.slots:
            raise RuntimeError(
                f"{self.component.name}: block {self.layouts[i].name} cannot run: the ring has no device slots to "
                "stream it through (allocating them failed when its plan changed, see the error raised then). "
                "Free device memory and call remove(), or apply the offload again with a smaller device_budget.")
        if self._warm and not self._disrupted and not self._warned_miss:
            self._warned_miss = True
            warnings.warn(
                f"{self.component.name}: block {self.layouts[i].name} ran but was not prefetched "
                "(blocks ran in another order than declared, or some were skipped). Outputs stay "
                "correct; the block is fetched on demand and its transfer is not hidden. If the "
                "order is intended, declare the blocks in execution order.",
                RuntimeWarning, stacklevel=4,
            )
        self._warm = True
        self._disrupted = False
        self._slot_block = [_EMPTY] * self.num_slots
        slot = self._take_slot()
        self._fill(i, slot)
        return slot

    def _guard_backward(self, i: int) -> None:
        """Block ``i`` streams with autograd on: a backward through it raises (``_NoBackward``).
        No guard is left from before: an interrupted block's is turned off as its release."""
        name = self.layouts[i].name
        guard = _NoBackward(
            f"{self.component.name}: backward through streamed block {name}. Offloading is for "
            "inference: the block's device slot has since held other blocks' weights, so the "
            "gradients would be wrong. Run the forward under torch.no_grad() or "
            "torch.inference_mode(), or call remove() on the offload handle to train. (A backward "
            "that does not go through the offloaded model meets this after a forward of it was "
            "interrupted with autograd on, until its next forward or remove().)")
        hooks = torch.autograd.graph.saved_tensors_hooks(guard.pack, guard.unpack)
        hooks.__enter__()
        self._grad_guard = (hooks, guard, threading.current_thread())
        if not self._warned_grad:
            self._warn_grad()

    def _unguard_backward(self, *, pop: bool) -> None:
        """The running block's hooks (if any) are done: turned off, and popped where ``pop`` (its
        own post-forward, in its thread: only then are they the top of that thread's stack)."""
        if self._grad_guard is None:
            return
        hooks, guard, thread = self._grad_guard
        self._grad_guard = None
        guard.active = False
        if thread is threading.current_thread() and (pop or _on_top(guard)):
            hooks.__exit__(None, None, None)

    def _warn_grad(self) -> None:
        self._warned_grad = True
        warnings.warn(
            f"{self.component.name}: streamed blocks ran with autograd enabled. Offloading is for "
            "inference: the device slots are reused, so nothing is kept for a backward pass, and "
            "one through these blocks raises. Run under torch.no_grad() or torch.inference_mode().",
            RuntimeWarning, stacklevel=5,
        )

    # -- changes to the blocks after setup: between forwards ---------------------------------
    def adopt_strays(self) -> None:
        """Move the tensors the blocks gained after setup (not in any layout) to the device,
        where they stay: a LoRA adapter loaded after ``apply_offload`` is created beside the
        parked host copies, and is small next to its block (rank 16 on a Wan-14B projection:
        0.3 MB against 12 MB), so it stays resident rather than growing every slot."""
        strays = [(layout, name, t) for layout in self.layouts
                  for name, t in itertools.chain(layout.module.named_parameters(), layout.module.named_buffers())
                  if id(t) not in self._entry_ids]
        if self.upcasts:
            stored = [f"{layout.name}.{name}" for layout, name, t in strays if t.dtype.is_floating_point
                      and t.dtype.itemsize == 1]
            if stored:
                # peft gives a new adapter its base layer's dtype, which reads 8 bits here.
                raise RuntimeError(
                    f"{self.component.name}: {stored[0]} ({len(stored)} tensors in all) came after "
                    "offloading, in 8 bits: an adapter loaded after apply_offload with upcast \"layer\" "
                    "takes its base layer's 8-bit dtype, which it cannot compute in. Load adapters before "
                    "offloading, or use upcast \"block\" (the default).")
        # Ordinary tensors, whatever mode the forward runs in: their creator made them so. A
        # tensor still on the meta device (peft injects an adapter empty, then un-merges the
        # layers it fused before, an edit, before it loads the values) waits for a later call.
        waiting = False
        added: dict[int, int] = {}
        with torch.inference_mode(False), torch.no_grad():
            for layout, _name, t in strays:
                if t.is_meta:
                    waiting = True
                    continue
                if t.device != self.device:
                    t.data = t.data.to(self.device)
                added[layout.index] = added.get(layout.index, 0) + t.numel() * t.element_size()
        self.adopt_pending = waiting
        big = [i for i, n in added.items() if 2 * n > self.layouts[i].tensor_bytes]
        if big and not self._warned_adopt:
            self._warned_adopt = True
            i = big[0]
            name = next(f"{self.layouts[i].name}.{n}" for layout, n, t in strays if layout.index == i)
            warnings.warn(
                f"{self.component.name}: {added[i] / 2**20:.1f} MiB of tensors added to block "
                f"{self.layouts[i].name} after apply_offload (such as {name}; {len(big)} blocks in all) "
                "stay on the device for good, over half of what the block streams: offloading no "
                "longer spares that memory. Make such changes (weight_norm, new layers) before "
                "apply_offload, or call remove() on the handle, change the model and apply again. "
                "Small additions, such as LoRA adapters, are expected.", RuntimeWarning, stacklevel=2)

    def block_tensors(self) -> dict[int, torch.Tensor]:
        """The blocks' tensors (parameters and buffers) by id, a tied one once."""
        return {id(e.tensor): e.tensor for layout in self.layouts for e in layout.entries}

    def edit_block(self, i: int, edit: Callable[[], _T]) -> _T:
        """Run ``edit()`` with block ``i``'s tensors on the device, and keep what it leaves in
        them: in the block's device buffer if it is resident, else in its slot and written back
        to its host copy (this rank's shard under allgather), so later forwards and
        ``remove()`` see it. For edits between forwards, such as fusing a LoRA adapter into a
        block's weights: computed on the device as on the resident model, so the bits match.
        Synchronises; collective under allgather (every rank edits the same blocks in the same
        order). If ``edit`` raises, what it did before is kept all the same, as on the resident
        model; under allgather, where an edit that raised on any rank is compared with none, no
        rank keeps any of it (the block's shards stay as they were)."""
        if self._current != _EMPTY:
            if (self._current_thread is not threading.current_thread()
                    or _in_call(self.layouts[self._current].module)):
                raise RuntimeError(f"{self.component.name}: block {self.layouts[i].name} cannot be edited "
                                   "during a forward; edit between forwards.")
            # A forward a KeyboardInterrupt cut short left its block bound (its post-forward never
            # ran): between forwards after all. Released first (lockstep: with its fills made).
            if self._lockstep:
                self.finish_interrupted()
            else:
                self._release_interrupted()
                self._disrupted = True
        if self.adopt_pending:
            self.adopt_strays()
        layout = self.layouts[i]
        with torch.no_grad():
            if self._cuda:
                torch.cuda.synchronize(self.device)
            slot = None
            if i in self.resident:
                views = [e.view_in(self._device_blocks[i]) for e in layout.entries]
            else:
                slot = self._slot_of(i)
                if slot == _EMPTY:
                    # Not the slot of the block the next forward starts with, prefetched by the
                    # last one: the edit leaves the ring warm.
                    slot = self._take_slot(keep=self.streamed[:1] if self.num_slots > 1 else ())
                    self._fill(i, slot)
                if self._cuda:
                    self._ready[slot].synchronize()  # an edit, not the per-block path
                kept = self._kept_views(i)
                views = [*kept, *self._slot_views[slot][i]]
            bind(layout.entries, views)
            # Under allgather every rank compares its edit with the others' (collectives): a rank
            # whose edit raised joins them too, saying so, and every rank raises there (no rank's
            # collectives then pair with another's next fill).
            checked = self._lockstep and (slot is not None or self.transfer.has_host_copy(i))
            try:
                error: Exception | None = None
                try:
                    # upcast "layer": the edit sees the weights in the model's dtype, as under
                    # "block", and what it leaves is stored in 8 bits again (rounded as Tensor.to
                    # rounds).
                    for entry in layout.entries:
                        compute = self.upcasts.get(id(entry.tensor))
                        if compute is not None:
                            entry.tensor.data = entry.tensor.data.to(compute)
                    result = edit()
                    self._keep_edit(layout, views)
                except Exception as exc:  # noqa: BLE001 - lockstep: told to the other ranks, then raised
                    if not checked:
                        # As on the resident model, what the edit did before it raised stays: peft
                        # merges adapters one layer and one adapter at a time, recording each, so
                        # a fuse that raises on a broken adapter leaves the others merged, and a
                        # later unfuse subtracts them. Kept and written back, then raised.
                        self._keep_edit(layout, views)
                        self._write_edit_back(i, slot)
                        raise
                    error = exc
                if checked:
                    self._check_same_edit(i, views, error)
                self._write_edit_back(i, slot)
                if self._cuda:
                    torch.cuda.synchronize(self.device)
            except BaseException:
                if slot is not None:  # the slot may hold a half-edited block: it holds none now
                    self._slot_block[slot] = _EMPTY
                raise
            finally:
                if slot is None:
                    bind(layout.entries, views)
                else:
                    bind(layout.entries, [*self._kept_views(i), *self._parked_moving[i]])
        return result

    def _keep_edit(self, layout: BlockLayout, views: Sequence[torch.Tensor]) -> None:
        """What an edit left in the block's tensors, into ``views`` (the bytes the ring holds)."""
        for entry, view in zip(layout.entries, views):
            _keep_in(entry.name, entry.tensor, view, stored=id(entry.tensor) in self.upcasts)

    def _write_edit_back(self, i: int, slot: int | None) -> None:
        """An edited block's bytes into its host copy: from ``slot``, or from its device buffer
        (``slot`` None: resident)."""
        layout = self.layouts[i]
        if slot is not None:
            self._moved(i, self.transfer.write_back(i, self._fill_views[slot][i], start=self._base[i]))
            if layout.image is not None:
                # Stored in 8 bits ("block"): the slot holds the edit unrounded, the image its
                # 8-bit rounding. The next forward fetches the block again, so every forward
                # runs on what is stored (fetched on demand: no ordering problem).
                self._slot_block[slot] = _EMPTY
                self._disrupted = True
            if i in self._kept and i not in self._kept_off_host:
                # A host copy that is still whole holds the kept part's edit too (one that gave
                # the kept part up has only the device's).
                self._moved(i, self.transfer.write_back(i, self._kept_bufs[i], start=0))
        elif self.transfer.has_host_copy(i):
            # Resident under a plan that is not final yet: a later plan may stream it again,
            # from its host copy, which must hold the edit too.
            self._write_back_resident(i)

    def _check_same_edit(self, i: int, parts: Sequence[torch.Tensor], error: Exception | None = None) -> None:
        """Under allgather every rank must leave the same bytes in a block it edits: each writes
        back its own shard only, so different edits (adapters, or scales, fused differently on
        different ranks) would be stitched into one block at the next gather, wrong on every
        rank. Compared exactly, a chunk at a time over the weight group: where ranks differ, the
        element-wise maximum or minimum differs from each rank's own bytes, so every rank finds
        it. Raises before anything is written back (the host shards keep the block as it was).
        ``parts``: the block's tensors (not its buffer, whose alignment gaps hold whatever the
        allocator left there, on each rank its own). ``error``: this rank's edit raised it.

        The comparison's buffers are allocated first, and the ranks agree that every edit (and
        allocation) succeeded before the first comparison (``groups.agree_step``): a rank whose
        edit raised would otherwise leave the others in the comparison's collectives, which its
        next fills would answer. Where one failed, every rank raises there."""
        group = _weight_group(self.transfer)
        if group is None or group.size == 1:
            if error is not None:
                raise error
            return
        flats = [part.detach().reshape(-1).view(torch.uint8) for part in parts]
        try:
            if error is None:
                n = min(_EDIT_CHUNK, max((f.numel() for f in flats), default=0))
                most = torch.empty(n, dtype=torch.uint8, device=self.device)
                least = torch.empty(n, dtype=torch.uint8, device=self.device)
                differs = torch.zeros((), dtype=torch.bool, device=self.device)
        except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised (agree_step)
            error = exc
        agree_step(group, self.device, error, f"{self.component.name}: editing block {self.layouts[i].name}")
        for flat in flats:
            for start in range(0, flat.numel(), _EDIT_CHUNK):
                own = flat[start: start + _EDIT_CHUNK]
                high, low = most[: own.numel()], least[: own.numel()]
                high.copy_(own)
                low.copy_(own)
                dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group.group)
                dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group.group)
                differs |= (high != own).any() | (low != own).any()
        if bool(differs):  # an edit, not the per-block path
            raise RuntimeError(
                f"{self.component.name}: the ranks of the weight group edited block {self.layouts[i].name} "
                "differently (fused different LoRA adapters, or with different scales); under allgather each "
                "rank holds a shard of the block, so every rank must make the same edit. The edit was not "
                "kept (the block's shards are as they were), but the adapter library may count it as done "
                "(peft marks the layers merged): reload the adapters, or the model, the same on every rank.")

    def _write_back_resident(self, i: int) -> None:
        """Resident block ``i``'s device bytes into its host copy (a plan that is not final may
        stream it again); its tensors' version counters now match the host copy."""
        nbytes = self.layouts[i].nbytes
        padded = torch.zeros(self.transfer.device_nbytes(i), dtype=torch.uint8, device=self.device)
        padded[:nbytes].copy_(self._device_blocks[i][:nbytes])
        self._moved(i, self.transfer.write_back(i, padded))
        self._note_device_versions(i)

    # Blocks kept on the device (resident, or the kept part of a partly kept block) while their
    # host copy stays (a plan that is not final): a write to their tensors lands on the device
    # only, so a later plan that streams them again first writes it back. The version counters
    # of their device tensors when the device and host last agreed; a block without an entry
    # (inference tensors keep no counters; peft's hotswap writes without one: forget_slots) is
    # written back whatever it holds.
    def _device_tensor_versions(self, i: int) -> tuple[int, ...]:
        entries = self.layouts[i].entries[: self._kept[i]] if i in self._kept else self.layouts[i].entries
        return tuple(e.tensor._version for e in entries)

    def _note_device_versions(self, i: int) -> None:
        if not self._inference:
            self._device_versions[i] = self._device_tensor_versions(i)
        else:
            self._device_versions.pop(i, None)

    def _written_on_device(self, i: int) -> bool:
        if not self.transfer.has_host_copy(i):
            return False
        seen = self._device_versions.get(i)
        return seen is None or seen != self._device_tensor_versions(i)

    def _moved(self, i: int, host: torch.Tensor | None) -> None:
        """The transfer gave block ``i`` a new host copy (``write_back``): park it there."""
        if host is None or self._parked[i] is None or self.layouts[i].image is not None:
            return  # unmoved, or parked on placeholders (a host copy the tensors cannot view)
        self._parked[i] = tuple(e.view_in(host) for e in self.layouts[i].entries)
        self._parked_moving[i] = self._parked[i][self._kept.get(i, 0):]
        self._parked_ptrs[i] = tuple(v.data_ptr() for v in self._parked_moving[i])

    @property
    def parks_placeholders(self) -> bool:
        """Whether streamed blocks' tensors hold placeholders between uses (shape and dtype, no
        values: under a gather, or where the host copy is an 8-bit image) rather than views of
        a host copy: ``state_dict()`` then reads NaN for them (see ``tenants.SAVING_METHODS``)."""
        return self.transfer.gather is not None or self._images or any(l.image is not None for l in self.layouts)

    @property
    def held(self) -> frozenset[int]:
        """Blocks a ring of 8-bit images keeps on the device as images, upcast into a slot when
        they run (its plan's resident blocks); empty for other rings."""
        return frozenset(getattr(self.transfer, "held", ()))

    def on_device(self) -> frozenset[int]:
        """The blocks the residency plan keeps on the device: resident, or held as images."""
        return self.resident | self.held

    def resident_nbytes(self, i: int) -> int:
        """Device bytes block ``i`` takes when the plan keeps it: its 8-bit image on a ring of
        images, else the block."""
        layout = self.layouts[i]
        return self.transfer.inner.device_nbytes(i) if self._images else layout.nbytes

    def kept_bytes(self, i: int) -> int:
        """Bytes of block ``i``'s leading part kept on the device (0: none)."""
        k = self._kept.get(i, 0)
        return self.layouts[i].entries[k].offset if k else 0

    def kept_blocks(self) -> list[int]:
        """Streamed blocks that keep a leading part on the device."""
        return sorted(self._kept)

    def kept_tensor_bytes(self) -> int:
        """Bytes of the tensors that streamed blocks keep on the device."""
        return sum(e.nbytes for i, k in self._kept.items() for e in self.layouts[i].entries[:k])

    def _kept_views(self, i: int) -> list[torch.Tensor]:
        k = self._kept.get(i, 0)
        return [e.view_in(self._kept_bufs[i]) for e in self.layouts[i].entries[:k]] if k else []

    def cuts(self) -> tuple[tuple[int, ...], ...] | None:
        """Per block, where it can split into a kept part and a streamed one (the offsets of its
        second to last tensors), for the planner; None on a ring of 8-bit images (an upcast from
        the stored image moves whole blocks). Under a gather the shards of what streams are
        padded per chunk: only the cuts whose streamed part gathers into no more than the
        block's slot bytes less the kept bytes, which is what the planner counts."""
        if self._images:
            return None
        offsets = [tuple(e.offset for e in l.entries[1:] if e.offset > 0) for l in self.layouts]
        transfer = self.transfer
        if transfer.gather is None:
            return tuple(offsets)
        return tuple(tuple(c for c in cs if transfer.part_nbytes(i, l.nbytes - c) <= transfer.device_nbytes(i) - c)
                     for i, (l, cs) in enumerate(zip(self.layouts, offsets)))

    # -- the residency plan: between forwards ------------------------------------------------
    def measured_costs(self, report: Mapping) -> RingCosts | None:
        """Per-block costs from a traced forward's report (``RingTracer.report``): compute as
        measured; copy time as measured for the blocks that streamed, and for the others at the
        rate the streamed ones moved. None when the forward did not run every block or nothing
        was copied."""
        rows = {r["index"]: r for r in report["blocks"]}
        if len(rows) != len(self.layouts) or report.get("pre_ms") is None:
            return None
        sizes = [self.transfer.device_nbytes(i) for i in range(len(self.layouts))]
        # What a whole fill moves over the link: the block, or on a ring of 8-bit images its
        # image (its slot holds the block upcast); and what the measured fill moved (a kept part
        # does not move).
        whole = [l.image_nbytes for l in self.layouts] if self._images else sizes
        moved = [whole[i] - self._base[i] for i in range(len(self.layouts))]
        # A held block's fill is an upcast on the device, not a copy: it says nothing of the link.
        held = self.held
        timed = [(moved[i], r["transfer_ms"]) for i, r in rows.items() if r["transfer_ms"] and i not in held]
        if not timed:
            return None
        ms_per_byte = sum(ms for _, ms in timed) / sum(b for b, _ in timed)
        copy = tuple(rows[i]["transfer_ms"] * whole[i] / moved[i] if rows[i]["transfer_ms"] and i not in held
                     else whole[i] * ms_per_byte for i in range(len(self.layouts)))
        issued = tuple(rows[i]["issued_ms"] for i in range(len(self.layouts)))
        # A ring of 8-bit images pays for its staging buffers too, as its first plan counted them.
        images = [self.transfer.inner.device_nbytes(i) for i in range(len(self.layouts))] if self._images else []
        slot_bytes = image_slot_bytes(sizes, images) if self._images else tuple(sizes)
        return RingCosts(tuple(self.resident_nbytes(i) for i in range(len(self.layouts))), slot_bytes,
                         tuple(rows[i]["compute_ms"] for i in range(len(self.layouts))), copy,
                         pre_ms=report["pre_ms"], post_ms=report["post_ms"], gap_ms=report.get("gap_ms") or 0.0,
                         issued_ms=issued if None not in issued else None, cuts=self.cuts(),
                         run_slot_bytes=max(sizes) if self._images else 0)

    def apply_plan(self, resident: Iterable[int], num_slots: int, settle: bool,
                   kept: Mapping[int, int] | None = None) -> None:
        """Make exactly ``resident`` the resident blocks and stream the rest through
        ``num_slots`` slots. Blocks that become resident are brought in through the current
        slot 0 (collective under allgather: every rank applies the same plan at the same point);
        ``settle``: resident blocks give up their host copies. ``kept``: streamed blocks that keep
        their leading bytes on the device (block -> bytes, one of :meth:`cuts`). With ``settle``
        the kept bytes leave the host (``keep_part``: a rank-local host copy keeps only the rest;
        under a gather each rank's shard is cut again from what streams), so the plan is final:
        the ring takes no other plan after it. Under a gather that is the only way (it needs
        ``settle``); a rank-local ring that does not settle keeps whole host copies, and a shared
        one always does (the host's other ranks may stream the whole block). Between forwards;
        synchronises.

        Runs in the post-hook of a forward, often under ``torch.inference_mode()``: the buffers
        it makes are made in the mode setup ran in (ordinary tensors when ``apply_offload`` ran
        outside it, so ``remove()`` can write them later). A failure part way leaves a ring
        that is consistent for the blocks it had moved by then, streaming through the slots it
        was given, or two where those could not be had (see :meth:`_configure_new_slots`).
        Under a gather, whose plan gathers are collectives paired by order only, what could fail
        on one rank comes before the first and the ranks agree on it
        (:meth:`_agreed_plan_buffers`): where one failed, every rank raises, the ring as it was;
        a failure after that leaves this rank's gathers short of its peers', and the ring refuses
        from then on (:meth:`_lose_step`)."""
        resident = frozenset(resident)
        bad = [i for i in resident if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.layouts)]
        if bad:  # bad input changes nothing
            raise ValueError(f"{self.component.name}: no block {bad[0]!r} to keep on the device (its blocks "
                             f"are 0 to {len(self.layouts) - 1})")
        if self._images:
            return self._apply_held_plan(resident, num_slots, settle, kept)
        if len(resident) < len(self.layouts) and num_slots < NUM_SLOTS:
            raise ValueError(f"{self.component.name}: a ring that streams needs at least {NUM_SLOTS} slots, "
                             f"found {num_slots}")
        kept = dict(kept or {})
        gather = self.transfer.gather is not None
        # A final plan that was cut short (the device or host out of memory part way through its
        # kept blocks) may be applied again as it was: the blocks it had kept by then stay as they
        # are. Any other plan would need bytes their host copies gave up.
        final = {i: self.kept_bytes(i) for i in self._kept_off_host}
        if final and (not settle or any(kept.get(i) != nbytes for i, nbytes in final.items())):  # bad input changes nothing
            raise ValueError(f"{self.component.name}: blocks {sorted(self._kept_off_host)} keep parts on the "
                             "device for good (their host copies gave them up: a settled plan with partly "
                             "kept blocks is final); no other plan can follow it")
        if gather and kept and not settle:
            raise ValueError(f"{self.component.name}: an allgather ring keeps parts of blocks on the device only "
                             "in a final plan (settle=True): their kept bytes leave the host")
        cuts = self.cuts()
        for i, nbytes in kept.items():
            if cuts is None or not 0 <= i < len(cuts) or i in set(resident) or nbytes not in cuts[i]:
                raise ValueError(f"{self.component.name}: block {i} cannot keep {nbytes} bytes on the device "
                                 f"(a streamed block keeps a leading part that ends where one of its tensors "
                                 f"starts; under allgather, one of the ring's cuts())")
        with torch.inference_mode(self._inference), torch.no_grad():
            if gather:  # every rank has what the plan needs, or every rank raises here: nothing changed
                buffers, scratch = self._agreed_plan_buffers(resident, kept)
            else:
                self._adopt_given_storage()
                buffers, scratch = None, None
            try:
                if not gather:
                    # The old slots go first: blocks come in through a buffer of one block each,
                    # so the change holds the new plan plus one block at most, within the budget's
                    # reach (a gather fills only its slots, which it keeps until the new come).
                    if self._cuda:
                        torch.cuda.synchronize(self.device)
                    self.slots, self._slot_views, self._fill_views = [], [], []
                    self.transfer.allocate_slots(0, 0)
                self._apply_plan(resident, kept, settle, buffers, scratch)
            except BaseException as exc:
                self._lose_step(exc, "applying its residency plan")
                raise
            finally:
                self.slots, self._slot_views, self._fill_views = [], [], []  # the old go before the new come
                if self._broken is None:  # a broken ring makes no more collectives (the copy-engine's slots)
                    try:
                        self._configure_new_slots(num_slots)
                    except BaseException as exc:
                        self._lose_step(exc, "allocating the slots of its new residency plan")
                        raise
                if self.tracer is not None:  # parts now kept move no more
                    self.tracer.nbytes = self._fill_bytes()
        if settle:
            for i in self.resident:
                if self.transfer.has_host_copy(i):
                    self.transfer.drop(i)
                # Every view of the dropped copy goes, or it would keep the host buffer alive
                # (_configure made _parked_moving from _parked above).
                self._parked[i] = self._parked_moving[i] = self._parked_ptrs[i] = None
        self._warm = False

    def _apply_held_plan(self, resident: frozenset[int], num_slots: int, settle: bool,
                         kept: Mapping[int, int] | None) -> None:
        """:meth:`apply_plan` on a ring of 8-bit images: every block goes through the slots; the
        plan's resident blocks keep their images on the device (no link to cross), the others
        stream theirs. ``settle``: held blocks give up their host copies."""
        if kept:
            raise ValueError(f"{self.component.name}: a ring of 8-bit images moves whole blocks; no block "
                             "can keep a part on the device")
        with torch.inference_mode(self._inference), torch.no_grad():
            if self._cuda:
                torch.cuda.synchronize(self.device)
            self.slots, self._slot_views, self._fill_views = [], [], []  # the old go before the new come
            self.transfer.drop_slots()
            try:
                # Held first: the staging buffers are then sized to the images that still stream.
                # Under a gather, hold() agrees with the other ranks before its first gather.
                self.transfer.hold(resident)
            except BaseException as exc:
                self._lose_step(exc, "holding the 8-bit images of its residency plan")
                if self._broken is None:  # a broken ring makes no more collectives (the copy-engine's slots)
                    self._configure_new_slots(NUM_SLOTS)  # the ring streams on as it was
                raise
            try:
                self._configure_new_slots(max(num_slots, NUM_SLOTS))  # held blocks run from a slot too
            except BaseException as exc:
                self._lose_step(exc, "allocating the slots of its new residency plan")
                raise
        if settle:
            for i in resident:
                if self.transfer.has_host_copy(i):
                    self.transfer.drop(i)
        self._warm = False

    def _configure_new_slots(self, num_slots: int) -> None:
        """:meth:`_configure` after a plan change, whose old slots went first. Where the new ones
        cannot be had (the device out of memory), the fewest that stream are tried, so that the
        ring runs on; the error still goes to the caller. Where not even those can be had, the
        ring has no slots: a streamed block's forward then raises saying so (``_fetch_missing``),
        and ``remove()`` tries once more (``restored_streamed``)."""
        self._warm = False  # the slots are new and empty: the first block is fetched, not missed
        try:
            self._configure(num_slots)
        except BaseException:
            if num_slots > NUM_SLOTS:
                with contextlib.suppress(Exception):
                    self._configure(NUM_SLOTS)
            raise

    def _apply_plan(self, new: frozenset[int], kept: dict[int, int], settle: bool,
                    buffers: Mapping[int, torch.Tensor] | None = None, scratch: torch.Tensor | None = None) -> None:
        """``buffers``, ``scratch``: a gathering ring's device buffers, allocated and agreed before
        the first gather (:meth:`_agreed_plan_buffers`, which also wrote back the demoted blocks);
        None: allocated here, block by block."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        same = self._kept_as_they_are(kept, settle)
        kept = {i: nbytes for i, nbytes in kept.items() if i not in same}
        for i in sorted(set(self._kept) - same):  # partly kept blocks stream whole again first
            if self._written_on_device(i):  # the host copy takes what was written to the kept part
                self._moved(i, self.transfer.write_back(i, self._kept_bufs[i], start=0))
            bind(self.layouts[i].entries, self._parked[i])
            del self._kept[i], self._kept_bufs[i]
            self._device_versions.pop(i, None)
        for i in sorted(self.resident - new):
            if self._parked[i] is None:
                raise RuntimeError(f"{self.component.name}: block {self.layouts[i].name} has no host copy "
                                   "to stream from; it was made resident for good")
            if buffers is None and self._written_on_device(i):  # (a gathering ring's: written back already)
                self._write_back_resident(i)
            bind(self.layouts[i].entries, self._parked[i])
            del self._device_blocks[i]
            self._device_versions.pop(i, None)
            self.resident = self.resident - {i}
        promote = sorted(new - self.resident)
        self._slot_block = [_EMPTY] * self.num_slots
        for i in promote:
            layout = self.layouts[i]
            if buffers is None:  # straight into its own buffer: the change holds no block twice
                buf = self._filled_on_device(i, layout.nbytes)
            else:
                buf = buffers[i].copy_(self._whole_on_device(i, scratch)[: layout.nbytes])
            bind(layout.entries, [e.view_in(buf) for e in layout.entries])
            self._device_blocks[i] = buf
            self._note_device_versions(i)
            self.resident = self.resident | {i}
        for i, nbytes in sorted(kept.items()):
            layout = self.layouts[i]
            k = next(j for j, e in enumerate(layout.entries) if j and e.offset == nbytes)
            if buffers is None:  # the kept part only: its host copy holds the rest
                buf = self._filled_on_device(i, nbytes)
            else:
                whole = self._whole_on_device(i, scratch)
                buf = buffers[i].copy_(whole[:nbytes])
            kept_views = [e.view_in(buf) for e in layout.entries[:k]]
            if self.transfer.gather is not None:  # the shards are cut again from what streams
                self.transfer.keep_part(i, nbytes, whole[nbytes : layout.nbytes])
                self._kept_off_host.add(i)
            elif settle and (host := self.transfer.keep_part(i, nbytes)) is not None:
                # The host copy now starts at the cut: park the streamed tensors in it (now, so
                # that nothing holds the old copy's memory).
                self._parked[i] = (*kept_views, *(e.view_in(host, nbytes) for e in layout.entries[k:]))
                bind(layout.entries[k:], self._parked[i][k:])
                self._kept_off_host.add(i)
            bind(layout.entries[:k], kept_views)
            self._kept[i], self._kept_bufs[i] = k, buf
            self._note_device_versions(i)

    def _agreed_plan_buffers(self, new: frozenset[int], kept: Mapping[int, int]
                             ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """A gathering ring's plan change up to its first gather, agreed with the other ranks of
        the weight group (``groups.agree_step``). Every fill is a collective, paired by order
        only: a rank that failed part way through the plan's gathers (the device out of memory
        for a promoted block's buffer) would leave the rest unmade, and its next forward's fills
        would pair with them. So what could fail on one rank comes first: the tensors given new
        storage taken in, the demoted blocks' writes written back to their shards, and every
        device buffer the plan's gathers fill allocated (the promoted blocks', the kept parts',
        and where slot 0 is too small for a gathered block, a scratch buffer; the copy-engine
        gather fills only its own slots, which it allocates after agreeing itself). Where any
        rank failed, every rank raises (:data:`IN_STEP`), the ring as it was, streaming.
        Returns the buffers by block, and the scratch buffer or None."""
        error: BaseException | None = None
        buffers: dict[int, torch.Tensor] = {}
        scratch = None
        try:
            self._adopt_given_storage()
            for i in sorted(self.resident - new):  # demoted: their shards take what was written on the device
                if self._parked[i] is None:
                    raise RuntimeError(f"{self.component.name}: block {self.layouts[i].name} has no host copy "
                                       "to stream from; it was made resident for good")
                if self._written_on_device(i):
                    self._write_back_resident(i)
            promote = sorted(new - self.resident)
            same = self._kept_as_they_are(kept, True)  # a gather keeps parts in final plans only
            kept = {i: nbytes for i, nbytes in kept.items() if i not in same}
            for i in promote:
                buffers[i] = torch.empty(self.layouts[i].nbytes, dtype=torch.uint8, device=self.device)
            for i, nbytes in sorted(kept.items()):
                buffers[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            need = max((self.transfer.device_nbytes(i) for i in (*promote, *kept)), default=0)
            if (need and not (self.slots and self.slots[0].numel() >= need)
                    and self.transfer.gather != "copy-engine"):
                scratch = torch.empty(need, dtype=torch.uint8, device=self.device)
        except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised (agree_step)
            error = exc
        if error is not None:
            buffers, scratch = {}, None  # freed before the agreement: nothing of the plan stays
        try:
            agree_step(_weight_group(self.transfer), self.device, error,
                       f"{self.component.name}: preparing its residency plan")
        except BaseException as exc:  # the agreement itself failed (a peer gone): no collective pairs now
            self._lose_step(exc, "agreeing on its residency plan")
            raise
        return buffers, scratch

    def _kept_as_they_are(self, kept: Mapping[int, int], settle: bool) -> set[int]:
        """Blocks a plan keeps partly on the device as they are kept now (the same bytes, and
        their host copies settled already where the plan settles): a plan change leaves them
        alone."""
        return {i for i, nbytes in kept.items() if i in self._kept and self.kept_bytes(i) == nbytes
                and (i in self._kept_off_host or not settle)}

    def _lose_step(self, exc: BaseException, what: str) -> None:
        """A lockstep ring's plan change failed on this rank part way through its collectives (a
        gather or the agreement failed, or something this rank did between the gathers, after
        the ranks had agreed): its gathers no longer pair with the other ranks', which went on
        with theirs, so the ring refuses to move blocks from then on, with the reason (the rank
        makes no collective after this: the others time out rather than pair theirs with the
        wrong ones). Not where every rank raised at the same point (:data:`IN_STEP`): those are
        in step still."""
        if self._lockstep and self._broken is None and not getattr(exc, IN_STEP, False):
            self._broken = (f"{self.component.name}: {what} failed on this rank part way through the collectives "
                            f"its weight group makes for it ({type(exc).__name__}: {exc}), so the weight group can "
                            "no longer move blocks in lockstep; end the job on every rank and start it again.")

    def _adopt_given_storage(self) -> None:
        """Before a plan change (which rebinds every block's tensors): tensors given new storage
        since the ring last pointed them (``tensor.data = ...``, peft's same-shape hotswap of an
        adapter that streams with its block) are taken in where they live now, as an in-place
        write would be: a streamed tensor's values into its host copy (:meth:`_take_new_storage`,
        which refuses what the host copy cannot take), a tensor kept on the device (a resident
        block, or a kept part) into its device buffer, whose changed versions make a block that
        streams again write it back to its host copy first. Another dtype or shape on the
        device is refused, naming it, before anything changes."""
        on_device = []
        for i, layout in enumerate(self.layouts):
            if i in self.resident:
                buf, entries = self._device_blocks[i], layout.entries
            elif i in self._kept:
                buf, entries = self._kept_bufs[i], layout.entries[: self._kept[i]]
            else:
                continue
            for e in entries:
                view, new = e.view_in(buf), e.tensor.data
                if new.data_ptr() == view.data_ptr():
                    continue
                if new.dtype != view.dtype or new.shape != view.shape:
                    raise RuntimeError(
                        f"{self.component.name}: {e.name} became {new.dtype} {tuple(new.shape)} after apply_offload "
                        f"(the ring keeps it on the device as {view.dtype} {tuple(view.shape)}), and its residency "
                        "plan changes now, which moves it: cast or resize the model before apply_offload, or call "
                        "remove() first and apply again.")
                on_device.append((i, e, view, new))
        for i, e, view, new in on_device:
            view.copy_(new)
            bind([e], [view])
            self._device_versions.pop(i, None)  # written on the device: a block that streams writes it back
        for i in self.streamed:
            if self._parked_ptrs[i] is not None and any(
                    t.data_ptr() != ptr for t, ptr in zip(self._moving_tensors[i], self._parked_ptrs[i])):
                self._take_new_storage(i)

    def _filled_on_device(self, i: int, nbytes: int) -> torch.Tensor:
        """A new device buffer holding block ``i``'s first ``nbytes`` from its host copy,
        synchronised: a rank-local ring's promoted block or kept part, copied straight to where it
        stays (no block passes through a staging buffer, so a plan change never holds more than
        its new plan). Plan changes only."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        # fill() records its ready event; this one-off is synchronised at once (plan time, never per block).
        self.transfer.fill(i, buf, None, torch.cuda.Event() if self._cuda else None)
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return buf

    def _whole_on_device(self, i: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Block ``i`` filled whole into slot 0 (or, where slot 0 is smaller than the block:
        ``scratch``, else on a rank-local ring a buffer of its own, under the copy-engine gather a
        new slot 0 of its size), synchronised. Plan changes only."""
        need = self.transfer.device_nbytes(i)
        if self.slots and self.slots[0].numel() >= need:
            dst = self.slots[0][:need]
        elif scratch is not None and scratch.numel() >= need:
            dst = scratch[:need]
        elif self.transfer.gather is None:
            dst = torch.empty(need, dtype=torch.uint8, device=self.device)
        else:
            # A gather fills only its own slots (the copy-engine gather's are mapped into every
            # rank of the group): one of this block's size in place of the old plan's, until the
            # new plan's come. Every rank applies the same plan in the same order, so every rank
            # allocates alike.
            self.slots, self._slot_views, self._fill_views = [], [], []
            self.transfer.allocate_slots(need, 1)
            self.slots = list(self.transfer.slots)
            dst = self.slots[0][:need]
        # fill() records its ready event; this one-off is synchronised at once (plan time, never per block).
        self.transfer.fill(i, dst, None, torch.cuda.Event() if self._cuda else None)
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return dst

    # -- teardown ------------------------------------------------------------------------
    def restore(self, device: torch.device | None) -> None:
        """Give every block tensor ordinary storage again, on ``device`` (None: where it was
        before offloading), bitwise equal to the streamed bytes. Streamed blocks go through slot
        0, so it is collective under allgather: every rank of the weight group calls it."""
        self.bind_restored(self.restored_streamed(device), device)

    def restored_streamed(self, device: torch.device | None, keep: bool = True) -> dict[int, list[torch.Tensor]]:
        """The first half of :meth:`restore`: the streamed blocks' tensors in storage of their own
        (collective under allgather), bound to nothing yet, so that a failure (a peer gone) leaves
        the ring as it was, streaming.

        Lockstep: every rank of the weight group must make the same gathers, so a failure of this
        rank's own (the device out of memory for a restored tensor) does not end the loop: the
        remaining fills are made, their results dropped, and the first such error raised at the
        end (``remove()`` then tells the other ranks, and none binds). ``keep`` False: the fills
        only, nothing restored (``remove()``, after an earlier ring's failure). A failed fill (a
        collective) cannot be made up for: the ring is broken from then on, and it raises at once."""
        slot, out, error = 0, {}, None
        try:
            if self.streamed and not self.slots:  # a plan change could not allocate them: once more
                self._configure(NUM_SLOTS)
            self._disrupted = True  # slot 0 is reused: a forward after a failed remove() fetches its first block
            for i in self.streamed:
                given = {}
                if keep and error is None:
                    try:
                        given = self._given_storage(i)
                    except Exception as exc:  # noqa: BLE001 - lockstep: the fills go on (see above)
                        if not self._lockstep:
                            raise
                        error = exc
                self._slot_block[slot] = _EMPTY
                with torch.inference_mode(self._inference or torch.is_inference_mode_enabled()):
                    self.transfer.fill(i, self._fill_views[slot][i], self._free[slot], self._ready[slot],
                                       start=self._base[i])
                if self._cuda:
                    self._ready[slot].synchronize()  # teardown, not the per-block path
                if keep and error is None:
                    try:
                        layout = self.layouts[i]
                        views = [*self._kept_views(i), *self._slot_views[slot][i]]
                        out[i] = [restored(e, v, device) if id(e) not in given
                                  else given[id(e)].to(device if device is not None else e.origin)
                                  for e, v in zip(layout.entries, views)]
                    except Exception as exc:  # noqa: BLE001 - lockstep: the fills go on (see above)
                        if not self._lockstep:
                            raise
                        error, out = exc, {}  # what was restored goes: nothing is bound
                if self._cuda:  # the next fill of slot 0 must wait for these copies
                    self._free[slot].record(torch.cuda.current_stream(self.device))
        except BaseException as exc:
            # A fill failed, or this rank stopped making them (an interrupt): the other ranks'
            # gathers no longer pair with this rank's.
            self._lose_step(exc, "restoring its blocks (remove())")
            raise
        if error is not None:
            raise error
        return out

    def bind_restored(self, streamed: dict[int, list[torch.Tensor]], device: torch.device | None) -> None:
        """The second half of :meth:`restore`: bind what :meth:`restored_streamed` made, and
        give the blocks kept on the device storage of their own, one block at a time (no
        collective; each device buffer goes as its block is done, so that a call that failed part
        way can be made again and goes on from the first block not done)."""
        for layout in self.layouts:
            i = layout.index
            if i in streamed:
                bind(layout.entries, streamed[i])
                continue
            if i not in self._device_blocks:  # given storage of its own by an earlier call
                continue
            given = self._given_storage(i)
            views = [e.view_in(self._device_blocks[i]) for e in layout.entries]
            bind(layout.entries, [restored(e, v, device) if id(e) not in given
                                  else given[id(e)].to(device if device is not None else e.origin)
                                  for e, v in zip(layout.entries, views)])
            self._device_blocks.pop(i, None)
        self._device_blocks = {}
        self.resident = frozenset()
        self._kept, self._kept_bufs, self._kept_off_host = {}, {}, set()

    def finish_interrupted(self) -> None:
        """Lockstep, between forwards: make the fills of a forward a ``KeyboardInterrupt`` cut
        short (the next forward would make them first; ``remove()`` calls this before it agrees)."""
        if self._in_forward and self._broken is None:
            self._release_interrupted()
            if self._reached < len(self.streamed):
                self._complete_forward()
            self._in_forward = False

    def _given_storage(self, i: int) -> dict[int, torch.Tensor]:
        """``id(entry)`` -> the storage a caller gave block ``i``'s tensor since the ring last
        pointed it somewhere (``tensor.data = ...``, ``model.to(...)`` after the last forward):
        :meth:`restore` keeps it, as the model would without offloading."""
        if i == self._current:  # left in a slot by an interrupted forward: the ring's own binding
            return {}
        if i in self.resident:
            buf = self._device_blocks[i]
            entries, ptrs = self.layouts[i].entries, [e.view_in(buf).data_ptr() for e in self.layouts[i].entries]
        elif self._parked_ptrs[i] is not None:
            entries, ptrs = self._moving[i], self._parked_ptrs[i]
            if i in self._kept:  # and the part kept on the device
                kept = self.layouts[i].entries[: self._kept[i]]
                entries, ptrs = [*kept, *entries], [*(v.data_ptr() for v in self._kept_views(i)), *ptrs]
        else:
            return {}
        return {id(e): e.tensor.data for e, ptr in zip(entries, ptrs) if e.tensor.data_ptr() != ptr}

    def release(self) -> None:
        """Free the slots, device buffers and host buffers. The caller has synchronised the device."""
        if self._on_drop is not None:  # released now: nothing left for a drop to free
            self._on_drop.detach()
            self._on_drop = None
        self.remove_hooks()
        self._unguard_backward(pop=False)  # a forward interrupted with autograd on
        self._on_forward = None
        self.slots = []
        self._slot_views = []
        self._fill_views = []
        self._parked = []
        self._device_blocks = {}
        self._kept, self._kept_bufs, self._kept_off_host = {}, {}, set()
        self.transfer.release()
