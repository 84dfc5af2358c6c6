"""Built-in models: tiny pipelines that run anywhere, and DiTs at real block sizes.

* :mod:`.tiny`: tiny random-weight components and the ``tiny-wan`` / ``tiny-flux`` pipelines;
* :mod:`.presets`: Wan-14B, Wan-1.3B and Flux-12B DiTs at real block sizes (benchmarks);
* :mod:`.builtin`: the pipelines ``Omni`` and the CLI accept by name.
"""

from .builtin import BUILTIN_MODELS, BUILTIN_PIPELINE_DEFAULTS, BUILTIN_PIPELINES
from .presets import PRESETS, Preset, build_model, case_inputs, flux_inputs, wan_inputs
from .tiny import cast_like_pretrained

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_PIPELINES",
    "BUILTIN_PIPELINE_DEFAULTS",
    "PRESETS",
    "Preset",
    "build_model",
    "case_inputs",
    "cast_like_pretrained",
    "flux_inputs",
    "wan_inputs",
]
