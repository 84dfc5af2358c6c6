"""Cold start: build streamed components without their weights, then read each block's bytes from
the safetensors files straight into this rank's host buffer.

The ordinary way to offload a pipeline loads the whole model into host memory first, so every
rank of a host pays for the complete model at start-up before sharding gives memory back (8 ranks
x a 28 GB DiT = 224 GB). Here a streamed component (a diffusers DiT or a transformers text
encoder of a diffusers pipeline folder) is built on the ``meta`` device with the dtypes its
library's ``from_pretrained`` would give it; its non-block tensors are read from the checkpoint
and put on the device; its block tensors become one-element placeholders whose bytes
:func:`~omni_dist_offload.apply.apply_offload` reads from the checkpoint block by block, into the
full host buffer (rank-local) or into only this rank's shard (allgather). Peak host memory is the
final host copy plus a little scratch: no block is ever held twice. Dtype conversion (an fp32
checkpoint run in bf16) happens per read, in place.

    from omni_dist_offload.loading.coldstart import load_offloaded

    pipe, handle = load_offloaded("/models/Wan2.2-T2V-A14B-Diffusers",
                                  {"mode": "layer", "components": ["dit", "text_encoder"]},
                                  dtype=torch.bfloat16)

The result is bitwise identical to ``DiffusionPipeline.from_pretrained`` followed by
``apply_offload``: the dtype of every tensor follows the library's own rules (diffusers: floating
tensors in the run dtype except modules in ``_keep_in_fp32_modules``; transformers: the library's
own meta load), conversion rounds as ``tensor.to(dtype)`` does, and buffers that checkpoints do
not hold are computed by the model's constructor as usual.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import diffusers
import huggingface_hub.constants
import torch
import transformers
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from torch import nn

from ..apply import apply_offload, quantization_method, quantized_refusal, resolve_device
from ..config import OffloadConfig
from ..plan import OffloadPlan, resolve_component
from ..runtime.dist import agree_on_step, tell_peers
from .checkpoint import (
    WEIGHT_NAMES,
    CheckpointError,
    CheckpointSource,
    SafetensorsCheckpoint,
    placeholder,
    read_model_index,
)
from .folders import CONFIG_VALUE_ERRORS, dtype_kwarg, pipeline_class, resolve_dtype, wrong_config_values

try:  # transformers 5: keys renamed on load (vision-language models' legacy checkpoint names)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
except ImportError:  # earlier transformers: checkpoint keys are the module's
    get_model_conversion_mapping = None

__all__ = ["ColdStart", "cold_start_folder", "load_offloaded", "prepare_cold_start"]

logger = logging.getLogger(__name__)

#: ``from_pretrained`` keyword arguments the cold-start path honours as the ordinary path does
#: (any other, e.g. ``variant`` or ``quantization_config``, selects the ordinary path).
COMPATIBLE_LOAD_KWARGS = frozenset({"use_safetensors", "local_files_only", "revision", "cache_dir", "token"})


@dataclass
class ColdStart:
    """Streamed components built without their block weights, and the sources that fill them."""

    folder: Path
    components: dict[str, nn.Module] = field(default_factory=dict)
    """Pipeline attribute -> module, to pass to ``DiffusionPipeline.from_pretrained``."""
    sources: dict[str, CheckpointSource] = field(default_factory=dict)
    """Pipeline attribute -> the source ``apply_offload(block_sources=...)`` reads blocks from."""

    def close(self) -> None:
        """Close the checkpoint files and reader threads (the blocks are in host memory by then)."""
        for source in self.sources.values():
            source.close()
            source.checkpoint.close()


def cold_start_folder(model: str, load_kwargs: Mapping[str, Any] | None = None) -> tuple[Path | None, str | None]:
    """The local diffusers folder ``model`` names (a hub id's snapshot, resolved as
    ``from_pretrained`` resolves it: :func:`_hub_folder`), or None and the reason the cold start
    does not apply (then the caller loads the ordinary way)."""
    extra = sorted(set(load_kwargs or {}) - COMPATIBLE_LOAD_KWARGS)
    if extra:
        return None, f"load options {extra} need the ordinary loader"
    if load_kwargs and load_kwargs.get("use_safetensors") is False:
        return None, "use_safetensors=False was asked for"
    # os.path's expanduser leaves a ~user this host does not know as it is (then refused as a
    # folder that does not exist); Path's raises a bare RuntimeError.
    path = Path(os.path.expanduser(model))
    if not path.is_dir() and model.startswith((".", "/", "~")):  # a path, not a hub id: the loader says it is not there
        return None, f"{model!r} is not a local folder"
    if not path.is_dir():
        path = _hub_folder(model, load_kwargs or {})
        if path is None:
            return None, f"{model!r} is not a local folder nor a hub id that could be downloaded or found cached"
    if not (path / "model_index.json").is_file():
        return None, f"{path} has no model_index.json"
    return path, None


def _hub_folder(model: str, load_kwargs: Mapping[str, Any]) -> Path | None:
    """The snapshot folder of hub id ``model`` as ``from_pretrained`` would resolve it, or None.

    Online, the Hub is asked, as the ordinary load asks it (``DiffusionPipeline.download``: the
    revision ``refs/main`` points at now, and only the files the cache lacks are fetched): a
    cache that holds part of a snapshot (a component never downloaded) or an older revision
    would otherwise cold-start from what happens to be cached. Offline (``HF_HUB_OFFLINE``, or
    ``local_files_only`` asked for), or when the Hub cannot be reached, the cached snapshot."""
    hub = {k: load_kwargs[k] for k in ("revision", "cache_dir", "token") if load_kwargs.get(k) is not None}
    if not load_kwargs.get("local_files_only") and not _hub_offline():
        try:
            return Path(diffusers.DiffusionPipeline.download(
                model, use_safetensors=load_kwargs.get("use_safetensors", True), **hub))
        except Exception as exc:  # noqa: BLE001 - no network, an unknown id, a refusal: the cache may still serve
            first = (str(exc).strip().splitlines() or [""])[0]
            logger.warning("%s: the Hub could not be asked for its files (%s: %s); looking for a snapshot in the "
                           "local cache instead (set HF_HUB_OFFLINE=1 to skip the Hub)", model,
                           type(exc).__name__, first)
    try:
        return Path(snapshot_download(model, local_files_only=True, revision=hub.get("revision"),
                                      cache_dir=hub.get("cache_dir")))
    except Exception:  # noqa: BLE001 - not cached, or not a hub id: the ordinary loader says why
        return None


def _hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set, at import (huggingface_hub's constant) or since."""
    value = os.environ.get("HF_HUB_OFFLINE", "")
    return bool(huggingface_hub.constants.HF_HUB_OFFLINE) or value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def prepare_cold_start(
    folder: Path | str,
    config: OffloadConfig | Mapping[str, Any] | str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    plan: OffloadPlan | None = None,
    threads: int | None = None,
) -> ColdStart:
    """Build every streamed component of the pipeline folder without reading its block weights.

    Components whose library is neither diffusers nor transformers, or that have no safetensors
    weights, are left to the ordinary loader. Raises :class:`CheckpointError` for a tensor the
    checkpoint lacks or holds with another shape."""
    folder = Path(folder)
    cfg = OffloadConfig.parse(config)
    index = read_model_index(folder / "model_index.json")
    plan = plan if plan is not None else _pipeline_plan(index.get("_class_name"))
    threads = threads or default_threads()
    cold = ColdStart(folder)
    with ExitStack() as undo:
        undo.callback(cold.close)
        for name, spec in index.items():
            if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2:
                continue
            if spec[0] is None or spec[1] is None:
                continue  # an optional component the pipeline was saved without ([null, null]): nothing to load
            category = plan.category_of(name)
            if category not in cfg.components:
                continue
            library, class_name = spec
            sub = folder / name
            builder = _BUILDERS.get(library)
            if builder is None or not _has_safetensors(sub):
                logger.info("%s (%s.%s): loaded the ordinary way (%s)", name, library,
                            class_name, "no safetensors weights" if builder else "library not supported")
                continue
            _check_not_quantized(name, class_name, sub)
            checkpoint = SafetensorsCheckpoint.from_folder(sub)
            try:
                # Built on the host whatever the caller's default device (torch.set_default_device):
                # the tensors a constructor computes (rotary tables) are read as host tensors.
                with torch.device("cpu"):
                    module, dtype_of, fresh_buffers, renamed = _build(builder, name, library, class_name, sub,
                                                                      dtype, checkpoint)
                    keys = _materialise(name, category, module, plan, checkpoint, device, dtype_of,
                                        fresh_buffers, renamed)
                    _tie_loaded(module, keys)
            except BaseException:
                checkpoint.close()
                raise
            cold.components[name] = module
            cold.sources[name] = CheckpointSource(checkpoint, keys, threads)
        undo.pop_all()
    return cold


