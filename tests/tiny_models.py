"""Tiny models for tests: the package's built-in tiny components, plus a few builders and
input makers only the tests use (Qwen-Image DiT, Qwen2 encoder, inputs for one forward)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel
from transformers import PreTrainedModel, Qwen2Config, Qwen2Model

from omni_dist_offload.models.builtin import *  # noqa: F401,F403
from omni_dist_offload.models.builtin import wan_14b_random_pipeline  # noqa: F401
from omni_dist_offload.models.tiny import *  # noqa: F401,F403
from omni_dist_offload.models.tiny import TINY_TEXT_DIM, TINY_VOCAB_SIZE, _randn, _seeded, cast_like_pretrained


def tiny_qwenimage_transformer(
    num_layers: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32
) -> QwenImageTransformer2DModel:
    """Qwen-Image-style DiT: 2 heads x 16 head dim over 2x2-packed 4-channel latents."""
    with _seeded(seed):
        model = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=num_layers,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TINY_TEXT_DIM,
            axes_dims_rope=(4, 6, 6),
        )
    return cast_like_pretrained(model, dtype)


def tiny_qwen2_model(num_layers: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen2Model:
    """Qwen2 decoder stack without LM head (grouped-query attention, 4 query / 2 KV heads)."""
    config = Qwen2Config(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=TINY_TEXT_DIM,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    with _seeded(seed):
        model = Qwen2Model(config)
    return cast_like_pretrained(model, dtype)


def wide_ffn_wan_transformer(num_layers: int) -> Any:
    """The tiny Wan DiT with a 65536-wide FFN in every block: blocks large next to its
    activations, for memory-bound tests."""
    model = tiny_wan_transformer(num_layers=num_layers)  # noqa: F405 (from the star import)
    for block in model.blocks:
        block.ffn.net[0].proj = torch.nn.Linear(model.config.attention_head_dim * 2, 1 << 16)
        block.ffn.net[2] = torch.nn.Linear(1 << 16, model.config.attention_head_dim * 2)
    return model


def _packed_image_ids(height: int, width: int) -> torch.Tensor:
    """Flux-style (0, row, col) position ids for a 2x2-packed latent of ``height x width``."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)


def flux_transformer_inputs(
    model: FluxTransformer2DModel,
    batch: int = 1,
    height: int = 8,
    width: int = 8,
    text_len: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Kwargs for one forward of ``model``; ``height/width`` are latent sizes before 2x2 packing (even)."""
    gen = torch.Generator().manual_seed(seed)
    cfg, dtype = model.config, model.dtype
    num_tokens = (height // 2) * (width // 2)
    inputs = dict(
        hidden_states=_randn(gen, batch, num_tokens, cfg.in_channels, dtype=dtype),
        encoder_hidden_states=_randn(gen, batch, text_len, cfg.joint_attention_dim, dtype=dtype),
        pooled_projections=_randn(gen, batch, cfg.pooled_projection_dim, dtype=dtype),
        # The pipeline passes t / 1000 in [0, 1]; the model rescales internally.
        timestep=torch.rand(batch, generator=gen).to(dtype),
        img_ids=_packed_image_ids(height, width).to(dtype),
        txt_ids=torch.zeros(text_len, 3, dtype=dtype),
        return_dict=False,
    )
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5, dtype=torch.float32)
    return inputs


def qwenimage_transformer_inputs(
    model: QwenImageTransformer2DModel,
    batch: int = 1,
    height: int = 8,
    width: int = 8,
    text_len: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Kwargs for one forward of ``model``; ``height/width`` are latent sizes before 2x2 packing (even).

    The text mask pads the last two tokens of every sample after the first, as a padded batch would.
    """
    gen = torch.Generator().manual_seed(seed)
    cfg, dtype = model.config, model.dtype
    h, w = height // 2, width // 2
    mask = torch.ones(batch, text_len, dtype=torch.long)
    mask[1:, max(1, text_len - 2) :] = 0
    return dict(
        hidden_states=_randn(gen, batch, h * w, cfg.in_channels, dtype=dtype),
        encoder_hidden_states=_randn(gen, batch, text_len, cfg.joint_attention_dim, dtype=dtype),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(batch, generator=gen).to(dtype),
        img_shapes=[[(1, h, w)]] * batch,
        return_dict=False,
    )


def text_encoder_inputs(
    model: PreTrainedModel, batch: int = 2, seq_len: int = 8, seed: int = 0
) -> dict[str, torch.Tensor]:
    """``input_ids``/``attention_mask`` of a right-padded batch; sample ``i`` has ``seq_len - 2 * i`` tokens.

    Every sequence ends with the model's EOS token (CLIP pools there) and is padded with its pad token.
    """
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else 1
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    # Ids 0..2 are the special tokens of the tiny tokenizers.
    input_ids = torch.randint(3, cfg.vocab_size, (batch, seq_len), generator=gen)
    attention_mask = torch.zeros(batch, seq_len, dtype=torch.long)
    for i in range(batch):
        length = max(1, seq_len - 2 * i)
        attention_mask[i, :length] = 1
        input_ids[i, length - 1] = eos
        input_ids[i, length:] = pad
    return dict(input_ids=input_ids, attention_mask=attention_mask)


