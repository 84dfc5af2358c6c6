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

diffusers hooks the module objects at its plan's paths as they are when it splits. Each split
DiT gets a root forward pre-hook that hooks again a module put at such a path later (peft's
``unload_lora_weights`` puts a LoRA layer's base layer back, a LoRA loaded after the split wraps
the module), and every split is checked before diffusers makes it: a length the group's size
does not divide raises :class:`UnevenSplitError` on every rank of the group alike (diffusers'
own check is an ``assert``, gone under ``python -O``, after which the ranks' shards differ and
the next collective aborts).

Before anything is built or loaded: :func:`check_dit_config` checks a DiT's class and config (its
``config.json``) as :func:`enable_context_parallel` checks the built DiT, and
:func:`planned_splits` finds the lengths a forward would split (run on the meta device, it
allocates and computes nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from typing import Any, Callable, Mapping
from unittest import mock

import torch
import torch.distributed as dist
from diffusers import __version__ as diffusers_version
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..plan import OffloadPlan, is_bare_module, pipeline_modules
from .adapters import CACHES, CacheSpec

try:  # diffusers' context parallelism (0.36 and later; the project is tested with 0.42)
    from diffusers.hooks.context_parallel import (
        _CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE,
        _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE,
        ContextParallelSplitHook,
        ModuleForwardMetadata,
        _get_submodule_by_name,
        apply_context_parallel,
        remove_context_parallel,
    )
    from diffusers.models._modeling_parallel import ContextParallelInput
    from diffusers.models._modeling_parallel import ContextParallelConfig
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
except ImportError:  # pragma: no cover - an older diffusers: enable_context_parallel says so
    ContextParallelConfig = None

__all__ = ["ContextParallel", "ContextParallelError", "ParallelGroups", "PlannedSplit", "UnevenSplitError",
           "check_attention_backend", "check_cache", "check_dit_config", "check_ranks", "disable_context_parallel",
           "enable_context_parallel", "pipeline_dits", "planned_splits"]

#: Attention backends that split with context parallelism but return no log-sum-exp, which ring
#: attention needs to merge its partial attentions (their ``return_lse=True`` raises).
_NO_LSE = frozenset({"native", "_native_npu"})

#: The inputs of diffusers' context-parallel plans that hold the prompt's text sequence (Flux,
#: Flux2, LTX and QwenImage split it with the image's); the others follow the image or video.
_TEXT_INPUTS = frozenset({"encoder_hidden_states", "encoder_hidden_states_mask", "encoder_attention_mask", "txt_ids"})

#: Where a split DiT keeps its :class:`_Watch` (a plain attribute: nn.Module keeps it in ``__dict__``).
_WATCH = "_omni_context_parallel_watch"


class ContextParallelError(ValueError):
    """Context parallelism cannot run as asked; the message says why and what to do."""


class UnevenSplitError(ContextParallelError):
    """A sequence that the context-parallel group's size does not divide, found before diffusers
    splits it (it splits only in equal parts). Raised in the DiT's forward, before that split's
    collectives, on every rank of the group alike (they run the same call). ``text``: the
    sequence is the prompt's text embedding rather than the image's or video's tokens."""

    def __init__(self, component: str, model: str, path: str, input: str | int, tokens: int, size: int) -> None:
        self.component, self.model, self.path, self.input = component, model, path, input
        self.tokens, self.size = tokens, size
        self.text = input in _TEXT_INPUTS
        where = f"output {input} of {path!r}" if isinstance(input, int) else \
            f"{input!r} of {path!r}" if path else f"its input {input!r}"
        what = "the text embedding's sequence" if self.text else "the sequence"
        super().__init__(
            f"{component} ({model}) splits {where} across {size} ranks, and {what} there has {tokens} tokens, which "
            f"{size} does not divide (diffusers splits in equal parts only): give inputs whose "
            f"{'text length' if self.text else 'token count'} {size} divides, or degrees whose product divides "
            f"{tokens}")


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

    def describe(self) -> str:
        """The degrees as ``Omni`` takes them and as the CLI's flags give them: the refusals
        reach Python callers and command-line users alike."""
        return (f"ulysses_degree {self.ulysses_degree} x ring_degree {self.ring_degree}; on the command line "
                f"--ulysses-degree {self.ulysses_degree} --ring-degree {self.ring_degree}")

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
    dits = pipeline_dits(pipeline)
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
        for name, model in dits.items():
            _check_splits(name, model)
            _Watch(name, model)
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
    _check_plan(name, type(model))
    if getattr(model, "_parallel_config", None) is not None:
        raise ContextParallelError(f"{name} ({type(model).__name__}) is already parallel: enable it once")
    _check_heads(name, type(model), getattr(getattr(model, "config", None), "num_attention_heads", None), spec)
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


def check_dit_config(name: str, cls: type, config: Mapping[str, Any], spec: ContextParallel) -> None:
    """What a DiT's class and config must allow for it to split as ``spec`` asks, checked before
    the DiT is built or loaded (``config``: its ``config.json``, or a built model's ``config``): a
    context-parallel plan in diffusers, and attention heads that ``ulysses_degree`` divides.
    Raises the :class:`ContextParallelError` :func:`enable_context_parallel` raises for the built
    DiT, which checks them again."""
    _check_plan(name, cls)
    _check_heads(name, cls, config.get("num_attention_heads"), spec)


def _check_plan(name: str, cls: type) -> None:
    if not getattr(cls, "_cp_plan", None):
        raise ContextParallelError(
            f"{name} ({cls.__name__}) has no context-parallel plan in diffusers (its class sets no "
            "_cp_plan): it cannot split a sample across ranks. Run it data parallel (without "
            "--ulysses-degree/--ring-degree), or use a model whose class has one (Wan, Flux, QwenImage, LTX, ...)")


def _check_heads(name: str, cls: type, heads: Any, spec: ContextParallel) -> None:
    """Ulysses gives each rank of a group whole attention heads: ``ulysses_degree`` must divide them."""
    if isinstance(heads, int) and not isinstance(heads, bool) and heads % spec.ulysses_degree:
        raise ContextParallelError(
            f"{name} ({cls.__name__}) has {heads} attention heads, which ulysses_degree "
            f"{spec.ulysses_degree} (--ulysses-degree on the command line) does not divide: use a degree that "
            f"divides {heads}, or ring_degree (--ring-degree)")


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedSplit:
    """One length a DiT's context-parallel plan splits in a forward (:func:`planned_splits`)."""

    path: str
    """The plan's path of the module whose input or output is split (``""``: the DiT itself)."""
    input: str | int
    """The input's name, or the index of the output, split there."""
    tokens: int
    """Its length along the split dimension, which the group's size must divide."""

    @property
    def text(self) -> bool:
        """The prompt's text sequence rather than the image's or video's tokens."""
        return self.input in _TEXT_INPUTS


def planned_splits(model: nn.Module, inputs: Mapping[str, Any]) -> list[PlannedSplit]:
    """The lengths the context-parallel plan of ``model``'s class splits in the forward
    ``model(**inputs)``, in the order the forward reaches them: that forward is run with hooks at
    the plan's paths that record each tensor diffusers would split (by its own rule: one of
    another rank than the plan expects passes unsplit) and change nothing. On a model built on the
    meta device (``with torch.device("meta")``), with inputs there, it allocates and computes
    nothing: the sizes a split would refuse (:class:`UnevenSplitError`), known before the model
    is built. Empty for a class without a plan, or a diffusers without context parallelism."""
    if ContextParallelConfig is None:
        return []
    found: list[PlannedSplit] = []

    def record(path: str, key: str | int, value: Any, planned: Any) -> None:
        pairs = (zip(value, planned) if isinstance(value, (list, tuple)) and isinstance(planned, (list, tuple))
                 else [(value, planned)])
        for x, cp_input in pairs:
            if (isinstance(x, torch.Tensor) and isinstance(cp_input, ContextParallelInput)
                    and (cp_input.expected_dims is None or x.dim() == cp_input.expected_dims)):
                found.append(PlannedSplit(path, key, int(x.size(cp_input.split_dim))))

    def before(path: str, planned: Mapping[str, Any], module: nn.Module, args: tuple, kwargs: dict) -> None:
        metadata = ModuleForwardMetadata(_cls=type(module))
        for key, cp_input in planned.items():
            try:  # diffusers' own lookup of a forward's argument by name
                value, _, _ = metadata._get_parameter_from_args_kwargs(key, list(args), kwargs)
            except ValueError:  # not passed: nothing to split
                continue
            record(path, key, value, cp_input)

    def after(path: str, planned: Mapping[int, Any], module: nn.Module, args: tuple, output: Any) -> None:
        outputs = [output] if isinstance(output, torch.Tensor) else list(output)
        for index, cp_input in planned.items():
            if index < len(outputs):
                record(path, index, outputs[index], cp_input)

    handles = []
    try:
        for path, planned in (getattr(type(model), "_cp_plan", None) or {}).items():
            if not isinstance(planned, Mapping):  # a gather
                continue
            outputs = {k: v for k, v in planned.items() if isinstance(v, ContextParallelInput) and v.split_output}
            ins = {k: v for k, v in planned.items() if k not in outputs}
            found_modules = _get_submodule_by_name(model, path)
            for module in found_modules if isinstance(found_modules, list) else [found_modules]:
                if ins:
                    handles.append(module.register_forward_pre_hook(functools.partial(before, path, ins),
                                                                    with_kwargs=True))
                if outputs:
                    handles.append(module.register_forward_hook(functools.partial(after, path, outputs)))
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return found


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
    start = (f"start it with torchrun --nproc_per_node {spec.size} (or a multiple of it; the launch scripts: "
             f"NGPU={spec.size})")
    if not (dist.is_available() and dist.is_initialized()):
        ranks = _job_ranks()
        if ranks > 1:  # under torchrun, but this process never joined the job's process group
            raise ContextParallelError(
                f"context parallelism over {spec.size} ranks ({spec.describe()}) needs torch.distributed, which "
                f"this process, one of the job's {ranks} ranks (WORLD_SIZE={ranks}), has not initialised: call "
                "torch.distributed.init_process_group() before Omni (on GPUs after "
                "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))); the CLI does both")
        raise ContextParallelError(
            f"context parallelism over {spec.size} ranks ({spec.describe()}) needs torch.distributed with a "
            f"multiple of {spec.size} ranks; the job has 1: {start}, and from Python call "
            "torch.distributed.init_process_group() before Omni (the CLI does)")
    world = dist.get_world_size()
    if world % spec.size:
        raise ContextParallelError(
            f"context parallelism over {spec.size} ranks ({spec.describe()}) needs a multiple of {spec.size} "
            f"ranks; the job has {world}: {start}, or degrees whose product divides {world}")


def _job_ranks() -> int:
    """The job's rank count as torchrun tells its processes (``WORLD_SIZE``; 1 when unset or unreadable)."""
    try:
        return max(int(os.environ.get("WORLD_SIZE") or 1), 1)
    except ValueError:
        return 1


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
    for name, model in pipeline_dits(pipeline).items():
        if name in groups.dits and getattr(model, "_parallel_config", None) is not None:
            _unsplit(model)
    _destroy(groups.owned)


def _unsplit(model: nn.Module) -> None:
    """One DiT as it was before ``enable_parallelism`` (also one it refused part-way)."""
    watch = vars(model).pop(_WATCH, None)
    if watch is not None:  # first: the modules it hooked may no longer be at their paths
        watch.remove()
    remove_context_parallel(model, type(model)._cp_plan)
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = None
    model._parallel_config = None


def _check_splits(name: str, model: nn.Module) -> None:
    """Make each of diffusers' split hooks on ``model`` that is not yet checked raise
    :class:`UnevenSplitError` before it splits a length the group's size does not divide.
    diffusers only asserts it (``EquipartitionSharder.shard``): under ``python -O`` the ranks
    would take shards of different lengths and abort in the next collective. Each tensor is
    checked where diffusers splits it (``_prepare_cp_input``, for inputs and for outputs the plan
    splits), so no rank of the group gets further than another."""
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for key, hook in list(getattr(registry, "hooks", {}).items()):
            if isinstance(hook, ContextParallelSplitHook) and "_prepare_cp_input" not in vars(hook):
                path = key.split("---", 1)[1] if "---" in key else key
                hook._prepare_cp_input = _checked_split(hook, name, type(model).__name__, path)


def _checked_split(hook: Any, component: str, model: str, path: str) -> Callable[..., torch.Tensor]:
    """``hook``'s own ``_prepare_cp_input``, checking the length first (diffusers leaves a
    tensor of another rank than the plan expects unsplit: it passes through as it is). The
    config :func:`enable_context_parallel` makes sets none of diffusers' "anything" modes,
    which would split uneven lengths."""
    prepare = hook._prepare_cp_input
    names: dict[int, str | int] = {}  # each planned split by identity: the input (or output index) it splits
    for key, planned in hook.metadata.items():
        for one in planned if isinstance(planned, (list, tuple)) else (planned,):
            names[id(one)] = key

    def checked(x: torch.Tensor, cp_input: Any) -> torch.Tensor:
        if cp_input.expected_dims is None or x.dim() == cp_input.expected_dims:
            size = hook.parallel_config._flattened_mesh.size()
            tokens = x.size(cp_input.split_dim)
            if tokens % size:
                raise UnevenSplitError(component, model, path, names.get(id(cp_input), "?"), int(tokens), size)
        return prepare(x, cp_input)

    return checked


class _Watch:
    """A split DiT's root forward pre-hook, run before each forward (and before any of its
    collectives), for what diffusers' hooks do not see:

    - The modules at the plan's paths (those without a wildcard: a block list's entries are not
      replaced, the leaf layers a LoRA wraps are), as diffusers hooked them; one put at such a
      path since is hooked again: peft's ``unload_lora_weights`` (also after ``fuse_lora``) puts
      a LoRA layer's base layer back at Wan's gathered ``proj_out``, which would run ungathered
      (a shape error far from the cause); a LoRA loaded after the split wraps the hooked layer,
      whose own gather would leave the adapter's part out. The module that was there loses its
      hook (dropped, or now inside the new one); the new one gets diffusers' own hooks for just
      that path.
    - Where the plan splits the text too (Flux, Flux2, LTX, QwenImage), the length of the root's
      ``encoder_hidden_states``, checked first: QwenImage splits the text's rotary embedding
      (``pos_embed``'s second output) before any input named as text, so only here is the text
      told apart from the image.

    Kept on the model (``_WATCH``); :func:`_unsplit` removes it."""

    __slots__ = ("component", "handle", "plan", "seen", "text", "text_index")

    def __init__(self, component: str, model: nn.Module) -> None:
        self.component = component
        self.plan = type(model)._cp_plan
        self.seen = {path: self._module_at(model, path) for path in self.plan if path and "*" not in path}
        # How the plan splits the text, if it does (the same wherever it names it).
        self.text = next((planned["encoder_hidden_states"] for planned in self.plan.values()
                          if isinstance(planned, dict) and "encoder_hidden_states" in planned), None)
        parameters = list(inspect.signature(type(model).forward).parameters)[1:]  # self: not passed
        self.text_index = parameters.index("encoder_hidden_states") if "encoder_hidden_states" in parameters else None
        # Excluded from torch.compile (a DiT compiled whole traces its hooks): it changes hooks.
        self.handle = model.register_forward_pre_hook(torch.compiler.disable(self._before_forward), prepend=True,
                                                      with_kwargs=True)
        setattr(model, _WATCH, self)

    def _before_forward(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        self._check_text(model, args, kwargs)  # first: a refused call changes nothing
        self._rehook(model)

    def _check_text(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.text is None:
            return
        text = kwargs.get("encoder_hidden_states")
        if text is None and self.text_index is not None and self.text_index < len(args):
            text = args[self.text_index]
        if not isinstance(text, torch.Tensor) or (self.text.expected_dims is not None
                                                  and text.dim() != self.text.expected_dims):
            return  # diffusers leaves it unsplit
        size = model._parallel_config.context_parallel_config._flattened_mesh.size()
        if text.size(self.text.split_dim) % size:
            raise UnevenSplitError(self.component, type(model).__name__, "", "encoder_hidden_states",
                                   int(text.size(self.text.split_dim)), size)

    def _rehook(self, model: nn.Module) -> None:
        changed = {path: module for path, module in self.seen.items()
                   if self._module_at(model, path) is not module}
        if not changed:
            return
        config = model._parallel_config.context_parallel_config
        for path, before in changed.items():
            now = self._module_at(model, path)
            name = self._hook_name(path)
            try:
                for module in (before, now):  # now: a module hooked by another split, say
                    registry = getattr(module, "_diffusers_hook", None)
                    if registry is not None:
                        registry.remove_hook(name, recurse=False)
                apply_context_parallel(model, config, {path: self.plan[path]})
            except Exception as exc:
                raise ContextParallelError(
                    f"{self.component} ({type(model).__name__})'s {path} was replaced after the context-parallel "
                    f"split (now a {type(now).__name__}), and diffusers could not hook the new one for the split "
                    f"({type(exc).__name__}: {exc}): put the module that was there back, or undo the split "
                    "(disable_context_parallel; Omni.close()) before changing the model and split it again after"
                ) from exc
            self.seen[path] = now
        _check_splits(self.component, model)

    def _module_at(self, model: nn.Module, path: str) -> nn.Module:
        found: Any = model
        for atom in path.split("."):
            found = getattr(found, atom, None)
            if not isinstance(found, nn.Module):
                raise ContextParallelError(
                    f"{self.component} ({type(model).__name__})'s {path} is split by context parallelism but is "
                    f"{'gone' if found is None else f'now a {type(found).__name__}'}: diffusers' split needs the "
                    "module there. Put it back, or undo the split (disable_context_parallel; Omni.close()) before "
                    "changing the model")
        return found

    def _hook_name(self, path: str) -> str:
        template = (_CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE if isinstance(self.plan[path], dict)
                    else _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE)
        return template.format(path)

    def remove(self) -> None:
        """The pre-hook, and diffusers' hooks on the modules it recorded: one replaced since the
        last forward may sit inside its replacement (a LoRA layer's base layer), still splitting."""
        self.handle.remove()
        for path, module in self.seen.items():
            registry = getattr(module, "_diffusers_hook", None)
            if registry is not None:
                registry.remove_hook(self._hook_name(path), recurse=False)


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


def pipeline_dits(pipeline: Any) -> dict[str, nn.Module]:
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
