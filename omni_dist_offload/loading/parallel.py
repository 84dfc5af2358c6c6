"""Context parallelism: several ranks work on one sample, with diffusers' own machinery.

diffusers 0.42 splits a DiT's sequence across ranks at the points its class's ``_cp_plan``
names (``model.enable_parallelism(config=ContextParallelConfig(...))``): Ulysses (an all-to-all
of q, k, v around each attention) and ring attention. It reads and moves no weights: it adds
hooks that split and gather activations and tells the attention processors their group. So it
composes with streaming in either order, and a streamed block computes what a resident one
does; with ``allgather`` every rank of a context-parallel group runs the same blocks at the same
time, the lockstep the gather needs ([Note: context parallelism] in ``docs/design.md``).

:func:`enable_context_parallel` lays the job's ranks out as a mesh ``(dp, ring, ulysses)``:
data parallel across groups of ``ring_degree * ulysses_degree`` consecutive ranks, context
parallel within one. Every rank of a group must run the same call with the same inputs (the
same prompt and seed): the pipeline itself knows nothing of the split.
:func:`disable_context_parallel` undoes it and destroys the process groups the mesh created.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Mapping
from unittest import mock

import torch
import torch.distributed as dist
from diffusers import __version__ as diffusers_version
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..plan import OffloadPlan, is_bare_module, pipeline_modules
from .adapters import CACHES, CacheSpec

try:  # diffusers' context parallelism (0.36 and later; the project is tested with 0.42)
    from diffusers.hooks.context_parallel import remove_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
except ImportError:  # pragma: no cover - an older diffusers: enable_context_parallel says so
    ContextParallelConfig = None

__all__ = ["ContextParallel", "ContextParallelError", "ParallelGroups", "check_attention_backend", "check_cache",
           "check_ranks", "disable_context_parallel", "enable_context_parallel"]

#: Attention backends that split with context parallelism but return no log-sum-exp, which ring
#: attention needs to merge its partial attentions (their ``return_lse=True`` raises).
_NO_LSE = frozenset({"native", "_native_npu"})


class ContextParallelError(ValueError):
    """Context parallelism cannot run as asked; the message says why and what to do."""


@dataclasses.dataclass(frozen=True, slots=True)
class ContextParallel:
    """How many ranks split one sample: ``ulysses_degree * ring_degree``."""

    ulysses_degree: int = 1
    ring_degree: int = 1

    @classmethod
    def parse(cls, value: ContextParallel | Mapping[str, Any] | None) -> ContextParallel | None:
        """From ``{"ulysses_degree": 2, "ring_degree": 1}`` (either key may be left out); None,
        or degrees of 1, mean no context parallelism."""
        if value is None or isinstance(value, ContextParallel):
            spec = value
        else:
            if not isinstance(value, Mapping) or set(value) - {"ulysses_degree", "ring_degree"}:
                raise ContextParallelError(
                    f"context_parallel must be a dict with keys 'ulysses_degree' and 'ring_degree', found {value!r}")
            spec = cls(**value)
        if spec is None:
            return None
        for key in ("ulysses_degree", "ring_degree"):
            degree = getattr(spec, key)
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ContextParallelError(f"context_parallel {key} must be a positive integer, found {degree!r}")
        return spec if spec.size > 1 else None

    @property
    def size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    def to_dict(self) -> dict[str, int]:
        return {"ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree}


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelGroups:
    """Where this rank sits: its context-parallel group (``cp_size`` consecutive ranks, one
    sample at a time) and that group's place among the data-parallel groups."""

    spec: ContextParallel
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    group: Any
    """The context-parallel group's process group (its ranks run every call together); destroyed
    by :func:`disable_context_parallel` unless it is the default group."""
    dits: tuple[str, ...]
    """The pipeline's components split this way."""
    mesh: Any = None
    """The ``(dp, ring, ulysses)`` device mesh the DiTs split over."""
    owned: list = dataclasses.field(default_factory=list, repr=False, compare=False)
    """The process groups the mesh created (never the default group), in creation order; emptied
    as :func:`disable_context_parallel` destroys them."""

    @property
    def writes(self) -> bool:
        """Whether this rank writes the group's outputs (the group's first rank: every rank of a
        group ends with the same sample)."""
        return self.cp_rank == 0


