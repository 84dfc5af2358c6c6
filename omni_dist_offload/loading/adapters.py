"""LoRA files and step caches for a loaded pipeline, as the front-ends name them.

``--lora PATH[:SCALE]`` (repeatable) loads each file through diffusers' own
``load_lora_weights`` after the pipeline was offloaded (the ring adopts the adapters, see
``docs/design.md``, [Note: tenants]) and weighs them with ``set_adapters``. ``--cache
first-block:0.1`` (or ``{"type": "first-block", "threshold": 0.1}``) enables one of diffusers'
step caches on every DiT of the pipeline. Both are parsed and checked before anything loads,
and recorded in the output metadata (:meth:`LoraSpec.to_dict`, :meth:`CacheSpec.to_dict`).
``Omni`` loads the LoRAs and enables the cache after offloading and before context parallelism
splits the DiTs (:mod:`omni_dist_offload.loading.parallel`); First Block Cache does not run split.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import diffusers.hooks
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

__all__ = ["CACHES", "LORA_WEIGHT_NAME", "AdapterError", "CacheSpec", "LoraSpec", "cached_modules", "enable_cache",
           "load_loras"]


#: The file diffusers' ``load_lora_weights`` reads from a LoRA folder.
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


class AdapterError(ValueError):
    """A LoRA or cache option that cannot be used as given (the message says how to fix it)."""


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """One LoRA file (or a folder holding ``pytorch_lora_weights.safetensors``) and its scale."""

    path: str
    """Kept as a string: a ``Path`` (or any path object) given here is converted, so that the
    spec loads, compares and is recorded in the metadata alike."""
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"a LoRA's path is a str or a Path, found {type(self.path).__name__} {self.path!r}.")
        object.__setattr__(self, "path", os.fsdecode(self.path))
        # Built directly too (not only through parse): a scale of NaN generated black frames.
        object.__setattr__(self, "scale", _scale(self.scale, self.path))

    @classmethod
    def parse(cls, value: str | os.PathLike[str] | Mapping[str, Any] | LoraSpec) -> LoraSpec:
        """``PATH`` or ``PATH:SCALE`` (the scale is what follows the last ``:``, when it is a
        number), or ``{"path": ..., "scale": ...}``."""
        if isinstance(value, LoraSpec):
            return value
        if not isinstance(value, (str, os.PathLike, Mapping)):
            raise TypeError(f"a LoRA is a path, 'PATH:SCALE', {{'path': ..., 'scale': ...}} or a LoraSpec; "
                            f"found {type(value).__name__} {value!r}.")
        if isinstance(value, Mapping):
            unknown = set(value) - {"path", "scale"}
            if unknown or "path" not in value:
                raise AdapterError(f"a LoRA is {{'path': ..., 'scale': ...}}; found keys {sorted(value)}")
            return cls(str(value["path"]), _scale(value.get("scale", 1.0), value))
        if not isinstance(value, str):  # a path object names the path whole: "run:1000" is a folder
            return cls(value)
        text = value
        path, sep, tail = text.rpartition(":")
        if sep and path and _is_number(tail) and not Path(text).exists():
            return cls(path, _scale(tail, text))
        if not text:
            raise AdapterError("--lora needs a path: PATH or PATH:SCALE")
        return cls(text)

    def check(self) -> None:
        """The weights file exists and is a readable safetensors file (nothing here downloads);
        whether it fits the model only loading tells."""
        weights = self.weights()
        if not weights.is_file():
            found = f"the folder has no {LORA_WEIGHT_NAME}" if Path(self.path).is_dir() else "no such file or folder"
            raise AdapterError(f"--lora {self.path}: {found}. Give a local .safetensors file, or a folder "
                               f"holding {LORA_WEIGHT_NAME}.")
        try:
            with safe_open(str(weights), framework="pt") as f:
                empty = not f.keys()
        except (OSError, SafetensorError) as exc:
            raise AdapterError(f"--lora {self.path}: {weights.name} is not a readable safetensors file ({exc}). "
                               "Give a LoRA saved as .safetensors (diffusers' save_lora_weights, or the "
                               "trainer's output).") from None
        if empty:
            raise AdapterError(f"--lora {self.path}: {weights.name} holds no tensors. Give a LoRA's weights.")

    def weights(self) -> Path:
        """The file to load: the path itself, or a folder's ``pytorch_lora_weights.safetensors``."""
        path = Path(self.path)
        return path / LORA_WEIGHT_NAME if path.is_dir() else path

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "scale": self.scale}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _scale(value: Any, given: Any) -> float:
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise AdapterError(f"a LoRA scale is a number; found {value!r} in {given!r}") from None
    if not math.isfinite(scale):
        raise AdapterError(f"a LoRA scale is a finite number; found {value!r} in {given!r}")
    return scale


