"""DiTs at real block sizes with random weights, for benchmarks and throughput runs.

A :class:`Preset` names a diffusers DiT class and a config whose blocks have the size of a real
model's (Wan-14B: ~703 MB a block in bf16; Flux-12B: ~415 MB), plus small Wan and Flux for CPU
smoke runs; :func:`build_model` builds one with any number of blocks and :func:`wan_inputs` /
:func:`flux_inputs` give the inputs of one denoising forward at a pixel size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import diffusers
import torch
from torch import nn

from .tiny import cast_like_pretrained

__all__ = ["PRESETS", "Preset", "build_model", "case_inputs", "flux_inputs", "wan_inputs"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A DiT class and config at real (or tiny) block sizes, and how to build its inputs."""

    cls_name: str
    config: dict[str, Any]
    blocks_key: str
    default_blocks: int
    video: bool
    text_tokens: int = 512
    """Text-encoder tokens fed to the DiT (512 in Wan and Flux; fewer keeps CPU presets fast)."""

    def built_blocks(self, blocks: int) -> int:
        """How many blocks :meth:`block_config` builds when asked for ``blocks``: a Flux model
        has at least one block of each kind, so asked for 1 it builds 2."""
        config = self.block_config(blocks)
        if self.blocks_key == "flux":
            return config["num_layers"] + config["num_single_layers"]
        return config[self.blocks_key]

    def block_config(self, blocks: int) -> dict[str, Any]:
        if self.blocks_key == "flux":  # dual-stream then single-stream blocks, 1:2 as in Flux
            double = max(1, round(blocks / 3))
            return {**self.config, "num_layers": double, "num_single_layers": max(1, blocks - double)}
        return {**self.config, self.blocks_key: blocks}


_WAN_COMMON = dict(patch_size=(1, 2, 2), in_channels=16, out_channels=16, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6)

PRESETS: dict[str, Preset] = {
    # Wan2.1/2.2 14B: 40 heads x 128, FFN 13824, text dim 4096; a block is ~703 MB in bf16.
    "wan-14b": Preset("WanTransformer3DModel", dict(
        _WAN_COMMON, num_attention_heads=40, attention_head_dim=128, text_dim=4096, freq_dim=256,
        ffn_dim=13824, rope_max_seq_len=1024), "num_layers", 8, True),
    # Wan2.1 1.3B: 12 heads x 128, FFN 8960, 30 blocks of ~93 MB in bf16 (the whole model).
    "wan-1.3b": Preset("WanTransformer3DModel", dict(
        _WAN_COMMON, num_attention_heads=12, attention_head_dim=128, text_dim=4096, freq_dim=256,
        ffn_dim=8960, rope_max_seq_len=1024), "num_layers", 30, True),
    # Flux.1-dev 12B: 19 dual-stream + 38 single-stream blocks of 3072; 415 MB a block on average.
    "flux-12b": Preset("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56)), "flux", 57, False),
    # Small Wan and Flux for CPU smoke runs of the benchmark itself.
    "tiny-wan": Preset("WanTransformer3DModel", dict(
        _WAN_COMMON, num_attention_heads=2, attention_head_dim=16, text_dim=64, freq_dim=32,
        ffn_dim=64, rope_max_seq_len=64), "num_layers", 4, True, text_tokens=16),
    "tiny-flux": Preset("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=16, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6)), "flux", 5, False, text_tokens=16),
}


def build_model(preset: Preset, blocks: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The preset's DiT with ``blocks`` blocks, built on ``device`` and cast like
    ``from_pretrained(dtype=...)``. Seeded, so every rank builds the same weights (allgather
    assembles blocks from all of them)."""
    cls = getattr(diffusers, preset.cls_name)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(**preset.block_config(blocks))
    return cast_like_pretrained(model, dtype)


def wan_inputs(model, frames: int, height: int, width: int, device, dtype, seed: int = 0,
               text_tokens: int = 512) -> dict:
    """Inputs for one denoising forward at a pixel size (the VAE is 4x in time, 8x in space)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cfg = model.config
    lat = (1, cfg.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    return dict(
        hidden_states=torch.randn(lat, generator=gen).to(device, dtype),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=torch.randn(1, text_tokens, cfg.text_dim, generator=gen).to(device, dtype),
        return_dict=False,
    )


def flux_inputs(model, px: int, device, dtype, seed: int = 0, text_tokens: int = 512) -> dict:
    """Inputs for one denoising forward of a square image (VAE 8x, then 2x2 packing)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cfg = model.config
    side = px // 16
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    return dict(
        hidden_states=torch.randn(1, side * side, cfg.in_channels, generator=gen).to(device, dtype),
        encoder_hidden_states=torch.randn(1, text_tokens, cfg.joint_attention_dim, generator=gen).to(device, dtype),
        pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=gen).to(device, dtype),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=ids.reshape(-1, 3).to(device, dtype),
        txt_ids=torch.zeros(text_tokens, 3, device=device, dtype=dtype),
        guidance=torch.tensor([3.5], device=device, dtype=torch.float32),
        return_dict=False,
    )


def case_inputs(preset: Preset, model: nn.Module, shape: tuple[int, ...], device: torch.device,
                dtype: torch.dtype, seed: int = 0) -> dict:
    """Inputs for one forward of ``model`` at ``shape``: (frames, height, width) for a video
    preset, (px,) for an image preset."""
    if preset.video:
        return wan_inputs(model, *shape, device, dtype, seed=seed, text_tokens=preset.text_tokens)
    return flux_inputs(model, shape[0], device, dtype, seed=seed, text_tokens=preset.text_tokens)
