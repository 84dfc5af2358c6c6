"""What a diffusers pipeline folder says about itself, and the loader keyword of this diffusers."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers
from huggingface_hub import try_to_load_from_cache
from torch import nn

from ..plan import OffloadPlan

try:  # transformers 5 configs are huggingface_hub strict dataclasses, which check each field's type
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub validates nothing, so raises nothing of the kind

    class StrictDataclassError(Exception):  # type: ignore[no-redef]
        """Stands in for huggingface_hub's class; never raised."""

__all__ = ["CONFIG_VALUE_ERRORS", "DTYPES", "dtype_kwarg", "folder_dit_configs", "local_folder", "pipeline_class",
           "resolve_dtype", "wrong_config_values"]

#: What the libraries raise building a model from a config.json value of the wrong type: a
#: diffusers constructor fails inside torch (``'str' object cannot be interpreted as an integer``),
#: a transformers config refuses the field.
CONFIG_VALUE_ERRORS: tuple[type[BaseException], ...] = (TypeError, StrictDataclassError)

#: Names accepted for ``dtype`` (and ``--dtype``).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None``: bfloat16 on a GPU, float32 on the CPU; names from :data:`DTYPES`, or one of
    its torch dtypes (the pipeline runs in it: an integer or 8-bit dtype is refused)."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            runs = sorted({str(d).removeprefix("torch.") for d in DTYPES.values()})
            raise ValueError(f"dtype {dtype} is not one a pipeline runs in: use one of {runs} "
                             f"(torch.bfloat16, say; 8-bit host storage is storage_dtype=).")
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {['auto', *DTYPES]}.")
    return DTYPES[dtype]


def dtype_kwarg() -> str:
    """diffusers 0.42 renamed ``torch_dtype`` to ``dtype`` (the old name warns)."""
    try:
        major, minor = (int(p) for p in importlib.metadata.version("diffusers").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return "torch_dtype"
    return "dtype" if (major, minor) >= (0, 42) else "torch_dtype"


def pipeline_class(folder: Path | str) -> Any:
    """The diffusers pipeline class a folder's model_index.json names (DiffusionPipeline if
    unknown). Passing prebuilt components needs it: ``DiffusionPipeline.from_pretrained`` loads
    optional components (WanPipeline's ``transformer``) from disk even when they are passed."""
    try:
        index = json.loads((Path(folder) / "model_index.json").read_text())
        name = index.get("_class_name") if isinstance(index, dict) else None
    except (OSError, ValueError):
        name = None
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    return cls if isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline) else diffusers.DiffusionPipeline


def wrong_config_values(folder: Path | str, library: str | None = None, class_name: str | None = None) -> list[str]:
    """Values of the wrong type in the config.json files of a pipeline folder (``library`` and
    ``class_name`` None: every component its model_index.json names) or of one component folder,
    each as ``"<component>/config.json: num_layers='3' (an integer, as the default 40)"``; empty when
    none is found. For an error message: it never raises.

    A diffusers value is compared with the type of its constructor's default; a transformers
    config is built, and its own validation says which field it refuses."""
    folder = Path(folder)
    if library is None or class_name is None:
        try:
            index = json.loads((folder / "model_index.json").read_text())
        except (OSError, ValueError):
            return []
        found = []
        for name, spec in index.items() if isinstance(index, dict) else ():
            if not name.startswith("_") and isinstance(spec, list) and len(spec) == 2 and all(
                    isinstance(x, str) for x in spec) and (folder / name).is_dir():
                found.extend(wrong_config_values(folder / name, spec[0], spec[1]))
        return found
    where = f"{folder.name}/config.json"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(config, dict):
        return []
    if library == "transformers":
        config_class = getattr(getattr(transformers, class_name, None), "config_class", None)
        if config_class is None:
            return []
        try:
            config_class.from_pretrained(folder)
        except CONFIG_VALUE_ERRORS as exc:
            return [f"{where}: {_one_line(exc)}"]
        except Exception:  # noqa: BLE001 - another problem, which the load itself reports
            return []
        return []
    cls = getattr(diffusers, class_name, None) if library == "diffusers" else None
    try:
        parameters = inspect.signature(cls.__init__).parameters if cls is not None else {}
    except (TypeError, ValueError):
        return []
    found = []
    for key, value in config.items():
        param = parameters.get(key)
        if key.startswith("_") or param is None or param.default is inspect.Parameter.empty or param.default is None:
            continue  # (compared by identity: a default may be an array, whose == is no truth value)
        expected = _expected_type(param.default, value)
        if expected:
            found.append(f"{where}: {key}={value!r} ({expected}, as the default {param.default!r})")
    return found


def _expected_type(default: Any, value: Any) -> str | None:
    """What ``value`` should be, judged by the type of the default it replaces; None if it fits."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "a boolean"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if isinstance(default, float):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    if isinstance(default, (tuple, list)):
        return None if isinstance(value, (tuple, list)) else "a list"
    return None


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())


def local_folder(model: str, load_kwargs: Mapping[str, Any]) -> Path | None:
    """The pipeline folder ``model`` names on this host: a local folder, or a hub id's snapshot
    already in the local cache (at the revision asked for, in the cache folder asked for); never
    downloaded. None otherwise."""
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        return path
    if model.startswith((".", "/", "~")):  # a folder that is not there: the loader says so
        return None
    try:
        index = try_to_load_from_cache(model, "model_index.json", cache_dir=load_kwargs.get("cache_dir"),
                                       revision=load_kwargs.get("revision"))
    except Exception:  # noqa: BLE001 - not a valid hub id, say: nothing to read
        return None
    return Path(index).parent if isinstance(index, str) else None


def folder_dit_configs(folder: Path, load_kwargs: Mapping[str, Any]) -> dict[str, tuple[type, Mapping[str, Any]]]:
    """The DiTs a pipeline folder loads as, by pipeline attribute, each with its class and config,
    from its ``model_index.json`` and each DiT's ``<component>/config.json`` (no weight read); a
    component passed in ``load_kwargs`` as a module, that module's. What cannot be read so (a
    class diffusers does not have, a file that is not there) is left out."""
    index = _json_object(folder / "model_index.json")
    if index is None:
        return {}
    plan = getattr(getattr(diffusers, str(index.get("_class_name")), None), "_offload_plan", None)
    plan = plan if isinstance(plan, OffloadPlan) else OffloadPlan()
    found: dict[str, tuple[type, Mapping[str, Any]]] = {}
    for name, entry in index.items():
        if name.startswith("_") or plan.category_of(name) != "dit":
            continue
        if name in load_kwargs:  # a module passed in is what loads (None: no such component)
            given = load_kwargs[name]
            if isinstance(given, nn.Module) and isinstance(getattr(given, "config", None), Mapping):
                found[name] = (type(given), dict(given.config))
            continue
        cls = (getattr(diffusers, entry[1], None) if isinstance(entry, (list, tuple)) and len(entry) == 2
               and entry[0] == "diffusers" and isinstance(entry[1], str) else None)
        config = _json_object(folder / name / "config.json")
        if isinstance(cls, type) and config is not None:
            found[name] = (cls, config)
    return found


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in file ``path``, or None (no such file, not JSON, not an object)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
