"""What a diffusers pipeline folder says about itself, and the loader keyword of this diffusers."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import diffusers
import torch

__all__ = ["DTYPES", "dtype_kwarg", "pipeline_class", "resolve_dtype"]

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