def load_loras(pipeline: Any, specs: Sequence[LoraSpec]) -> list[str]:
    """Load every LoRA into ``pipeline`` (``lora_0``, ``lora_1``, ... in order) and make them
    active at their scales; returns the adapter names."""
    if not specs:
        return []
    if not callable(getattr(pipeline, "load_lora_weights", None)):
        raise AdapterError(f"{type(pipeline).__name__} takes no LoRA (it has no load_lora_weights): drop --lora")
    names = []
    for k, spec in enumerate(specs):
        spec.check()
        name = f"lora_{k}"
        weights = spec.weights()
        with _loading(pipeline, f"--lora {spec.path}"):
            pipeline.load_lora_weights(str(weights.parent), weight_name=weights.name, adapter_name=name)
        names.append(name)
    with _loading(pipeline, "--lora " + " ".join(s.path for s in specs)):
        pipeline.set_adapters(names, adapter_weights=[s.scale for s in specs])
    return names


@contextlib.contextmanager
def _loading(pipeline: Any, what: str) -> Iterator[None]:
    """diffusers' and peft's refusals of a LoRA (keys for another model, shapes that differ)
    as an :class:`AdapterError` in one line; running out of device memory stays what it is."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
        raise AdapterError(f"{what}: {type(pipeline).__name__} could not load it ({type(exc).__name__}: {first}). "
                           "Give a LoRA trained for this model, in a format diffusers reads.") from exc


@dataclass(frozen=True, slots=True)
class _Cache:
    config_class: str
    """The diffusers config class (in ``diffusers.hooks``)."""
    primary: str
    """The option ``name:VALUE`` sets."""
    kind: type
    minimum: float
    """The smallest value the option means something at: diffusers' config classes do not check
    (a threshold of nan skips every step after the first; an interval of 0 divides by zero
    mid-generation)."""
    needs_timestep: bool = False
    """The config takes a ``current_timestep_callback``: the pipeline's current timestep."""
    alike: tuple[str, ...] = ()
    """Further options of the same kind and range, checked in the dict form."""
    splits: bool = True
    """Runs under context parallelism: it decides what to skip by the step or timestep, the same on
    every rank of a group. First Block Cache decides from the first block's output, which context
    parallelism splits across the ranks (``loading.parallel.check_cache`` refuses it there)."""