def enable_context_parallel(pipeline: Any, spec: ContextParallel, device: torch.device) -> ParallelGroups:
    """Split every DiT of ``pipeline`` (each component with a diffusers ``_cp_plan``) across the
    ranks of this rank's context-parallel group. Collective: every rank calls it. Checks first,
    changes nothing on an error: torch.distributed must be running with a multiple of
    ``spec.size`` ranks, every transformer of the pipeline must have a context-parallel plan and
    attend with a backend that splits. Should diffusers still refuse, every DiT is put back as it
    was and the mesh's process groups are destroyed before the error propagates."""
    check_ranks(spec)
    world = dist.get_world_size()
    dits = _dits(pipeline)
    if not dits:
        raise ContextParallelError(
            f"{type(pipeline).__name__} has no transformer to split: context parallelism applies to DiTs")
    for name, model in dits.items():
        _check_dit(name, model, spec)
    mesh = init_device_mesh(device.type, (world // spec.size, spec.ring_degree, spec.ulysses_degree),
                            mesh_dim_names=("dp", "ring", "ulysses"))
    touched: list[nn.Module] = []
    try:
        for model in dits.values():
            config = ContextParallelConfig(ulysses_degree=spec.ulysses_degree, ring_degree=spec.ring_degree,
                                           mesh=mesh)
            touched.append(model)  # before the call: diffusers records its config before it may refuse
            with _accelerator_counted(device):
                model.enable_parallelism(config=config)
        # diffusers' own flattening of (ring, ulysses): the ranks that split one sample.
        cp = next(iter(dits.values()))._parallel_config.context_parallel_config._flattened_mesh
    except BaseException:
        flattened = None
        for model in touched:
            config = getattr(getattr(model, "_parallel_config", None), "context_parallel_config", None)
            flattened = flattened or getattr(config, "_flattened_mesh", None)
            _unsplit(model)
        _destroy(_created_groups(mesh, flattened))
        raise
    rank = dist.get_rank()
    return ParallelGroups(spec, dp_rank=rank // spec.size, dp_size=world // spec.size, cp_rank=rank % spec.size,
                          cp_size=spec.size, group=cp.get_group(), dits=tuple(dits), mesh=mesh,
                          owned=_created_groups(mesh, cp))


def _check_dit(name: str, model: nn.Module, spec: ContextParallel) -> None:
    """What must hold of one DiT before any is split (each refusal changes nothing)."""
    if not getattr(type(model), "_cp_plan", None):
        raise ContextParallelError(
            f"{name} ({type(model).__name__}) has no context-parallel plan in diffusers (its class sets no "
            "_cp_plan): it cannot split a sample across ranks. Run it data parallel (without "
            "--ulysses-degree/--ring-degree), or use a model whose class has one (Wan, Flux, QwenImage, LTX, ...)")
    if getattr(model, "_parallel_config", None) is not None:
        raise ContextParallelError(f"{name} ({type(model).__name__}) is already parallel: enable it once")
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if isinstance(heads, int) and heads % spec.ulysses_degree:
        raise ContextParallelError(
            f"{name} ({type(model).__name__}) has {heads} attention heads, which ulysses_degree "
            f"{spec.ulysses_degree} does not divide: use a degree that divides {heads}")
    active = _AttentionBackendRegistry.get_active_backend()[0]
    for module in model.modules():
        # diffusers' own rule (ModelMixin.enable_parallelism): a processor's own backend, else the
        # active one. diffusers looks at the first processor only; every one must split.
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(processor, "_attention_backend"):
            continue
        own = processor._attention_backend
        backend = active if own is None else AttentionBackendName(own)
        refusal = _backend_refusal(backend, spec, own=own is not None)
        if refusal is not None:
            whose = "its own backend" if own is not None else "the active attention backend"
            raise ContextParallelError(f"{name} ({type(model).__name__})'s attention processor "
                                       f"{type(processor).__name__} attends with {whose} {backend.value!r}: {refusal}")


def check_attention_backend(spec: ContextParallel) -> None:
    """Refuse, before a model loads, an active attention backend (diffusers'
    ``DIFFUSERS_ATTN_BACKEND``, ``attention_backend(...)``) that cannot split as ``spec`` asks.
    A loaded model's processors may name backends of their own: :func:`enable_context_parallel`
    checks those."""
    if ContextParallelConfig is None:
        return  # check_ranks says diffusers has no context parallelism
    active = _AttentionBackendRegistry.get_active_backend()[0]
    refusal = _backend_refusal(active, spec, own=False)
    if refusal is not None:
        raise ContextParallelError(f"the active attention backend is {active.value!r}: {refusal}")


def _backend_refusal(backend: Any, spec: ContextParallel, *, own: bool) -> str | None:
    """Why ``backend`` cannot split as ``spec`` asks, and what to do; None when it can. It must
    support context parallelism in diffusers, and for ``ring_degree > 1`` return the log-sum-exp.
    ``own``: a processor's own backend, which only ``set_attention_backend`` changes (the active
    backend does not apply to it)."""
    value = str(getattr(backend, "value", backend))
    splits = sorted(_AttentionBackendRegistry._supports_context_parallel)
    if value not in splits:
        needs, fine = "diffusers' context parallelism needs a backend that splits", splits
    elif spec.ring_degree > 1 and value in _NO_LSE:
        needs = (f"ring_degree {spec.ring_degree} > 1 needs an attention backend that returns log-sum-exp, "
                 "by which ring attention merges its partial attentions")
        fine = [name for name in splits if name not in _NO_LSE]
    else:
        return None
    how = ("with model.set_attention_backend(name) before the split" if own else
           "from Python with model.set_attention_backend(name) or diffusers' attention_backend(name), "
           "on the command line with the environment variable DIFFUSERS_ATTN_BACKEND=name")
    instead = ("split with ulysses_degree (--ulysses-degree) instead" if value in splits
               else "run without context parallelism")
    return f"{needs} ({', '.join(fine)}). Set one {how}, or {instead}"


def check_ranks(spec: ContextParallel) -> None:
    """What can be checked before a model loads: diffusers has context parallelism, and the job
    runs under torch.distributed with a multiple of ``spec.size`` ranks."""
    if ContextParallelConfig is None:
        raise ContextParallelError(
            f"diffusers {diffusers_version} has no context parallelism: upgrade it (pip install -U diffusers)")
    if not (dist.is_available() and dist.is_initialized()):
        raise ContextParallelError(
            f"context parallelism over {spec.size} ranks needs torch.distributed: start the job with "
            f"torchrun --nproc_per_node {spec.size} (or a multiple of it)")
    world = dist.get_world_size()
    if world % spec.size:
        raise ContextParallelError(
            f"context parallelism over {spec.size} ranks (ulysses_degree {spec.ulysses_degree} x ring_degree "
            f"{spec.ring_degree}) needs a multiple of {spec.size} ranks; the job has {world}")


def check_cache(spec: ContextParallel | None, cache: CacheSpec | None, *, flags: bool = False) -> None:
    """Refuse a step cache that cannot run split (before anything loads): First Block Cache
    decides whether to skip the later blocks from the first block's output, which the split
    divides between the ranks of a group. Enabled after the split, its hook sees the whole input
    while the block returns this rank's shard (a shape error on the first forward); enabled
    before, each rank decides from its own shard, and a rank that skips leaves the others waiting
    in the all-to-alls of the blocks it skipped. ``flags``: name the CLI's flags, not Omni's
    arguments."""
    if spec is None or cache is None or CACHES[cache.type].splits:
        return
    fine = [name for name, c in CACHES.items() if c.splits]
    if flags:
        given = f"--cache {cache.type} with " + " ".join(
            f"--{key.replace('_', '-')} {degree}" for key, degree in spec.to_dict().items() if degree > 1)
        use, drop = "--cache " + " or ".join(f"{name}:N" for name in fine), "--ulysses-degree/--ring-degree"
    else:
        given = (f"cache {cache.type!r} with context_parallel (ulysses_degree {spec.ulysses_degree} x "
                 f"ring_degree {spec.ring_degree})")
        use, drop = "cache " + " or ".join(f"{name + ':N'!r}" for name in fine), "context_parallel"
    raise ContextParallelError(
        f"{given}: First Block Cache decides from the first block's output, which context parallelism splits "
        "across the ranks, so it fails on the first forward (or the ranks decide apart and hang). Use "
        f"{use} with context parallelism (they skip by step, alike on every rank), or drop {drop} to keep "
        f"{cache.type}" + (". On Wan, diffusers' TaylorSeer hooks no module in its default mode; its lite mode "
                           "does ({\"type\": \"taylorseer\", \"use_lite_mode\": true})" if "taylorseer" in fine else ""))


def disable_context_parallel(pipeline: Any, groups: ParallelGroups) -> None:
    """Undo :func:`enable_context_parallel`: remove diffusers' context-parallel hooks, forget the
    configuration (diffusers has no undo of its own) and destroy the process groups the mesh
    created (``groups.group`` among them, unless it is the default group: undo what uses it
    first). Collective, as the split was: every rank calls it. Idempotent."""
    for name, model in _dits(pipeline).items():
        if name in groups.dits and getattr(model, "_parallel_config", None) is not None:
            _unsplit(model)
    _destroy(groups.owned)


def _unsplit(model: nn.Module) -> None:
    """One DiT as it was before ``enable_parallelism`` (also one it refused part-way)."""
    remove_context_parallel(model, type(model)._cp_plan)
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = None
    model._parallel_config = None


def _created_groups(mesh: Any, flattened: Any) -> list:
    """The process groups ``init_device_mesh`` and diffusers' flattening created for ``mesh``, in
    creation order: each dimension's, then the flattened ``(ring, ulysses)`` one. A dimension
    that spans the job reuses the default group, which is not theirs to destroy."""
    created: list = []
    for group in [*mesh.get_all_groups(), *([flattened.get_group()] if flattened is not None else [])]:
        if group != dist.group.WORLD and all(group is not known for known in created):
            created.append(group)
    return created


def _destroy(created: list) -> None:
    """Destroy ``created`` newest first, the same order on every rank (some NCCL versions abort a
    communicator collectively); empties the list, so a second call does nothing."""
    while created:
        group = created.pop()
        if dist.is_initialized():  # a job that destroyed the default group took every group with it
            dist.destroy_process_group(group)


def _dits(pipeline: Any) -> dict[str, nn.Module]:
    """The pipeline's DiTs by attribute name, as offloading names them (``transformer``,
    ``transformer_2``, and what the pipeline's ``OffloadPlan.dit_components`` adds); a bare
    transformer is ``transformer``."""
    if is_bare_module(pipeline):
        return {"transformer": pipeline}
    plan = getattr(pipeline, "_offload_plan", None) or OffloadPlan()
    return {name: mod for name, mod in pipeline_modules(pipeline).items() if plan.category_of(name) == "dit"}


def _accelerator_counted(device: torch.device):
    """diffusers picks a device as ``rank % torch.accelerator.device_count()`` even when the mesh
    is given, which divides by zero on a machine without one; on the CPU the device it picks is
    never used, so it is told there is one."""
    if device.type != "cpu" or torch.accelerator.device_count() > 0:
        return contextlib.nullcontext()
    return mock.patch.object(torch.accelerator, "device_count", lambda: 1)