def _build(builder: Callable, name: str, library: str, class_name: str, folder: Path, dtype: torch.dtype,
           checkpoint: SafetensorsCheckpoint) -> tuple:
    """``builder``'s result; what the library raises reading the component's config (a damaged or
    missing config.json) as a :class:`CheckpointError` naming the component, as the ordinary
    load's ``ModelLoadError`` does, not a bare ``OSError``."""
    try:
        return builder(class_name, folder, dtype, checkpoint)
    except CheckpointError:
        raise
    except CONFIG_VALUE_ERRORS as exc:  # a value of the wrong type ("num_layers": "3"), found deep in the library
        first = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
        # What the library said rarely names the value (a diffusers constructor's TypeError comes
        # from torch): the config's values of another type than their defaults do.
        found = [f.removeprefix(f"{folder.name}/config.json: ") for f in wrong_config_values(folder, library, class_name)]
        found = [f for f in found if f not in first]
        raise CheckpointError(
            f"{name} ({library}.{class_name}): cannot be built from {folder / 'config.json'} ({type(exc).__name__}: "
            f"{first}){': it holds ' + '; '.join(found) if found else ''}; fix "
            f"{'the value' if found else 'the value of the wrong type'} in that file, or download the component "
            "again.") from exc
    except (OSError, ValueError) as exc:  # json's errors are ValueErrors
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{name} ({library}.{class_name}): cannot be built from {folder / 'config.json'} ({type(exc).__name__}: "
            f"{first}); download the component again or fix the file.") from exc


