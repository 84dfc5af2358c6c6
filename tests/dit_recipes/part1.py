"""Tiny builders for diffusers transformer classes (part 1): each returns a model at tiny size in float32 on the CPU and the keyword arguments of one forward."""
from __future__ import annotations

import torch

from .common import flux_like_ids as _flux_like_ids
from .common import randn as _randn


def _ace_step(seed: int):
    from diffusers import AceStepTransformer1DModel

    torch.manual_seed(seed)
    model = AceStepTransformer1DModel(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        in_channels=16,
        audio_acoustic_hidden_dim=8,
        patch_size=2,
        sliding_window=4,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 16, 8),
        "timestep": torch.tensor([0.7]),
        "timestep_r": torch.tensor([0.7]),
        "encoder_hidden_states": _randn(g, 1, 6, 32),
        "context_latents": _randn(g, 1, 16, 8),
        "return_dict": False,
    }
    return model, kwargs


def _allegro(seed: int):
    from diffusers import AllegroTransformer3DModel

    torch.manual_seed(seed)
    model = AllegroTransformer3DModel(
        patch_size=2,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        cross_attention_dim=16,
        sample_height=8,
        sample_width=8,
        sample_frames=2,
        caption_channels=16,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": torch.tensor([500]),
        "return_dict": False,
    }
    return model, kwargs


def _anyflow(seed: int):
    from diffusers import AnyFlowTransformer3DModel

    torch.manual_seed(seed)
    model = AnyFlowTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 2, 4, 8, 8),
        "timestep": torch.tensor([[700.0, 700.0]]),
        "r_timestep": torch.tensor([[400.0, 400.0]]),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "return_dict": False,
    }
    return model, kwargs


def _anyflow_far(seed: int):
    from diffusers import AnyFlowFARTransformer3DModel

    torch.manual_seed(seed)
    model = AnyFlowFARTransformer3DModel(
        patch_size=(1, 2, 2),
        compressed_patch_size=(1, 4, 4),
        full_chunk_limit=2,
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
        chunk_partition=(1, 1, 1),
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 3, 4, 8, 8),
        "timestep": torch.tensor([[0.0, 700.0, 700.0]]),
        "r_timestep": torch.tensor([[0.0, 400.0, 400.0]]),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "chunk_partition": [1, 1, 1],
        "return_dict": False,
    }
    return model, kwargs




def _auraflow(seed: int):
    from diffusers import AuraFlowTransformer2DModel

    torch.manual_seed(seed)
    model = AuraFlowTransformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=2,
        num_single_dit_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=64,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": torch.tensor([0.5]),
        "return_dict": False,
    }
    return model, kwargs


def _bria(seed: int):
    from diffusers import BriaTransformer2DModel

    torch.manual_seed(seed)
    model = BriaTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=[4, 6, 6],
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    txt_ids, img_ids = _flux_like_ids(6, 4, 4)
    kwargs = {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": torch.tensor([500.0]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "return_dict": False,
    }
    return model, kwargs


