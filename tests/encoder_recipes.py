"""Tiny builders for the text encoders diffusers pipelines take: each returns a model at tiny size in float32 on the CPU and the keyword arguments of one forward (token ids, and a mask where the model takes one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers.pipelines.deprecated.alt_diffusion.modeling_roberta_series import (
    RobertaSeriesConfig,
    RobertaSeriesModelWithTransformation,
)
from diffusers.pipelines.deprecated.blip_diffusion.modeling_ctx_clip import (
    ContextCLIPTextModel,
)
from diffusers.pipelines.kandinsky.text_encoder import MCLIPConfig, MultilingualCLIP
from diffusers.pipelines.kolors.text_encoder import ChatGLMConfig, ChatGLMModel
from diffusers.pipelines.kolors.text_encoder import RMSNorm as ChatGLMRMSNorm
from transformers import (
    BertConfig,
    BertModel,
    ClapTextConfig,
    ClapTextModelWithProjection,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    Gemma2Config,
    Gemma2Model,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    Gemma4UnifiedConfig,
    Gemma4UnifiedForConditionalGeneration,
    Gemma4UnifiedTextConfig,
    Gemma4UnifiedVisionConfig,
    GemmaConfig,
    GemmaModel,
    GlmConfig,
    GlmModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Mistral3Model,
    MistralConfig,
    PixtralVisionConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2_5_VLVisionConfig,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLTextConfig,
    Qwen2VLVisionConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLModel,
    Qwen3VLTextConfig,
    Qwen3VLVisionConfig,
    SiglipVisionConfig,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    T5Config,
    T5EncoderModel,
    T5Gemma2Encoder,
    T5GemmaConfig,
    T5GemmaEncoderModel,
    UMT5Config,
    UMT5EncoderModel,
    VitsConfig,
    VitsModel,
)
from transformers.models.t5gemma.configuration_t5gemma import T5GemmaModuleConfig
from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder
from transformers.models.t5gemma2.configuration_t5gemma2 import (
    T5Gemma2EncoderConfig,
    T5Gemma2TextConfig,
)

VOCAB = 64
SEQ = 7
HIDDEN = 32
# Special-token ids of the composite (vision-language) configs: inside the tiny vocab, but above
# every id the inputs draw, so a text-only forward never meets one.
_IMAGE_ID, _VIDEO_ID, _BOI_ID, _EOI_ID = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4
_TOP_INPUT_ID = VOCAB - 8

Recipe = Callable[[int], "tuple[torch.nn.Module, dict[str, Any]]"]


def _text_inputs(
    seed: int, mask: bool = True, low: int = 3, high: int = _TOP_INPUT_ID
) -> dict[str, torch.Tensor]:
    """Token ids (1, SEQ) from a generator seeded by ``seed + 1``, plus an all-ones mask."""
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {"input_ids": torch.randint(low, high, (1, SEQ), generator=g)}
    if mask:
        kwargs["attention_mask"] = torch.ones(1, SEQ, dtype=torch.long)
    return kwargs


def _eager(config):
    """Eager attention: no SDPA kernel choice on the CPU, the same math every run."""
    config._attn_implementation = "eager"
    for name in ("text_config", "vision_config", "audio_config", "encoder", "decoder"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            sub._attn_implementation = "eager"
    return config


def _make(cls, config, seed: int, mask: bool = True, **model_kwargs):
    torch.manual_seed(seed)
    model = cls(_eager(config), **model_kwargs).eval()
    return model, _text_inputs(seed, mask=mask)


# --- decoder-only language models -------------------------------------------------------------

_LM = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _llama_config():
    return LlamaConfig(**_LM)


def _llama_model(seed: int):
    return _make(LlamaModel, _llama_config(), seed)


def _llama_causal(seed: int):
    return _make(LlamaForCausalLM, _llama_config(), seed)


def _qwen3_config():
    return Qwen3Config(**_LM, head_dim=8)


def _qwen3_model(seed: int):
    return _make(Qwen3Model, _qwen3_config(), seed)


def _qwen3_causal(seed: int):
    return _make(Qwen3ForCausalLM, _qwen3_config(), seed)


def _smollm3(seed: int):
    return _make(SmolLM3ForCausalLM, SmolLM3Config(**_LM), seed)


def _glm(seed: int):
    return _make(GlmModel, GlmConfig(**_LM, head_dim=8), seed)


def _gemma(seed: int):
    return _make(GemmaModel, GemmaConfig(**_LM, head_dim=8), seed)


def _gemma2(seed: int):
    config = Gemma2Config(**_LM, head_dim=8, query_pre_attn_scalar=8, sliding_window=4)
    return _make(Gemma2Model, config, seed)


def _chatglm(seed: int):
    config = ChatGLMConfig(
        num_layers=2,
        padded_vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_hidden_size=64,
        kv_channels=8,
        num_attention_heads=4,
        seq_length=32,
        multi_query_attention=True,
        multi_query_group_num=2,
        add_qkv_bias=True,
        original_rope=True,
        use_cache=False,
    )
    # empty_init=False: the default skip_init leaves the weights as uninitialised memory.
    model, kwargs = _make(ChatGLMModel, config, seed, empty_init=False)
    # Its RMSNorm weights are torch.empty and its _init_weights is a no-op (checkpoints fill them).
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ChatGLMRMSNorm):
                module.weight.fill_(1.0)
    return model, kwargs


# --- encoders ---------------------------------------------------------------------------------


def _t5(seed: int):
    config = T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    return _make(T5EncoderModel, config, seed)


def _umt5(seed: int):
    config = UMT5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    return _make(UMT5EncoderModel, config, seed)


def _bert(seed: int):
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return _make(BertModel, config, seed)


def _clip_text_config(**extra):
    return CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        projection_dim=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


def _clip(seed: int):
    return _make(CLIPTextModel, _clip_text_config(), seed)


def _clip_projection(seed: int):
    return _make(CLIPTextModelWithProjection, _clip_text_config(), seed)


def _context_clip(seed: int):
    # Without ctx_embeddings the model is a plain CLIP text stack.
    return _make(ContextCLIPTextModel, _clip_text_config(), seed)


def _clap_text(seed: int):
    config = ClapTextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        projection_dim=HIDDEN,
    )
    return _make(ClapTextModelWithProjection, config, seed)


_XLMR = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


def _roberta_series(seed: int):
    config = RobertaSeriesConfig(project_dim=HIDDEN, **_XLMR)
    return _make(RobertaSeriesModelWithTransformation, config, seed)


def _mclip(seed: int):
    config = MCLIPConfig(transformerDimSize=HIDDEN, imageDimSize=HIDDEN, **_XLMR)
    return _make(MultilingualCLIP, config, seed)


def _t5gemma_module() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "query_pre_attn_scalar": 8,
        "max_position_embeddings": 64,
        "sliding_window": 4,
    }


def _t5gemma_encoder(seed: int):
    # diffusers builds it from the encoder sub-config; T5GemmaConfig would add the dropout rates.
    config = T5GemmaModuleConfig(**_t5gemma_module())
    config.dropout_rate = 0.0
    return _make(T5GemmaEncoder, config, seed)


def _t5gemma_encoder_model(seed: int):
    module = _t5gemma_module()
    config = T5GemmaConfig(
        encoder=module, decoder=module, is_encoder_decoder=False, vocab_size=VOCAB
    )
    return _make(T5GemmaEncoderModel, config, seed)


def _siglip_vision():
    return SiglipVisionConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
    )


def _t5gemma2_encoder(seed: int):
    text = T5Gemma2TextConfig(**_t5gemma_module())
    text.dropout_rate = 0.0  # set by T5Gemma2Config on its encoder's text config
    config = T5Gemma2EncoderConfig(
        text_config=text,
        vision_config=_siglip_vision(),
        mm_tokens_per_image=4,
        boi_token_index=_BOI_ID,
        eoi_token_index=_EOI_ID,
        image_token_index=_IMAGE_ID,
    )
    return _make(T5Gemma2Encoder, config, seed, eoi_token_index=_EOI_ID)


def _vits(seed: int):
    config = VitsConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=64,
        flow_size=16,
        spectrogram_bins=16,
        upsample_initial_channel=16,
        upsample_rates=(2, 2),
        upsample_kernel_sizes=(4, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1, 3),),
        duration_predictor_filter_channels=16,
        duration_predictor_num_flows=2,
        prior_encoder_num_flows=2,
        prior_encoder_num_wavenet_layers=2,
        posterior_encoder_num_wavenet_layers=2,
        # The forward samples noise from the global generator; zero scales make it exact.
        noise_scale=0.0,
        noise_scale_duration=0.0,
    )
    return _make(VitsModel, config, seed)


# --- vision-language models, text path only ----------------------------------------------------


def _llava(seed: int):
    vision = CLIPVisionConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
        projection_dim=HIDDEN,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_llama_config(),
        image_token_index=_IMAGE_ID,
        image_seq_length=4,
    )
    return _make(LlavaForConditionalGeneration, config, seed)


def _mistral3_config():
    vision = PixtralVisionConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
    )
    text = MistralConfig(**_LM, head_dim=8, sliding_window=None)
    return Mistral3Config(
        vision_config=vision, text_config=text, image_token_index=_IMAGE_ID
    )


def _mistral3_model(seed: int):
    return _make(Mistral3Model, _mistral3_config(), seed)


def _mistral3_cg(seed: int):
    return _make(Mistral3ForConditionalGeneration, _mistral3_config(), seed)


def _gemma3(seed: int):
    text = Gemma3TextConfig(
        **_LM, head_dim=8, query_pre_attn_scalar=8, sliding_window=4
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=_siglip_vision(),
        mm_tokens_per_image=4,
        boi_token_index=_BOI_ID,
        eoi_token_index=_EOI_ID,
        image_token_index=_IMAGE_ID,
    )
    return _make(Gemma3ForConditionalGeneration, config, seed)


def _gemma4_unified(seed: int):
    text = Gemma4UnifiedTextConfig(
        **_LM,
        head_dim=8,
        global_head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = Gemma4UnifiedVisionConfig(
        patch_size=4,
        pooling_kernel_size=2,
        mm_embed_dim=HIDDEN,
        mm_posemb_size=16,
        output_proj_dims=HIDDEN,
    )
    config = Gemma4UnifiedConfig(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        boi_token_id=_BOI_ID,
        eoi_token_id=_EOI_ID,
        image_token_id=_IMAGE_ID,
        video_token_id=_VIDEO_ID,
        boa_token_id=VOCAB - 5,
        eoa_token_index=VOCAB - 6,
        audio_token_id=VOCAB - 7,
    )
    return _make(Gemma4UnifiedForConditionalGeneration, config, seed)


def _qwen_vl_text() -> dict[str, Any]:
    """Text-config fields of the Qwen VL models: the LM stack, with a multimodal RoPE split over head_dim 8."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    return {**_LM, "rope_parameters": rope}


