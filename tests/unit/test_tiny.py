"""Tests for the tiny random-weight models and pipelines in ``omni_dist_offload.tiny``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

import tiny_models as tiny

DIT_CASES: dict[str, tuple[Callable[..., torch.nn.Module], Callable[..., dict[str, Any]]]] = {
    "wan": (tiny.tiny_wan_transformer, tiny.wan_transformer_inputs),
    "flux": (tiny.tiny_flux_transformer, tiny.flux_transformer_inputs),
    "qwenimage": (tiny.tiny_qwenimage_transformer, tiny.qwenimage_transformer_inputs),
}

TEXT_ENCODERS: dict[str, Callable[..., torch.nn.Module]] = {
    "umt5": tiny.tiny_umt5_encoder,
    "t5": tiny.tiny_t5_encoder,
    "clip": tiny.tiny_clip_text_model,
    "qwen2": tiny.tiny_qwen2_model,
}

OOV_PROMPT = "A Zorblax quux glimmers, flibbertigibbet-style!"


def _states_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _pipeline_output(pipe: Any, **kwargs: Any) -> torch.Tensor:
    out = pipe(output_type="pt", **kwargs)
    return out.frames if hasattr(out, "frames") else out.images


@pytest.mark.parametrize("name", DIT_CASES)
def test_dit_forward_is_deterministic(name: str) -> None:
    build, make_inputs = DIT_CASES[name]
    a, b = build(seed=3), build(seed=3)
    assert not a.training
    assert _states_equal(a, b)
    assert not _states_equal(a, build(seed=4))
    with torch.no_grad():
        inputs = make_inputs(a, batch=2, seed=1)
        out_a = a(**inputs)[0]
        out_b = b(**make_inputs(b, batch=2, seed=1))[0]
    assert torch.isfinite(out_a).all()
    assert torch.equal(out_a, out_b)
    if name == "wan":
        assert out_a.shape == inputs["hidden_states"].shape
    else:
        tokens = inputs["hidden_states"].shape[:2]
        assert out_a.shape[:2] == tokens


def test_dit_layer_counts() -> None:
    assert len(tiny.tiny_wan_transformer(num_layers=5).blocks) == 5
    flux = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=4)
    assert (len(flux.transformer_blocks), len(flux.single_transformer_blocks)) == (1, 4)
    assert len(tiny.tiny_qwenimage_transformer(num_layers=2).transformer_blocks) == 2


@pytest.mark.parametrize("name", TEXT_ENCODERS)
def test_text_encoder_forward_is_deterministic(name: str) -> None:
    build = TEXT_ENCODERS[name]
    a, b = build(num_layers=2, seed=5), build(num_layers=2, seed=5)
    assert _states_equal(a, b)
    inputs = tiny.text_encoder_inputs(a, batch=2, seq_len=8, seed=2)
    assert inputs["attention_mask"].tolist() == [[1] * 8, [1] * 6 + [0] * 2]
    with torch.no_grad():
        out_a = a(**inputs).last_hidden_state
        out_b = b(**tiny.text_encoder_inputs(b, batch=2, seq_len=8, seed=2)).last_hidden_state
    assert out_a.shape == (2, 8, tiny.TINY_TEXT_DIM)
    assert torch.isfinite(out_a).all()
    assert torch.equal(out_a, out_b)


def test_t5_embeddings_stay_tied_after_cast() -> None:
    model = tiny.tiny_t5_encoder(dtype=torch.float16)
    assert model.shared.weight is model.encoder.embed_tokens.weight
    assert model.shared.weight.dtype == torch.float16
    # transformers keeps T5's `wo` projections in fp32 when loading in fp16.
    assert model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32


def test_wan_bf16_keeps_fp32_modules() -> None:
    model = tiny.tiny_wan_transformer(dtype=torch.bfloat16)
    assert model.patch_embedding.weight.dtype == torch.bfloat16
    assert model.scale_shift_table.dtype == torch.float32
    assert model.blocks[0].norm2.weight.dtype == torch.float32
    with torch.no_grad():
        out = model(**tiny.wan_transformer_inputs(model))[0]
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_builders_leave_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    tiny.tiny_flux_transformer(seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_t5_tokenizer_handles_oov_prompt() -> None:
    tok = tiny.tiny_t5_tokenizer()
    enc = tok(
        [OOV_PROMPT, ""],
        padding="max_length",
        max_length=16,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids, mask = enc.input_ids, enc.attention_mask
    assert ids.shape == (2, 16)
    assert tok.unk_token_id in ids[0].tolist()
    assert ids[0, 0].item() == tok.convert_tokens_to_ids("a")  # lower-cased
    n = int(mask[0].sum())
    assert ids[0, n - 1].item() == tok.eos_token_id
    assert (ids[0, n:] == tok.pad_token_id).all()
    assert ids[1, 0].item() == tok.eos_token_id and int(mask[1].sum()) == 1
    assert int(ids.max()) < tiny.TINY_VOCAB_SIZE
    long = tok(" ".join(["fox"] * 40), padding="max_length", max_length=16, truncation=True).input_ids
    assert len(long) == 16 and long[-1] == tok.eos_token_id


def test_clip_tokenizer_handles_oov_prompt() -> None:
    tok = tiny.tiny_clip_tokenizer()
    ids = tok(OOV_PROMPT, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
    assert len(ids) == 77
    assert ids[0] == tok.bos_token_id and tok.unk_token_id in ids
    # The pooled CLIP output is taken at the first EOS token, which the padding repeats.
    assert tok.eos_token_id == tok.pad_token_id == tiny.tiny_clip_text_model().config.eos_token_id
    assert tok.decode(tok("a red fox").input_ids, skip_special_tokens=True) == "a red fox"


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-flux"])
def test_pipeline_end_to_end(name: str) -> None:
    defaults = tiny.BUILTIN_PIPELINE_DEFAULTS[name]
    pipe_a, pipe_b = tiny.BUILTIN_PIPELINES[name](seed=7), tiny.BUILTIN_PIPELINES[name](seed=7)

    def run(pipe: Any, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return _pipeline_output(pipe, prompt=OOV_PROMPT, generator=generator, **defaults)

    with torch.no_grad():
        out_a, out_b, out_c = run(pipe_a, 0), run(pipe_b, 0), run(pipe_a, 1)
    hw = (defaults["height"], defaults["width"])
    expected = (1, defaults["num_frames"], 3, *hw) if name == "tiny-wan" else (1, 3, *hw)
    assert out_a.shape == expected
    assert torch.isfinite(out_a).all()
    assert torch.equal(out_a, out_b)
    assert not torch.equal(out_a, out_c)


def test_pipeline_components_match_standalone_builders() -> None:
    wan = tiny.tiny_wan_pipeline(seed=2, num_layers=2)
    assert _states_equal(wan.transformer, tiny.tiny_wan_transformer(num_layers=2, seed=2))
    flux = tiny.tiny_flux_pipeline(seed=2)
    assert _states_equal(flux.transformer, tiny.tiny_flux_transformer(seed=2))
    assert _states_equal(flux.text_encoder_2, tiny.tiny_t5_encoder(seed=2))


def test_wan_pipeline_batched_prompts_without_max_sequence_length() -> None:
    pipe = tiny.tiny_wan_pipeline()
    with torch.no_grad():
        frames = _pipeline_output(
            pipe,
            prompt=["a red fox", OOV_PROMPT],
            negative_prompt="blurry",
            num_inference_steps=2,
            height=16,
            width=16,
            num_frames=5,
            guidance_scale=5.0,
            generator=torch.Generator().manual_seed(0),
        )
    assert frames.shape == (2, 5, 3, 16, 16)
    assert torch.isfinite(frames).all()


def test_wan_14b_random_has_real_block_size():
    # The sizes are the point, not the values: skip drawing 351M random numbers (seconds on CI).
    keep = lambda tensor, *args, **kwargs: tensor  # noqa: E731
    with mock.patch.multiple(torch.nn.init, kaiming_uniform_=keep, uniform_=keep, normal_=keep,
                             trunc_normal_=keep, xavier_uniform_=keep):
        pipe = tiny.wan_14b_random_pipeline(num_layers=1)
    block = pipe.transformer.blocks[0]
    assert sum(p.numel() for p in block.parameters()) == 351_394_304  # 703 MB in bf16
    assert pipe.components["transformer"] is pipe.transformer
