"""``apply_offload``: put a pipeline's blocks in host memory and stream them; the handle undoes it.

Setup runs in two phases. The first reads only: config, discovery, layouts, ownership checks.
The second consolidates block by block (each block's tensors move into one host buffer and the
original storage is dropped), allocates the device slots, moves everything else to the device
and installs the hooks. If anything in the second phase fails, what was done is undone and the
target is as it was.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from .config import OffloadConfig, OffloadConfigError
from .hostmem import HostBuffer, HostPinner
from .distributed import ComponentFacts, WeightGroup, agree_on_setup, resolve_weight_group
from .layout import BlockLayout, bind, check_ownership, layout_block, restore_blocks
from .plan import OffloadPlan, StreamedComponent, discover, is_bare_module, pipeline_modules
from .ranks import current_rank, rank_prefix
from .ring import BlockRing
from .sharding import layout_digest, plan_shards, sample_digest, shard_pieces, write_shard
from .trace import trace_enabled
from .transfer import RankLocalTransfer, gather_transfer

if TYPE_CHECKING:
    from .checkpoint import BlockSource

__all__ = ["OffloadHandle", "apply_offload", "resolve_device"]

logger = logging.getLogger("omni_dist_offload")

#: Attribute set on every module of an offloaded target, pointing at its handle.
_STATE_ATTR = "_omni_offload_handle"


class OffloadHandle:
    """What :func:`apply_offload` did, and how to undo it."""

    def __init__(self, target: Any, modules: Mapping[str, nn.Module], device: torch.device,
                 config: OffloadConfig) -> None:
        self.target = target
        self.device = device
        self.config = config
        self.rings: list[BlockRing] = []
        self._modules = dict(modules)
        # allgather rings keep their blocks' original storage until setup has succeeded, so a
        # failure can be undone without asking the other ranks for their shards.
        self._originals: dict[int, list[list[torch.Tensor]]] = {}
        self._undo_moves: list[Callable[[], None]] = []
        self._removed = False
        self.setup_seconds: dict[str, float] = {}
        """Per streamed component: seconds spent filling and page-locking its host copy."""

    def summary(self) -> list[dict[str, Any]]:
        """One dict per streamed ring (see the README for the keys)."""
        rows = []
        for ring in self.rings:
            comp = ring.component
            rows.append({
                "component": comp.name,
                "category": comp.category,
                "module_class": type(comp.module).__name__,
                "num_blocks": len(ring.layouts),
                "weight_transfer": ring.transfer.name,
                "gather": getattr(ring.transfer, "gather", None),
                "fallback_reason": ring.transfer.fallback_reason,
                "block_bytes": sum(layout.tensor_bytes for layout in ring.layouts),
                "host_bytes": ring.transfer.host_bytes(),
                "device_slot_bytes": sum(s.numel() for s in ring.slots),
                "setup_s": self.setup_seconds.get(comp.name),
            })
        return rows

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
        remove the hooks and free the slots and pinned host memory. Calling it again does nothing.

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
        self._unmark()
        self._removed = True

    # -- setup helpers -----------------------------------------------------------------
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

    def _mark(self) -> None:
        for mod in self._modules.values():
            setattr(mod, _STATE_ATTR, self)

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

    ``block_sources`` (component name -> :class:`~omni_dist_offload.checkpoint.BlockSource`)
    fills the host copies of blocks whose tensors are placeholders from a checkpoint; the
    cold-start loader (``omni_dist_offload.coldstart``) passes it. ``progress`` shows a bar per
    streamed component while its blocks are filled and page-locked (rank 0 only).

    With ``weight_transfer: "allgather"`` this is collective: every rank calls it with the same
    model and config.
    """
    cfg = OffloadConfig.parse(config)
    dev = resolve_device(device)
    if dev.type not in ("cuda", "cpu"):
        raise OffloadConfigError(f"device {dev} is not supported: use a CUDA device or 'cpu'.")
    modules = {"transformer": target} if is_bare_module(target) else pipeline_modules(target)
    for name, mod in modules.items():
        if getattr(mod, _STATE_ATTR, None) is not None:
            raise OffloadConfigError(
                f"{name} ({type(mod).__name__}) is already offloaded: call remove() on the handle "
                "that apply_offload returned before applying again."
            )
    components = discover(target, cfg, plan)
    layouts = {c.name: [layout_block(i, n, b) for i, (n, b) in enumerate(c.blocks)] for c in components}
    check_ownership(((c.name, layouts[c.name]) for c in components), modules)
    sources = dict(block_sources or {})
    if stray := sorted(set(sources) - {c.name for c in components}):
        raise OffloadConfigError(
            f"block_sources has sources for {stray}, which do not stream under this config (streamed: "
            f"{[c.name for c in components]}): their placeholder weights would never be read. Pass the "
            "same config to prepare_cold_start and apply_offload."
        )
    group, reason, wants = _weight_group(components, layouts, cfg, dev, process_group, sources)

    handle = OffloadHandle(target, modules, dev, cfg)
    pin = HostPinner.for_device(cfg.pin_memory, cfg.pin_failure, dev)
    try:
        # The copy stream exists so host-to-device copies run beside compute instead of behind
        # it; the comm stream so the gather (NCCL all-gathers, or the copy-engine pulls from the
        # peers' slots) runs beside both.
        copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        # High priority for the same reason as the weight group's NCCL stream
        # (distributed._nccl_options).
        comm_stream = torch.cuda.Stream(dev, priority=-1) if dev.type == "cuda" and group is not None else None
        for comp in components:
            ls = layouts[comp.name]
            source = sources.get(comp.name)
            start = time.perf_counter()
            with _setup_bar(progress, comp, len(ls)) as bar:
                step = bar.update if bar is not None else _no_step
                if comp.name in wants and group is not None:
                    chunk = _chunk_bytes(cfg, comp)
                    ring, originals = _build_allgather_ring(comp, ls, dev, pin, group, chunk, copy_stream,
                                                            comm_stream, source, step,
                                                            _gather_of(cfg, comp, group, dev),
                                                            cfg.collective_timeout_s)
                    handle._originals[id(ring)] = originals
                else:
                    ring = _build_rank_local_ring(comp, ls, dev, pin, copy_stream,
                                                  reason if comp.name in wants else None, source, step)
            handle.setup_seconds[comp.name] = time.perf_counter() - start
            handle.rings.append(ring)
        streamed = {id(e.tensor) for ls in layouts.values() for l in ls for e in l.entries}
        handle._move_resident(streamed)
        for ring in handle.rings:
            if trace_enabled(trace):
                ring.enable_trace()
            ring.install_hooks()
        handle._mark()
    except BaseException as exc:
        handle._rollback()
        if group is not None:  # tell the other ranks, which would otherwise wait in their first fill
            with contextlib.suppress(Exception):
                agree_on_setup(f"{type(exc).__name__}: {exc}", cfg.collective_timeout_s)
        raise
    finally:
        pin.close()
    if group is not None:
        failed = agree_on_setup(None, cfg.collective_timeout_s)
        if failed:
            handle._rollback()  # still local: the original storage is kept until here
            rank, error = failed[0]
            raise RuntimeError(
                f"apply_offload failed on rank {rank} ({error}); every rank undid its setup, since "
                "allgather needs all of them. Fix the error on that rank and apply again."
            )
    handle._originals = {}  # setup succeeded everywhere: drop the original storage of allgather blocks
    _log_summary(handle, reason)
    return handle


