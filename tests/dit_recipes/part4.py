"""Tiny builders for diffusers transformer classes (part 4): each returns a model at tiny size in float32 on the CPU and the keyword arguments of one forward."""
from __future__ import annotations

import torch
from diffusers import (
    QwenImageTransformer2DModel,
    RFD4ProteinaTransformer,
    SanaTransformer2DModel,
    SanaVideoTransformer3DModel,
    SanaWMLTX2RefinerTransformer3DModel,
    SanaWMTransformer3DModel,
    SD3Transformer2DModel,
    SkyReelsV2Transformer3DModel,
    StableAudio3DiTModel,
    StableAudioDiTModel,
    T5FilmDecoder,
    Transformer2DModel,
    TransformerTemporalModel,
    WanAnimate2Transformer3DModel,
    WanAnimateTransformer3DModel,
    WanTransformer3DModel,
    WanVACETransformer3DModel,
    ZImageTransformer2DModel,
)
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

from .common import finish as _finish
from .common import randn as _randn


def _qwen_image(seed: int):
    torch.manual_seed(seed)
    model = _finish(QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 1 * 4 * 4, 16),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "encoder_hidden_states_mask": torch.ones(1, 6),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, 4, 4)]],
        "return_dict": False,
    }
    return model, kwargs


def _sd3(seed: int):
    torch.manual_seed(seed)
    model = _finish(SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16,
        pooled_projection_dim=12, out_channels=4, pos_embed_max_size=8,
        dual_attention_layers=(0,), qk_norm="rms_norm",
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "pooled_projections": _randn(g, 1, 12),
        "timestep": torch.tensor([500]),
        "return_dict": False,
    }
    return model, kwargs


def _sana(seed: int):
    torch.manual_seed(seed)
    model = _finish(SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
        caption_channels=24, mlp_ratio=2.5, sample_size=8, patch_size=1,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 24),
        "timestep": torch.tensor([500]),
        "return_dict": False,
    }
    return model, kwargs


def _sana_video(seed: int):
    torch.manual_seed(seed)
    model = _finish(SanaVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24,
        caption_channels=20, mlp_ratio=2.5, sample_size=8, patch_size=(1, 2, 2), rope_max_seq_len=32,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 20),
        "timestep": torch.tensor([500]),
        "return_dict": False,
    }
    return model, kwargs


def _skyreels_v2(seed: int):
    torch.manual_seed(seed)
    model = _finish(SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=20, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, 6, 20),
        "return_dict": False,
    }
    return model, kwargs


def _stable_audio(seed: int):
    torch.manual_seed(seed)
    model = _finish(StableAudioDiTModel(
        sample_size=16, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        num_key_value_attention_heads=1, out_channels=4, cross_attention_dim=16, time_proj_dim=16,
        global_states_input_dim=12, cross_attention_input_dim=20,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    seq = 16
    kwargs = {
        "hidden_states": _randn(g, 1, 4, seq),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, 6, 20),
        "global_hidden_states": _randn(g, 1, 1, 12),
        "rotary_embedding": get_1d_rotary_pos_embed(8 // 2, seq + 1, use_real=True, repeat_interleave_real=False),
        "return_dict": False,
    }
    return model, kwargs


def _t5_film(seed: int):
    torch.manual_seed(seed)
    model = _finish(T5FilmDecoder(
        input_dims=8, targets_length=16, max_decoder_noise_time=2000.0, d_model=16, num_layers=2,
        num_heads=2, d_kv=8, d_ff=32, dropout_rate=0.1,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    enc1 = _randn(g, 1, 6, 16)
    enc2 = _randn(g, 1, 4, 16)
    kwargs = {
        "encodings_and_masks": [(enc1, torch.ones(1, 6, dtype=torch.bool)), (enc2, torch.ones(1, 4, dtype=torch.bool))],
        "decoder_input_tokens": _randn(g, 1, 16, 8),
        "decoder_noise_time": torch.tensor([0.5]),
    }
    return model, kwargs


def _transformer_2d(seed: int):
    torch.manual_seed(seed)
    model = _finish(Transformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=8, out_channels=8, num_layers=2,
        norm_num_groups=4, cross_attention_dim=12,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 8, 4, 4),
        "encoder_hidden_states": _randn(g, 1, 6, 12),
        "return_dict": False,
    }
    return model, kwargs


def _transformer_temporal(seed: int):
    torch.manual_seed(seed)
    model = _finish(TransformerTemporalModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=8, out_channels=8, num_layers=2,
        norm_num_groups=4,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1 * 3, 8, 4, 4),
        "num_frames": 3,
        "return_dict": False,
    }
    return model, kwargs


def _wan(seed: int):
    torch.manual_seed(seed)
    model = _finish(WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=20, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, 6, 20),
        "return_dict": False,
    }
    return model, kwargs


def _wan_vace(seed: int):
    torch.manual_seed(seed)
    model = _finish(WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=20, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
        vace_layers=[0, 1], vace_in_channels=6,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, 6, 20),
        "control_hidden_states": _randn(g, 1, 6, 2, 8, 8),
        "control_hidden_states_scale": torch.tensor([1.0, 0.5]),
        "return_dict": False,
    }
    return model, kwargs