def _check_not_quantized(name: str, class_name: str, folder: Path) -> None:
    """A component saved quantized (its config.json holds a ``quantization_config``) is refused
    before anything loads, as ``apply_offload`` refuses it loaded."""
    try:
        found = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return  # the builder reads the config again and says what is wrong with it
    if found:
        raise quantized_refusal(f"{name} ({class_name}, {folder / 'config.json'})",
                                quantization_method(found) or "quantization_config")


def load_offloaded(
    model: str | Path,
    config: OffloadConfig | Mapping[str, Any] | str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    process_group: Any | None = None,
    plan: OffloadPlan | None = None,
    threads: int | None = None,
    trace: bool | None = None,
    **load_kwargs: Any,
) -> tuple[Any, Any]:
    """Load a diffusers pipeline folder (or hub id, resolved as ``from_pretrained`` resolves it)
    with its streamed components cold-started, and offload it. Returns ``(pipeline, handle)``.
    ``dtype``: as ``Omni``'s (``None``: bfloat16 on a GPU, float32 on the CPU). Collective under
    allgather or shared, like :func:`~omni_dist_offload.apply.apply_offload`; then, as ``Omni``
    does, the ranks agree that every one of them loaded before any enters the offload's
    collectives: a rank that failed (a shard missing on its host) raises its own error, and the
    others, as soon as they have loaded, a ``PeerFailed`` naming it and its error
    (``runtime.dist.agree_on_step``), instead of waiting ``collective_timeout_s`` for it in those
    collectives (a rank that never answers is named after ``collective_timeout_s``)."""
    cfg = OffloadConfig.parse(config)
    # Collective when the ranks share weights: one rank's failure to load is told to the others
    # before they enter apply_offload's collectives, which it never reaches (as Omni does).
    collective = any(cfg.options_for(c).weight_transfer in ("allgather", "shared") for c in cfg.components)
    agree = (functools.partial(agree_on_step, "load the model", timeout_s=cfg.collective_timeout_s)
             if collective else None)
    cold = None
    try:
        if "torch_dtype" in load_kwargs:  # from_pretrained would get the dtype twice
            raise ValueError("load_offloaded(torch_dtype=...): the dtype is load_offloaded's own argument: "
                             "pass dtype=... instead.")
        dev = resolve_device(device)
        dtype = resolve_dtype(dtype, dev)
        folder, reason = cold_start_folder(str(model), load_kwargs)
        if folder is None:
            raise CheckpointError(f"cannot cold-start {model!r}: {reason}.")
        cold = prepare_cold_start(folder, cfg, device=dev, dtype=dtype, plan=plan, threads=threads)
        # The other components load on the host too, whatever the default device; apply_offload
        # places them on ``dev``.
        with torch.device("cpu"):
            pipe = pipeline_class(folder).from_pretrained(
                str(folder), **{dtype_kwarg(): dtype}, **{"use_safetensors": True, **load_kwargs}, **cold.components)
    except BaseException as exc:  # an interrupt too: the other ranks are told without waiting
        if cold is not None:
            cold.close()
        tell_peers(agree, exc)
        raise
    try:
        if agree is not None:
            agree(None)
        handle = apply_offload(pipe, cfg, device=dev, plan=plan, process_group=process_group,
                               trace=trace, block_sources=cold.sources)
    finally:
        cold.close()
    return pipe, handle


