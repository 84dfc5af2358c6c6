"""diffusers' step caches on streamed models: each cache hook on a rank-local ring gives the
cached resident model's outputs, bitwise, step by step. A cache that skips a block still calls
it (diffusers replaces what runs inside the block), so the ring's hooks see every block in
order and nothing is fetched out of turn."""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
)

import tiny_models as tiny
from omni_dist_offload import apply_offload

STEPS = 8
CLOCK = {"t": 0.0}  # the timestep callbacks of PAB and FasterCache read it


def cache_configs() -> dict:
    return {
        "first-block": (FirstBlockCacheConfig(threshold=0.2), True, 1),
        "mag": (MagCacheConfig(mag_ratios=[1.0] * STEPS, num_inference_steps=STEPS, max_skip_steps=2,
                               retention_ratio=0.25), False, 1),
        "taylorseer-lite": (TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2, use_lite_mode=True,
                                                  taylor_factors_dtype=torch.float32), True, 1),
        "pyramid-attention": (PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, cross_attention_block_skip_range=3,
            spatial_attention_timestep_skip_range=(100, 950), cross_attention_timestep_skip_range=(100, 950),
            current_timestep_callback=lambda: CLOCK["t"]), False, 1),
        "faster": (FasterCacheConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 901),
            unconditional_batch_skip_range=3, unconditional_batch_timestep_skip_range=(-1, 901),
            current_timestep_callback=lambda: CLOCK["t"], tensor_format="BCFHW",
            attention_weight_callback=lambda _: 0.5), False, 2),
    }


def cached_steps(name: str, offload: dict | None, drift: float = 0.001, cache: bool = True,
                 device: str = "cpu") -> list[torch.Tensor]:
    """STEPS forwards of the tiny Wan DiT with cache ``name`` (enabled after offloading), the
    input moving by ``drift`` a step: slowly enough that some steps skip by default."""
    config, needs_context, batch = cache_configs()[name]
    model = tiny.tiny_wan_transformer(num_layers=4).to(device)
    handle = apply_offload(model, offload) if offload is not None else None
    if cache:
        model.enable_cache(config)
    torch.manual_seed(1)
    base = torch.randn(batch, 16, 2, 8, 8, device=device)
    text = torch.randn(batch, 8, tiny.TINY_TEXT_DIM, device=device)
    outs = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a block fetched out of turn would warn
        for s in range(STEPS):
            CLOCK["t"] = 999.0 - s * 125
            kwargs = {"hidden_states": base + drift * s, "timestep": torch.full((batch,), CLOCK["t"], device=device),
                      "encoder_hidden_states": text, "return_dict": False}
            if needs_context and cache:
                with model.cache_context("cond"):
                    outs.append(model(**kwargs)[0])
            else:
                outs.append(model(**kwargs)[0])
    if cache:
        model.disable_cache()
    if handle is not None:
        handle.remove()
    return outs


@pytest.mark.parametrize("name", list(cache_configs()))
def test_step_caches_on_a_streamed_model_match_the_cached_resident_model(name):
    ref = cached_steps(name, None)
    got = cached_steps(name, {"mode": "layer"})
    assert [torch.equal(a, b) for a, b in zip(got, ref)] == [True] * STEPS
