"""Offloaded outputs are bitwise equal to the resident model: real diffusers and transformers
classes built tiny from configs, and complete pipelines."""

import types

import pytest
import torch

from omni_dist_offload import apply_offload
import tiny_models as tiny

DIT = {"mode": "layer", "components": ["dit"]}
TE = {"mode": "layer", "components": ["text_encoder"]}
BOTH = {"mode": "layer", "components": ["dit", "text_encoder"]}

DITS = {
    "wan": (tiny.tiny_wan_transformer, tiny.wan_transformer_inputs),
    "flux": (tiny.tiny_flux_transformer, tiny.flux_transformer_inputs),
    "qwenimage": (tiny.tiny_qwenimage_transformer, tiny.qwenimage_transformer_inputs),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(DITS))
@torch.no_grad()
def test_dit_parity(family, dtype):
    build, inputs = DITS[family]
    model = build(dtype=dtype)
    batches = [inputs(model, seed=0), inputs(model, batch=2, seed=1)]
    refs = [model(**b)[0] for b in batches]
    handle = apply_offload(model, DIT, device="cpu")
    for _ in range(2):  # the second pass starts from the block the last one prefetched
        for b, ref in zip(batches, refs):
            assert torch.equal(model(**b)[0], ref)
    (row,) = handle.summary()
    assert row["module_class"] == type(model).__name__ and row["weight_transfer"] == "rank-local"
    handle.remove()
    assert torch.equal(model(**batches[0])[0], refs[0])


@pytest.mark.parametrize("build", [tiny.tiny_umt5_encoder, tiny.tiny_clip_text_model, tiny.tiny_qwen2_model])
@torch.no_grad()
def test_text_encoder_parity(build):
    pipe = types.SimpleNamespace(text_encoder=build(), transformer=tiny.tiny_wan_transformer())
    batch = tiny.text_encoder_inputs(pipe.text_encoder)
    ref = pipe.text_encoder(**batch).last_hidden_state
    handle = apply_offload(pipe, TE, device="cpu")
    assert [r["component"] for r in handle.summary()] == ["text_encoder"]
    for _ in range(2):
        assert torch.equal(pipe.text_encoder(**batch).last_hidden_state, ref)
    handle.remove()


def _run_wan(pipe):
    args = dict(tiny.TINY_WAN_DEFAULTS)
    return pipe(prompt=["a red fox in snow", "a boat"], negative_prompt="blurry",
                generator=torch.Generator().manual_seed(0), output_type="pt", **args).frames


@pytest.mark.parametrize("config", [DIT, TE, BOTH], ids=["dit", "text_encoder", "both"])
def test_wan_pipeline_parity(config):
    ref = _run_wan(tiny.tiny_wan_pipeline(seed=3))
    pipe = tiny.tiny_wan_pipeline(seed=3)
    handle = apply_offload(pipe, config, device="cpu")
    streamed = {r["component"] for r in handle.summary()}
    assert streamed == {"dit": {"transformer"}, "text_encoder": {"text_encoder"},
                        "both": {"transformer", "text_encoder"}}[
        "both" if len(config["components"]) == 2 else config["components"][0]]
    for _ in range(2):
        assert torch.equal(_run_wan(pipe), ref)
    handle.remove()
    assert torch.equal(_run_wan(pipe), ref)


def test_flux_pipeline_parity_streams_both_text_encoders():
    args = dict(tiny.TINY_FLUX_DEFAULTS)
    run = lambda p: p(prompt="a lighthouse", generator=torch.Generator().manual_seed(1),
                      output_type="pt", **args).images
    ref = run(tiny.tiny_flux_pipeline(seed=2))
    pipe = tiny.tiny_flux_pipeline(seed=2)
    handle = apply_offload(pipe, BOTH, device="cpu")
    assert sorted(r["component"] for r in handle.summary()) == ["text_encoder", "text_encoder_2", "transformer"]
    assert torch.equal(run(pipe), ref)
    handle.remove()


def test_pipeline_loaded_from_a_folder(tmp_path):
    """from_pretrained memory-maps safetensors: tensors start at odd offsets, not 64-byte aligned."""
    from diffusers import DiffusionPipeline

    tiny.tiny_wan_pipeline(seed=5).save_pretrained(tmp_path / "wan")
    ref = _run_wan(DiffusionPipeline.from_pretrained(tmp_path / "wan"))
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "wan")
    pipe.set_progress_bar_config(disable=True)
    handle = apply_offload(pipe, BOTH, device="cpu")
    assert torch.equal(_run_wan(pipe), ref)
    handle.remove()
