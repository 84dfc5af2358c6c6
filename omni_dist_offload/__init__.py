"""Layerwise offloading for diffusion transformers and their text encoders.

Each transformer block's weights live in host memory; one block at a time is on the device,
the next prefetched on a copy stream while the current one computes. The layout of the package
is mapped at the top of ``docs/design.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app.api import GenerationOptionError, LoraSpec, Omni
    from .apply import OffloadHandle, RingSummary, apply_offload
    from .config import LayerOptions, OffloadConfig, OffloadConfigError
    from .plan import OffloadPlan

# Loaded on first use (PEP 562): ``python -m omni_dist_offload`` and the ``omni-offload``
# script decide how to start (see ``__main__.py``) before torch and diffusers are imported.
_WHERE = {"Omni": ".app.api", "GenerationOptionError": ".app.api", "LoraSpec": ".app.api",
          "OffloadHandle": ".apply", "RingSummary": ".apply",
          "apply_offload": ".apply", "LayerOptions": ".config", "OffloadConfig": ".config",
          "OffloadConfigError": ".config", "OffloadPlan": ".plan"}

__all__ = [
    "GenerationOptionError",
    "LayerOptions",
    "LoraSpec",
    "OffloadConfig",
    "OffloadConfigError",
    "OffloadHandle",
    "OffloadPlan",
    "Omni",
    "RingSummary",
    "apply_offload",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