def _weight_group(components, layouts, cfg, dev, process_group, sources):
    """Decide, on every rank alike, whether the allgather components get a weight group."""
    wants = {}
    for c in components:
        if cfg.options_for(c.category).weight_transfer != "allgather":
            continue
        source = sources.get(c.name)
        samples = sample_digest(layouts[c.name], head=source.head if source is not None else None)
        wants[c.name] = ComponentFacts("allgather", _chunk_bytes(cfg, c), cfg.options_for(c.category).gather,
                                       tuple(l.name for l in layouts[c.name]),
                                       tuple(layout_digest(layouts[c.name])), tuple(samples))
    if not wants:
        return None, None, wants
    if process_group is not None and not isinstance(process_group, torch.distributed.ProcessGroup):
        raise OffloadConfigError(
            f"process_group must be a torch.distributed ProcessGroup, found "
            f"{type(process_group).__name__}: pass a group from torch.distributed.new_group(ranks), "
            "or None for one group per host."
        )
    group, reason = resolve_weight_group(wants, dev, process_group, cfg.collective_timeout_s)
    if group is not None and group.peer_copy_reason is not None and dev.type == "cuda":
        # Every rank sees the same gathered facts, so every rank raises alike.
        for name, facts in wants.items():
            if facts.gather == "copy-engine":
                raise OffloadConfigError(
                    f"{name}: gather 'copy-engine' cannot run here: {group.peer_copy_reason}. Use "
                    "\"gather\": \"auto\" (falls back to NCCL) or \"nccl\"."
                )
        if current_rank() == 0 and any(f.gather == "auto" for f in wants.values()):
            logger.info("%sallgather rebuilds blocks with NCCL, not the copy engines: %s",
                        rank_prefix(), group.peer_copy_reason)
    return group, reason, wants


