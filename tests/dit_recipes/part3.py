"""Tiny builders for diffusers transformer classes (part 3): each returns a model at tiny size in float32 on the CPU and the keyword arguments of one forward."""
from __future__ import annotations

import torch
from diffusers import (
    LatteTransformer3DModel,
    LongCatAudioDiTTransformer,
    LongCatImageTransformer2DModel,
    LTX2VideoTransformer3DModel,
    LTXVideoTransformer3DModel,
    Lumina2Transformer2DModel,
    LuminaNextDiT2DModel,
    MiniMaxH3Transformer3DModel,
    MiniMaxMusic3RVQDepthDecoder,
    MiniMaxMusic3Transformer1DModel,
    MochiTransformer3DModel,
    MotifVideoTransformer3DModel,
    NucleusMoEImageTransformer2DModel,
    OmniGenTransformer2DModel,
    OvisImageTransformer2DModel,
    PixArtTransformer2DModel,
    PriorTransformer,
    PRXTransformer2DModel,
    QwenImage21Transformer2DModel,
)
from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

from .common import fill_zero_params as _fill_zero_params
from .common import flux_like_ids as _flux_like_ids
from .common import randn as _randn


def _ltx2(seed: int):
    torch.manual_seed(seed)
    model = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=2,
        caption_channels=16,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    f, h, w, af, txt = 2, 2, 2, 3, 4
    kwargs = {
        "hidden_states": _randn(g, 1, f * h * w, 4),
        "audio_hidden_states": _randn(g, 1, af, 4),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "audio_encoder_hidden_states": _randn(g, 1, txt, 16),
        "timestep": torch.tensor([500.0]),
        "encoder_attention_mask": torch.ones(1, txt),
        "audio_encoder_attention_mask": torch.ones(1, txt),
        "num_frames": f,
        "height": h,
        "width": w,
        "audio_num_frames": af,
        "return_dict": False,
    }
    return model, kwargs


def _ltx(seed: int):
    torch.manual_seed(seed)
    model = LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=2,
        caption_channels=16,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    f, h, w, txt = 2, 2, 2, 4
    kwargs = {
        "hidden_states": _randn(g, 1, f * h * w, 4),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "timestep": torch.tensor([500]),
        "encoder_attention_mask": torch.ones(1, txt),
        "num_frames": f,
        "height": h,
        "width": w,
        "rope_interpolation_scale": (1.0, 1.0, 1.0),
        "return_dict": False,
    }
    return model, kwargs


def _latte(seed: int):
    torch.manual_seed(seed)
    model = LatteTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        norm_type="ada_norm_single",
        caption_channels=16,
        video_length=2,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, 4, 16),
        "return_dict": False,
    }
    return model, kwargs


def _longcat_audio(seed: int):
    torch.manual_seed(seed)
    model = LongCatAudioDiTTransformer(
        dit_dim=32,
        dit_depth=2,
        dit_heads=2,
        dit_text_dim=16,
        latent_dim=4,
        ff_mult=2.0,
    ).eval()
    _fill_zero_params(model, seed)  # adaLN / output heads are zero-initialised
    g = torch.Generator().manual_seed(seed + 1)
    seq, txt = 6, 4
    kwargs = {
        "hidden_states": _randn(g, 1, seq, 4),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "encoder_attention_mask": torch.ones(1, txt, dtype=torch.bool),
        "timestep": torch.tensor([0.5]),
        "attention_mask": torch.ones(1, seq, dtype=torch.bool),
        "latent_cond": _randn(g, 1, seq, 4),
        "return_dict": False,
    }
    return model, kwargs




def _longcat_image(seed: int):
    torch.manual_seed(seed)
    model = LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        axes_dims_rope=[4, 6, 6],
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    txt, h, w = 4, 2, 3
    txt_ids, img_ids = _flux_like_ids(txt, h, w)
    kwargs = {
        "hidden_states": _randn(g, 1, h * w, 8),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "timestep": torch.tensor([0.5]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "return_dict": False,
    }
    return model, kwargs


def _lumina2(seed: int):
    torch.manual_seed(seed)
    model = Lumina2Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=2,
        num_refiner_layers=2,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),
        axes_lens=(32, 32, 32),
        cap_feat_dim=16,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    txt = 4
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "encoder_attention_mask": torch.ones(1, txt, dtype=torch.bool),
        "return_dict": False,
    }
    return model, kwargs


def _lumina_next(seed: int):
    torch.manual_seed(seed)
    model = LuminaNextDiT2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        learn_sigma=True,
        qk_norm=True,
        cross_attention_dim=16,
    ).eval()
    with torch.no_grad():  # `pad_token` is created with torch.empty and never initialised
        model.pad_token.copy_(torch.randn(model.pad_token.shape, generator=torch.Generator().manual_seed(seed + 2)))
    g = torch.Generator().manual_seed(seed + 1)
    txt = 4
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "encoder_mask": torch.ones(1, txt, dtype=torch.bool),
        "image_rotary_emb": get_2d_rotary_pos_embed_lumina(16, 8, 8),
        "cross_attention_kwargs": {},  # the blocks unpack it with **, so None fails
        "return_dict": False,
    }
    return model, kwargs


