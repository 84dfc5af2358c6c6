"""Loading a pipeline for offloading: a built-in, a local diffusers folder or a cached hub id,
built on the host, then streamed with :func:`~omni_dist_offload.apply.apply_offload` (or moved
whole to the device without a config).

With an offload config, a folder or hub snapshot is cold-started (:mod:`.coldstart`):
streamed components are built without their weights and each block is read from the
safetensors files straight into this rank's host buffer or shard, so no rank ever holds the
whole model; everything else loads as usual.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from torch import nn
from transformers.utils import logging as transformers_logging

from ..apply import OffloadHandle, apply_offload
from ..config import OffloadConfig
from ..models import BUILTIN_MODELS, BUILTIN_PIPELINES, cast_like_pretrained
from ..plan import module_bytes
from ..residency import format_bytes
from ..runtime.dist import tell_peers
from .checkpoint import CheckpointError, CheckpointSource, ModelLoadError, check_pipeline_folder
from .coldstart import ColdStart, cold_start_folder, prepare_cold_start
from .folders import CONFIG_VALUE_ERRORS, DTYPES, dtype_kwarg, pipeline_class, resolve_dtype, wrong_config_values

__all__ = [
    "DTYPES",
    "LoadedPipeline",
    "ModelLoadError",
    "check_load_kwargs",
    "format_bytes",
    "load_and_place",
    "load_pipeline",
    "module_components",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

#: ``from_pretrained`` keywords the loader sets itself from the run dtype.
_DTYPE_KWARGS = ("dtype", "torch_dtype")


def check_load_kwargs(model: str, load_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``load_kwargs`` as a dict, checked before anything loads: a mapping of keyword names,
    none of them the dtype (the loader passes the run dtype itself, and ``from_pretrained``
    would get it twice), and none for a built-in model (built in code, never loaded). Raises
    ``TypeError`` or ``ValueError`` naming the fix."""
    if load_kwargs is None:
        return {}
    if not isinstance(load_kwargs, Mapping):
        raise TypeError(f"load_kwargs must be a dict of from_pretrained's keyword arguments, found "
                        f"{type(load_kwargs).__name__} {load_kwargs!r}: pass e.g. {{'variant': 'fp16'}}, or None.")
    names = [key for key in load_kwargs if not isinstance(key, str)]
    if names:
        raise TypeError(f"load_kwargs keys are from_pretrained's keyword names (strings), found {names!r}.")
    given = [key for key in _DTYPE_KWARGS if key in load_kwargs]
    if given:
        raise ValueError(f"load_kwargs sets {given[0]!r}, which the loader sets itself from the run dtype: "
                         "drop it and pass the dtype as Omni(dtype=...) (e.g. dtype=torch.bfloat16 or "
                         "'bfloat16'; CLI --dtype).")
    if load_kwargs and os.fspath(model) in BUILTIN_MODELS:
        raise ValueError(f"load_kwargs {sorted(load_kwargs)} go to from_pretrained, and the built-in {model!r} "
                         "is built in code, not loaded: drop load_kwargs (the run dtype is Omni(dtype=...)), "
                         "or save it with save_pretrained and give that folder.")
    return dict(load_kwargs)


@dataclass(frozen=True, slots=True)
class LoadedPipeline:
    """A pipeline on its device, its offload handle (None when resident) and how long it took."""

    pipeline: Any
    handle: OffloadHandle | None
    load_s: float
    """Building or loading the pipeline on the host."""
    place_s: float
    """``apply_offload`` (consolidating, pinning, moving the rest), or moving it all resident."""
    cold_start: bool
    """Whether the streamed components were cold-started from their safetensors files."""