def _gather_of(cfg: OffloadConfig, comp: StreamedComponent, group: WeightGroup, dev: torch.device) -> str:
    """The gather an allgather ring uses: see ``LayerOptions.gather``."""
    asked = cfg.options_for(comp.category).gather
    if dev.type != "cuda":
        return "nccl"  # the collective path; on the CPU that is gloo's all-gather
    if asked == "auto":
        return "copy-engine" if group.peer_copy_reason is None else "nccl"
    return asked


def _setup_bar(enabled: bool, comp: StreamedComponent, blocks: int) -> Any:
    """A progress bar over a component's blocks during setup, on rank 0; else no bar."""
    if not enabled or current_rank() != 0:
        return contextlib.nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=blocks, desc=f"{comp.name}: filling and page-locking blocks", unit="block", leave=False)


def _no_step(n: int = 1) -> None:
    pass


def _chunk_bytes(cfg: OffloadConfig, comp: StreamedComponent) -> int:
    return int(cfg.options_for(comp.category).chunk_mib * 2**20)


def _build_rank_local_ring(comp: StreamedComponent, layouts: Sequence[BlockLayout], device: torch.device,
                           pin: HostPinner, copy_stream, fallback_reason: str | None,
                           source: BlockSource | None = None, step: Callable[[int], Any] = _no_step) -> BlockRing:
    """Consolidate block by block: each block's original storage is dropped as soon as its host
    buffer holds it, so host memory is never doubled. With a ``source``, placeholder tensors are
    read from the checkpoint straight into the buffer. A failure copies the done blocks back."""
    buffers: list[HostBuffer] = []
    host_views: list[tuple[torch.Tensor, ...]] = []
    try:
        for layout in layouts:
            buf = HostBuffer(layout.nbytes)
            views = tuple(e.view_in(buf.tensor) for e in layout.entries)
            if source is not None:
                source.fill(layout, [(0, layout.nbytes, 0)], buf.tensor)
            else:
                for entry, view in zip(layout.entries, views):
                    view.copy_(entry.tensor.detach())
            pin.pin_later(buf, comp.name, layout.name)
            bind(layout.entries, views)
            buffers.append(buf)
            host_views.append(views)
            step(1)
        pin.wait()
        transfer = RankLocalTransfer(buffers, copy_stream, fallback_reason)
        return BlockRing(comp, layouts, transfer, device, host_views)
    except BaseException:
        with contextlib.suppress(BaseException):
            pin.wait()  # no registration may still be running on a buffer released below
        restore_blocks(layouts[: len(host_views)], host_views, None)
        for buf in buffers:
            buf.release()
        raise