_QWEN_VL_IDS = {
    "image_token_id": _IMAGE_ID,
    "video_token_id": _VIDEO_ID,
    "vision_start_token_id": _BOI_ID,
    "vision_end_token_id": _EOI_ID,
}


def _qwen2_vl(seed: int):
    vision = Qwen2VLVisionConfig(
        depth=2,
        embed_dim=HIDDEN,
        hidden_size=HIDDEN,
        mlp_ratio=2,
        num_heads=4,
        patch_size=4,
        temporal_patch_size=2,
    )
    config = Qwen2VLConfig(
        text_config=Qwen2VLTextConfig(**_qwen_vl_text()),
        vision_config=vision,
        **_QWEN_VL_IDS,
    )
    return _make(Qwen2VLForConditionalGeneration, config, seed)


def _qwen2_5_vl_text_config():
    return Qwen2_5_VLTextConfig(**_qwen_vl_text())


def _qwen2_5_vl(seed: int):
    vision = Qwen2_5_VLVisionConfig(
        depth=2,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_heads=4,
        patch_size=4,
        temporal_patch_size=2,
        window_size=16,
        out_hidden_size=HIDDEN,
        fullatt_block_indexes=[1],
    )
    config = Qwen2_5_VLConfig(
        text_config=_qwen2_5_vl_text_config(), vision_config=vision, **_QWEN_VL_IDS
    )
    return _make(Qwen2_5_VLForConditionalGeneration, config, seed)