def load_and_place(
    model: str,
    config: OffloadConfig | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    load_kwargs: Mapping[str, Any] | None = None,
    cold_start: bool = True,
    progress: bool = False,
    agree: Callable[[BaseException | None], None] | None = None,
) -> LoadedPipeline:
    """Load ``model`` and stream it with ``config`` (cold-started where it can be), or move it
    whole to ``device`` when ``config`` is None. ``progress`` shows the offload setup's bars.
    ``load_kwargs`` are checked first (:func:`check_load_kwargs`). Collective under allgather.

    ``agree``, when the placing is collective: called between loading and placing with the
    error loading raised (this rank's failure is then raised) or None (it raises when another
    rank failed), so every rank learns of one rank's failure to load (a folder missing on one
    host) before the others enter the placing's collectives, which that rank never would."""
    model = os.fspath(model)
    kwargs = check_load_kwargs(model, load_kwargs)
    start = time.perf_counter()
    cold = None
    try:
        if config is not None and cold_start and model not in BUILTIN_MODELS:
            with _loading_bars(progress):  # it builds encoders with transformers, which shows a bar
                cold = _prepare_cold_start(model, config, device, dtype, kwargs)
        pipe = load_pipeline(str(cold.folder) if cold else model, dtype,
                             {**kwargs, **(cold.components if cold else {})}, progress=progress)
    except BaseException as exc:  # an interrupt too: agree tells the others without waiting
        if cold is not None:
            cold.close()
        tell_peers(agree, exc)
        raise
    try:
        if agree is not None:
            agree(None)
        loaded = time.perf_counter()
        handle = _place(pipe, model, config, device, cold.sources if cold else None, progress)
    finally:
        if cold is not None:
            cold.close()
    return LoadedPipeline(pipe, handle, loaded - start, time.perf_counter() - loaded, cold is not None)


def _prepare_cold_start(model: str, config: OffloadConfig, device: torch.device, dtype: torch.dtype,
                        load_kwargs: Mapping[str, Any]) -> ColdStart | None:
    """The streamed components of a folder built without their weights, or None when the
    ordinary load applies."""
    folder, reason = cold_start_folder(model, load_kwargs)
    if folder is None:
        logger.info("loading %s whole before offloading: %s", model, reason)
        return None
    cold = prepare_cold_start(folder, config, device=device, dtype=dtype)
    if not cold.components:
        cold.close()
        return None
    logger.info("cold start: %s built without block weights; their blocks are read from the "
                "safetensors files into host memory", sorted(cold.components))
    return cold


def _place(pipe: Any, model: str, config: OffloadConfig | None, device: torch.device,
           sources: Mapping[str, CheckpointSource] | None, progress: bool) -> OffloadHandle | None:
    """Stream the selected components; everything else (or all of it) goes to the device.

    Never ``pipeline.to(device)`` after ``apply_offload``: that would pull the streamed blocks
    onto the device and undo the streaming."""
    if config is None:
        pipe.to(device)
        return None
    total = sum(module_bytes(m) for m in module_components(pipe).values())
    logger.info("offloading %s of %s (%s of weights in all) to stream from host memory; "
                "consolidating%s blocks", list(config.components), model, format_bytes(total),
                " and pinning" if config.pin_memory and device.type == "cuda" else "")
    return apply_offload(pipe, config, device=device, block_sources=sources, progress=progress)