def _bria_fibo(seed: int):
    from diffusers import BriaFiboTransformer2DModel

    torch.manual_seed(seed)
    model = BriaFiboTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=[4, 6, 6],
        text_encoder_dim=16,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    txt_ids, img_ids = _flux_like_ids(6, 4, 4)
    kwargs = {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "text_encoder_layers": [_randn(g, 1, 6, 16) for _ in range(4)],
        "timestep": torch.tensor([500.0]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "return_dict": False,
    }
    return model, kwargs


def _bria_fibo2(seed: int):
    from diffusers import BriaFibo2Transformer2DModel

    torch.manual_seed(seed)
    model = BriaFibo2Transformer2DModel(
        in_channels=4,
        patch_size=2,
        dim=32,
        n_layers=2,
        n_refiner_layers=2,
        n_heads=2,
        cap_feat_dim=16,
        injection_layer_ids=(1,),
        perceiver_num_layers=2,
        min_num_gist_tokens=4,
        max_num_gist_tokens=8,
        gist_step=4,
        gist_min_text_len=4,
        gist_max_text_len=16,
        axes_dims=(4, 6, 6),
        axes_lens=(16, 8, 8),
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.tensor([0.6]),
        "encoder_hidden_states": _randn(g, 1, 2, 6, 16),
        "return_dict": False,
    }
    return model, kwargs


def _chroma(seed: int):
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(seed)
    model = ChromaTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=2,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    txt_ids, img_ids = _flux_like_ids(6, 4, 4)
    kwargs = {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": torch.tensor([0.5]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "return_dict": False,
    }
    return model, kwargs


def _chronoedit(seed: int):
    from diffusers import ChronoEditTransformer3DModel

    torch.manual_seed(seed)
    model = ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=48,
        num_layers=2,
        rope_max_seq_len=32,
        rope_temporal_skip_len=8,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "return_dict": False,
    }
    return model, kwargs


def _cogvideox(seed: int):
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=16,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=6,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 2, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": torch.tensor([500]),
        "return_dict": False,
    }
    return model, kwargs


def _cogview3plus(seed: int):
    from diffusers import CogView3PlusTransformer2DModel

    torch.manual_seed(seed)
    model = CogView3PlusTransformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        out_channels=4,
        text_embed_dim=16,
        time_embed_dim=16,
        condition_dim=8,
        pos_embed_max_size=8,
        sample_size=8,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": torch.tensor([500]),
        "original_size": torch.tensor([[64.0, 64.0]]),
        "target_size": torch.tensor([[64.0, 64.0]]),
        "crop_coords": torch.tensor([[0.0, 0.0]]),
        "return_dict": False,
    }
    return model, kwargs


def _cogview4(seed: int):
    from diffusers import CogView4Transformer2DModel

    torch.manual_seed(seed)
    model = CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        text_embed_dim=16,
        time_embed_dim=16,
        condition_dim=8,
        pos_embed_max_size=8,
        sample_size=8,
        rope_axes_dim=(8, 8),
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": torch.tensor([500]),
        "original_size": torch.tensor([[64.0, 64.0]]),
        "target_size": torch.tensor([[64.0, 64.0]]),
        "crop_coords": torch.tensor([[0.0, 0.0]]),
        "return_dict": False,
    }
    return model, kwargs


def _consisid(seed: int):
    from diffusers import ConsisIDTransformer3DModel

    torch.manual_seed(seed)
    inner_dim = 2 * 16
    model = ConsisIDTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=16,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=6,
        is_train_face=True,
        cross_attn_interval=1,
        cross_attn_dim_head=8,
        cross_attn_num_heads=2,
        LFE_id_dim=16,
        LFE_vit_dim=16,
        LFE_depth=2,
        LFE_dim_head=8,
        LFE_num_heads=2,
        LFE_num_id_token=2,
        LFE_num_querie=4,
        LFE_output_dim=int(inner_dim / 3 * 2),
        LFE_ff_mult=2,
        LFE_num_scale=2,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 2, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": torch.tensor([500]),
        "id_cond": _randn(g, 1, 16),
        "id_vit_hidden": [_randn(g, 1, 5, 16) for _ in range(2)],
        "return_dict": False,
    }
    return model, kwargs


