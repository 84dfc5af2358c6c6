"""Loading: pipelines from built-ins, folders and hub ids; cold start from safetensors.

* :mod:`.pipelines`: load a pipeline on the host and stream it (or move it whole);
* :mod:`.coldstart`: streamed components built without weights, blocks read into host shards;
* :mod:`.checkpoint`: safetensors read by byte range; the block sources cold start passes on;
* :mod:`.folders`: what a diffusers folder says about itself.
"""

from .coldstart import load_offloaded
from .pipelines import LoadedPipeline, ModelLoadError, load_and_place, load_pipeline

__all__ = ["LoadedPipeline", "ModelLoadError", "load_and_place", "load_offloaded", "load_pipeline"]