def load_pipeline(model: str, dtype: torch.dtype, load_kwargs: Mapping[str, Any], *,
                  progress: bool = True) -> Any:
    """Build a built-in pipeline, or load a local folder or hub id, on the host in ``dtype``.
    ``progress=False`` hides diffusers' and transformers' loading bars while it loads."""
    load_kwargs = check_load_kwargs(model, load_kwargs)
    if model in BUILTIN_MODELS:
        pipe = BUILTIN_PIPELINES[model]()
        if dtype != torch.float32:
            for module in module_components(pipe).values():
                cast_like_pretrained(module, dtype)
        return pipe
    model = os.fspath(model)
    # os.path's expanduser leaves a ~user this host does not know as it is (then refused as a
    # folder that does not exist); Path's raises a bare RuntimeError.
    path = Path(os.path.expanduser(model))
    if path.is_dir() and not (path / "model_index.json").is_file():
        raise ModelLoadError(
            f"folder {str(path)!r} has no model_index.json, so it is not a diffusers pipeline "
            "folder: point --model at the folder that pipe.save_pretrained() wrote."
        )
    if not path.is_dir() and model.startswith((".", "/", "~")):
        raise ModelLoadError(
            f"model folder {model!r} does not exist: give an existing diffusers folder, a hub id "
            f"or a built-in name {list(BUILTIN_MODELS)}."
        )
    if path.is_dir():
        try:
            check_pipeline_folder(path, safetensors=load_kwargs.get("use_safetensors", True) is not False)
        except CheckpointError as exc:
            raise ModelLoadError(str(exc)) from exc
    logger.info("loading %s (%s) on the host", model, str(dtype).removeprefix("torch."))
    try:
        # Weights come from safetensors only (no pickled .bin checkpoints), unless the caller
        # passes use_safetensors=False in load_kwargs.
        loader = DiffusionPipeline
        if path.is_dir() and any(isinstance(v, nn.Module) for v in load_kwargs.values()):
            # Components passed in must go through the concrete class: DiffusionPipeline's own
            # from_pretrained treats components with a default (WanPipeline's transformer) as
            # plain options, loads them from disk anyway and then drops them.
            loader = pipeline_class(path)
        with _loading_bars(progress):
            return loader.from_pretrained(
                str(path) if path.is_dir() else model, **{dtype_kwarg(): dtype},
                **{"use_safetensors": True, **load_kwargs})
    except (OSError, ValueError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        pickled = _pickled_only(path) if path.is_dir() and load_kwargs.get("use_safetensors", True) else []
        if pickled:
            raise ModelLoadError(
                f"could not load {model!r}: {pickled} hold only .bin (pickled) weights, and this "
                "package reads safetensors only. Convert them once (DiffusionPipeline."
                "from_pretrained(folder).save_pretrained(new_folder) writes safetensors), or, from "
                "Python, pass load_kwargs={'use_safetensors': None} to let diffusers read the .bin "
                "files (with torch.load(weights_only=True))."
            ) from exc
        raise ModelLoadError(
            f"could not load {model!r} ({type(exc).__name__}: {detail}): give a built-in name "
            f"{list(BUILTIN_MODELS)}, a local diffusers folder, or a hub id whose weights are in "
            "the local cache (set HF_HUB_OFFLINE=1 to skip the network)."
        ) from exc
    except CONFIG_VALUE_ERRORS as exc:
        # A config.json value of the wrong type ("num_layers": "3"): diffusers' constructors fail
        # inside torch without naming it, transformers' configs name the field but not the file.
        detail = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
        found = wrong_config_values(path) if path.is_dir() else []
        # A transformers config's own refusal is the error itself: name only its file then.
        found = [f"in {where}" if what in detail else f"{where}: {what}"
                 for where, _, what in (f.partition(": ") for f in found)]
        raise ModelLoadError(
            f"could not load {model!r} ({type(exc).__name__}: {detail})"
            + (f": {'; '.join(found)}; fix the value in that file, or download the component again."
               if found else ": a component's config.json may hold a value of the wrong type; fix it, or download "
               "the model again.")
        ) from exc
    except RuntimeError as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        # transformers refuses a checkpoint whose shapes differ from the config this way, after
        # logging a report that names the tensors; other RuntimeErrors (a quantized folder on a
        # host without a GPU) say what is wrong themselves.
        mismatch = "mismatch" in str(exc) or "ignore_mismatched_sizes" in str(exc)
        raise ModelLoadError(
            f"could not load {model!r} ({type(exc).__name__}: {detail})"
            + (": a component's checkpoint does not match its config.json (the loader's report above names "
               "the tensors); fix the folder or download it again." if mismatch else ".")
        ) from exc


def _pickled_only(folder: Path) -> list[str]:
    """The component folders of a pipeline folder that hold ``.bin`` weights and no safetensors."""
    found = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = [f.name for f in sub.iterdir() if f.is_file()]
        if any(f.endswith(".bin") for f in files) and not any(f.endswith(".safetensors") for f in files):
            found.append(sub.name)
    return found


@contextlib.contextmanager
def _loading_bars(show: bool) -> Iterator[None]:
    """Hide diffusers' and transformers' progress bars ("Loading pipeline components", "Loading
    weights") unless ``show``; each library's setting is restored afterwards."""
    if show:
        yield
        return
    libraries = [lib for lib in (diffusers_logging, transformers_logging) if lib.is_progress_bar_enabled()]
    for lib in libraries:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in libraries:
            lib.enable_progress_bar()


def module_components(pipe: Any) -> dict[str, nn.Module]:
    """A pipeline's module components by attribute name."""
    components = getattr(pipe, "components", None) or {}
    return {name: m for name, m in components.items() if isinstance(m, nn.Module)}