def _rfd4(seed: int):
    torch.manual_seed(seed)
    model = _finish(RFD4ProteinaTransformer(
        nlayers=3, token_dim=16, nheads=2, dim_cond=16, pair_repr_dim=8, latent_dim=4, token_type_emb_dim=4,
        cath_emb_dim=4, t_emb_dim=16, seq_sep_dim=8, xt_pair_dist_dim=8,
        feats_seq=("xt_bb_ca", "xt_local_latents", "token_type"),
        feats_cond_seq=("time_emb_bb_ca", "time_emb_local_latents"),
        feats_pair_repr=("xt_bb_ca_pair_dists", "bond_order", "token_bond_path_length"),
        feats_pair_cond=("time_emb_bb_ca",),
        update_pair_repr_every_n=1, tri_mult_c=8, num_sequence_classes=10, num_token_types=7,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = 6
    kwargs = {
        "bb_ca": _randn(g, 1, n, 3),
        "local_latents": _randn(g, 1, n, 4),
        "bb_ca_time": torch.tensor([0.3]),
        "local_latents_time": torch.tensor([0.6]),
        "padding_mask": torch.ones(1, n, dtype=torch.bool),
        "token_type": torch.randint(0, 7, (1, n), generator=g),
        "conditioning": {
            "is_in_context_conditioning": torch.zeros(1, n, dtype=torch.bool),
            "supports_local_latent": torch.ones(1, n, dtype=torch.bool),
            "bond_order": torch.randint(0, 5, (1, n, n), generator=g),
            "token_bond_path_length": torch.randint(0, 8, (1, n, n), generator=g),
        },
        "return_dict": False,
    }
    return model, kwargs


def _sana_wm(seed: int):
    torch.manual_seed(seed)
    model = _finish(SanaWMTransformer3DModel(
        in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2, patch_size=(1, 1, 1),
        softmax_every_n=2, linear_head_dim=16, chunk_plucker_channels=6, chunk_plucker_post_attn_blocks=2,
        image_size=8, caption_channels=24, mlp_ratio=2.0,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    b, t, h, w = 1, 3, 4, 4
    cam = torch.zeros(b, t, 20)
    c2w = torch.eye(4).repeat(b, t, 1, 1)
    c2w[..., :3, 3] = 0.1 * _randn(g, b, t, 3)
    cam[..., :16] = c2w.flatten(-2)
    cam[..., 16] = w
    cam[..., 17] = h
    cam[..., 18] = w / 2
    cam[..., 19] = h / 2
    kwargs = {
        "hidden_states": _randn(g, b, 4, t, h, w),
        "timestep": torch.full((b, 1, t), 500.0),
        "encoder_hidden_states": _randn(g, b, 1, 6, 24),
        "encoder_attention_mask": torch.ones(b, 6),
        "camera_conditions": cam,
        "chunk_plucker": _randn(g, b, 6, t, h, w),
        "return_dict": False,
    }
    return model, kwargs


def _sana_wm_refiner(seed: int):
    torch.manual_seed(seed)
    model = _finish(SanaWMLTX2RefinerTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=12,
        rope_double_precision=False,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    b, t, h, w = 1, 2, 4, 4
    kwargs = {
        "hidden_states": _randn(g, b, t * h * w, 4),
        "encoder_hidden_states": _randn(g, b, 6, 12),
        "timestep": torch.full((b, t * h * w), 500.0),
        "video_rotary_emb": model.build_rotary_emb_for_absolute_positions(
            b, list(range(t)), h, w, torch.device("cpu"), fps=24.0
        ),
        "encoder_attention_mask": torch.ones(b, 6),
        "return_dict": False,
    }
    return model, kwargs


def _stable_audio3(seed: int):
    torch.manual_seed(seed)
    model = _finish(StableAudio3DiTModel(
        io_channels=4, patch_size=1, embed_dim=16, depth=2, num_heads=2, cond_token_dim=12, global_cond_dim=10,
        local_add_cond_dim=5, timestep_features_dim=16, ff_mult=2.0, num_memory_tokens=4,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 16),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, 6, 12),
        "global_hidden_states": _randn(g, 1, 10),
        "encoder_attention_mask": torch.tensor([[True] * 5 + [False]]),
        "local_add_cond": _randn(g, 1, 5, 16),
        "return_dict": False,
    }
    return model, kwargs


def _wan_animate(seed: int):
    torch.manual_seed(seed)
    model = _finish(WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12, latent_channels=4,
        out_channels=4, text_dim=20, freq_dim=16, ffn_dim=64, num_layers=4, image_dim=16, rope_max_seq_len=32,
        motion_encoder_channel_sizes={"4": 4, "8": 4, "16": 4}, motion_encoder_size=16, motion_style_dim=8,
        motion_dim=4, motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2,
        inject_face_latents_blocks=2, motion_encoder_batch_size=4,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 12, 3, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, 6, 20),
        "encoder_hidden_states_image": _randn(g, 1, 4, 16),
        "pose_hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "face_pixel_values": _randn(g, 1, 3, 5, 16, 16),
        "return_dict": False,
    }
    return model, kwargs


def _wan_animate_2(seed: int):
    torch.manual_seed(seed)
    model = _finish(WanAnimate2Transformer3DModel(
        patch_size=(1, 2, 2), text_len=8, in_dim=8, dim=24, ffn_dim=32, freq_dim=16, text_dim=20, out_dim=4,
        num_heads=2, num_layers=2, use_img_emb=False,
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": [_randn(g, 4, 2, 8, 8)],
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": [_randn(g, 6, 20)],
        "condition_latents": [_randn(g, 4, 2, 8, 8)],
        "kv_cache": WanAnimate2KVCache(2),
        "kv_cache_mode": "extract",
        "seq_len": 2 * 4 * 4,
        "offset_grid_sizes": torch.tensor([[2, 4, 4]]),
        "return_dict": False,
    }
    return model, kwargs


def _z_image(seed: int):
    torch.manual_seed(seed)
    model = _finish(ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=2,
        n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32],
        siglip_feat_dim=8,  # as Z-Image Omni: its refiner runs only with condition images
    ), seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "x": [_randn(g, 4, 1, 8, 8)],
        "t": torch.tensor([0.5]),
        "cap_feats": [_randn(g, 6, 16)],
        "return_dict": False,
    }
    return model, kwargs


RECIPES = {
    "QwenImageTransformer2DModel": _qwen_image,
    "RFD4ProteinaTransformer": _rfd4,
    "SD3Transformer2DModel": _sd3,
    "SanaTransformer2DModel": _sana,
    "SanaVideoTransformer3DModel": _sana_video,
    "SanaWMLTX2RefinerTransformer3DModel": _sana_wm_refiner,
    "SanaWMTransformer3DModel": _sana_wm,
    "SkyReelsV2Transformer3DModel": _skyreels_v2,
    "StableAudio3DiTModel": _stable_audio3,
    "StableAudioDiTModel": _stable_audio,
    "T5FilmDecoder": _t5_film,
    "Transformer2DModel": _transformer_2d,
    "TransformerTemporalModel": _transformer_temporal,
    "WanAnimateTransformer3DModel": _wan_animate,
    "WanTransformer3DModel": _wan,
    "WanVACETransformer3DModel": _wan_vace,
}
# These two return a list of per-sample tensors; the test compares every tensor.
RECIPES["WanAnimate2Transformer3DModel"] = _wan_animate_2
RECIPES["ZImageTransformer2DModel"] = _z_image

SKIPPED: dict[str, str] = {}
