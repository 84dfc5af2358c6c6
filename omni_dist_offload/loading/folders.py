"""What a diffusers pipeline folder says about itself, and the loader keyword of this diffusers."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import diffusers

__all__ = ["dtype_kwarg", "pipeline_class"]


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
        name = json.loads((Path(folder) / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError):
        name = None
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    return cls if isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline) else diffusers.DiffusionPipeline