def default_threads() -> int:
    """Reader threads per rank: the host's cores shared among the ranks on it, at most 8."""
    local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(8, (os.cpu_count() or 1) // local_world))


# -- building components on the meta device ----------------------------------------------------
DtypeOf = Callable[[str, torch.Tensor, torch.dtype], torch.dtype]
"""(state-dict name, meta tensor, checkpoint dtype) -> the dtype the library would load it in."""


def _diffusers_builder(class_name: str, folder: Path, dtype: torch.dtype, checkpoint: SafetensorsCheckpoint):
    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise CheckpointError(f"{folder}: diffusers has no class {class_name!r} (model_index.json); "
                              "upgrade diffusers or fix the folder.")
    config = cls.load_config(folder)
    # Parameters on meta, buffers real: what diffusers' own from_pretrained builds before loading,
    # so buffers the checkpoint does not hold (RoPE tables, attention masks) are computed as
    # usual, in the run dtype where the constructor uses the default dtype (diffusers builds
    # under it, except for float8 runs).
    default = cls._set_default_torch_dtype(dtype) if dtype != getattr(torch, "float8_e4m3fn", None) else None
    try:
        with init_empty_weights(include_buffers=False):
            module = cls.from_config(config)
    finally:
        if default is not None:
            torch.set_default_dtype(default)
    keep = cls._keep_in_fp32_modules
    keep = [] if keep is None else [keep] if isinstance(keep, str) else list(keep)

    def dtype_of(name: str, tensor: torch.Tensor, stored: torch.dtype) -> torch.dtype:
        # diffusers' load_model_dict_into_meta: floating tensors take the run dtype, or fp32 in
        # a module named in _keep_in_fp32_modules; others keep the checkpoint's dtype.
        if not stored.is_floating_point:
            return stored
        return torch.float32 if any(k in name.split(".") for k in keep) else dtype

    module.eval()
    module.register_to_config(_name_or_path=str(folder))
    return module, dtype_of, None, {}


def _transformers_builder(class_name: str, folder: Path, dtype: torch.dtype, checkpoint: SafetensorsCheckpoint):
    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise CheckpointError(f"{folder}: transformers has no class {class_name!r} (model_index.json); "
                              "upgrade transformers or fix the folder.")
    # The library's own meta load: its dtype rules, tied weights and key names, no tensor data.
    # Sizes are checked against the checkpoint by _materialise, which names every mismatch in
    # one CheckpointError (transformers would raise a bare RuntimeError after a log report).
    module = cls.from_pretrained(folder, dtype=dtype, device_map="meta", ignore_mismatched_sizes=True)
    module.eval()

    def fresh_buffers() -> dict[str, torch.Tensor]:
        # Buffers no checkpoint holds (rotary tables, position ids) come out of meta loading as
        # meta; the constructor computes them, as an ordinary load does.
        with init_empty_weights(include_buffers=False):
            skeleton = cls._from_config(module.config, dtype=dtype)
        return dict(skeleton.named_buffers())

    def dtype_of(name: str, tensor: torch.Tensor, stored: torch.dtype) -> torch.dtype:
        return tensor.dtype

    return module, dtype_of, fresh_buffers, _renamed_keys(module, checkpoint)


def _renamed_keys(module: nn.Module, checkpoint: SafetensorsCheckpoint) -> dict[str, str]:
    """Model key -> checkpoint key where transformers renames on load (``save_pretrained`` of a
    vision-language model writes ``language_model.model.layers...``, the module holds
    ``model.language_model.layers...``): the library's own renamings, applied as its loader
    applies them. Keys a converter fuses or splits (one tensor from several) have no single
    source and are left out."""
    if get_model_conversion_mapping is None:  # a transformers without load-time renaming
        return {}
    transforms = get_model_conversion_mapping(module)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings:
        return {}
    meta = dict(module.state_dict())
    prefix = getattr(module, "base_model_prefix", None) or None
    found: dict[str, str] = {}
    for key in checkpoint.tensors:
        renamed, converted = rename_source_key(key, renamings, converters, prefix, meta)
        if converted is None and renamed != key:
            found[renamed] = key
    return found


_BUILDERS = {"diffusers": _diffusers_builder, "transformers": _transformers_builder}


def _materialise(name: str, category: str, module: nn.Module, plan: OffloadPlan,
                 checkpoint: SafetensorsCheckpoint, device: torch.device, dtype_of: DtypeOf,
                 fresh_buffers: Callable[[], dict[str, torch.Tensor]] | None,
                 renamed: Mapping[str, str]) -> dict[int, str]:
    """Give every tensor of ``module`` real storage but its block tensors: those become
    placeholders, and the returned map says which checkpoint key fills each. Non-block tensors are
    read and put on ``device``; a tensor shared by several names stays one object."""
    comp = resolve_component(name, category, module, plan)
    in_block = {id(t) for _, block in comp.blocks for t in [*block.parameters(), *block.buffers()]}
    names: dict[int, list[str]] = {}
    for qual, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(qual)
    prefix = getattr(module, "base_model_prefix", "") or ""
    keys: dict[int, str] = {}
    done: dict[int, torch.Tensor] = {}
    missing: list[str] = []
    mismatched: list[str] = []
    used: set[str] = set()
    fresh: dict[str, torch.Tensor] | None = None
    refused: set[int] = set()  # tensors named in missing or mismatched already (a tied one is held twice)
    for mod in module.modules():
        for registry in (mod._parameters, mod._buffers):
            for attr, t in list(registry.items()):
                if t is None:
                    continue
                if id(t) in done:
                    registry[attr] = done[id(t)]
                    continue
                if id(t) in refused:
                    continue
                quals = names[id(t)]
                # A non-persistent buffer is never loaded, even where an older save holds it (CLIP's
                # position_ids): both libraries leave such keys unused.
                persistent = registry is mod._parameters or attr not in mod._non_persistent_buffers_set
                # Every name of a tied tensor may have its own key (T5's ``shared`` and
                # ``encoder.embed_tokens``): all are the model's, none is unused.
                found = [k for q in quals if (k := _checkpoint_key([q], checkpoint, prefix, renamed))]
                used.update(found)
                key = found[0] if persistent and found else None
                if key is None and not t.is_meta:
                    continue  # a buffer the constructor computed: apply_offload places it
                if key is None:
                    if registry is mod._buffers and fresh_buffers is not None:
                        fresh = fresh if fresh is not None else fresh_buffers()
                        value = next((fresh[q] for q in quals if q in fresh and not fresh[q].is_meta), None)
                        if value is not None:
                            new = value.to(t.dtype).to(device if id(t) not in in_block else "cpu")
                            done[id(t)] = registry[attr] = new
                            continue
                    missing.append(quals[0])
                    refused.add(id(t))
                    continue
                info = checkpoint.info(key)
                if tuple(info.shape) != tuple(t.shape):
                    mismatched.append(f"{quals[0]} (model {tuple(t.shape)}, checkpoint {tuple(info.shape)})")
                    refused.add(id(t))
                    continue
                target = dtype_of(quals[0], t, info.dtype)
                if id(t) in in_block:
                    data = placeholder(t.shape, target)
                else:
                    data = checkpoint.load(key, target).to(device)
                new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
                if id(t) in in_block:
                    keys[id(new)] = key
                done[id(t)] = registry[attr] = new
    where = f"{name} ({type(module).__name__}, {checkpoint.where()})"
    if missing:
        raise CheckpointError(
            f"{where}: the checkpoint has no tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} in all): the files do not belong to this model class and config, or "
            "are incomplete. Download the complete checkpoint."
        )
    if mismatched:
        raise CheckpointError(
            f"{where}: tensor shapes differ between the model config and the checkpoint: "
            f"{mismatched[:5]}{' ...' if len(mismatched) > 5 else ''}. The config.json and the "
            "weights come from different models."
        )
    _warn_unused(where, module, [k for k in checkpoint.tensors if k not in used])
    return keys


def _tie_loaded(module: nn.Module, placeholders: Mapping[int, str]) -> None:
    """Tie what transformers ties when both names of a tied pair are in the checkpoint (T5's
    ``shared`` and ``encoder.embed_tokens`` in a save converted from ``.bin``): one tensor where
    the two hold the same values, two (and its warning) where they differ. Its meta load cannot
    compare values, so it leaves both names separate: without this, the device would hold the
    embedding twice. Block tensors (placeholders, ``placeholders``) are left as they are."""
    tied = getattr(module, "all_tied_weights_keys", None)
    if not isinstance(tied, dict):
        return
    for target_name, source_name in list(tied.items()):
        try:
            source = module.get_parameter_or_buffer(source_name)
            target = module.get_parameter_or_buffer(target_name)
        except AttributeError:
            continue
        if source is target or id(source) in placeholders or id(target) in placeholders:
            continue
        if source.is_meta or target.is_meta:
            continue
        if source.shape != target.shape or source.dtype != target.dtype or not torch.equal(source, target):
            logger.warning("%s: %s and %s are tied by the config but hold different values in the "
                           "checkpoint; they are kept apart, as transformers keeps them. Set "
                           "tie_word_embeddings=False in the config to silence this.",
                           type(module).__name__, target_name, source_name)
            tied.pop(target_name, None)
            continue
        parent_name, _, attr = target_name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, source)
        adjust = getattr(module, "_adjust_bias", None)
        if adjust is not None:
            adjust(parent, source)