def _cosmos3_omni(seed: int):
    from diffusers import Cosmos3OmniTransformer

    torch.manual_seed(seed)
    model = Cosmos3OmniTransformer(
        head_dim=16,
        hidden_size=32,
        intermediate_size=64,
        latent_channel=4,
        latent_patch_size=2,
        num_attention_heads=2,
        num_hidden_layers=2,
        num_key_value_heads=1,
        patch_latent_dim=16,
        rope_theta=10000.0,
        vocab_size=64,
        rope_axes_dim=(4, 2, 2),
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    und_len, num_vision = 4, 4  # 4 text tokens, then a 1x4x4 latent -> 1x2x2 patches
    seq_len = und_len + num_vision
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(3, -1).clone()
    kwargs = {
        "input_ids": torch.randint(0, 64, (und_len,), generator=g),
        "text_indexes": torch.arange(und_len),
        "position_ids": position_ids,
        "und_len": und_len,
        "sequence_length": seq_len,
        "vision_tokens": [_randn(g, 1, 4, 1, 4, 4)],
        "vision_token_shapes": [(1, 2, 2)],
        "vision_sequence_indexes": torch.arange(und_len, seq_len),
        "vision_mse_loss_indexes": torch.arange(und_len, seq_len),
        "vision_timesteps": torch.full((num_vision,), 0.5),
        "vision_noisy_frame_indexes": [torch.tensor([0])],
        "return_dict": False,
    }
    return model, kwargs


def _cosmos(seed: int):
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(seed)
    model = CosmosTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        mlp_ratio=2.0,
        text_embed_dim=16,
        adaln_lora_dim=8,
        max_size=(4, 16, 16),
        patch_size=(1, 2, 2),
        concat_padding_mask=False,  # needs torchvision, which is not installed
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "fps": 24,
        "return_dict": False,
    }
    return model, kwargs


def _dit(seed: int):
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    model = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.tensor([500]),
        "class_labels": torch.tensor([3]),
        "return_dict": False,
    }
    return model, kwargs


def _dreamlite(seed: int):
    from diffusers import DreamLiteTransformer2DModel

    torch.manual_seed(seed)
    model = DreamLiteTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=8,
        num_layers=2,
        norm_num_groups=4,
        cross_attention_dim=16,
        qk_norm="rms_norm",
        num_kv_heads=1,
        ff_mult=2,
    ).eval()
    # GQA (num_kv_heads < heads) with qk_norm needs DreamLite's own processor; the DreamLite U-Net installs it the
    # same way (the stock AttnProcessor2_0 reshapes K/V with the query head count).
    from diffusers.models.attention_processor import Attention
    from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0

    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(DreamLiteAttnProcessor2_0())
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 8, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "return_dict": False,
    }
    return model, kwargs


def _easyanimate(seed: int):
    from diffusers import EasyAnimateTransformer3DModel

    torch.manual_seed(seed)
    model = EasyAnimateTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        patch_size=2,
        sample_width=8,
        sample_height=8,
        num_layers=2,
        mmdit_layers=2,
        time_embed_dim=16,
        text_embed_dim=16,
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "return_dict": False,
    }
    return model, kwargs


RECIPES = {
    "AceStepTransformer1DModel": _ace_step,
    "AllegroTransformer3DModel": _allegro,
    "AnyFlowFARTransformer3DModel": _anyflow_far,
    "AnyFlowTransformer3DModel": _anyflow,
    "AuraFlowTransformer2DModel": _auraflow,
    "BriaFibo2Transformer2DModel": _bria_fibo2,
    "BriaFiboTransformer2DModel": _bria_fibo,
    "BriaTransformer2DModel": _bria,
    "ChromaTransformer2DModel": _chroma,
    "ChronoEditTransformer3DModel": _chronoedit,
    "CogVideoXTransformer3DModel": _cogvideox,
    "CogView3PlusTransformer2DModel": _cogview3plus,
    "CogView4Transformer2DModel": _cogview4,
    "ConsisIDTransformer3DModel": _consisid,
    "CosmosTransformer3DModel": _cosmos,
    "DiTTransformer2DModel": _dit,
    "DreamLiteTransformer2DModel": _dreamlite,
    "EasyAnimateTransformer3DModel": _easyanimate,
}

# Its forward returns per-item lists of tensors; the test compares every tensor.
RECIPES["Cosmos3OmniTransformer"] = _cosmos3_omni

SKIPPED: dict[str, str] = {}
