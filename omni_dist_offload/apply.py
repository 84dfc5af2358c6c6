"""``apply_offload``: put a pipeline's blocks in host memory and stream them; the handle undoes it.

Setup runs in two phases ([Note: setup phases] in ``docs/design.md``). The first reads only:
config, discovery, layouts, ownership checks, and (allgather) the weight group every rank agrees
on. The second changes the target: each component's blocks move into host buffers (or this
rank's shards) one block at a time, its ring and slots are built, everything else moves to the
device and the hooks go in. If anything in the second phase fails, what was done is undone and
the target is as it was; under allgather the ranks agree at the end, all or nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from .config import OffloadConfig, OffloadConfigError
from .hostmem import HostBuffer, HostPinner
from .layout import (
    BlockLayout,
    BlockSource,
    TensorEntry,
    bind,
    check_ownership,
    layout_block,
    restore_blocks,
)
from .plan import (
    OffloadPlan,
    StreamedComponent,
    discover,
    is_bare_module,
    pipeline_modules,
)
from .residency import (
    ResidencyPlan,
    RingCosts,
    format_bytes,
    min_budget,
    plan_fewest,
    plan_residency,
    prior_costs,
)
from .ring import NUM_SLOTS, BlockRing
from .trace import trace_enabled
from .transfer import RankLocalTransfer, TransferStreams, gather_transfer
from .transfer.groups import ComponentFacts, GroupSession, WeightGroup
from .transfer.sharding import (
    ShardPlan,
    layout_digest,
    plan_shards,
    sample_digest,
    shard_pieces,
    write_shard,
)

__all__ = ["OffloadHandle", "RingSummary", "apply_offload", "resolve_device"]

logger = logging.getLogger(__name__)

#: Attribute set on every module of an offloaded target, pointing at its handle.
_STATE_ATTR = "_omni_offload_handle"


@dataclasses.dataclass(frozen=True, slots=True)
class RingSummary:
    """What one streamed ring is. ``OffloadHandle.summary()`` gives these as dicts, with the
    same keys in the same order (the documented summary keys)."""

    component: str
    category: str
    module_class: str
    num_blocks: int
    weight_transfer: str
    """What runs after any fallback: ``rank-local`` or ``allgather``."""
    gather: str | None
    """What rebuilds allgather blocks: ``copy-engine``, ``nccl`` or ``gloo``; None for rank-local."""
    fallback_reason: str | None
    block_bytes: int
    """Bytes of the blocks' tensors (without alignment padding)."""
    host_bytes: int
    """Host bytes this rank holds for the ring (whole blocks, or its shards)."""
    device_slot_bytes: int
    setup_s: float | None
    """Seconds spent filling and page-locking the ring's host copy."""
    resident_blocks: list[int]
    """Blocks kept on the device instead of streaming (indices in ring order)."""
    resident_bytes: int
    """Bytes of those blocks' tensors."""
    predicted_ratio: float | None
    """The residency plan's predicted forward / the resident forward; None before a forward
    was measured (and for rings without a device budget)."""
    device_budget: int | None
    """Device bytes this ring's resident blocks and slots may take (its share of
    ``device_budget``, after ``"auto"`` is resolved); None without a budget."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class OffloadHandle:
    """What :func:`apply_offload` did, and how to undo it."""

    def __init__(self, target: Any, modules: Mapping[str, nn.Module], device: torch.device,
                 config: OffloadConfig, groups: GroupSession) -> None:
        self.target = target
        self.device = device
        self.config = config
        self.rings: list[BlockRing] = []
        self._modules = dict(modules)
        # The process groups setup created; released with the handle.
        self._groups = groups
        # allgather rings keep their blocks' original storage until setup has succeeded, so a
        # failure can be undone without asking the other ranks for their shards.
        self._originals: dict[int, list[list[torch.Tensor]]] = {}
        self._undo_moves: list[Callable[[], None]] = []
        self._removed = False

    def summary_rows(self) -> list[RingSummary]:
        """One typed row per streamed ring."""
        return [RingSummary(
            component=ring.component.name,
            category=ring.component.category,
            module_class=type(ring.component.module).__name__,
            num_blocks=len(ring.streamed),
            weight_transfer=ring.transfer.name,
            gather=ring.transfer.gather,
            fallback_reason=ring.transfer.fallback_reason,
            block_bytes=sum(ring.layouts[i].tensor_bytes for i in ring.streamed),
            host_bytes=ring.transfer.host_bytes(),
            device_slot_bytes=sum(s.numel() for s in ring.slots),
            setup_s=ring.setup_s,
            resident_blocks=sorted(ring.resident),
            resident_bytes=sum(ring.layouts[i].tensor_bytes for i in ring.resident),
            predicted_ratio=ring.plan.predicted_ratio if ring.plan is not None else None,
            device_budget=ring.budget,
        ) for ring in self.rings]

    def summary(self) -> list[dict[str, Any]]:
        """One dict per streamed ring (see the README for the keys)."""
        return [row.as_dict() for row in self.summary_rows()]

    def trace_report(self) -> list[dict[str, Any]]:
        """Per ring, the most recent forward block by block: compute, transfer, exposed wait
        and bandwidth, in ms from the forward's start (see ``trace.py``). Needs tracing on
        (``apply_offload(trace=True)`` or ``OMNI_OFFLOAD_TRACE=1``); synchronises the device."""
        rows = []
        for ring in self.rings:
            if ring.tracer is None:
                raise RuntimeError(
                    f"{ring.component.name}: tracing is off; apply with trace=True or set "
                    "OMNI_OFFLOAD_TRACE=1 to record per-block timings."
                )
            rows.append({"component": ring.component.name, **ring.tracer.report()})
        return rows

    def remove(self) -> None:
        """Restore every streamed tensor as an ordinary tensor on the device, bitwise equal,
        remove the hooks, free the slots and pinned host memory, and release the process groups
        setup created. Calling it again does nothing.

        With allgather rings this is collective: every rank of the weight group calls it."""
        if self._removed:
            return
        self._synchronize()
        for ring in self.rings:
            ring.remove_hooks()
            ring.restore(self.device)
            ring.release()
        self.rings = []
        self._undo_moves = []
        self._groups.close()
        self._unmark()
        self._removed = True

    # -- setup helpers -----------------------------------------------------------------
    def _add_ring(self, ring: BlockRing, originals: list[list[torch.Tensor]] | None) -> None:
        self.rings.append(ring)
        if originals is not None:
            self._originals[id(ring)] = originals

    def _install(self, trace: bool, specs: Sequence["_RingSpec"]) -> None:
        for ring, spec in zip(self.rings, specs, strict=True):
            if trace or not spec.settled:
                ring.enable_trace()
            if not spec.settled:  # measure a forward, then plan for good
                ring.watch_forwards(_Replanner(spec, self.device, keep_trace=trace))
            if ring.streamed or not spec.settled or trace:
                # A ring whose blocks all stay resident for good needs no hooks: the model runs
                # as it would without offloading (where the host is the bottleneck, hooks cost).
                ring.install_hooks()
        for mod in self._modules.values():
            setattr(mod, _STATE_ATTR, self)

    def _commit(self) -> None:
        """Setup succeeded everywhere: drop the original storage of allgather blocks."""
        self._originals = {}
        self._groups.close_exchange()

    def _rollback(self) -> None:
        """Undo a partial setup: blocks and resident tensors go back where they were."""
        self._synchronize()
        for undo in reversed(self._undo_moves):
            undo()
        self._undo_moves = []
        for ring in self.rings:
            ring.remove_hooks()
            originals = self._originals.get(id(ring))
            if originals is None:
                ring.restore(None)
            else:
                for layout, data in zip(ring.layouts, originals):
                    bind(layout.entries, data)
            ring.release()
        self.rings = []
        self._originals = {}
        self._unmark()
        self._removed = True

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _move_resident(self, streamed: set[int]) -> None:
        """Everything that does not stream goes to the device and stays there."""
        for root in self._modules.values():
            for mod in root.modules():
                for registry in (mod._parameters, mod._buffers):
                    for t in registry.values():
                        # A tied tensor moves once: the second time it is already on the device.
                        if t is None or id(t) in streamed or t.device == self.device:
                            continue
                        self._undo_moves.append(functools.partial(_set_data, t, t.data))
                        t.data = t.data.to(self.device)

    def _unmark(self) -> None:
        for mod in self._modules.values():
            if getattr(mod, _STATE_ATTR, None) is self:
                delattr(mod, _STATE_ATTR)


def _set_data(tensor: torch.Tensor, data: torch.Tensor) -> None:
    tensor.data = data


def apply_offload(
    target: Any,
    config: OffloadConfig | Mapping[str, Any] | str,
    *,
    device: torch.device | str | None = None,
    plan: OffloadPlan | None = None,
    process_group: Any | None = None,
    trace: bool | None = None,
    block_sources: Mapping[str, BlockSource] | None = None,
    progress: bool = False,
) -> OffloadHandle:
    """Stream the blocks of ``target``'s selected components from host memory.

    ``target`` is a pipeline (any object holding its components as attributes) or a bare
    ``nn.Module`` (streamed as the ``dit`` component). ``device`` defaults to the current CUDA
    device when there is one, else the CPU. ``process_group`` overrides the group that carries
    allgather weight collectives (default: the ranks of this host, in a group of their own).
    ``trace`` records per-block timings (default: the ``OMNI_OFFLOAD_TRACE`` environment
    variable), read with ``handle.trace_report()``. Returns a handle with ``summary()`` and
    ``remove()``.

    ``block_sources`` (component name -> :class:`~omni_dist_offload.layout.BlockSource`)
    fills the host copies of blocks whose tensors are placeholders from a checkpoint; the
    cold-start loader (``omni_dist_offload.loading.coldstart``) passes it. ``progress`` shows a
    bar per streamed component while its blocks are filled and page-locked (front-ends pass it on
    the rank whose output shows).

    With ``weight_transfer: "allgather"`` this is collective: every rank calls it with the same
    model and config.
    """
    # Phase 1 reads only: nothing below changes the target until the handle exists.
    cfg = OffloadConfig.parse(config)
    dev = _checked_device(device)
    modules = _fresh_modules(target)
    components = discover(target, cfg, plan)
    layouts = {c.name: [layout_block(i, n, b) for i, (n, b) in enumerate(c.blocks)] for c in components}
    check_ownership(((c.name, layouts[c.name]) for c in components), modules)
    sources = _checked_sources(block_sources, components)
    _check_process_group(process_group)
    groups = GroupSession(cfg.collective_timeout_s)
    try:
        specs = _ring_specs(components, layouts, cfg, dev, process_group, sources, groups)
        specs = _with_residency(specs, cfg, dev, modules)
    except BaseException:
        groups.close()
        raise

    # Phase 2 changes the target; any failure undoes it.
    handle = OffloadHandle(target, modules, dev, cfg, groups)
    setup = _Setup.start(cfg, dev, any(s.group is not None for s in specs), progress)
    try:
        for spec in specs:
            ring, originals = _build_ring(spec, setup)
            handle._add_ring(ring, originals)
        handle._move_resident({id(e.tensor) for ls in layouts.values() for l in ls for e in l.entries})
        handle._install(trace_enabled(trace), specs)
    except BaseException as exc:
        handle._rollback()
        if groups.active:  # tell the other ranks, which would otherwise wait in their first fill
            with contextlib.suppress(Exception):
                groups.agree(f"{type(exc).__name__}: {exc}")
        groups.close()
        raise
    finally:
        setup.pin.close()
    _agree_all_or_nothing(handle, groups)
    handle._commit()
    _log_summary(handle)
    return handle


# -- phase 1: what streams, and how ---------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class _RingSpec:
    """Everything phase 2 needs to build one component's ring."""

    component: StreamedComponent
    layouts: Sequence[BlockLayout]
    source: BlockSource | None
    group: WeightGroup | None = None
    """Set when the ring streams with allgather over this group."""
    gather: str = "nccl"
    chunk_bytes: int = 0
    fallback_reason: str | None = None
    """Why an allgather ring streams rank-local."""
    resident: tuple[int, ...] = ()
    """Blocks that stay on the device from the start."""
    num_slots: int = NUM_SLOTS
    settled: bool = True
    """The residency is final: resident blocks keep no host copy. Otherwise every block keeps
    one until a measured forward has been planned for (``_Replanner``)."""
    budget: int | None = None
    """The ring's share of ``device_budget``."""
    fewest: bool = False
    """``device_budget: "auto"``: re-plan to the fewest resident blocks within 1% of resident."""
    plan: ResidencyPlan | None = None

    def slot_bytes(self) -> list[int]:
        """Per block, the slot bytes it needs when it streams."""
        if self.group is None:
            return [l.nbytes for l in self.layouts]
        return [s.padded_nbytes for s in self.shard_plans()]

    def shard_plans(self) -> list[ShardPlan]:
        return [plan_shards(l.nbytes, self.group.size, self.group.rank, self.chunk_bytes) for l in self.layouts]