def _qwen2_5_vl_text(seed: int):
    return _make(Qwen2_5_VLTextModel, _qwen2_5_vl_text_config(), seed)


def _qwen3_vl_config():
    text = Qwen3VLTextConfig(
        **{
            k: v
            for k, v in _qwen_vl_text().items()
            if k not in ("bos_token_id", "eos_token_id")
        },
        head_dim=8,
    )
    vision = Qwen3VLVisionConfig(
        depth=2,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_heads=4,
        patch_size=4,
        temporal_patch_size=2,
        out_hidden_size=HIDDEN,
        num_position_embeddings=16,
        deepstack_visual_indexes=[1],
    )
    return Qwen3VLConfig(text_config=text, vision_config=vision, **_QWEN_VL_IDS)


def _qwen3_vl_model(seed: int):
    return _make(Qwen3VLModel, _qwen3_vl_config(), seed)


def _qwen3_vl_cg(seed: int):
    return _make(Qwen3VLForConditionalGeneration, _qwen3_vl_config(), seed)


RECIPES: dict[str, Recipe] = {
    "BertModel": _bert,
    "CLIPTextModel": _clip,
    "CLIPTextModelWithProjection": _clip_projection,
    "ChatGLMModel": _chatglm,
    "ClapTextModelWithProjection": _clap_text,
    "ContextCLIPTextModel": _context_clip,
    "Gemma2PreTrainedModel": _gemma2,
    "Gemma3ForConditionalGeneration": _gemma3,
    "Gemma4UnifiedForConditionalGeneration": _gemma4_unified,
    "GemmaPreTrainedModel": _gemma,
    "GlmModel": _glm,
    "LlamaForCausalLM": _llama_causal,
    "LlamaModel": _llama_model,
    "LlavaForConditionalGeneration": _llava,
    "Mistral3ForConditionalGeneration": _mistral3_cg,
    "Mistral3Model": _mistral3_model,
    "MultilingualCLIP": _mclip,
    "Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl,
    "Qwen2_5_VLTextModel": _qwen2_5_vl_text,
    "Qwen2VLForConditionalGeneration": _qwen2_vl,
    "Qwen3ForCausalLM": _qwen3_causal,
    "Qwen3Model": _qwen3_model,
    "Qwen3VLForConditionalGeneration": _qwen3_vl_cg,
    "Qwen3VLModel": _qwen3_vl_model,
    "RobertaSeriesModelWithTransformation": _roberta_series,
    "SmolLM3ForCausalLM": _smollm3,
    "T5EncoderModel": _t5,
    "T5Gemma2Encoder": _t5gemma2_encoder,
    "T5GemmaEncoder": _t5gemma_encoder,
    "T5GemmaEncoderModel": _t5gemma_encoder_model,
    "UMT5EncoderModel": _umt5,
    "VitsModel": _vits,
}

SKIPPED: dict[str, str] = {
    "ClapModel": "its forward always runs the audio tower (input_features=None fails); text-only is get_text_features or ClapTextModelWithProjection",
}
