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
import types
import typing
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
        fields = _fields(cache)
        for key, value in options.items():
            if value is None and _nullable(fields.get(key)):  # diffusers' default for the option
                continue
            if key in (cache.primary, *cache.alike):
                if not _in_range(value, cache):
                    raise AdapterError(f"--cache {given}: {key} is {_expected(cache)}, found {value!r}")
            else:
                options[key] = _option(key, value, fields.get(key), given)
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
        """As recorded in the metadata (JSON: a dtype by its name); :meth:`parse` reads it back."""
        options = {k: _DTYPE_NAMES.get(v, v) if isinstance(v, torch.dtype) else v for k, v in self.options.items()}
        return {"type": self.type, **options}


#: The dtypes a dtype option (TaylorSeer's ``taylor_factors_dtype``) takes, by name: floating point,
#: as the caches keep tensors of the model's outputs.
_DTYPES = {name: getattr(torch, name) for name in ("bfloat16", "float16", "float32", "float64")}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _fields(cache: _Cache) -> dict[str, Any]:
    """The config class's options and their types (none where this diffusers lacks the class, which
    :meth:`CacheSpec.build` refuses, or annotates it in a way this Python cannot read)."""
    config_class = getattr(diffusers.hooks, cache.config_class, None)
    try:
        return typing.get_type_hints(config_class) if config_class is not None else {}
    except (NameError, TypeError):
        return {}


def _nullable(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _option(key: str, value: Any, hint: Any, given: Any) -> Any:
    """``value`` checked against its field's type in the config class, in what diffusers takes: a
    dtype's name becomes the dtype, a JSON list a tuple. diffusers does not check them: a wrong type
    fails mid-generation (``Invalid device string: 'float32'``, ``'int' object is not subscriptable``).
    An option of another type (a callable; one the class lacks) is left to the class."""
    if _nullable(hint):  # X | None: checked as X (a union of more is left to the class)
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    converted = value
    if hint is bool:
        ok, expected = isinstance(value, bool), "true or false"
    elif hint in (int, float):
        ok, expected = _number(value, integer=hint is int), "an integer" if hint is int else "a finite number"
    elif hint is torch.dtype:
        converted = _DTYPES.get(value.removeprefix("torch."), value) if isinstance(value, str) else value
        ok = isinstance(converted, torch.dtype) and converted in _DTYPE_NAMES
        expected = f"a floating-point dtype: one of {list(_DTYPES)} (or 'torch.float32' alike)"
    elif origin in (list, tuple) and args and all(a in (str, Ellipsis) for a in args):  # regexes of module names
        ok, expected = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value), "a list of strings"
        converted = origin(value) if ok else value
    elif origin is tuple and len(args) == 2 and all(a in (int, float) for a in args):  # a range of timesteps
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(_number(v) for v in value)
        expected, converted = "a pair of numbers, e.g. [100, 800]", tuple(value) if ok else value
    else:
        return value
    if not ok:
        raise AdapterError(f"--cache {given}: {key} is {expected}, found {value!r}")
    return converted


def _number(value: Any, integer: bool = False) -> bool:
    """An int (or, unless ``integer``, a float), finite; not a bool."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return math.isfinite(value)


def _in_range(value: Any, cache: _Cache) -> bool:
    return _number(value, integer=cache.kind is int) and value >= cache.minimum


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