def _checked_device(device: torch.device | str | None) -> torch.device:
    dev = resolve_device(device)
    if dev.type not in ("cuda", "cpu"):
        raise OffloadConfigError(f"device {dev} is not supported: use a CUDA device or 'cpu'.")
    return dev


def _fresh_modules(target: Any) -> dict[str, nn.Module]:
    """The target's modules by attribute name; none may be offloaded already."""
    modules = {"transformer": target} if is_bare_module(target) else pipeline_modules(target)
    for name, mod in modules.items():
        if getattr(mod, _STATE_ATTR, None) is not None:
            raise OffloadConfigError(
                f"{name} ({type(mod).__name__}) is already offloaded: call remove() on the handle "
                "that apply_offload returned before applying again."
            )
    return modules


def _resident_indices(comp: StreamedComponent, asked: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """Which blocks stay on the device. A count is spread evenly through the ring, so the copies
    of the streamed blocks between two resident ones hide under their compute."""
    n = len(comp.blocks)
    where = f"{comp.name} ({type(comp.module).__name__}): layer_options.{comp.category}.resident_blocks"
    if asked is None or asked == 0:
        return ()
    if isinstance(asked, int):
        if asked >= n:
            raise OffloadConfigError(
                f"{where} is {asked}, but the component has {n} blocks: keep at most {n - 1} "
                f"resident, or leave {comp.category!r} out of 'components' to keep it all on the device."
            )
        return tuple(int((j + 0.5) * n / asked) for j in range(asked))
    if out := [i for i in asked if i >= n]:
        raise OffloadConfigError(
            f"{where} lists {out}, but the component has {n} blocks (indices 0 to {n - 1}): "
            "give indices in ring order from 0."
        )
    if len(asked) >= n:
        raise OffloadConfigError(
            f"{where} lists every block of the component: leave {comp.category!r} out of "
            "'components' to keep it all on the device."
        )
    return asked


def _checked_sources(block_sources: Mapping[str, BlockSource] | None,
                     components: Sequence[StreamedComponent]) -> dict[str, BlockSource]:
    sources = dict(block_sources or {})
    if stray := sorted(set(sources) - {c.name for c in components}):
        raise OffloadConfigError(
            f"block_sources has sources for {stray}, which do not stream under this config (streamed: "
            f"{[c.name for c in components]}): their placeholder weights would never be read. Pass the "
            "same config to prepare_cold_start and apply_offload."
        )
    return sources


def _check_process_group(process_group: Any | None) -> None:
    if process_group is not None and not isinstance(process_group, torch.distributed.ProcessGroup):
        raise OffloadConfigError(
            f"process_group must be a torch.distributed ProcessGroup, found "
            f"{type(process_group).__name__}: pass a group from torch.distributed.new_group(ranks), "
            "or None for one group per host."
        )


def _ring_specs(components: Sequence[StreamedComponent], layouts: Mapping[str, Sequence[BlockLayout]],
                cfg: OffloadConfig, dev: torch.device, process_group: Any | None,
                sources: Mapping[str, BlockSource], groups: GroupSession) -> list[_RingSpec]:
    """How each component streams. Components asking for allgather get the weight group that
    every rank agrees on, or all stream rank-local with the same reason."""
    facts = {c.name: _allgather_facts(c, layouts[c.name], cfg, sources.get(c.name)) for c in components
             if cfg.options_for(c.category).weight_transfer == "allgather"}
    group, reason = groups.resolve(facts, dev, process_group) if facts else (None, None)
    if group is not None:
        _check_gather(facts, group, dev)
    specs = []
    for c in components:
        base = _RingSpec(c, layouts[c.name], sources.get(c.name))
        if c.name not in facts:
            specs.append(base)
        elif group is None:
            specs.append(dataclasses.replace(base, fallback_reason=reason))
        else:
            specs.append(dataclasses.replace(base, group=group, gather=_gather_of(cfg, c, group, dev),
                                             chunk_bytes=facts[c.name].chunk_bytes))
    return specs


def _allgather_facts(comp: StreamedComponent, layouts: Sequence[BlockLayout], cfg: OffloadConfig,
                     source: BlockSource | None) -> ComponentFacts:
    """What must match across ranks for an allgather component."""
    opts = cfg.options_for(comp.category)
    samples = sample_digest(layouts, head=source.head if source is not None else None)
    return ComponentFacts("allgather", int(opts.chunk_mib * 2**20), opts.gather,
                          tuple(l.name for l in layouts), tuple(layout_digest(layouts)), tuple(samples))


def _check_gather(facts: Mapping[str, ComponentFacts], group: WeightGroup, dev: torch.device) -> None:
    """``gather: "copy-engine"`` where it cannot run is an error; ``auto`` says what it took."""
    if group.peer_copy_reason is None or dev.type != "cuda":
        return
    # Every rank sees the same gathered facts, so every rank raises alike.
    for name, f in facts.items():
        if f.gather == "copy-engine":
            raise OffloadConfigError(
                f"{name}: gather 'copy-engine' cannot run here: {group.peer_copy_reason}. Use "
                "\"gather\": \"auto\" (falls back to NCCL) or \"nccl\"."
            )
    if any(f.gather == "auto" for f in facts.values()):
        logger.info("allgather rebuilds blocks with NCCL, not the copy engines: %s", group.peer_copy_reason)


def _gather_of(cfg: OffloadConfig, comp: StreamedComponent, group: WeightGroup, dev: torch.device) -> str:
    """The gather an allgather ring uses: see ``LayerOptions.gather``."""
    asked = cfg.options_for(comp.category).gather
    if dev.type != "cuda":
        return "nccl"  # the collective path; on the CPU that is gloo's all-gather
    if asked == "auto":
        return "copy-engine" if group.peer_copy_reason is None else "nccl"
    return asked


# -- phase 1: residency ----------------------------------------------------------------------
#: The forward a budgeted ring measures before planning for good: the first pays one-off costs
#: (kernel autotuning, workspace and allocator growth, compilation) that would misstate compute.
MEASURED_FORWARD = 2
#: ``device_budget: "auto"`` plans the fewest resident blocks predicted within this of resident.
AUTO_TOLERANCE = 0.01
_MIN_RESERVE = 2 * 2**30


def _with_residency(specs: Sequence[_RingSpec], cfg: OffloadConfig, dev: torch.device,
                    modules: Mapping[str, nn.Module]) -> list[_RingSpec]:
    """Which blocks of each ring start resident, with how many slots: ``resident_blocks`` where
    given, else the budget's plan (before anything is measured, from :func:`prior_costs`), else
    none. Raises before anything changes when the budget cannot hold the rings."""
    fixed = {s.component.name: _resident_indices(s.component, cfg.options_for(s.component.category).resident_blocks)
             for s in specs if cfg.options_for(s.component.category).resident_blocks is not None}
    out = {s.component.name: dataclasses.replace(s, resident=fixed.get(s.component.name, ())) for s in specs}
    if cfg.device_budget is None:
        return list(out.values())
    planned = [s for s in specs if s.component.name not in fixed]
    slot_bytes = {s.component.name: s.slot_bytes() for s in specs}

    def fixed_bytes(spec: _RingSpec) -> int:
        keep = set(out[spec.component.name].resident)
        streamed = [b for i, b in enumerate(slot_bytes[spec.component.name]) if i not in keep]
        return sum(spec.layouts[i].nbytes for i in keep) + NUM_SLOTS * max(streamed)

    held = sum(fixed_bytes(s) for s in specs if s.component.name in fixed)
    floors = {s.component.name: min_budget(slot_bytes[s.component.name]) for s in planned}
    whole = {s.component.name: sum(l.nbytes for l in s.layouts) for s in planned}
    budget = cfg.device_budget
    auto = budget == "auto"
    if auto:
        budget = _auto_budget(cfg, dev, modules, specs)
        if budget is None or budget >= held + sum(whole.values()):
            for s in planned:
                out[s.component.name] = dataclasses.replace(
                    s, resident=tuple(range(len(s.layouts))), num_slots=0, budget=whole[s.component.name])
            logger.info("device_budget auto: %s free for block weights; every block of %s fits and stays "
                        "resident", "the whole device" if budget is None else format_bytes(budget),
                        [s.component.name for s in planned])
            return list(out.values())
    smallest = held + sum(floors.values())
    if budget < smallest:
        what = "auto resolved to " if auto else ""
        raise OffloadConfigError(
            f"config key 'device_budget' is {what}{format_bytes(budget)} ({budget} bytes), below the "
            f"smallest budget that works here, {format_bytes(smallest)} ({smallest} bytes): two slots of "
            f"the largest block of each streamed component{' plus the resident_blocks given' if held else ''}. "
            "Raise the budget" + (", lower activation_reserve" if auto else "") +
            ", or drop device_budget to stream every block.")
    shares = _shares(planned, budget - held, floors, whole)
    for s in planned:
        name = s.component.name
        share = shares[name]
        prior = plan_residency(prior_costs([l.nbytes for l in s.layouts], slot_bytes[name], share), share)
        settled = prior.slots == 0  # everything fits: nothing to measure
        out[name] = dataclasses.replace(s, resident=prior.resident, num_slots=prior.slots or NUM_SLOTS,
                                        settled=settled, budget=share, fewest=auto, plan=prior)
    return list(out.values())


def _shares(specs: Sequence[_RingSpec], budget: int, floors: Mapping[str, int],
            whole: Mapping[str, int]) -> dict[str, int]:
    """Split a budget between rings (the rule in ``docs/design.md``, [Note: residency planner]):
    each gets two slots of its largest block; what is left goes to the DiTs, in proportion to
    what more they could use (up to all their blocks resident), then to the text encoders alike."""
    share = dict(floors)
    left = budget - sum(floors.values())
    for category in ("dit", "text_encoder"):
        want = {s.component.name: max(0, whole[s.component.name] - floors[s.component.name])
                for s in specs if s.component.category == category}
        total = sum(want.values())
        if total == 0 or left <= 0:
            continue
        give = min(left, total)
        for name, w in want.items():
            share[name] += give * w // total
        left -= give
    return share


def _auto_budget(cfg: OffloadConfig, dev: torch.device, modules: Mapping[str, nn.Module],
                 specs: Sequence[_RingSpec]) -> int | None:
    """``device_budget: "auto"``: device memory free now, less what the non-streamed modules will
    take when they move there, less the activation reserve. None on the CPU (no device memory
    apart from the host's: every block fits). Under allgather, the smallest over the weight group,
    so every rank plans alike."""
    free = _free_device_bytes(dev)
    if free is None:
        return None
    in_blocks = {id(e.tensor): e.tensor for s in specs for l in s.layouts for e in l.entries}
    # Block tensors already on the device leave it when they stream: their memory counts as free.
    leaving = sum(t.numel() * t.element_size() for t in in_blocks.values() if t.device == dev and dev.type == "cuda")
    seen: set[int] = set()
    incoming = 0
    for root in modules.values():
        for t in [*root.parameters(), *root.buffers()]:
            if id(t) in seen or id(t) in in_blocks or t.device == dev:
                continue
            seen.add(id(t))
            incoming += t.numel() * t.element_size()
    reserve = cfg.activation_reserve
    if reserve is None:
        reserve = max(_MIN_RESERVE, _total_device_bytes(dev) // 10)
    budget = max(0, free + leaving - incoming - reserve)
    group = next((s.group for s in specs if s.group is not None), None)
    if group is not None:
        budget = int(_group_reduce([float(budget)], group, dev, dist.ReduceOp.MIN)[0])
    return budget


def _free_device_bytes(dev: torch.device) -> int | None:
    """What this process can still allocate on ``dev``: free device memory plus what PyTorch's
    allocator holds unused, within ``torch.cuda.set_per_process_memory_fraction`` if set."""
    if dev.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(dev)
    allocated = torch.cuda.memory_allocated(dev)
    usable = free + torch.cuda.memory_reserved(dev) - allocated
    return min(usable, _device_limit(dev, total) - allocated)  # may be negative: over the cap


def _device_limit(dev: torch.device, total: int) -> int:
    """The allocator's cap on ``dev`` (the device's memory unless a fraction was set)."""
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(dev)
    return int(total * min(1.0, fraction))


def _total_device_bytes(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 0
    return _device_limit(dev, torch.cuda.get_device_properties(dev).total_memory)


def _group_reduce(values: Sequence[float], group: WeightGroup, dev: torch.device, op) -> list[float]:
    """One reduction over the weight group (on the device for NCCL, on the host for gloo)."""
    where = dev if "nccl" in group.backend else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float64, device=where)
    dist.all_reduce(t, op=op, group=group.group)
    return t.tolist()


class _Replanner:
    """Called by a ring after each complete forward until it returns True: after the measured
    forward it plans from what was measured (agreed across the weight group: the slowest rank's
    figures), applies the plan and drops the host copies of the blocks that stay."""

    def __init__(self, spec: _RingSpec, device: torch.device, keep_trace: bool) -> None:
        self.budget = spec.budget
        self.fewest = spec.fewest
        self.group = spec.group
        self.device = device
        self.keep_trace = keep_trace
        self.forwards = 0

    def __call__(self, ring: BlockRing) -> bool:
        self.forwards += 1
        if self.forwards < MEASURED_FORWARD:
            return False
        costs = ring.measured_costs(ring.tracer.report())
        if self.group is not None:  # every rank must take the same plan: agree on the figures first
            costs = _agreed(costs, len(ring.layouts), self.group, self.device)
        if costs is None:  # the forward skipped blocks: keep the current plan, and settle it
            plan = ring.plan
            ring.apply_plan(ring.resident, ring.num_slots or NUM_SLOTS, settle=True)
            logger.warning("%s: the measured forward did not run every block; keeping the unmeasured "
                           "residency plan", ring.component.name)
        else:
            plan = plan_fewest(costs, self.budget, AUTO_TOLERANCE) if self.fewest else plan_residency(costs, self.budget)
            ring.apply_plan(plan.resident, plan.slots or NUM_SLOTS, settle=True)
            ring.plan, ring.costs = plan, costs
            _log_plan(ring, plan, costs)
        if not self.keep_trace:
            ring.tracer = None
        return True


def _agreed(costs: RingCosts | None, n: int, group: WeightGroup, dev: torch.device) -> RingCosts | None:
    """The slowest rank's figures, per block (all ranks call this; a rank without a complete
    measurement makes every rank keep its current plan)."""
    flat = [0.0] * (3 * n + 3)
    if costs is not None:
        flat = [*costs.compute_ms, *costs.copy_ms, *(costs.issued_ms or [-1e9] * n), costs.pre_ms,
                costs.post_ms, costs.gap_ms]
    worst = _group_reduce(flat, group, dev, dist.ReduceOp.MAX)
    complete = _group_reduce([1.0 if costs is not None else 0.0], group, dev, dist.ReduceOp.MIN)[0]
    if costs is None or complete < 1.0:
        return None
    return dataclasses.replace(costs, compute_ms=tuple(worst[:n]), copy_ms=tuple(worst[n:2 * n]),
                               issued_ms=tuple(worst[2 * n:3 * n]), pre_ms=worst[3 * n],
                               post_ms=worst[3 * n + 1], gap_ms=worst[3 * n + 2])


def _log_plan(ring: BlockRing, plan: ResidencyPlan, costs: RingCosts) -> None:
    streamed = len(ring.layouts) - len(plan.resident)
    logger.info(
        "%s: residency plan from a measured forward: %d of %d blocks resident (%s), %d streamed "
        "through %d slots (%s); predicted forward %.1f ms, %.3fx resident (%.1f ms); budget %s",
        ring.component.name, len(plan.resident), len(ring.layouts),
        format_bytes(sum(ring.layouts[i].nbytes for i in plan.resident)), streamed, ring.num_slots,
        format_bytes(sum(s.numel() for s in ring.slots)), plan.predicted_ms, plan.predicted_ratio or 0.0,
        costs.resident_ms, format_bytes(ring.budget or 0))


# -- phase 2: fill host copies, build rings ---------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class _Setup:
    """What every ring of one ``apply_offload`` shares."""

    device: torch.device
    pin: HostPinner
    streams: TransferStreams
    timeout_s: float
    progress: bool

    @classmethod
    def start(cls, cfg: OffloadConfig, dev: torch.device, gathers: bool, progress: bool) -> _Setup:
        cuda = dev.type == "cuda"
        # The copy stream exists so host-to-device copies run beside compute instead of behind
        # it; the comm stream so the gather (NCCL all-gathers, or the copy-engine pulls from the
        # peers' slots) runs beside both. High priority for the same reason as the weight
        # group's NCCL stream (transfer.groups._nccl_options).
        streams = TransferStreams(copy=torch.cuda.Stream(dev) if cuda else None,
                                  comm=torch.cuda.Stream(dev, priority=-1) if cuda and gathers else None)
        return cls(dev, HostPinner.for_device(cfg.pin_memory, cfg.pin_failure, dev), streams,
                   cfg.collective_timeout_s, progress)


def _build_ring(spec: _RingSpec, setup: _Setup) -> tuple[BlockRing, list[list[torch.Tensor]] | None]:
    """One component's ring, and (allgather) its blocks' original storage, kept until every
    rank's setup has succeeded."""
    start = time.perf_counter()
    with _setup_bar(setup.progress, spec) as step:
        if spec.group is not None:
            transfer, parked, resident, originals = _fill_shards(spec, setup, step)
        else:
            transfer, parked, resident = _fill_buffers(spec, setup, step)
            originals = None
    try:
        ring = BlockRing(spec.component, spec.layouts, transfer, setup.device, parked, resident, spec.num_slots)
    except BaseException:
        if originals is None:  # give the blocks their storage back, as _fill_buffers does on failure
            restore_blocks(spec.layouts, [parked[i] if parked[i] is not None else
                                          [e.view_in(resident[i]) for e in l.entries]
                                          for i, l in enumerate(spec.layouts)], None)
        else:
            for layout, data in zip(spec.layouts, originals):
                bind(layout.entries, data)
        transfer.release()
        raise
    ring.setup_s = time.perf_counter() - start
    ring.plan = spec.plan
    ring.budget = spec.budget
    return ring, originals


def _device_copy(spec: _RingSpec, layout: BlockLayout, setup: _Setup, image: torch.Tensor | None) -> torch.Tensor:
    """A resident block's device buffer, filled from ``image`` (its bytes on the host), or from
    the source, or from the block's own tensors."""
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=setup.device)
    if image is None and spec.source is not None:
        image = torch.empty(layout.nbytes, dtype=torch.uint8)
        spec.source.fill(layout, [(0, layout.nbytes, 0)], image)
    if image is not None:
        buf.copy_(image)
    else:
        for entry in layout.entries:
            entry.view_in(buf).copy_(entry.tensor.detach())
    return buf


@contextlib.contextmanager
def _setup_bar(enabled: bool, spec: _RingSpec):
    """Yields a step function: a progress bar over the component's blocks, or nothing."""
    if not enabled:
        yield _no_step
        return
    with tqdm(total=len(spec.layouts), desc=f"{spec.component.name}: filling and page-locking blocks",
              unit="block", leave=False) as bar:
        yield bar.update


def _no_step(n: int = 1) -> None:
    pass


def _fill_buffers(spec: _RingSpec, setup: _Setup, step: Callable[[int], Any]):
    """Rank-local: whole blocks, consolidated one at a time; each block's original storage is
    dropped as soon as its host buffer (or, for a resident block, its device buffer) holds it,
    so host memory is never doubled. With a source, placeholder tensors are read from the
    checkpoint straight into the buffer. A failure copies the done blocks back."""
    layouts, pin = spec.layouts, setup.pin
    keep = set(spec.resident)
    buffers: list[HostBuffer | None] = []
    current: list[tuple[torch.Tensor, ...]] = []   # what each done block's tensors point at now
    resident: dict[int, torch.Tensor] = {}
    try:
        for layout in layouts:
            i = layout.index
            buf = None
            if i in keep and spec.settled:  # resident for good: no host copy
                resident[i] = _device_copy(spec, layout, setup, None)
            else:
                buf = HostBuffer(layout.nbytes)
                if spec.source is not None:
                    spec.source.fill(layout, [(0, layout.nbytes, 0)], buf.tensor)
                else:
                    for entry in layout.entries:
                        entry.view_in(buf.tensor).copy_(entry.tensor.detach())
                if i in keep:  # resident until a measured forward is planned for: both copies
                    resident[i] = _device_copy(spec, layout, setup, buf.tensor)
                pin.pin_later(buf, spec.component.name, layout.name)
            views = tuple(e.view_in(buf.tensor if buf is not None else resident[i]) for e in layout.entries)
            bind(layout.entries, views)
            buffers.append(buf)
            current.append(views)
            step(1)
        pin.wait()
        parked = [v if b is not None else None for v, b in zip(current, buffers)]
        transfer = RankLocalTransfer(buffers, [l.nbytes for l in layouts], setup.streams, setup.device,
                                     spec.fallback_reason)
        return transfer, parked, resident
    except BaseException:
        with contextlib.suppress(BaseException):
            pin.wait()  # no registration may still be running on a buffer released below
        restore_blocks(layouts[: len(current)], current, None)
        for buf in buffers:
            if buf is not None:
                buf.release()
        raise


def _fill_shards(spec: _RingSpec, setup: _Setup, step: Callable[[int], Any]):
    """allgather: this rank's shard of every block. With a source, only this rank's byte ranges
    are read from the checkpoint, straight into the shard. Between uses a block's tensors hold
    placeholders; their original storage is returned for the caller to keep until every rank
    has succeeded. A block resident for good has no shard, and its whole bytes on the device."""
    layouts, pin, group = spec.layouts, setup.pin, spec.group
    keep = set(spec.resident)
    plans = spec.shard_plans()
    # The image of one whole block, cut into this rank's shard; a source reads the shard directly.
    image = torch.empty(max(l.nbytes for l in layouts) if spec.source is None else 0, dtype=torch.uint8)
    placeholders: dict[torch.dtype, torch.Tensor] = {}
    shards: list[HostBuffer | None] = []
    originals: list[list[torch.Tensor]] = []
    parked: list[list[torch.Tensor] | None] = []
    resident: dict[int, torch.Tensor] = {}
    try:
        for layout, shard_plan in zip(layouts, plans):
            i = layout.index
            block_image = None
            if spec.source is None:
                block_image = image[: layout.nbytes]
                for entry in layout.entries:
                    entry.view_in(block_image).copy_(entry.tensor.detach())
            shard = None
            if not (i in keep and spec.settled):
                shard = HostBuffer(shard_plan.shard_nbytes)
                if spec.source is not None:
                    spec.source.fill(layout, shard_pieces(shard_plan), shard.tensor)
                else:
                    write_shard(shard_plan, block_image, shard.tensor)
                pin.pin_later(shard, spec.component.name, layout.name)
            if i in keep:
                resident[i] = _device_copy(spec, layout, setup, block_image)
            shards.append(shard)
            originals.append([e.tensor.data for e in layout.entries])
            held = [_placeholder(e, placeholders) for e in layout.entries]
            parked.append(held if shard is not None else None)
            bind(layout.entries, [e.view_in(resident[i]) for e in layout.entries] if i in keep else held)
            step(1)
        del image
        pin.wait()
        transfer = gather_transfer(spec.gather, shards, plans, group, setup.streams, setup.device,
                                   setup.timeout_s, spec.component.name)
        return transfer, parked, resident, originals
    except BaseException:
        with contextlib.suppress(BaseException):
            pin.wait()  # as in _fill_buffers
        for layout, data in zip(layouts, originals):
            bind(layout.entries, data)
        for shard in shards:
            if shard is not None:
                shard.release()
        raise


def _placeholder(entry: TensorEntry, cache: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    """A host tensor with the entry's shape and dtype and one element of storage: what a
    parameter holds between uses when this rank has only a shard of its block. Floats read NaN,
    so a weight used outside its block's forward shows up rather than passing for real data."""
    scalar = cache.get(entry.dtype)
    if scalar is None:
        fill = float("nan") if entry.dtype.is_floating_point or entry.dtype.is_complex else 0
        scalar = cache[entry.dtype] = torch.full((), fill, dtype=entry.dtype, device=entry.tensor.device
                                                 if entry.tensor.device.type == "cpu" else "cpu")
    return scalar.expand(entry.tensor.shape)


# -- the end of setup -------------------------------------------------------------------------
def _agree_all_or_nothing(handle: OffloadHandle, groups: GroupSession) -> None:
    """Under allgather every rank must have succeeded; otherwise all undo (still local: the
    original storage is kept until here) and raise alike."""
    if not groups.active:
        return
    failed = groups.agree(None)
    if failed:
        handle._rollback()
        groups.close()
        rank, error = failed[0]
        raise RuntimeError(
            f"apply_offload failed on rank {rank} ({error}); every rank undid its setup, since "
            "allgather needs all of them. Fix the error on that rank and apply again."
        )


def _log_summary(handle: OffloadHandle) -> None:
    """One line per decision; the front-ends' log filter decides which ranks show."""
    for row in handle.summary_rows():
        if row.fallback_reason is not None:
            logger.warning("%s: allgather not used, streaming rank-local instead: %s",
                           row.component, row.fallback_reason)
        logger.info(
            "streaming %s (%s, %s): %d blocks, %.1f MiB, %s, %.1f MiB host, %.1f MiB device slots%s",
            row.component, row.module_class, row.category, row.num_blocks, row.block_bytes / 2**20,
            row.weight_transfer + (f" ({row.gather} gather)" if row.gather else ""),
            row.host_bytes / 2**20, row.device_slot_bytes / 2**20,
            f"; blocks {row.resident_blocks} resident ({row.resident_bytes / 2**20:.1f} MiB)"
            if row.resident_blocks else "",
        )


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None``: the current CUDA device (per rank under torchrun), else the CPU; a bare
    ``"cuda"`` becomes the current CUDA device."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
