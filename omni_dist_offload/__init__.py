"""Layerwise offloading for diffusion transformers and their text encoders.

Each transformer block's weights live in host memory; one block at a time is on the device,
the next prefetched on a copy stream while the current one computes. The layout of the package
is mapped at the top of ``docs/design.md``.
"""

from .app.api import Omni
from .apply import OffloadHandle, RingSummary, apply_offload
from .config import LayerOptions, OffloadConfig, OffloadConfigError
from .plan import OffloadPlan

__all__ = [
    "LayerOptions",
    "OffloadConfig",
    "OffloadConfigError",
    "OffloadHandle",
    "OffloadPlan",
    "Omni",
    "RingSummary",
    "apply_offload",
]

__version__ = "0.1.0"