def _minimax_h3(seed: int):
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        hidden_size=32,
        num_layers=2,
        num_refiner_layers=2,
        ffn_dim=64,
        in_channels=4,
        audio_in_channels=4,
        patch_size=(1, 2, 2),
        text_dim=16,
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    n_txt, n_vid, n_aud = 3, 4, 2
    seq = n_txt + n_vid + n_aud
    text_indices = torch.arange(0, n_txt)
    video_indices = torch.arange(n_txt, n_txt + n_vid)
    audio_indices = torch.arange(n_txt + n_vid, seq)
    token_tags = torch.cat(
        [torch.full((n_txt,), 1), torch.full((n_vid,), 0), torch.full((n_aud,), 2)]
    ).long()
    timestep_indices = torch.cat(
        [torch.zeros(n_txt), torch.zeros(n_vid), torch.ones(n_aud)]
    ).long()
    position_ids = torch.zeros(seq, 3, dtype=torch.long)
    position_ids[:n_txt] = torch.arange(n_txt)[:, None]
    position_ids[video_indices, 0] = n_txt
    position_ids[video_indices, 1] = torch.tensor([0, 0, 1, 1])
    position_ids[video_indices, 2] = torch.tensor([0, 1, 0, 1])
    position_ids[audio_indices, 0] = torch.arange(n_aud) + n_txt
    kwargs = {
        "hidden_states": _randn(g, 1, n_vid, 16),
        "audio_hidden_states": _randn(g, 1, n_aud, 4),
        "encoder_hidden_states": _randn(g, 1, n_txt, 16),
        "timestep": torch.tensor([0.3, 0.7]),
        "timestep_indices": timestep_indices,
        "token_tags": token_tags,
        "position_ids": position_ids,
        "video_indices": video_indices,
        "audio_indices": audio_indices,
        "text_indices": text_indices,
        "return_dict": False,
    }
    return model, kwargs


def _minimax_music3_depth(seed: int):
    torch.manual_seed(seed)
    model = MiniMaxMusic3RVQDepthDecoder(
        hidden_size=32,
        num_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        audio_vocab_size=16,
        num_codebooks=3,
        max_position_embeddings=8,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {"inputs_embeds": _randn(g, 1, 3, 32)}
    return model, kwargs


def _minimax_music3(seed: int):
    torch.manual_seed(seed)
    model = MiniMaxMusic3Transformer1DModel(
        in_channels=4,
        condition_dim=8,
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=8,
        ff_inner_dim=32,
        rotary_dim=8,
        fourier_embedding_dim=16,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    length = 6
    kwargs = {
        "hidden_states": _randn(g, 1, 4, length),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, length, 8),
        "return_dict": False,
    }
    return model, kwargs


def _mochi(seed: int):
    torch.manual_seed(seed)
    model = MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        pooled_projection_dim=16,
        in_channels=4,
        text_embed_dim=16,
        time_embed_dim=16,
        max_sequence_length=8,
    ).eval()
    _fill_zero_params(model, seed)  # `pos_frequencies` is zero-initialised (RoPE would be the identity)
    g = torch.Generator().manual_seed(seed + 1)
    txt = 4
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "timestep": torch.tensor([500]),
        "encoder_attention_mask": torch.ones(1, txt, dtype=torch.bool),
        "return_dict": False,
    }
    return model, kwargs


def _motif_video(seed: int):
    torch.manual_seed(seed)
    model = MotifVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=2,
        mlp_ratio=2.0,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=16,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    txt = 4
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "encoder_attention_mask": torch.ones(1, txt),
        "image_embeds": _randn(g, 1, 2, 16),
        "return_dict": False,
    }
    return model, kwargs


def _nucleus_moe(seed: int):
    torch.manual_seed(seed)
    model = NucleusMoEImageTransformer2DModel(
        patch_size=2,
        in_channels=8,  # packed 2x2 patches of 2 latent channels
        out_channels=2,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
        mlp_ratio=6.0,  # dense FFN inner dim is rounded down to a multiple of 128
        moe_enabled=True,
        dense_moe_strategy="leave_first_block_dense",  # block 0 dense, block 1 MoE
        num_experts=4,
        moe_intermediate_dim=16,
        capacity_factors=2.0,
    ).eval()
    # the routed-expert weights are created with torch.empty and never initialised
    ge = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".experts." in name:
                p.copy_(torch.randn(p.shape, generator=ge) * 0.1)
    g = torch.Generator().manual_seed(seed + 1)
    txt, h, w = 4, 2, 3
    kwargs = {
        "hidden_states": _randn(g, 1, h * w, 8),
        "img_shapes": [(1, h, w)],
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "encoder_hidden_states_mask": torch.ones(1, txt, dtype=torch.bool),
        "timestep": torch.tensor([0.5]),
        "return_dict": False,
    }
    return model, kwargs