def _warn_unused(where: str, module: nn.Module, unused: list[str]) -> None:
    """Say which checkpoint tensors the model has no place for, as both libraries' loaders do
    (keys the class declares ignorable are left out): a checkpoint of a neighbouring model or
    config usually shows here first."""
    ignore = [re.compile(p) for p in getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unused = [k for k in unused if not any(p.search(k) for p in ignore)]
    if unused:
        logger.warning("%s: %d checkpoint tensor(s) were not used: %s%s. Check that the weights belong "
                       "to this model class and config.", where, len(unused), unused[:5],
                       " ..." if len(unused) > 5 else "")


def _checkpoint_key(quals: list[str], checkpoint: SafetensorsCheckpoint, prefix: str,
                    renamed: Mapping[str, str]) -> str | None:
    for qual in quals:
        if qual in renamed:
            return renamed[qual]
        for key in (qual, f"{prefix}.{qual}" if prefix else None,
                    qual.removeprefix(f"{prefix}.") if prefix and qual.startswith(f"{prefix}.") else None):
            if key is not None and key in checkpoint:
                return key
    return None


def _pipeline_plan(class_name: str | None) -> OffloadPlan:
    cls = getattr(diffusers, class_name, None) if class_name else None
    plan = getattr(cls, "_offload_plan", None)
    return plan if isinstance(plan, OffloadPlan) else OffloadPlan()


def _has_safetensors(folder: Path) -> bool:
    return any((folder / n).is_file() for pair in WEIGHT_NAMES for n in pair)
