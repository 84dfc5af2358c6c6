"""Tiny random-weight models and the complete pipelines ``tiny-wan`` and ``tiny-flux``.

Everything is built in code from small configs: no weights, tokenizer files or
configs are fetched from a hub.  Every builder is deterministic in ``seed``: two
calls with the same arguments give bitwise-equal parameters, and the caller's
global torch RNG state is left untouched.

Each pipeline component is built from the pipeline's own ``seed``, so for example
``tiny_wan_pipeline(seed=s).transformer`` has the same weights as
``tiny_wan_transformer(seed=s)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import diffusers
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

__all__ = [
    "cast_like_pretrained",
    "TINY_FLUX_DEFAULTS",
    "TINY_TEXT_DIM",
    "TINY_VOCAB_SIZE",
    "TINY_WAN_DEFAULTS",
    "tiny_clip_text_model",
    "tiny_clip_tokenizer",
    "tiny_flux_pipeline",
    "tiny_flux_transformer",
    "tiny_flux_vae",
    "tiny_t5_encoder",
    "tiny_t5_tokenizer",
    "tiny_umt5_encoder",
    "tiny_wan_pipeline",
    "tiny_wan_transformer",
    "tiny_wan_vae",
    "wan_transformer_inputs",
]

# Hidden size of every tiny text encoder; the DiTs' text/joint dims match it.
TINY_TEXT_DIM = 32
# Embedding rows of every tiny text encoder (>= the size of the tiny vocabularies).
TINY_VOCAB_SIZE = 256

# Wan: the VAE compresses 4x in time and 8x in space and the DiT patches 2x2, so
# height/width must be multiples of 16 and num_frames of the form 4k + 1.
# 32x32x5 gives a 2x4x4 latent and 8 DiT tokens.
TINY_WAN_DEFAULTS: dict[str, Any] = dict(
    height=32,
    width=32,
    num_frames=5,
    num_inference_steps=2,
    guidance_scale=5.0,
    max_sequence_length=16,
)

# Flux: the VAE compresses 2x and latents are packed 2x2, so height/width must be
# multiples of 4.  16x16 gives an 8x8x4 latent and 16 DiT tokens.
TINY_FLUX_DEFAULTS: dict[str, Any] = dict(
    height=16,
    width=16,
    num_inference_steps=2,
    guidance_scale=3.5,
    max_sequence_length=32,
)

# Closed word list; any other word maps to the unknown token.
_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        """
        a an the of and or with without in on at to from by for over under near is are this that it its
        red green blue yellow white black orange purple pink brown gray grey golden silver
        fox cat dog bird horse fish monkey squirrel rabbit bear lion tiger owl dragon
        man woman child person people robot astronaut knight
        tree trees forest flower flowers grass field river lake sea ocean beach mountain mountains
        sky cloud clouds sun moon star stars rain snow wind fog
        city street house castle bridge car boat ship train road garden room window
        run running jump jumping fly flying walk walking dance dancing sit sitting eat eating
        swim swimming sleep sleeping play playing
        big small tall little old young beautiful cute happy sad dark bright soft
        photo painting video cinematic portrait landscape close up view detailed realistic style
        high quality low blurry morning night sunset sunrise light shadow water fire
        burger apple cake coffee
        , . ! ? - ' :
        """.split()
    )
)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for the block and restore the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _word_level_tokenizer(
    specials: list[str], unk: str, eos: str, bos: str | None = None
) -> Tokenizer:
    """Lower-casing word-level tokenizer over ``specials + _WORDS``; adds ``eos`` and optional ``bos``."""
    vocab = {tok: i for i, tok in enumerate([*specials, *_WORDS])}
    if len(vocab) > TINY_VOCAB_SIZE:
        raise ValueError(f"tiny vocabulary has {len(vocab)} entries, more than {TINY_VOCAB_SIZE}")
    tok = Tokenizer(WordLevel(vocab, unk_token=unk))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    prefix = f"{bos} " if bos else ""
    special_ids = [(t, vocab[t]) for t in (bos, eos) if t]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{prefix}$A {eos}",
        pair=f"{prefix}$A {eos} $B:1 {eos}:1",
        special_tokens=special_ids,
    )
    return tok


def tiny_t5_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """T5/UMT5-style tokenizer: ``<pad>``=0, ``</s>``=1 (appended), ``<unk>``=2, no BOS."""
    backend = _word_level_tokenizer(["<pad>", "</s>", "<unk>"], unk="<unk>", eos="</s>")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        padding_side="right",
        truncation_side="right",
    )


def tiny_clip_tokenizer(model_max_length: int = 77) -> PreTrainedTokenizerFast:
    """CLIP-style tokenizer: BOS ``<|startoftext|>``=0, EOS and pad ``<|endoftext|>``=1, ``[UNK]``=2."""
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    backend = _word_level_tokenizer([bos, eos, "[UNK]"], unk="[UNK]", eos=eos, bos=bos)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=eos,
        unk_token="[UNK]",
        model_max_length=model_max_length,
        padding_side="right",
        truncation_side="right",
    )


def _keeps_fp32(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Module names that ``from_pretrained(torch_dtype=dtype)`` would leave in float32."""
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if isinstance(model, PreTrainedModel):
        # transformers upcasts these only for fp16 (the strict list also for bf16).
        strict = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        keep = keep if dtype == torch.float16 else []
        keep += strict if dtype in (torch.float16, torch.bfloat16) else []
    return keep