def _build_allgather_ring(comp: StreamedComponent, layouts: Sequence[BlockLayout], device: torch.device,
                          pin: HostPinner, group: WeightGroup, chunk_bytes: int, copy_stream, comm_stream,
                          source: BlockSource | None = None, step: Callable[[int], Any] = _no_step,
                          gather: str = "nccl", timeout_s: float = 600.0):
    """Keep this rank's shard of every block. Returns the ring and the blocks' original storage,
    which the caller drops once the whole setup has succeeded. With a ``source``, only this
    rank's byte ranges are read from the checkpoint, straight into the shard."""
    plans = [plan_shards(l.nbytes, group.size, group.rank, chunk_bytes) for l in layouts]
    # The image of one whole block, cut into this rank's shard; a source reads the shard directly.
    image = torch.empty(max(l.nbytes for l in layouts) if source is None else 0, dtype=torch.uint8)
    placeholders: dict[torch.dtype, torch.Tensor] = {}
    shards: list[HostBuffer] = []
    originals: list[list[torch.Tensor]] = []
    try:
        for layout, shard_plan in zip(layouts, plans):
            shard = HostBuffer(shard_plan.shard_nbytes)
            if source is not None:
                source.fill(layout, shard_pieces(shard_plan), shard.tensor)
            else:
                block_image = image[: layout.nbytes]
                for entry in layout.entries:
                    entry.view_in(block_image).copy_(entry.tensor.detach())
                write_shard(shard_plan, block_image, shard.tensor)
            pin.pin_later(shard, comp.name, layout.name)
            shards.append(shard)
            originals.append([e.tensor.data for e in layout.entries])
            bind(layout.entries, [_placeholder(e, placeholders) for e in layout.entries])
            step(1)
        del image
        pin.wait()
        transfer = gather_transfer(gather, shards, plans, group, copy_stream, comm_stream, timeout_s, comp.name)
        parked = [[e.tensor.data for e in layout.entries] for layout in layouts]
        return BlockRing(comp, layouts, transfer, device, parked), originals
    except BaseException:
        with contextlib.suppress(BaseException):
            pin.wait()  # as in _build_rank_local_ring
        for layout, data in zip(layouts, originals):
            bind(layout.entries, data)
        for shard in shards:
            shard.release()
        raise


def _placeholder(entry, cache: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    """A host tensor with the entry's shape and dtype and one element of storage: what a
    parameter holds between uses when this rank has only a shard of its block. Floats read NaN,
    so a weight used outside its block's forward shows up rather than passing for real data."""
    scalar = cache.get(entry.dtype)
    if scalar is None:
        fill = float("nan") if entry.dtype.is_floating_point or entry.dtype.is_complex else 0
        scalar = cache[entry.dtype] = torch.full((), fill, dtype=entry.dtype, device=entry.tensor.device
                                                 if entry.tensor.device.type == "cpu" else "cpu")
    return scalar.expand(entry.tensor.shape)


def _log_summary(handle: OffloadHandle, reason: str | None) -> None:
    if current_rank() != 0:
        return
    if reason is not None:
        logger.warning("%sallgather not used, streaming rank-local instead: %s", rank_prefix(), reason)
    for row in handle.summary():
        logger.info(
            "%sstreaming %s (%s, %s): %d blocks, %.1f MiB, %s, %.1f MiB host, %.1f MiB device slots",
            rank_prefix(), row["component"], row["module_class"], row["category"],
            row["num_blocks"], row["block_bytes"] / 2**20,
            row["weight_transfer"] + (f" ({row['gather']} gather)" if row["gather"] else ""),
            row["host_bytes"] / 2**20, row["device_slot_bytes"] / 2**20,
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