def _omnigen(seed: int):
    torch.manual_seed(seed)
    head_dim = 16
    model = OmniGenTransformer2DModel(
        in_channels=4,
        patch_size=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_layers=2,
        pad_token_id=0,
        vocab_size=64,
        max_position_embeddings=64,
        original_max_position_embeddings=32,
        rope_scaling={"short_factor": [1.0] * (head_dim // 2), "long_factor": [1.0] * (head_dim // 2)},
        pos_embed_max_size=8,
        time_step_dim=32,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    # condition: 6 text tokens, of which positions 1..4 are replaced by a 4x4 input-image latent (4 patches)
    n_cond, n_out = 6, 16
    seq = n_cond + 1 + n_out
    input_ids = torch.randint(1, 64, (1, n_cond), generator=g)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.tensor([0.5]),
        "input_ids": input_ids,
        "input_img_latents": [_randn(g, 1, 4, 4, 4)],
        "input_image_sizes": {0: [(1, 5)]},
        "attention_mask": torch.ones(1, seq, seq),
        "position_ids": torch.arange(seq)[None],
        "return_dict": False,
    }
    return model, kwargs


def _ovis_image(seed: int):
    torch.manual_seed(seed)
    model = OvisImageTransformer2DModel(
        patch_size=1,
        in_channels=8,
        out_channels=8,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    txt, h, w = 4, 2, 3
    txt_ids, img_ids = _flux_like_ids(txt, h, w)
    kwargs = {
        "hidden_states": _randn(g, 1, h * w, 8),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "timestep": torch.tensor([0.5]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "return_dict": False,
    }
    return model, kwargs


def _prx(seed: int):
    torch.manual_seed(seed)
    model = PRXTransformer2DModel(
        in_channels=4,
        patch_size=2,
        context_in_dim=16,
        hidden_size=32,
        mlp_ratio=2.0,
        num_heads=2,
        depth=2,
        axes_dim=[8, 8],
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    txt = 4
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "attention_mask": torch.ones(1, txt, dtype=torch.bool),
        "return_dict": False,
    }
    return model, kwargs


def _pixart(seed: int):
    torch.manual_seed(seed)
    model = PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        caption_channels=16,
        use_additional_conditions=False,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    txt = 4
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "timestep": torch.tensor([500]),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        "encoder_attention_mask": torch.ones(1, txt),
        "return_dict": False,
    }
    return model, kwargs


def _prior(seed: int):
    torch.manual_seed(seed)
    model = PriorTransformer(
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        embedding_dim=16,
        num_embeddings=6,
        additional_embeddings=4,
    ).eval()
    _fill_zero_params(model, seed)  # positional / prd embeddings and clip stats are zero-initialised
    g = torch.Generator().manual_seed(seed + 1)
    txt = 6
    kwargs = {
        "hidden_states": _randn(g, 1, 16),
        "timestep": torch.tensor([500]),
        "proj_embedding": _randn(g, 1, 16),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "attention_mask": torch.ones(1, txt, dtype=torch.bool),
        "return_dict": False,
    }
    return model, kwargs


def _qwenimage21(seed: int):
    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=8,
        out_channels=8,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=16,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    # VLM sequence: 2 text, 1 condition-image slot, 1 text (= encoder_hidden_states), then 2 target-image slots.
    # Each slot stands for 2x2 latent tokens: condition image 2x2 (4 tokens), target image 2x4 (8 tokens).
    img_shapes = [[(1, 2, 2), (1, 2, 4)]]
    img_mask = torch.tensor([[False, False, True, False, True, True]])
    txt = 4
    kwargs = {
        "hidden_states": _randn(g, 1, 4 + 8, 8),
        "encoder_hidden_states": _randn(g, 1, txt, 16),
        "timestep": torch.tensor([0.5]),
        "img_shapes": img_shapes,
        "img_mask": img_mask,
        "encoder_hidden_states_mask": torch.ones(1, txt, dtype=torch.bool),
        "return_dict": False,
    }
    return model, kwargs


RECIPES = {
    "LTX2VideoTransformer3DModel": _ltx2,
    "LTXVideoTransformer3DModel": _ltx,
    "LatteTransformer3DModel": _latte,
    "LongCatAudioDiTTransformer": _longcat_audio,
    "LongCatImageTransformer2DModel": _longcat_image,
    "Lumina2Transformer2DModel": _lumina2,
    "LuminaNextDiT2DModel": _lumina_next,
    "MiniMaxH3Transformer3DModel": _minimax_h3,
    "MiniMaxMusic3RVQDepthDecoder": _minimax_music3_depth,
    "MiniMaxMusic3Transformer1DModel": _minimax_music3,
    "MochiTransformer3DModel": _mochi,
    "MotifVideoTransformer3DModel": _motif_video,
    "NucleusMoEImageTransformer2DModel": _nucleus_moe,
    "OmniGenTransformer2DModel": _omnigen,
    "OvisImageTransformer2DModel": _ovis_image,
    "PRXTransformer2DModel": _prx,
    "PixArtTransformer2DModel": _pixart,
    "PriorTransformer": _prior,
    "QwenImage21Transformer2DModel": _qwenimage21,
}

SKIPPED: dict[str, str] = {}