#: The caches ``--cache`` names, with the option its short form sets. The dict form takes any
#: option of the diffusers config class.
CACHES: dict[str, _Cache] = {
    # Skips the rest of the blocks while the first block's relative change stays below it.
    "first-block": _Cache("FirstBlockCacheConfig", "threshold", float, 0, splits=False),
    # Steps between full forwards (diffusers takes it modulo).
    "taylorseer": _Cache("TaylorSeerCacheConfig", "cache_interval", int, 1),
    # Forwards between computed attentions (diffusers takes the iteration modulo it).
    "pyramid-attention": _Cache("PyramidAttentionBroadcastConfig", "spatial_attention_block_skip_range", int, 1,
                                needs_timestep=True,
                                alike=("temporal_attention_block_skip_range", "cross_attention_block_skip_range")),
}


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """A step cache and its options."""

    type: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | CacheSpec) -> CacheSpec:
        """``NAME``, ``NAME:VALUE`` (the cache's main option, e.g. ``first-block:0.1``), a JSON
        object, or a dict ``{"type": NAME, option: value, ...}``. Checked against the diffusers
        config class, so a bad option fails here, before anything loads."""
        if isinstance(value, CacheSpec):  # built directly: checked as a dict is
            value = {**value.options, "type": value.type}
        given = value
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise AdapterError(f"--cache {value}: not valid JSON ({exc})") from None
        if isinstance(value, Mapping):
            options = dict(value)
            name = options.pop("type", None)
        else:
            name, sep, tail = str(value).partition(":")
            options = {}
            if sep:
                cache = CACHES.get(name)
                if cache is not None:
                    try:
                        options[cache.primary] = cache.kind(tail)
                    except ValueError:
                        raise AdapterError(f"--cache {value}: {cache.primary} is {_expected(cache)}, "
                                           f"found {tail!r}") from None
        if name not in CACHES:
            raise AdapterError(f"unknown step cache {name!r}: choose one of {sorted(CACHES)} "
                               "(e.g. first-block:0.1)")
        cache = CACHES[name]
        for key in (cache.primary, *cache.alike):
            if options.get(key) is not None and not _in_range(options[key], cache):
                raise AdapterError(f"--cache {given}: {key} is {_expected(cache)}, found {options[key]!r}")
        spec = cls(name, options)
        spec.build(timestep=lambda: None)  # checks the options against the config class
        return spec

    def build(self, timestep: Any = None) -> Any:
        """The diffusers config; ``timestep``: a callable returning the current timestep (for
        the caches that need one)."""
        cache = CACHES[self.type]
        options = dict(self.options)
        if cache.needs_timestep:
            if timestep is None:
                raise AdapterError(f"the {self.type} cache follows a pipeline's timestep: use it through Omni or the CLI")
            options.setdefault("current_timestep_callback", timestep)
        config_class = getattr(diffusers.hooks, cache.config_class, None)
        if config_class is None:
            raise AdapterError(f"--cache {self.type} needs a diffusers with {cache.config_class} "
                               f"(this is {diffusers.__version__}): upgrade diffusers")
        try:
            return config_class(**options)
        except (TypeError, ValueError) as exc:
            raise AdapterError(f"--cache {self.type}: {exc}; the options are those of diffusers' "
                               f"{cache.config_class}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **self.options}


def _in_range(value: Any, cache: _Cache) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if cache.kind is int else (int, float)):
        return False
    return math.isfinite(value) and value >= cache.minimum


def _expected(cache: _Cache) -> str:
    if cache.kind is int:
        return f"an integer, {cache.minimum} or more"
    return f"a number, finite and {cache.minimum} or more"


def cached_modules(pipeline_or_model: Any) -> list[nn.Module]:
    """The modules a cache goes on: the model itself, or a pipeline's DiTs (``transformer``,
    ``transformer_2``): those with diffusers' ``enable_cache``."""
    if isinstance(pipeline_or_model, nn.Module):
        found = [pipeline_or_model]
    else:
        found = [getattr(pipeline_or_model, name, None) for name in ("transformer", "transformer_2")]
    return [m for m in found if m is not None and callable(getattr(m, "enable_cache", None))]


def enable_cache(pipeline_or_model: Any, spec: CacheSpec) -> list[nn.Module]:
    """Enable the cache on every module :func:`cached_modules` finds; returns them."""
    modules = cached_modules(pipeline_or_model)
    if not modules:
        raise AdapterError(f"{type(pipeline_or_model).__name__} has no DiT that takes a step cache: drop --cache")
    timestep = getattr(type(pipeline_or_model), "current_timestep", None)
    callback = (lambda: pipeline_or_model.current_timestep) if timestep is not None else None
    for module in modules:
        module.enable_cache(spec.build(callback))
    return modules