def cast_like_pretrained(model: Any, dtype: torch.dtype) -> Any:
    """Cast like ``from_pretrained(torch_dtype=dtype)`` would, then switch to eval mode.

    Parameters and persistent buffers are cast in place (tied parameters stay tied), except those
    under the class's keep-in-fp32 modules; non-persistent buffers (e.g. RoPE tables) keep their dtype.
    """
    keep = set(_keeps_fp32(model, dtype)) if dtype != torch.float32 else set()

    def target(module_name: str, name: str) -> torch.dtype:
        return torch.float32 if keep & {*module_name.split("."), name} else dtype

    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(target(module_name, name))
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and name not in module._non_persistent_buffers_set:
                module._buffers[name] = buf.to(target(module_name, name))
    return model.eval()


def tiny_wan_transformer(
    num_layers: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32
) -> WanTransformer3DModel:
    """Wan 2.1-style DiT: 2 heads x 12 head dim, 16 latent channels, text dim ``TINY_TEXT_DIM``."""
    with _seeded(seed):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=TINY_TEXT_DIM,
            freq_dim=32,
            ffn_dim=48,
            num_layers=num_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
    return cast_like_pretrained(model, dtype)


def tiny_flux_transformer(
    num_layers: int = 2,
    num_single_layers: int = 3,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> FluxTransformer2DModel:
    """FLUX.1-dev-style DiT with guidance embedding: 2 heads x 16 head dim, 2x2-packed 4-channel latents."""
    with _seeded(seed):
        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=num_layers,
            num_single_layers=num_single_layers,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TINY_TEXT_DIM,
            pooled_projection_dim=TINY_TEXT_DIM,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
    return cast_like_pretrained(model, dtype)


def _t5_kwargs(num_layers: int) -> dict:
    """The tiny T5 and UMT5 encoders' config (the two classes take the same keys)."""
    return dict(vocab_size=TINY_VOCAB_SIZE, d_model=TINY_TEXT_DIM, d_kv=8, d_ff=64, num_layers=num_layers,
                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                dropout_rate=0.0, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0)


def tiny_umt5_encoder(
    num_layers: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32
) -> UMT5EncoderModel:
    """UMT5 encoder (Wan's text encoder), hidden size ``TINY_TEXT_DIM``; pairs with ``tiny_t5_tokenizer``."""
    config = UMT5Config(**_t5_kwargs(num_layers))
    with _seeded(seed):
        model = UMT5EncoderModel(config)
    return cast_like_pretrained(model, dtype)


def tiny_t5_encoder(
    num_layers: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32
) -> T5EncoderModel:
    """T5 v1.1 encoder (Flux's second text encoder), hidden size ``TINY_TEXT_DIM``.

    Pairs with ``tiny_t5_tokenizer``.
    """
    config = T5Config(**_t5_kwargs(num_layers))
    with _seeded(seed):
        model = T5EncoderModel(config)
    return cast_like_pretrained(model, dtype)


def tiny_clip_text_model(
    num_layers: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32
) -> CLIPTextModel:
    """CLIP text tower (Flux's pooled text encoder), hidden size ``TINY_TEXT_DIM``.

    Pairs with ``tiny_clip_tokenizer``.
    """
    config = CLIPTextConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=TINY_TEXT_DIM,
        intermediate_size=64,
        projection_dim=TINY_TEXT_DIM,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        attention_dropout=0.0,
        # Must match tiny_clip_tokenizer; eos id 2 would select CLIP's legacy argmax pooling.
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    with _seeded(seed):
        model = CLIPTextModel(config)
    return cast_like_pretrained(model, dtype)


def tiny_wan_vae(seed: int = 0, dtype: torch.dtype = torch.float32) -> AutoencoderKLWan:
    """Wan 2.1 video VAE: 16 latent channels, 4x temporal and 8x spatial compression."""
    with _seeded(seed):
        model = AutoencoderKLWan(
            base_dim=8,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )
    return cast_like_pretrained(model, dtype)


def tiny_flux_vae(seed: int = 0, dtype: torch.dtype = torch.float32) -> AutoencoderKL:
    """Flux-style image VAE: 4 latent channels, 2x spatial compression, no quant convs."""
    with _seeded(seed):
        model = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.1159,
            scaling_factor=0.3611,
        )
    return cast_like_pretrained(model, dtype)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def wan_transformer_inputs(
    model: WanTransformer3DModel,
    batch: int = 1,
    num_frames: int = 2,
    height: int = 4,
    width: int = 4,
    text_len: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Kwargs for one forward of ``model``; ``num_frames/height/width`` are latent sizes (h/w even)."""
    gen = torch.Generator().manual_seed(seed)
    cfg, dtype = model.config, model.dtype
    return dict(
        hidden_states=_randn(gen, batch, cfg.in_channels, num_frames, height, width, dtype=dtype),
        timestep=torch.randint(0, 1000, (batch,), generator=gen),
        encoder_hidden_states=_randn(gen, batch, text_len, cfg.text_dim, dtype=dtype),
        return_dict=False,
    )


def tiny_wan_pipeline(seed: int = 0, num_layers: int = 3) -> WanPipeline:
    """Wan 2.1 text-to-video pipeline: tiny UMT5 + tokenizer, Wan DiT, Wan VAE, flow UniPC scheduler.

    Run it with ``TINY_WAN_DEFAULTS`` (or any height/width multiple of 16 and num_frames = 4k + 1).
    """
    # Wan 2.1's own scheduler setup: UniPC on flow-matching sigmas.
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )
    pipe = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=tiny_umt5_encoder(num_layers=num_layers, seed=seed),
        vae=tiny_wan_vae(seed=seed),
        scheduler=scheduler,
        transformer=tiny_wan_transformer(num_layers=num_layers, seed=seed),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux_pipeline(seed: int = 0) -> diffusers.FluxPipeline:
    """FLUX.1-dev text-to-image pipeline: tiny CLIP and T5 with tokenizers, Flux DiT, VAE, flow-match Euler.

    Run it with ``TINY_FLUX_DEFAULTS`` (or any height/width multiple of 4).
    """
    # FLUX.1-dev's scheduler config: resolution-dependent shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    # Looked up on diffusers' lazy module when first built: importing FluxPipeline pulls in
    # transformers' image processors, which warn on hosts without torchvision.
    pipe = diffusers.FluxPipeline(
        scheduler=scheduler,
        vae=tiny_flux_vae(seed=seed),
        text_encoder=tiny_clip_text_model(seed=seed),
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=tiny_t5_encoder(seed=seed),
        tokenizer_2=tiny_t5_tokenizer(),
        transformer=tiny_flux_transformer(seed=seed),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


