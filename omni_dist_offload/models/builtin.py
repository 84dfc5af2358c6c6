"""The built-in pipelines ``Omni`` and the CLI accept by name: random weights, built in code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers import DiffusionPipeline, WanPipeline, WanTransformer3DModel

from .presets import PRESETS
from .tiny import (
    TINY_FLUX_DEFAULTS,
    TINY_TEXT_DIM,
    TINY_WAN_DEFAULTS,
    tiny_flux_pipeline,
    tiny_wan_pipeline,
)

__all__ = ["BUILTIN_MODELS", "BUILTIN_PIPELINES", "BUILTIN_PIPELINE_DEFAULTS", "wan_14b_random_pipeline"]

WAN_14B_RANDOM_DEFAULTS: dict[str, Any] = dict(
    height=480, width=832, num_frames=17, num_inference_steps=4, guidance_scale=5.0,
    max_sequence_length=16,
)


def wan_14b_random_pipeline(seed: int = 0, num_layers: int = 8) -> WanPipeline:
    """The tiny Wan pipeline with its DiT's blocks at real Wan-14B size (the ``wan-14b``
    benchmark preset, random weights).

    Text encoder and VAE stay tiny; only the streamed blocks matter for offload throughput.
    Weights are float32 here (about 1.4 GB a block); cast to bf16 before use.
    """
    pipe = tiny_wan_pipeline(seed=seed, num_layers=3)
    config = dict(PRESETS["wan-14b"].block_config(num_layers), text_dim=TINY_TEXT_DIM)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe.transformer = WanTransformer3DModel(**config).eval()
    pipe.register_modules(transformer=pipe.transformer)
    return pipe


BUILTIN_PIPELINES: dict[str, Callable[..., DiffusionPipeline]] = {
    "tiny-wan": tiny_wan_pipeline,
    "tiny-flux": tiny_flux_pipeline,
    "wan-14b-random": wan_14b_random_pipeline,
}

BUILTIN_PIPELINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny-wan": TINY_WAN_DEFAULTS,
    "tiny-flux": TINY_FLUX_DEFAULTS,
    "wan-14b-random": WAN_14B_RANDOM_DEFAULTS,
}

#: Names ``Omni(model=...)`` and ``--model`` build in code.
BUILTIN_MODELS: tuple[str, ...] = tuple(BUILTIN_PIPELINES)
