"""``apply_offload``: put a pipeline's blocks in host memory and stream them; the handle undoes it.

Setup runs in two phases ([Note: setup phases] in ``docs/design.md``). The first reads only:
config, discovery, layouts, ownership checks, and (allgather) the weight group every rank agrees
on. The second changes the target: each component's blocks move into host buffers (or this
rank's shards) one block at a time, its ring and slots are built, everything else moves to the
device and the hooks go in. If anything in the second phase fails, what was done is undone and
the target is as it was; under allgather the ranks agree once every host copy is filled (before
the weight group's first collective) and at the end, all or nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from .budget import Replanner, Residency, RingSizes, auto_budget, initial_residency
from .config import OffloadConfig, OffloadConfigError
from .hostmem import HostBuffer, HostPinner
from .layout import (
    BlockLayout,
    BlockSource,
    TensorEntry,
    bind,
    check_ownership,
    layout_block,
    quantized_refusal,
    restore_blocks,
)
from .plan import (
    OffloadPlan,
    StreamedComponent,
    discover,
    is_bare_module,
    pipeline_modules,
)
from .residency import image_slot_bytes, pick_resident
from .ring import BlockRing, check_not_cuda_graphs, refuse_copy
from .tenants import BlockWatch
from .trace import trace_enabled
from .storage import (LayerUpcasts, StoredLayers, cast_tensors, layerwise_cast_modules, store_outside_blocks, upcast,
                      upcast_per_layer)
from .transfer import RankLocalTransfer, TransferStreams, gather_transfer
from .sharedmem import (CopyLayout, Offer, SharedBlocks, SharedMemoryError, available_host_bytes,
                        out_of_descriptors, receive, small_pages_note)
from .transfer.casting import CastingTransfer
from .transfer.groups import AGREED, ComponentFacts, GroupSession, HostRanks, SetupAsk, WeightGroup
from .transfer.shared import SharedTransfer
from .transfer.sharding import (
    ShardPlan,
    layout_digest,
    plan_shards,
    sample_digest,
    shard_pieces,
    write_shard,
)

__all__ = ["OffloadHandle", "RingSummary", "apply_offload", "checked_device", "resolve_device"]

logger = logging.getLogger(__name__)

#: Attribute set on every module of an offloaded target, pointing at its handle.
_STATE_ATTR = "_omni_offload_handle"
#: Attribute set on each streamed component's module: its rings and 8-bit layers, which the
#: module owns and the handle reaches weakly (see OffloadHandle).
_OWNED_ATTR = "_omni_offload_owned"
#: Set on a streamed component by OffloadHandle.discard(), which emptied its block tensors.
_DISCARDED_ATTR = "_omni_offload_discarded"


@dataclasses.dataclass(frozen=True, slots=True)
class RingSummary:
    """What one streamed ring is. ``OffloadHandle.summary()`` gives these as dicts, with the
    same keys in the same order (the documented summary keys)."""

    component: str
    category: str
    module_class: str
    num_blocks: int
    weight_transfer: str
    """What runs after any fallback: ``rank-local``, ``shared`` or ``allgather``."""
    gather: str | None
    """What rebuilds allgather blocks: ``copy-engine``, ``nccl`` or ``gloo``; None for rank-local
    and shared."""
    fallback_reason: str | None
    block_bytes: int
    """Bytes of the streamed blocks' tensors as stored on the host (without alignment padding;
    8-bit where ``storage_dtype`` stores them so)."""
    host_bytes: int
    """Host bytes this rank holds for the ring (whole blocks, or its shards, or its share of
    the host copy the ranks of its host share)."""
    device_slot_bytes: int
    setup_s: float | None
    """Seconds spent filling and page-locking the ring's host copy."""
    resident_blocks: list[int]
    """Blocks kept on the device instead of streaming (indices in ring order)."""
    resident_bytes: int
    """Bytes of those blocks' tensors, and of the leading tensors that streamed blocks keep on
    the device (``kept_blocks``)."""
    predicted_ratio: float | None
    """The residency plan's predicted forward / the resident forward; None before a forward
    was measured (and for rings without a device budget)."""
    device_budget: int | None
    """Device bytes this ring's resident blocks and slots may take (its share of
    ``device_budget``, after ``"auto"`` is resolved); None without a budget."""
    kept_blocks: list[int] = dataclasses.field(default_factory=list)
    """Streamed blocks that keep their largest tensors on the device and stream the rest (a
    residency plan's partly kept blocks)."""
    found_by: str = ""
    """How the block lists were found: ``declared`` (the class's
    ``_layerwise_offload_blocks_attrs`` or the pipeline's ``OffloadPlan``), ``built-in table``
    or ``scan``."""
    storage_dtype: str | None = None
    """``layer_options.<c>.storage_dtype``: the 8-bit format block weights are stored and moved
    in, upcast on the device; None: as the model holds them."""
    upcast: str | None = None
    """With a ``storage_dtype``, where the 8-bit weights are upcast (``layer_options.<c>.upcast``):
    ``"block"`` or ``"layer"``; None without one."""
    shared_host_bytes: int | None = None
    """``shared``: bytes of the one host copy the ranks of this host share (``host_bytes`` is
    this rank's share of it); None for other transfers."""
    host_ranks: int | None = None
    """``shared``: how many ranks of this host share the host copy; None for other transfers."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class OffloadHandle:
    """What :func:`apply_offload` did, and how to undo it.

    The handle reaches the components weakly. Each component's module owns its rings and 8-bit
    layers (``_OWNED_ATTR``); the handle holds weak references to the modules and the rings. A
    component dropped from the pipeline (``pipe.text_encoder = None`` after encoding the prompt,
    as diffusers suggests) is freed with everything the offload gave it (host copy, slots,
    device tensors); the handle goes on with the rest."""

    def __deepcopy__(self, memo: dict) -> Any:
        raise refuse_copy(", ".join(self._module_refs) or type(self.target).__name__)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refuse_copy(", ".join(self._module_refs) or type(self.target).__name__)

    def __init__(self, target: Any, modules: Mapping[str, nn.Module], device: torch.device,
                 config: OffloadConfig, groups: GroupSession) -> None:
        self.target = target
        self.device = device
        self.config = config
        self._ring_refs: list[weakref.ref[BlockRing]] = []
        self._module_refs = {name: weakref.ref(mod) for name, mod in modules.items()}
        # The process groups setup created; released with the handle.
        self._groups = groups
        # allgather rings keep their blocks' original storage until setup has succeeded, so a
        # failure can be undone without asking the other ranks for their shards.
        self._originals: dict[int, list[list[torch.Tensor]]] = {}
        self._undo_moves: list[Callable[[], None]] = []
        # What remove() and an undo put back besides the blocks (layers outside the blocks that
        # storage_dtype stores in 8 bits).
        self._removed = False
        self._watch: BlockWatch | None = None
        # remove() once its streamed blocks are restored: the rings still to bind, each with
        # its restored tensors, until every one is (a failure there, the device out of memory
        # for a resident block's new storage, is resumed by the next remove()).
        self._binding: list[tuple[BlockRing, dict[int, list[torch.Tensor]]]] | None = None

    @property
    def active(self) -> bool:
        """Whether the offload is in place: not yet undone by :meth:`remove` or :meth:`discard`."""
        return not self._removed

    @property
    def rings(self) -> list[BlockRing]:
        """The streamed rings, in setup order; a dropped component's are gone."""
        return [ring for ring in (ref() for ref in self._ring_refs) if ring is not None]

    @property
    def _modules(self) -> dict[str, nn.Module]:
        return {name: mod for name, ref in self._module_refs.items() if (mod := ref()) is not None}

    @property
    def _stored(self) -> list[StoredLayers | LayerUpcasts]:
        """What remove() and an undo put back besides the blocks (layers outside the blocks that
        storage_dtype stores in 8 bits)."""
        unique = {id(mod): mod for mod in self._modules.values()}  # a module under two names owns once
        return [stored for mod in unique.values() for stored in _owned(mod)["stored"]]

    def _keep_stored(self, module: nn.Module, stored: StoredLayers | LayerUpcasts) -> None:
        _owned(module)["stored"].append(stored)

    def lockstep_status(self) -> tuple[int, str | None]:
        """The fills this rank's lockstep (allgather) rings have made, and why one of them can no
        longer be used, if one cannot. Every rank of a weight group that ran the same forwards
        reports the same count: a front-end that runs ranks in lockstep (``serve``'s waves)
        compares them after each wave, and stops rather than serve on out of step."""
        rings = [ring for ring in self.rings if ring._lockstep]
        return sum(ring._fills for ring in rings), next((r._broken for r in rings if r._broken), None)

    def summary_rows(self) -> list[RingSummary]:
        """One typed row per streamed ring."""
        return [self._row(ring, _shared_of(ring.transfer)) for ring in self.rings]

    @staticmethod
    def _row(ring: BlockRing, shared: SharedTransfer | None) -> RingSummary:
        return RingSummary(
            component=ring.component.name,
            category=ring.component.category,
            module_class=type(ring.component.module).__name__,
            num_blocks=len(ring.streamed) - len(ring.held),
            weight_transfer=ring.transfer.name,
            gather=ring.transfer.gather,
            fallback_reason=ring.transfer.fallback_reason,
            block_bytes=sum(ring.layouts[i].stored_tensor_bytes for i in ring.streamed if i not in ring.held)
            - ring.kept_tensor_bytes(),
            host_bytes=ring.transfer.host_bytes(),
            device_slot_bytes=sum(s.numel() for s in ring.slots) + getattr(ring.transfer, "staging_bytes", 0),
            setup_s=ring.setup_s,
            resident_blocks=sorted(ring.on_device()),
            resident_bytes=sum(ring.layouts[i].tensor_bytes for i in ring.resident) + ring.kept_tensor_bytes()
            + sum(ring.layouts[i].stored_tensor_bytes for i in ring.held),
            predicted_ratio=ring.plan.predicted_ratio if ring.plan is not None else None,
            device_budget=ring.budget,
            kept_blocks=ring.kept_blocks(),
            found_by=ring.component.source if ring.component.source in ("built-in table", "scan") else "declared",
            storage_dtype=ring.storage_dtype,
            upcast=ring.upcast,
            shared_host_bytes=shared.shared_bytes() if shared is not None else None,
            host_ranks=shared.host_ranks if shared is not None else None,
        )

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

        With allgather rings this is collective: every rank of the weight group calls it, at
        the same point. If a rank is missing or out of step, or fails to restore a block (its
        device out of memory), every rank raises and changes nothing: the model stays offloaded,
        the ranks in step (its streamed blocks are gathered into storage of their own, and the
        ranks agree that every one of them has all of it, before anything is bound). A failure
        after that (binding a resident block's new storage, the layers outside the blocks put
        back) leaves the rings it had finished restored and the others offloaded; calling
        remove() again finishes it, with no collective (or discard() gives up the model)."""
        if self._removed:
            return
        if self._binding is not None:  # an earlier remove() restored the streamed blocks
            return self._finish_remove()
        self._synchronize()
        for stored in self._stored:
            if isinstance(stored, LayerUpcasts):
                stored.settle()  # a layer a Ctrl-C left on the upcast buffer: its 8-bit tensors again
        rings = self.rings
        lockstep = [ring for ring in rings if ring._lockstep]
        agreeing = bool(lockstep) and self._groups.group is not None and dist.is_initialized()  # (a job may tear down first)
        try:
            broken = next((ring._broken for ring in lockstep if ring._broken), None)
            if broken is not None:  # its blocks cannot be gathered
                raise RuntimeError(broken)
            for ring in lockstep:
                ring.finish_interrupted()  # a forward a Ctrl-C cut short: its fills, as every rank's
            if agreeing:
                try:
                    self._groups.agree_in_step("remove()", {ring.component.name: ring._fills for ring in lockstep})
                except RuntimeError as exc:
                    if "out of step" in str(exc):
                        for ring in lockstep:
                            ring._broken = f"{ring.component.name}: {exc}"
                    raise
            streamed, error = self._restored_streamed(rings, lockstep)
            if agreeing:
                # Every rank made every gather; none binds unless every one has all its blocks.
                failed = self._groups.agree_done("remove()", None if error is None else f"{type(error).__name__}: {error}")
                if failed:
                    raise RuntimeError("; ".join(f"rank {r} failed: {why}" for r, why in failed)) from error
            elif error is not None:
                raise error
        except RuntimeError as exc:
            raise RuntimeError(f"remove() changed nothing; the model is still offloaded: {exc}") from exc
        self._binding = list(zip(rings, streamed))
        self._finish_remove()

    def _finish_remove(self) -> None:
        """:meth:`remove` once every streamed block is restored, bound to nothing yet: ring by
        ring, bind the blocks (a ring's resident blocks get storage of their own, one at a time)
        and release the ring, then put back what 8-bit storage changed outside the blocks. Each
        step is done at most once: after a failure the next call goes on from where this one
        stopped. No collective."""
        try:
            while self._binding:
                ring, tensors = self._binding[0]
                ring.bind_restored(tensors, self.device)  # goes on past the blocks an earlier call bound
                ring.release()
                self._binding.pop(0)
                self._ring_refs = [ref for ref in self._ring_refs if ref() is not ring]
            self._unguard_casts()  # what undoing the storage does may cast
            self._close_watch()
            for stored in self._stored:
                stored.unstore()  # goes on past the layers an earlier call put back
        except BaseException as exc:
            exc.add_note("remove() had restored part of the model when this happened: call remove() again "
                         "to finish it (no collective), or discard() to give up the model.")
            raise
        self._binding = None
        self._ended()

    def _restored_streamed(self, rings: Sequence[BlockRing], lockstep: Sequence[BlockRing]
                           ) -> tuple[list[dict[int, list[torch.Tensor]]], Exception | None]:
        """:meth:`remove`'s gathers: every ring's streamed blocks in storage of their own, bound to
        nothing yet, and this rank's first failure, if any. With lockstep rings a failure of this
        rank's own (the device out of memory for a restored tensor) does not end it: each such
        ring makes all of its fills, as every rank of the weight group does
        (``BlockRing.restored_streamed``), and so does every ring after it, so that the ranks'
        gathers stay paired and the failure can be agreed on. A failed fill (a collective) ends
        it at once: no gather of the weight group can be trusted after it, so every lockstep
        ring refuses from then on."""
        streamed: list[dict[int, list[torch.Tensor]]] = []
        error: Exception | None = None
        for ring in rings:
            if error is not None and not ring._lockstep:  # no gathers to make: nothing to do
                streamed.append({})
                continue
            try:
                # After a failure the fills alone (what is restored would be dropped).
                streamed.append(ring.restored_streamed(self.device) if error is None
                                else ring.restored_streamed(self.device, keep=False))
            except Exception as exc:
                if ring._broken is not None:  # its fills failed: the weight group's gathers no longer pair
                    for other in lockstep:
                        other._broken = other._broken or ring._broken
                    raise RuntimeError(ring._broken) from exc
                if not lockstep:
                    raise
                error = error or exc
                streamed.append({})
        return streamed, error

    def discard(self) -> None:
        """End the offload without bringing the model back, for when the model is done with:
        remove the hooks; free the slots, device buffers and host copy (a shared copy is left to
        its other ranks) and the process groups setup created; and leave every streamed tensor
        empty (no elements). The streamed components cannot run after it (drop them;
        apply_offload refuses them); what did not stream stays where it is. :meth:`remove`
        restores the streamed tensors on the device instead, which needs room for all of them: a
        model that fits only streamed cannot have it. No collective but the process groups' release (every rank of a weight
        group calls it); calling it again, or after :meth:`remove`, does nothing."""
        if self._removed:
            return
        self._binding = None  # a remove() cut short: its restored tensors go with the model
        self._synchronize()  # the last copies and gathers may still write into the slots
        self._unguard_casts()
        self._close_watch()
        for ring in self.rings:
            # A later apply_offload refuses the module by this mark (its weights are gone).
            ring.component.module.__dict__[_DISCARDED_ATTR] = True
            tensors = ring.block_tensors()
            # Emptied first: its data was a slot, a device buffer or host bytes, and on a shared
            # ring a view of the host's copy, which leaving would otherwise take for a caller's
            # tensor and copy into this rank's memory.
            for tensor in tensors.values():
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            ring.release()
        for stored in self._stored:  # 8-bit storage's hooks (and the upcast buffers they hold)
            stored.discard()
        self._ended()

    def _ended(self) -> None:
        """The end of :meth:`remove` and :meth:`discard`: nothing left to own or undo."""
        self._ring_refs = []
        self._undo_moves = []
        self._groups.close()
        self._unmark()
        self._removed = True

    # -- setup helpers -----------------------------------------------------------------
    def _add_ring(self, ring: BlockRing, originals: list[list[torch.Tensor]] | None) -> None:
        module = ring.component.module
        _owned(module)["rings"].append(ring)
        # A component the user drops frees its offload as it goes, not at a garbage collection
        # that may never come: the ring's own objects refer to one another (hooks, events, the
        # transfer), so reference counting alone would not free its host copy and slots.
        # Detached when the ring is released (remove(), or a setup that failed).
        ring._on_drop = weakref.finalize(module, _free_dropped, ring)
        ring._on_drop.atexit = False
        self._ring_refs.append(weakref.ref(ring))
        if originals is not None:
            self._originals[id(ring)] = originals

    def _install(self, trace: bool, specs: Sequence["_RingSpec"]) -> None:
        for ring, spec in zip(self.rings, specs, strict=True):
            settled = spec.residency.settled
            if trace or not settled:
                ring.enable_trace()
            if not settled:  # measure a forward, then plan for good
                ring.watch_forwards(Replanner(spec.residency, spec.group, self.device, keep_trace=trace))
            if ring.streamed or not settled or trace:
                # A ring whose blocks all stay resident for good needs no hooks: the model runs
                # as it would without offloading (where the host is the bottleneck, hooks cost).
                ring.install_hooks()
        ringed = {id(ring.component.module) for ring in self.rings}
        for name, mod in self._modules.items():
            setattr(mod, _STATE_ATTR, self)
            # Looked up on the instance when pickling or deep-copying, before anything inside
            # the model is reached, such as diffusers' layerwise-casting hooks (local functions)
            # under 8-bit storage: the user meets this library's message, not one about a hook.
            for attr in _COPY_ATTRS:
                setattr(mod, attr, _RefuseCopy(name))
            # ``to``, ``half``, ``float``, ``cuda``... all call ``_apply``: see _RefuseCast. Only
            # where blocks were laid out: a VAE kept in float32 beside a bf16 DiT is cast as usual.
            if id(mod) in ringed:
                mod._apply = _RefuseCast(mod, name)
        # A pipeline's to(dtype) casts its modules one by one (diffusers' order): a refusal from
        # the streamed one would come after the modules before it were cast. Asked first.
        guards = [mod.__dict__["_apply"] for mod in self._modules.values()
                  if isinstance(mod.__dict__.get("_apply"), _RefuseCast)]
        if guards and not isinstance(self.target, nn.Module) and callable(getattr(self.target, "to", None)) \
                and "to" not in vars(self.target):
            self.target.to = _RefusePipelineCast(self.target, guards)
        # Adapters loaded or fused after this point reach the device (see tenants.py).
        self._watch = BlockWatch(self.rings)

    def _commit(self) -> None:
        """Setup succeeded everywhere: drop the original storage of allgather blocks, and the
        host copies of what moved to the device (kept only to undo a failed setup: held on, they
        would keep every non-block tensor in host memory too, a text encoder's embedding and the
        VAE among them, for the handle's life)."""
        self._originals = {}
        self._undo_moves = []
        for stored in self._stored:
            stored.commit()
        self._groups.close_exchange()

    def _rollback(self) -> None:
        """Undo a partial setup: blocks and resident tensors go back where they were."""
        self._unguard_casts()  # what undoing the storage does may cast
        self._synchronize()
        self._close_watch()
        for stored in self._stored:
            stored.undo()
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
        self._ring_refs = []
        self._originals = {}
        self._unmark()
        self._removed = True

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

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
            mod.__dict__.pop(_OWNED_ATTR, None)
            if getattr(mod, _STATE_ATTR, None) is self:
                delattr(mod, _STATE_ATTR)
                for attr in _COPY_ATTRS:
                    if isinstance(mod.__dict__.get(attr), _RefuseCopy):
                        delattr(mod, attr)

    def _unguard_casts(self) -> None:
        if isinstance(getattr(self.target, "__dict__", {}).get("to"), _RefusePipelineCast):
            del self.target.to
        for mod in self._modules.values():
            if getattr(mod, _STATE_ATTR, None) is self and isinstance(mod.__dict__.get("_apply"), _RefuseCast):
                del mod._apply


_COPY_ATTRS = ("__reduce_ex__", "__deepcopy__")


class _RefuseCast:
    """Set on each streamed component's module as ``_apply``, which ``to``, ``half``, ``float``,
    ``cuda`` and the like call: a change of dtype is refused before any tensor changes. The ring
    streams each block in the dtype it was laid out in, so a cast let through would reach the
    non-block tensors and fail at the next forward, the model left half cast. A move to a device
    (``pipe.to("cuda")``) goes through as before. Which dtypes ``fn`` makes is found by calling
    it on an empty tensor of each dtype and device the module holds."""

    __slots__ = ("_module", "_name", "__weakref__")

    def __init__(self, module: nn.Module, name: str) -> None:
        # Weakly: the module holds this guard (a strong reference back would make a cycle that
        # keeps a dropped component, and its offload, alive until a garbage collection).
        self._module = weakref.ref(module)
        self._name = name

    def __call__(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> nn.Module:
        module = self._module()
        stored = _stored_dtypes(module)
        self.check(fn, stored)
        if stored:
            # A tensor storage_dtype keeps in 8 bits stays so: a cast to the dtype it computes in
            # (which check() let through: the model's own) would otherwise upcast it for good.
            # A move to another device still moves it.
            def applied(t: torch.Tensor) -> Any:
                if id(t) not in stored:
                    return fn(t)
                probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
                if not isinstance(probe, torch.Tensor) or probe.dtype == t.dtype:
                    return fn(t)
                return t if probe.device == t.device else t.to(probe.device)
            return type(module)._apply(module, applied, recurse)
        return type(module)._apply(module, fn, recurse)

    def check(self, fn: Callable[[torch.Tensor], Any], stored: Mapping[int, torch.dtype] | None = None) -> None:
        """Raise if ``fn`` would change the dtype of a tensor of the module; changes nothing. A
        tensor stored in 8 bits (``storage_dtype``) is judged by the dtype it computes in, the one
        the model reports: a cast to it changes nothing."""
        module = self._module()
        if module is None:
            return
        if stored is None:
            stored = _stored_dtypes(module)
        seen: set[tuple[torch.dtype, torch.device]] = set()
        for t in (*module.parameters(), *module.buffers()):
            dtype = stored.get(id(t), t.dtype)
            if (dtype, t.device) in seen:
                continue
            seen.add((dtype, t.device))
            out = fn(torch.empty(0, dtype=dtype, device=t.device))
            if isinstance(out, torch.Tensor) and out.dtype != dtype:
                raise RuntimeError(
                    f"{self._name}: casting {type(module).__name__} ({dtype} tensors to {out.dtype}) after "
                    "apply_offload is refused, and nothing was changed: streamed blocks stay in the dtype "
                    "they were laid out in. Cast before apply_offload, or call remove() on the handle, "
                    "cast, and apply again.")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refuse_copy(self._name)


def _stored_dtypes(module: nn.Module | None) -> dict[int, torch.dtype]:
    """``id(tensor) -> the dtype it computes in`` of the module's tensors that ``storage_dtype``
    keeps in 8 bits (layers outside the blocks under diffusers' hook; the blocks' own under
    ``upcast: "layer"``)."""
    out: dict[int, torch.dtype] = {}
    if module is None:
        return out
    for stored in _owned(module)["stored"]:
        if isinstance(stored, LayerUpcasts):
            out.update(stored.compute_dtypes())
            continue
        for layer, compute, _originals in stored.layers:
            for t in (*layer.parameters(), *layer.buffers()):
                if t.is_floating_point() and t.dtype.itemsize == 1:
                    out[id(t)] = compute
    return out


class _RefuseCopy:
    """Set on a streamed component's module as ``__reduce_ex__`` and ``__deepcopy__``: pickling and
    ``copy.deepcopy`` look both up on the instance first (see ``OffloadHandle._install``)."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any) -> Any:
        raise refuse_copy(self._name)


class _RefusePipelineCast:
    """Set on an offloaded pipeline as ``to``: a dtype in the call is checked against every
    streamed component before diffusers' ``to`` casts any module, so a refused cast changes
    nothing (diffusers casts module by module: the text encoders would be cast before the DiT
    refused). Anything else goes to the class's ``to``."""

    __slots__ = ("_pipeline", "_guards", "_names")

    def __init__(self, pipeline: Any, guards: Sequence[_RefuseCast]) -> None:
        self._pipeline = pipeline
        # Weak: each guard lives on its component's module, which the pipeline may drop.
        self._guards = [weakref.ref(guard) for guard in guards]
        self._names = [guard._name for guard in guards]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dtypes = [a for a in (*args, kwargs.get("dtype")) if isinstance(a, torch.dtype)]
        for dtype in dtypes:
            def cast(t: torch.Tensor, dtype: torch.dtype = dtype) -> torch.Tensor:  # as Module.to casts
                return t.to(dtype) if t.is_floating_point() or t.is_complex() else t
            for ref in self._guards:
                guard = ref()
                if guard is not None:
                    guard.check(cast)
        return type(self._pipeline).to(self._pipeline, *args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refuse_copy(self._names[0])


def _free_dropped(ring: BlockRing) -> None:
    """A streamed component was dropped (nothing refers to its module): free its ring's slots,
    device buffers and host copy now (a shared copy is left, an allgather shard freed). Its
    blocks' tensors go with the module."""
    try:
        if ring.device.type == "cuda":
            torch.cuda.synchronize(ring.device)  # its last copies may still be in flight
        shared = _shared_of(ring.transfer)
        if shared is not None:
            # The module's parameters still view the shared copy (they go just after this, with
            # the module's attributes): leaving now would copy every block to keep them valid.
            shared.leave_after(ring.block_tensors())
        ring.release()
    except Exception:  # noqa: BLE001 - called as the module is freed: nothing to raise into
        logger.warning("%s: freeing the offload of the dropped component failed", ring.component.name,
                       exc_info=True)


def _owned(module: nn.Module) -> dict[str, list]:
    """What ``module`` owns of an offload: its rings and 8-bit layers (see OffloadHandle)."""
    owned = module.__dict__.get(_OWNED_ATTR)
    if owned is None:
        owned = module.__dict__[_OWNED_ATTR] = {"rings": [], "stored": []}
    return owned


def _set_data(tensor: torch.Tensor, data: torch.Tensor) -> None:
    tensor.data = data


def _shared_of(transfer: Any) -> SharedTransfer | None:
    """The shared transfer of a ring, under its 8-bit upcast if it has one."""
    transfer = getattr(transfer, "inner", transfer)
    return transfer if isinstance(transfer, SharedTransfer) else None


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
    with contextlib.ExitStack() as mode:
        return _apply_offload(target, config, device=device, plan=plan, process_group=process_group,
                              trace=trace, block_sources=block_sources, progress=progress, mode=mode)


def _apply_offload(target: Any, config: OffloadConfig | Mapping[str, Any] | str, *, device: torch.device | str | None,
                   plan: OffloadPlan | None, process_group: Any | None, trace: bool | None,
                   block_sources: Mapping[str, BlockSource] | None, progress: bool, mode: contextlib.ExitStack) -> OffloadHandle:
    # Phase 1 reads only: nothing below changes the target until the handle exists.
    for flag, value in (("trace", trace), ("progress", progress)):
        if value is not None and not isinstance(value, bool):
            raise OffloadConfigError(f"{flag} must be True or False (or None), found {value!r} "
                                     f"({type(value).__name__}).")
    cfg = OffloadConfig.parse(config)
    dev = checked_device(device)
    modules = _fresh_modules(target)
    components = discover(target, cfg, plan)
    for c in components:
        _check_not_quantized(c)
    casts = _stored_casts(components, cfg)
    for stored in {d for cast in casts.values() for d in cast.values()}:
        _check_cast(stored, dev)
    per_layer = {c.name for c in components if c.name in casts and cfg.options_for(c.category).upcast == "layer"}
    layouts = {c.name: [layout_block(i, n, b, cast=casts.get(c.name), per_layer=c.name in per_layer)
                        for i, (n, b) in enumerate(c.blocks)] for c in components}
    check_ownership(((c.name, layouts[c.name]) for c in components), modules)
    _check_not_meta(modules, {id(e.tensor) for ls in layouts.values() for layout in ls for e in layout.entries})
    # What the rings make (host copies, slots, staging) is ordinary tensors whatever mode the
    # caller sets up in: later fills write into them in place in whatever mode the forwards run
    # (a pipeline's __call__ is no_grad, not inference_mode), and their version counters see
    # writes made between forwards. Inference tensors only for a model built under
    # inference_mode: its parameters cannot point at ordinary storage.
    mode.enter_context(torch.inference_mode(
        any(e.inference for ls in layouts.values() for layout in ls for e in layout.entries)))
    for c in components:
        for name, block in c.blocks:  # first: a block's own name in the message
            check_not_cuda_graphs(f"{c.name} block {name}", block)
        check_not_cuda_graphs(c.name, c.module)
    sources = _checked_sources(block_sources, components)
    for c in components:
        if c.name in per_layer and not hasattr(c.module, "enable_layerwise_casting"):
            raise OffloadConfigError(
                f"{c.name} ({type(c.module).__name__}): upcast 'layer' needs a diffusers model, whose "
                "layers read their weights only in their own forward (what diffusers' layerwise casting "
                "relies on too); use upcast 'block' (the default) for this component.")
    _check_process_group(process_group)
    groups = GroupSession(cfg.collective_timeout_s)
    try:
        specs = _ring_specs(components, layouts, cfg, dev, process_group, sources, groups)
        specs = _with_residency(specs, cfg, dev, modules, groups)
        specs = _with_shared_copies(specs, groups)
    except BaseException as exc:
        groups.tell_failure(exc)  # shared: the others wait for this rank's plan (plan_shared)
        groups.close()
        raise

    # Phase 2 changes the target; any failure undoes it.
    handle = OffloadHandle(target, modules, dev, cfg, groups)
    gathers = any(s.group is not None for s in specs)
    setup = _Setup.start(cfg, dev, gathers, progress, groups)
    filled: list[_Filled] = []  # host copies whose rings are not built yet: undone here on a failure
    try:
        in_blocks = {id(e.tensor) for ls in layouts.values() for l in ls for e in l.entries}
        upcasts = {}
        for c in components:
            if c.name in per_layer:  # before the rings point the tensors at their 8-bit bytes
                upcasts[c.name] = upcast_per_layer(c.module, casts[c.name], in_blocks, dev)
                handle._keep_stored(c.module, upcasts[c.name])
        # Every ring's host copy first (and a ring of 8-bit images that does not gather, its
        # resident images): this rank's own work, which may fail on this rank only (page-locking,
        # host or device memory; a shared ring's fill agrees with the other ranks itself). Then,
        # where some ring gathers, the ranks agree that every copy is filled before any makes a
        # collective of the weight group (the gathers that bring in a ring's 8-bit images, the
        # copy-engine gather's slots: a rendezvous). A rank that failed here would otherwise be
        # told of in the setup's last agreement, where it would wait while the others waited in
        # that collective until collective_timeout_s.
        for spec in specs:
            filled.append(_fill_ring(spec, setup))
            if spec.group is None:
                _hold_images(filled[-1])
        if gathers:
            _agree_filled(groups)
        for fill in filled:
            if fill.spec.group is not None:  # agreed before its first gather (CastingTransfer.hold)
                _hold_images(fill)
        # The rings whose slots are this rank's own first, then those of a gather: the
        # copy-engine gather's slots are a collective (agreed before its rendezvous), which a rank
        # whose device could not hold another ring's slots must not leave the others waiting in.
        built = {k: None for k in range(len(filled))}
        for k in sorted(built, key=lambda k: filled[k].spec.group is not None):
            built[k] = _ring_of(filled[k], setup)  # a failure: every fill is still listed, undone below
        for k in built:
            ring, originals = built[k]
            spec = filled.pop(0).spec
            if spec.component.name in upcasts:
                ring.upcasts = upcasts[spec.component.name].compute_dtypes()
            handle._add_ring(ring, originals)
        handle._move_resident(in_blocks)
        for c in components:
            if c.name in casts:
                handle._keep_stored(c.module, store_outside_blocks(c.module, casts[c.name], in_blocks))
        handle._install(trace_enabled(trace), specs)
    except BaseException as exc:
        try:
            for fill in reversed(filled):
                _undo_filled(fill)
        finally:
            _undo_setup(handle, groups, specs, exc)
        raise
    finally:
        setup.pin.close()
    _agree_all_or_nothing(handle, groups, specs)
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
    storage_dtype: str | None = None
    """``layer_options.<c>.storage_dtype``."""
    upcast: str = "block"
    """``layer_options.<c>.upcast``: with ``"layer"``, the layouts are planned in the stored
    dtype and the blocks stream as any others do ([Note: upcast per layer])."""
    host: HostRanks | None = None
    """Set when the ring streams from a host copy shared by the ranks of this host."""
    shared: SharedBlocks | None = None
    """That host copy, once created and mapped (``_with_shared_copies``)."""
    residency: Residency = Residency()
    """Which blocks start resident, the slots, and whether a measured forward re-plans."""

    def slot_bytes(self) -> list[int]:
        """Per block, the slot bytes it needs when it streams. A ring of stored images runs every
        block from a slot and also holds two staging buffers of the largest streamed image
        (``image_slot_bytes``)."""
        if self.stored:
            return list(image_slot_bytes([l.nbytes for l in self.layouts], self.image_bytes()))
        if self.group is None:
            return [l.nbytes for l in self.layouts]
        return [s.padded_nbytes for s in self.shard_plans()]

    def image_bytes(self) -> list[int]:
        """Per block, device bytes of its stored image as it arrives (gathered: padded to a whole
        number of chunks per rank), what a staging buffer or a kept image takes."""
        if self.group is None:
            return [l.image_nbytes for l in self.layouts]
        return [s.padded_nbytes for s in self.shard_plans()]

    def shard_plans(self) -> list[ShardPlan]:
        return [plan_shards(l.image_nbytes, self.group.size, self.group.rank, self.chunk_bytes) for l in self.layouts]

    @property
    def stored(self) -> bool:
        """Whether some block is stored in another dtype on the host (``storage_dtype``) and
        upcast into its slot as a whole (``upcast: "block"``)."""
        return any(l.image is not None for l in self.layouts)

    @property
    def keeps_originals(self) -> bool:
        """Whether a rank-local fill keeps the blocks' original storage until setup has
        succeeded: their host copy holds other values (8-bit), so it cannot give them back."""
        return self.stored or (self.storage_dtype is not None and self.upcast == "layer")


def _stored_casts(components: Sequence[StreamedComponent], cfg: OffloadConfig) -> dict[str, dict[int, torch.dtype]]:
    """Per component with a ``storage_dtype``, the tensors stored in it (``storage.py``). Refuses
    a component diffusers' layerwise casting already stores: reads only, before setup."""
    out = {}
    for c in components:
        stored = cfg.options_for(c.category).storage_dtype
        if stored is not None:
            _check_not_layerwise_cast(c, stored)
            out[c.name] = cast_tensors(c.module, getattr(torch, stored))
    return out


def quantization_method(config: Any) -> str | None:
    """The method a ``quantization_config`` names (an object, or the dict a config.json holds)."""
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    method = getattr(method, "value", method)  # diffusers and transformers use an enum
    return str(method) if method else None


def _check_not_meta(modules: Mapping[str, nn.Module], in_blocks: set[int]) -> None:
    """What does not stream moves to the device in phase 2, where a tensor on the meta device
    would fail with torch's message, naming nothing: refused here, naming it (the blocks' own
    tensors are checked as they are laid out)."""
    for name, root in modules.items():
        for qual, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
            if id(t) not in in_blocks and t.is_meta:
                raise OffloadConfigError(
                    f"{name}.{qual} is on the meta device: load real weights before offloading "
                    "(e.g. call to_empty() and load a state dict, or build the model with "
                    "from_pretrained without leaving weights on 'meta').")


def _check_not_quantized(comp: StreamedComponent) -> None:
    """A model loaded with a ``quantization_config`` (bitsandbytes, quanto, torchao, GGUF, ...)
    carries its quantizer: refused before anything changes."""
    quantizer = getattr(comp.module, "hf_quantizer", None)
    if quantizer is not None:
        method = quantization_method(getattr(quantizer, "quantization_config", None))
        raise quantized_refusal(f"{comp.name} ({type(comp.module).__name__})", method or type(quantizer).__name__)


def _check_not_layerwise_cast(comp: StreamedComponent, stored: str) -> None:
    """``storage_dtype`` stores a component as ``enable_layerwise_casting`` would; on one that
    already has its hooks, it would store it again (and diffusers refuses a second hook)."""
    hooked = layerwise_cast_modules(comp.module)
    if hooked:
        raise OffloadConfigError(
            f"{comp.name} ({type(comp.module).__name__}): already layerwise-cast ({hooked[0]}"
            f"{f' and {len(hooked) - 1} more layers' if len(hooked) > 1 else ''} carry diffusers' layerwise "
            f"casting hook, from enable_layerwise_casting): storage_dtype {stored} would store it a second "
            "time. Drop storage_dtype (offloading streams its 8-bit weights as they are, and diffusers' hooks "
            "upcast them), or reload the model without enable_layerwise_casting and keep storage_dtype.")


def _check_cast(stored: torch.dtype, dev: torch.device) -> None:
    """The device can cast to and from ``stored`` (the upcast runs there)."""
    try:
        torch.ones(2, device=dev).to(stored).to(torch.float32)
    except (RuntimeError, TypeError) as exc:
        raise OffloadConfigError(
            f"storage_dtype {str(stored).removeprefix('torch.')}: {dev} cannot cast to and from it "
            f"({type(exc).__name__}: {exc}); drop storage_dtype or use another device.") from None


def checked_device(device: torch.device | str | None) -> torch.device:
    """``device`` resolved, or an :class:`OffloadConfigError` naming what this host has: a CUDA
    device that is visible, or the CPU (what :func:`apply_offload` checks first)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = f"{visible} CUDA device(s) visible" if visible else "no CUDA device visible"
    try:
        dev = resolve_device(device)
    except (RuntimeError, AssertionError, ValueError, TypeError) as exc:
        raise OffloadConfigError(f"device {device!r} is not a device here ({exc}; {where}): use 'cuda', "
                                 "'cuda:N' or 'cpu'.") from None
    if dev.type not in ("cuda", "cpu"):
        raise OffloadConfigError(f"device {dev} is not supported: use a CUDA device or 'cpu'.")
    if dev.type == "cuda" and not 0 <= dev.index < visible:
        raise OffloadConfigError(
            f"device {dev}: {where}" + (f" (indices 0 to {visible - 1}): use one of them, or" if visible else
                                        " (check CUDA_VISIBLE_DEVICES and the driver): use") + " device 'cpu'.")
    return dev


def _fresh_modules(target: Any) -> dict[str, nn.Module]:
    """The target's modules by attribute name; none may be offloaded already, nor hold a module
    that is (a wrapper around an offloaded model would stream its blocks a second time)."""
    modules = {"transformer": target} if is_bare_module(target) else pipeline_modules(target)
    for name, root in modules.items():
        for sub, mod in root.named_modules():
            where = f"{name}.{sub}" if sub else name
            if mod.__dict__.get(_DISCARDED_ATTR):
                raise OffloadConfigError(
                    f"{where} ({type(mod).__name__}) was emptied by OffloadHandle.discard() (Omni.close() calls "
                    "it): its streamed weights are gone. Load the model again; to keep a model after offloading, "
                    "end the offload with remove() instead.")
            handle = mod.__dict__.get(_STATE_ATTR)
            if handle is not None:
                streamed = sorted({ring.component.name for ring in handle.rings})
                raise OffloadConfigError(
                    f"{where} ({type(mod).__name__}) belongs to an earlier apply_offload (streaming "
                    f"{streamed or 'nothing'}; the rest it placed on the device): call remove() on the handle "
                    "that apply_offload returned before applying again."
                )
    return modules


def _resident_indices(comp: StreamedComponent, asked: int | tuple[int, ...] | None, nbytes: Sequence[int],
                      slot_bytes: Sequence[int], run_slot_bytes: int) -> tuple[int, ...]:
    """Which blocks stay on the device. For a count, the planner picks which
    (``residency.pick_resident``, from the blocks' sizes: the same on every rank)."""
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
        return pick_resident(nbytes, slot_bytes, asked, run_slot_bytes)
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
    if _is_non_member(process_group):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "?"
        raise OffloadConfigError(
            f"process_group is torch.distributed.GroupMember.NON_GROUP_MEMBER on rank {rank}: rank {rank} is "
            "not a member of the process_group it passed (new_group(ranks) returns NON_GROUP_MEMBER on the "
            "ranks not in ranks). Every rank must pass a group that contains it: new_group is collective, "
            "so every rank creates every group and each passes its own group's handle (in a [0, 1] + [2] "
            "split, new_group([0, 1]) on ranks 0 and 1 and new_group([2]) on rank 2), or None on every "
            "rank for one group per host."
        )
    if process_group is not None and not isinstance(process_group, torch.distributed.ProcessGroup):
        raise OffloadConfigError(
            f"process_group must be a torch.distributed ProcessGroup, found "
            f"{type(process_group).__name__}: pass a group from torch.distributed.new_group(ranks), "
            "or None for one group per host."
        )


def _is_non_member(process_group: Any | None) -> bool:
    """Whether ``process_group`` is what ``new_group`` returns on a rank outside its ranks."""
    member = getattr(torch.distributed, "GroupMember", None)
    non_member = getattr(member, "NON_GROUP_MEMBER", None)
    if process_group is None or non_member is None:
        return False
    return process_group is non_member or (type(process_group) is type(non_member) and process_group == non_member)


def _ring_specs(components: Sequence[StreamedComponent], layouts: Mapping[str, Sequence[BlockLayout]],
                cfg: OffloadConfig, dev: torch.device, process_group: Any | None,
                sources: Mapping[str, BlockSource], groups: GroupSession) -> list[_RingSpec]:
    """How each component streams. Components asking for allgather get the weight group that
    every rank agrees on, or all stream rank-local with the same reason. First, where some
    component asks for allgather or shared, the ranks compare what they ask for."""
    ask = _setup_ask(components, cfg, process_group)
    if any(t != "rank-local" for _, t in ask.transfers.values()):
        groups.compare_asks(ask)
    gathered = [c for c in components if cfg.options_for(c.category).weight_transfer == "allgather"]
    shared = [c for c in components if cfg.options_for(c.category).weight_transfer == "shared"]
    try:
        # Both kinds before the first exchange: a cold start reads each tensor's first bytes from
        # its checkpoint here, which can fail on one rank only (a read error on its host).
        facts = {c.name: _allgather_facts(c, layouts[c.name], cfg, sources.get(c.name)) for c in gathered}
        sharing = {c.name: _shared_facts(c, layouts[c.name], sources.get(c.name)) for c in shared}
    except Exception as exc:
        # The others wait in the next exchange: they learn why there (an error naming this rank)
        # instead of a lost connection, and this rank raises its own.
        why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        with contextlib.suppress(Exception):  # an exchange failing too must not hide why this rank failed
            if gathered:
                groups.resolve(why, dev, process_group)
            elif shared:
                groups.resolve_shared(why, dev)
        raise
    group, reason = groups.resolve(facts, dev, process_group) if facts else (None, None)
    if group is not None:
        _check_gather(facts, group, dev)
    host, host_reason = groups.resolve_shared(sharing, dev) if sharing else (None, None)
    specs = []
    for c in components:
        opts = cfg.options_for(c.category)
        base = _RingSpec(c, layouts[c.name], sources.get(c.name), storage_dtype=opts.storage_dtype,
                         upcast=opts.upcast)
        if c.name in sharing:
            specs.append(dataclasses.replace(base, host=host) if host is not None
                         else dataclasses.replace(base, fallback_reason=host_reason))
        elif c.name not in facts:
            specs.append(base)
        elif group is None:
            specs.append(dataclasses.replace(base, fallback_reason=reason))
        else:
            specs.append(dataclasses.replace(base, group=group, gather=_gather_of(cfg, c, group, dev),
                                             chunk_bytes=facts[c.name].chunk_bytes))
    return specs


def _setup_ask(components: Sequence[StreamedComponent], cfg: OffloadConfig, process_group: Any | None) -> SetupAsk:
    """What this rank asks for that the other ranks depend on: every component's transfer; for
    one whose weights the ranks share, what its bytes are (both transfers) and the sequence of
    gathers (allgather: chunks, gather, which blocks stream; a ``device_budget`` decides that
    too, and "auto" takes the smallest over the group, a collective); the process group."""
    transfers, settings = {}, {}
    for c in components:
        opts = cfg.options_for(c.category)
        key = f"layer_options.{c.category}."
        transfers[c.name] = (key + "weight_transfer", opts.weight_transfer)
        if opts.weight_transfer == "rank-local":
            continue
        asked: dict[str, Any] = {"storage_dtype": opts.storage_dtype, "upcast": opts.upcast}
        if opts.weight_transfer == "allgather":
            asked |= {"chunk_mib": opts.chunk_mib, "gather": opts.gather, "resident_blocks": opts.resident_blocks}
        settings[c.name] = {key + k: v for k, v in asked.items()}
        if opts.weight_transfer == "allgather":
            settings[c.name]["device_budget"] = cfg.device_budget
    ranks = tuple(torch.distributed.get_process_group_ranks(process_group)) if process_group is not None else None
    return SetupAsk(transfers, settings, ranks)


def _allgather_facts(comp: StreamedComponent, layouts: Sequence[BlockLayout], cfg: OffloadConfig,
                     source: BlockSource | None) -> ComponentFacts:
    """What must match across ranks for an allgather component."""
    opts = cfg.options_for(comp.category)
    samples = sample_digest(layouts, elements=source.elements if source is not None else None)
    return ComponentFacts("allgather", int(opts.chunk_mib * 2**20), opts.gather,
                          tuple(l.name for l in layouts), tuple(layout_digest(layouts)), tuple(samples))


def _shared_facts(comp: StreamedComponent, layouts: Sequence[BlockLayout], source: BlockSource | None) -> ComponentFacts:
    """What must match across ranks for a component whose host copy they share: each rank fills
    part of it, so the same layout and weights everywhere."""
    samples = sample_digest(layouts, elements=source.elements if source is not None else None)
    return ComponentFacts("shared", 0, "", tuple(l.name for l in layouts), tuple(layout_digest(layouts)),
                          tuple(samples))


def _with_shared_copies(specs: Sequence[_RingSpec], groups: GroupSession) -> list[_RingSpec]:
    """Create and map the host copy of every shared ring (collective: every rank, in ring order).

    The ranks first say, in one exchange, which blocks of each shared ring each streams (a block
    every rank of the host keeps resident for good has no place in the copy), or why they could
    not get this far (``GroupSession.tell_failure``: every other rank then raises an error
    naming that rank). The host's first rank checks that the host has the memory for every
    shared copy of this call together, then per ring creates the files and offers them; the
    others collect and map them. Not enough memory on any host raises the same error
    everywhere, naming the total and each copy, before anything has changed; a hand-over that
    fails on any rank makes every rank stream rank-local, with the reason."""
    out = list(specs)
    host = groups.host  # set on every rank alike (resolve_shared), and then on every shared ring
    if host is None:
        return out
    shared = [k for k, spec in enumerate(out) if spec.host is not None]
    plans = groups.plan_shared({out[k].component.name: _streamed_blocks(out[k]) for k in shared})
    copies = {k: _copy_layout(out[k], [p[out[k].component.name] for p in plans], host) for k in shared}
    space = _space_shortfall([(out[k].component.name, copies[k][0].nbytes) for k in shared], host) \
        if host.index == 0 else None
    try:
        for n, k in enumerate(shared):
            if out[k].host is not None:  # not if an earlier ring's hand-over failed: it falls back too
                out[k:] = _map_shared_copy(out[k:], *copies[k], groups, space if n == 0 else None)
    except BaseException:
        for spec in out:
            if spec.shared is not None:
                spec.shared.close()
        raise
    if not any(spec.shared is not None for spec in out):
        # Every shared ring fell back: the ranks no longer depend on each other's setup (unless a
        # weight group ties them). While one copy is in use, setup's end stays agreed (its
        # ranks wrote it together).
        groups.host = None
    return out


def _streamed_blocks(spec: _RingSpec) -> tuple[int, ...]:
    """The blocks of a shared ring this rank streams (all but those it keeps resident for good)."""
    keep = set(spec.residency.resident) if spec.residency.settled and not spec.stored else set()
    return tuple(i for i in range(len(spec.layouts)) if i not in keep)


def _copy_layout(spec: _RingSpec, users: Sequence[Sequence[int]],
                 host: HostRanks) -> tuple[CopyLayout, list[tuple[int, ...]]]:
    """What a shared ring's copy on this host holds, from which blocks each rank streams
    (``users``, by global rank): every block some rank of the host streams; and per block, the
    host ranks (0 .. size - 1) that stream it."""
    per_block = [tuple(j for j, r in enumerate(host.ranks) if i in users[r]) for i in range(len(spec.layouts))]
    return CopyLayout(tuple(l.image_nbytes if per_block[l.index] else None for l in spec.layouts),
                      host.size), per_block


def _space_shortfall(copies: Sequence[tuple[str, int]], host: HostRanks) -> str | None:
    """The host's first rank: why this host lacks the memory for every shared copy of this call
    together (component, bytes), or None when it has it (or cannot tell). The files are sparse
    until the fill, so each copy is checked against what the others will take too."""
    free = available_host_bytes()
    need = sum(nbytes for _, nbytes in copies)
    if free is None or free >= need:
        return None
    names = ", ".join(name for name, _ in copies)
    if len(copies) == 1:
        return (f"{names}: host {host.node} has {_host_size(free)} of memory available, and the shared host copy "
                f"of {names} needs {_host_size(need)}")
    parts = " + ".join(f"{name} {_host_size(nbytes)}" for name, nbytes in copies)
    return (f"{names}: host {host.node} has {_host_size(free)} of memory available, and the shared host copies "
            f"of this apply_offload need {_host_size(need)} together ({parts})")


def _host_size(nbytes: int) -> str:
    """GiB, or MiB below a quarter of one."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


_HAND_OVER_NOTE = ("apply_offload could not hear from the host's other ranks while {step} {name}'s shared host "
                   "copy: a rank died, stalled past collective_timeout_s or reached another step of setup: see "
                   "its output, then restart the job (its process group is likely broken). This rank's model "
                   "is as it was.")


def _map_shared_copy(specs: list[_RingSpec], layout: CopyLayout, per_block: Sequence[tuple[int, ...]],
                     groups: GroupSession, space: str | None) -> list[_RingSpec]:
    """:func:`_with_shared_copies` for ``specs[0]``, whose copy holds ``layout`` (``per_block``:
    the host ranks that stream each block); the rest come back as they are, or, when its
    hand-over failed, falling back to rank-local with it. ``space``: the host's first rank found
    the host short of memory for every copy of the call (given with the first ring only): every
    rank raises it, and nothing is created."""
    spec, host, out = specs[0], specs[0].host, list(specs)
    name = spec.component.name
    offer, blocks, said = None, None, None
    if host.index == 0:
        if space is not None:
            said = ("space", space)
        else:
            try:
                blocks = SharedBlocks.create(f"omni-offload:{host.job}:{spec.component.name}", layout, per_block)
                offer = Offer(host.job, spec.component.name)
                said = ("offer", (offer.address, offer.key))
            except Exception as exc:  # noqa: BLE001 - every rank falls back with this reason
                if blocks is not None:
                    blocks.close()
                    blocks = None
                why = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                    why = out_of_descriptors("creating its files", layout.files, exc)
                said = ("failed", f"creating the shared host copy failed on rank {host.ranks[0]}: {why}")
    try:
        told = groups.all_gather(said, f"{name}: offer the shared copy")
    except BaseException as exc:
        if blocks is not None:
            blocks.close()
        exc.add_note(_HAND_OVER_NOTE.format(name=name, step="offering"))
        raise
    error, serving = None, None
    try:
        if short := next((t[1] for t in told if t is not None and t[0] == "space"), None):
            raise OffloadConfigError(
                f"{short}. Free host memory, store the blocks in 8 bits (storage_dtype), keep blocks "
                "resident (device_budget), or give each rank a shard (weight_transfer: allgather).")
        try:
            kind, what = told[host.ranks[0]]
            if kind != "offer":
                raise SharedMemoryError(what)
            # Every rank of the host is here (the exchange above): a hand-over takes
            # milliseconds. The first rank serves from a thread and goes on to the exchange
            # below, where each peer says whether it got the file (one that could not connect
            # says so at once).
            wait_s = min(groups.timeout_s, _HAND_OVER_S)
            if host.index == 0:
                serving = offer.serve(blocks.fds(), host.size - 1, wait_s)
            else:
                address, key = what
                blocks = SharedBlocks.open(receive(address, key, layout.files, wait_s), layout, host.index)
        except Exception as exc:  # noqa: BLE001 - every rank falls back with this reason
            error = f"rank {torch.distributed.get_rank()} could not map the shared host copy: {exc}"
        try:
            failed = [e for e in groups.all_gather(error, f"{name}: map the shared copy") if e is not None]
        except BaseException as exc:
            exc.add_note(_HAND_OVER_NOTE.format(name=name, step="mapping"))
            raise
    except BaseException:
        if blocks is not None:
            blocks.close()
        raise
    finally:
        if offer is not None:
            offer.close()
        if serving is not None:
            serving.join()
    if failed:
        if blocks is not None:
            blocks.close()
        for j, other in enumerate(specs):  # every shared ring from this one on falls back
            if other.host is not None:
                out[j] = dataclasses.replace(other, host=None, fallback_reason=failed[0])
        return out
    out[0] = dataclasses.replace(spec, shared=blocks)
    return out


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
def _with_residency(specs: Sequence[_RingSpec], cfg: OffloadConfig, dev: torch.device,
                    modules: Mapping[str, nn.Module], groups: GroupSession) -> list[_RingSpec]:
    """Each ring's starting residency (``budget.initial_residency``). Under allgather the ranks
    of a weight group then compare it: it decides which blocks each gathers, and when."""
    sizes = []
    for s in specs:
        asked = cfg.options_for(s.component.category).resident_blocks
        # A ring of 8-bit images keeps a resident block as its image (see BlockRing.held).
        nbytes = tuple(s.image_bytes() if s.stored else (l.nbytes for l in s.layouts))
        slot_bytes = tuple(s.slot_bytes())
        run_slot_bytes = max(l.nbytes for l in s.layouts) if s.stored else 0
        fixed = (_resident_indices(s.component, asked, nbytes, slot_bytes, run_slot_bytes)
                 if asked is not None else None)
        sizes.append(RingSizes(s.component.name, s.component.category, nbytes, slot_bytes, fixed,
                               run_slot_bytes=run_slot_bytes))
    group = next((s.group for s in specs if s.group is not None), None)
    blocks = [e.tensor for s in specs for l in s.layouts for e in l.entries]
    try:
        chosen = initial_residency(sizes, cfg.device_budget, lambda: auto_budget(cfg, dev, modules, blocks, group))
    except Exception as exc:
        if groups.group is not None:  # the others wait for this rank's plan: tell them why there is none
            groups.compare_residency(f"{type(exc).__name__}: {exc}")
        raise
    out = [dataclasses.replace(s, residency=chosen[s.component.name]) for s in specs]
    if groups.group is not None:  # the same on every rank (resolve)
        groups.compare_residency({s.component.name: _residency_facts(s.residency) for s in out if s.group is not None})
    return out


def _residency_facts(residency: Residency) -> dict[str, Any]:
    """What of a ring's residency the ranks of a weight group must share, by what it is called
    in an error."""
    return {"resident blocks": residency.resident, "slots": residency.num_slots,
            "final plan (no re-plan after a measured forward)": residency.settled,
            "budget share": residency.budget, "device_budget auto": residency.fewest}


# -- phase 2: fill host copies, build rings ---------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class _Setup:
    """What every ring of one ``apply_offload`` shares."""

    device: torch.device
    pin: HostPinner
    streams: TransferStreams
    timeout_s: float
    progress: bool
    groups: GroupSession | None = None
    """The job's setup exchanges (shared rings agree once every rank has written its part)."""

    @classmethod
    def start(cls, cfg: OffloadConfig, dev: torch.device, gathers: bool, progress: bool,
              groups: GroupSession | None = None) -> _Setup:
        cuda = dev.type == "cuda"
        # The copy stream exists so host-to-device copies run beside compute instead of behind
        # it; the comm stream so the gather (NCCL all-gathers, or the copy-engine pulls from the
        # peers' slots) runs beside both. High priority for the same reason as the weight
        # group's NCCL stream (transfer.groups._nccl_options).
        streams = TransferStreams(copy=torch.cuda.Stream(dev) if cuda else None,
                                  comm=torch.cuda.Stream(dev, priority=-1) if cuda and gathers else None)
        return cls(dev, HostPinner.for_device(cfg.pin_memory, cfg.pin_failure, dev), streams,
                   cfg.collective_timeout_s, progress, groups)


@dataclasses.dataclass(slots=True)
class _Filled:
    """One ring's host copy, filled, before its ring is built."""

    spec: _RingSpec
    transfer: Any
    parked: list
    resident: dict[int, torch.Tensor]
    originals: list[list[torch.Tensor]] | None
    """allgather (and 8-bit copies): the blocks' original storage, kept until every rank's setup
    has succeeded."""
    seconds: float
    """Spent filling and page-locking it (and bringing its 8-bit images in)."""


def _fill_ring(spec: _RingSpec, setup: _Setup) -> _Filled:
    """One component's host copy (this rank's shards under allgather), its blocks' tensors
    parked on it, and its transfer. Undoes itself on a failure."""
    start = time.perf_counter()
    with _setup_bar(setup.progress, spec) as step:
        if spec.group is not None:
            transfer, parked, resident, originals = _fill_shards(spec, setup, step)
        elif spec.shared is not None:
            transfer, parked, resident, originals = _fill_shared(spec, setup, step)
        else:
            transfer, parked, resident, originals = _fill_buffers(spec, setup, step)
    filled = _Filled(spec, transfer, parked, resident, originals, 0.0)
    if spec.stored:
        try:
            filled.transfer = CastingTransfer(transfer, spec.layouts, spec.storage_dtype, setup.streams, setup.device,
                                              spec.component.name)
        except BaseException:
            _undo_filled(filled)
            raise
    filled.seconds = time.perf_counter() - start
    return filled


def _hold_images(filled: _Filled) -> None:
    """A ring of 8-bit images brings its plan's images in before its ring is built (which then
    sizes its staging buffers to the images that still stream), and before the ranks agree at
    the end of setup, so that a failure here (the device out of memory) is one every rank hears
    of. Under a gather it is collective: ``hold`` agrees with the weight group before its first
    gather (every rank raises there alike; each tells the ranks of other weight groups at its
    undo). A shared ring's fill has agreed already that every rank wrote its part: the copy
    holds every block."""
    spec, residency = filled.spec, filled.spec.residency
    if not (spec.stored and residency.resident):
        return
    start = time.perf_counter()
    filled.transfer.hold(residency.resident)
    if residency.settled:  # resident for good: held blocks give up their host copies
        for i in residency.resident:
            if filled.transfer.has_host_copy(i):
                filled.transfer.drop(i)
    filled.seconds += time.perf_counter() - start


def _ring_of(filled: _Filled, setup: _Setup) -> tuple[BlockRing, list[list[torch.Tensor]] | None]:
    """The ring of a filled host copy, and (allgather) its blocks' original storage, kept until
    every rank's setup has succeeded. On a failure the caller undoes the fill
    (:func:`_undo_filled`)."""
    spec = filled.spec
    ring = BlockRing(spec.component, spec.layouts, filled.transfer, setup.device, filled.parked, filled.resident,
                     spec.residency.num_slots)
    ring.setup_s = filled.seconds
    ring.storage_dtype = spec.storage_dtype
    ring.upcast = spec.upcast if spec.storage_dtype is not None else None
    ring.plan = spec.residency.plan
    ring.budget = spec.residency.budget
    return ring, filled.originals


def _undo_filled(filled: _Filled) -> None:
    """A host copy whose ring was not built: give the blocks their storage back (as
    ``_fill_buffers`` does on a failure), free the copy."""
    spec, parked, resident = filled.spec, filled.parked, filled.resident
    if filled.originals is None:
        restore_blocks(spec.layouts, [parked[i] if parked[i] is not None else
                                      [e.view_in(resident[i]) for e in l.entries]
                                      for i, l in enumerate(spec.layouts)], None)
    else:
        for layout, data in zip(spec.layouts, filled.originals):
            bind(layout.entries, data)
    filled.transfer.release()


def _device_copy(spec: _RingSpec, layout: BlockLayout, setup: _Setup, image: torch.Tensor | None) -> torch.Tensor:
    """A resident block's device buffer, filled from ``image`` (its bytes on the host), or from
    the source, or from the block's own tensors."""
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=setup.device)
    if image is None and layout.image is not None:  # stored in another dtype: through its image
        image = _image_from_tensors(layout, torch.empty(layout.image_nbytes, dtype=torch.uint8, device="cpu"))
    if image is None and spec.source is not None:
        image = torch.empty(layout.nbytes, dtype=torch.uint8, device="cpu")
        spec.source.fill(layout, [(0, layout.nbytes, 0)], image)
    if image is not None and layout.image is not None:  # stored in another dtype: upcast once
        upcast(layout.image, image[: layout.image_nbytes].to(setup.device), buf)
    elif image is not None:
        buf.copy_(image)
    else:
        for entry in layout.entries:
            entry.view_in(buf).copy_(entry.tensor.detach())
    return buf


def _write_image(spec: _RingSpec, layout: BlockLayout, dst: torch.Tensor) -> None:
    """Fill ``dst`` (host bytes, ``layout.image_nbytes``) with the block as it is stored: read
    from the source (cold start), or from the block's own tensors."""
    if spec.source is not None:
        spec.source.fill(layout, [(0, layout.image_nbytes, 0)], dst)
    else:
        _image_from_tensors(layout, dst)


def _image_from_tensors(layout: BlockLayout, dst: torch.Tensor) -> torch.Tensor:
    """``dst`` filled from the block's tensors, each cast to its stored dtype where it is (a GPU
    casts in microseconds; the same values as a cast on the host), the padding between 8-bit
    tensors zeroed (it upcasts to zeros)."""
    if layout.image is not None:
        dst.zero_()
    for entry, view in zip(layout.entries, layout.image_views(dst), strict=True):
        view.copy_(entry.tensor.detach().to(view.dtype))
    return dst


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
    # A ring of 8-bit images holds its resident blocks as images, once the ring is built.
    keep, settled = set(spec.residency.resident) if not spec.stored else set(), spec.residency.settled
    buffers: list[HostBuffer | None] = []
    current: list[tuple[torch.Tensor, ...]] = []   # what each done block's tensors point at now
    resident: dict[int, torch.Tensor] = {}
    # A block stored in another dtype has no host views its tensors could point at between uses
    # (its host copy is in the stored dtype): they hold placeholders, as under allgather, and its
    # original storage is kept until every ring is set up, for an undo that changes nothing.
    placeholders: dict[torch.dtype, torch.Tensor] = {}
    originals: list[list[torch.Tensor]] | None = [] if spec.keeps_originals else None
    try:
        for layout in layouts:
            i = layout.index
            buf = None
            if originals is not None:
                originals.append([e.tensor.data for e in layout.entries])
            if i in keep and settled:  # resident for good: no host copy
                resident[i] = _device_copy(spec, layout, setup, None)
            else:
                buf = HostBuffer(layout.image_nbytes)
                _write_image(spec, layout, buf.tensor)
                if i in keep:  # resident until a measured forward is planned for: both copies
                    resident[i] = _device_copy(spec, layout, setup, buf.tensor)
                pin.pin_later(buf, spec.component.name, layout.name)
            if layout.image is None:  # between uses: views into the host copy (or the device copy)
                views = tuple(e.view_in(buf.tensor if buf is not None else resident[i]) for e in layout.entries)
            else:
                views = tuple(_placeholder(e, placeholders) for e in layout.entries)
            bind(layout.entries, views)
            buffers.append(buf)
            current.append(views)
            step(1)
        pin.wait()
        parked = [v if b is not None else None for v, b in zip(current, buffers)]
        if spec.stored:
            parked = [tuple(_placeholder(e, placeholders) for e in l.entries) if b is not None else None
                      for l, b in zip(layouts, buffers)]
        transfer = RankLocalTransfer(buffers, [l.image_nbytes for l in layouts], setup.streams, setup.device,
                                     spec.fallback_reason)
        return transfer, parked, resident, originals
    except BaseException:
        with contextlib.suppress(BaseException):
            pin.wait()  # no registration may still be running on a buffer released below
        if originals is not None:
            for layout, data in zip(layouts, originals):
                bind(layout.entries, data)
        else:
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
    # As in _fill_buffers: a ring of 8-bit images holds its resident blocks once it is built.
    keep, settled = set(spec.residency.resident) if not spec.stored else set(), spec.residency.settled
    plans = spec.shard_plans()
    # The image of one whole block, cut into this rank's shard; a source reads the shard directly.
    image = torch.empty(max(l.image_nbytes for l in layouts) if spec.source is None else 0, dtype=torch.uint8,
                        device="cpu")
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
                block_image = _image_from_tensors(layout, image[: layout.image_nbytes])
            shard = None
            if not (i in keep and settled):
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
        _undo_fill(pin, layouts, originals, shards)
        raise


def _undo_fill(pin: HostPinner, layouts: Sequence[BlockLayout], originals: Sequence[list[torch.Tensor]],
               buffers: Sequence[HostBuffer | None]) -> None:
    """A fill that kept the blocks' original storage failed: give it back, free the host copy."""
    with contextlib.suppress(BaseException):
        pin.wait()  # no registration may still be running on a buffer released below
    for layout, data in zip(layouts, originals):
        bind(layout.entries, data)
    for buf in buffers:
        if buf is not None:
            buf.release()


def _fill_shared(spec: _RingSpec, setup: _Setup, step: Callable[[int], Any]):
    """shared: whole blocks in the host copy the ranks of this host share. This rank writes its
    part of the blocks (an even split by bytes; with a source, read straight from the
    checkpoint) and page-locks them as they are written. It page-locks its mapping of another
    rank's block once the header says that block is written (checked after each block of its
    own, and for the rest once every rank says its part is written, a collective): pages that
    exist already only need mapping, where locking a page before its writer touched it would
    allocate it here, contending with the writer. Between uses a block's tensors view the
    shared copy (placeholders for 8-bit images); their original storage is returned for the
    caller to keep until every rank has succeeded."""
    layouts, pin, shared = spec.layouts, setup.pin, spec.shared
    keep, settled = set(spec.residency.resident) if not spec.stored else set(), spec.residency.settled
    owner = _owners(shared.layout.sizes, shared.layout.ranks)
    placeholders: dict[torch.dtype, torch.Tensor] = {}
    buffers: list[HostBuffer | None] = []
    originals: list[list[torch.Tensor]] = []
    parked: list[Sequence[torch.Tensor] | None] = []
    resident: dict[int, torch.Tensor] = {}
    error: BaseException | None = None
    # Threads allocate this rank's pages ahead of the writes (SharedBlocks.populate), in 64 MiB
    # pieces, a few per rank so that a host's ranks together use about its cores.
    threads = max(1, min(_POPULATE_THREADS, (os.cpu_count() or 1) // shared.layout.ranks))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="omni-offload-populate")
    ready = {i: [pool.submit(shared.populate, i, piece) for piece in shared.view(i).split(_POPULATE_PIECE)]
             for i in range(len(layouts)) if owner[i] == shared.me}
    others: list[int] = []  # other ranks' blocks this rank streams, not yet handed to the pinner

    def pin_written_others() -> None:
        for i in [i for i in others if shared.written(i)]:
            others.remove(i)
            pin.pin_later(buffers[i], spec.component.name, layouts[i].name)

    try:
        for layout in layouts:
            i = layout.index
            view = shared.view(i)
            buf = None
            if owner[i] == shared.me:
                for future in ready.pop(i):
                    future.result()
                _write_image(spec, layout, view)
                shared.mark_written(i)
            if i in keep:  # from this rank's own tensors: the copy may not hold the block yet
                resident[i] = _device_copy(spec, layout, setup, view if owner[i] == shared.me else None)
            if not (i in keep and settled) and shared.uses(i):
                buf = HostBuffer.wrap(view)
                if owner[i] == shared.me:
                    pin.pin_later(buf, spec.component.name, layout.name)
                else:
                    others.append(i)
            buffers.append(buf)
            originals.append([e.tensor.data for e in layout.entries])
            if buf is None:
                held = None
            elif layout.image is None:
                held = tuple(e.view_in(view) for e in layout.entries)
                shared.adopt(i, held)  # the ring's own: not a caller's views when the block is left
            else:
                held = tuple(_placeholder(e, placeholders) for e in layout.entries)
            parked.append(held)
            if i in keep:
                bind(layout.entries, [e.view_in(resident[i]) for e in layout.entries])
            elif held is not None:
                bind(layout.entries, held)
            if owner[i] == shared.me:
                pin_written_others()
            step(1)
    except BaseException as exc:  # noqa: BLE001 - told to the other ranks, then raised
        error = exc
    finally:
        pool.shutdown(cancel_futures=True)
    failed: list[tuple[int, str]] = []
    try:
        if error is None:
            try:
                failed = setup.groups.agree(None)
            except BaseException as exc:  # a rank died or timed out, or reached another exchange
                exc.add_note(
                    f"apply_offload could not agree with the other ranks that the setup of {spec.component.name}'s "
                    "shared host copy succeeded everywhere; this rank undid its setup (the model is as it was). "
                    "A rank died, stalled past collective_timeout_s or reached another step of setup: see its "
                    "output, then restart the job (its process group is likely broken).")
                raise
        else:
            with contextlib.suppress(Exception):
                setup.groups.agree(f"{type(error).__name__}: {error}")
            raise error
        if failed:
            raise _agreed_failure(failed)
        for i in others:  # written by now
            pin.pin_later(buffers[i], spec.component.name, layouts[i].name)
        pin.wait()
        transfer = SharedTransfer(shared, buffers, [l.image_nbytes for l in layouts], setup.streams, setup.device,
                                  HostPinner(setup.pin.enabled, setup.pin.on_failure), spec.component.name,
                                  [l.name for l in layouts])
        return transfer, parked, resident, originals
    except BaseException as exc:
        if exc is error or failed:
            setattr(exc, AGREED, True)  # the other ranks know: the caller does not tell them again
        _undo_fill(pin, layouts, originals, buffers)
        shared.close()
        raise


#: Threads per rank that allocate a shared copy's pages ahead of its writes, and the piece each
#: allocates at a time.
_POPULATE_THREADS = 8
_POPULATE_PIECE = 64 * 2**20


def _owners(sizes: Sequence[int | None], ranks: int) -> list[int | None]:
    """Which host rank writes each block of a shared copy: the largest first, each to the rank
    with the fewest bytes so far (ties to the lowest), so every rank writes about 1/N of it."""
    load = [0] * ranks
    owner: list[int | None] = [None] * len(sizes)
    for i in sorted((i for i, s in enumerate(sizes) if s is not None), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


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
#: Seconds the host's ranks wait for each other while the shared copy's descriptor is handed over.
_HAND_OVER_S = 30.0


def _agreed_failure(failed: Sequence[tuple[int, str]]) -> RuntimeError:
    rank, error = failed[0]
    return RuntimeError(
        f"apply_offload failed on rank {rank} ({error}); every rank undid its setup, since "
        "the ranks share weights (allgather or shared). Fix the error on that rank and apply again."
    )


def _agree_filled(groups: GroupSession) -> None:
    """allgather: every rank filled its host copies, agreed before the weight group's first
    collective (see ``_apply_offload``); otherwise every rank raises alike, and the caller
    undoes this rank's setup. Every rank knows the outcome (or the exchange broke): no rank
    tells the others again (``AGREED``)."""
    try:
        failed = groups.agree(None)
    except BaseException as exc:
        exc.add_note("apply_offload could not agree with the other ranks that every host copy was filled; "
                     "this rank undid its setup (the model is as it was).")
        setattr(exc, AGREED, True)
        raise
    if failed:
        exc = _agreed_failure(failed)
        setattr(exc, AGREED, True)
        raise exc


def _agree_all_or_nothing(handle: OffloadHandle, groups: GroupSession, specs: Sequence[_RingSpec]) -> None:
    """Under allgather or shared every rank must have succeeded (a block is rebuilt from every
    rank's shard, or a shared copy holds blocks every rank wrote); otherwise all undo (still
    local: the original storage is kept until here) and raise alike. An agreement that cannot
    complete (a rank died or timed out, or reached another exchange) undoes this rank's setup too."""
    if not groups.active:
        return
    try:
        failed = groups.agree(None)
    except BaseException as exc:
        _undo_setup(handle, groups, specs)
        exc.add_note("apply_offload could not agree with the other ranks that setup succeeded "
                     "everywhere; this rank undid its setup (the model is as it was).")
        raise
    if failed:
        _undo_setup(handle, groups, specs)
        raise _agreed_failure(failed)


def _undo_setup(handle: OffloadHandle, groups: GroupSession, specs: Sequence[_RingSpec],
                failure: BaseException | None = None) -> None:
    """Undo this rank's setup: its rings (blocks back to their storage, hooks out), the process
    groups, the shared copies. ``failure``: this rank's own, told to the other ranks first, which
    would otherwise wait for it in their next exchange (unless every rank knows it already: a
    shared ring's agreement that its copy is written, or exchanges that did not match)."""
    try:
        handle._rollback()
    finally:
        if failure is not None and groups.active and not getattr(failure, AGREED, False):
            with contextlib.suppress(Exception):
                groups.agree(f"{type(failure).__name__}: {failure}")
        groups.close()
        for spec in specs:  # shared copies, of rings never built too
            if spec.shared is not None:
                spec.shared.close()


def _log_summary(handle: OffloadHandle) -> None:
    """One line per decision; the front-ends' log filter decides which ranks show."""
    rows = handle.summary_rows()
    for row in rows:
        if row.fallback_reason is not None:
            logger.warning("%s: %s not used, streaming rank-local instead: %s", row.component,
                           handle.config.options_for(row.category).weight_transfer, row.fallback_reason)
        logger.info(
            "streaming %s (%s, %s): %d blocks, %.1f MiB, %s, %.1f MiB host, %.1f MiB device slots%s",
            row.component, row.module_class, row.category, row.num_blocks, row.block_bytes / 2**20,
            row.weight_transfer + (f" ({row.gather} gather)" if row.gather else ""),
            row.host_bytes / 2**20, row.device_slot_bytes / 2**20,
            f"; blocks {row.resident_blocks} resident ({row.resident_bytes / 2**20:.1f} MiB)"
            if row.resident_blocks else "",
        )
    if any(row.weight_transfer == "shared" for row in rows) and (note := small_pages_note()):
        logger.info("%s", note)


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
