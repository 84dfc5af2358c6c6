"""LoRA files and step caches through ``Omni`` and the CLI (``--lora PATH[:SCALE]``, ``--cache
first-block:0.1``): parsed and checked before anything loads, applied after offloading,
recorded in the metadata, and bitwise equal to the same options on the resident pipeline."""

from __future__ import annotations

import json

import pytest
import torch

from omni_dist_offload import Omni
from omni_dist_offload.app.cli import main
from omni_dist_offload.loading.adapters import AdapterError, CacheSpec, LoraSpec

pytest.importorskip("peft")
from safetensors.torch import save_file  # noqa: E402
from unit.test_lora import lora_state_dict  # noqa: E402

STREAMED = {"mode": "layer", "components": ["dit", "text_encoder"]}


@pytest.mark.parametrize(("text", "expected"), [
    ("a.safetensors", LoraSpec("a.safetensors", 1.0)),
    ("dir/a.safetensors:0.5", LoraSpec("dir/a.safetensors", 0.5)),
    ("C:/loras/a.safetensors", LoraSpec("C:/loras/a.safetensors", 1.0)),  # not a scale: part of the path
    ({"path": "x", "scale": 2}, LoraSpec("x", 2.0)),
])
def test_lora_specs(text, expected):
    assert LoraSpec.parse(text) == expected


@pytest.mark.parametrize(("value", "expected"), [
    ("first-block:0.1", {"type": "first-block", "threshold": 0.1}),
    ("taylorseer:3", {"type": "taylorseer", "cache_interval": 3}),
    ("first-block", {"type": "first-block"}),
    ('{"type": "first-block", "threshold": 0.2}', {"type": "first-block", "threshold": 0.2}),
    ({"type": "pyramid-attention", "spatial_attention_block_skip_range": 2},
     {"type": "pyramid-attention", "spatial_attention_block_skip_range": 2}),
])
def test_cache_specs_round_trip(value, expected):
    spec = CacheSpec.parse(value)
    assert spec.to_dict() == expected and CacheSpec.parse(spec.to_dict()) == spec


@pytest.mark.parametrize(("value", "message"), [
    ("warp", "unknown step cache 'warp'"),
    ("taylorseer:0.5", "cache_interval is an integer"),
    ({"threshold": 0.1}, "unknown step cache None"),
    ({"type": "first-block", "thresh": 0.1}, "unexpected keyword argument 'thresh'"),
    ("{not json", "not valid JSON"),
    # diffusers' config classes take these, then fail or misbehave mid-generation.
    ("taylorseer:0", "--cache taylorseer:0: cache_interval is an integer, 1 or more, found 0"),
    ("pyramid-attention:0", "spatial_attention_block_skip_range is an integer, 1 or more, found 0"),
    ('{"type": "pyramid-attention", "cross_attention_block_skip_range": 0}', "cross_attention_block_skip_range is"),
    ("first-block:nan", "threshold is a number, finite and 0 or more, found nan"),
    ("first-block:-1", "threshold is a number, finite and 0 or more, found -1.0"),
])
def test_bad_cache_specs_say_what_to_fix(value, message):
    with pytest.raises(AdapterError, match=message):
        CacheSpec.parse(value)


def test_specs_built_directly_are_checked_as_parsed_ones_are(tmp_path):
    """A LoraSpec or CacheSpec object skipped the checks: a NaN scale generated black frames."""
    with pytest.raises(AdapterError, match="a LoRA scale is a finite number; found nan"):
        LoraSpec("a.safetensors", float("nan"))
    assert LoraSpec("a.safetensors", "0.5").scale == 0.5
    with pytest.raises(AdapterError, match="a LoRA scale is a number; found 'half'"):
        LoraSpec("a.safetensors", "half")
    with pytest.raises(AdapterError, match="cache_interval is an integer, 1 or more, found 0"):
        CacheSpec.parse(CacheSpec("taylorseer", {"cache_interval": 0}))
    # A folder whose name ends in ':<number>' is a path, not a path and a scale.
    (tmp_path / "run:1000").mkdir()
    assert LoraSpec.parse(tmp_path / "run:1000") == LoraSpec(str(tmp_path / "run:1000"))
    assert LoraSpec.parse(str(tmp_path / "run:1000")) == LoraSpec(str(tmp_path / "run:1000"))
    assert LoraSpec.parse(str(tmp_path / "run:0.5")) == LoraSpec(str(tmp_path / "run"), 0.5)


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    """A LoRA file, and a folder holding one as diffusers saves it."""
    folder = tmp_path_factory.mktemp("loras")
    (folder / "lora1").mkdir()
    save_file(lora_state_dict(0), str(folder / "lora0.safetensors"))
    save_file(lora_state_dict(1), str(folder / "lora1" / "pytorch_lora_weights.safetensors"))
    return [str(folder / "lora0.safetensors"), str(folder / "lora1")]


def test_lora_files_are_checked_before_anything_loads(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "other.safetensors").write_bytes(b"")
    (tmp_path / "pickled.safetensors").write_bytes(b"\x80\x04not a header")
    save_file({}, str(tmp_path / "empty.safetensors"))
    for path, message in [("folder", "folder: the folder has no pytorch_lora_weights.safetensors"),
                          ("pickled.safetensors", "pickled.safetensors is not a readable safetensors file"),
                          ("empty.safetensors", "empty.safetensors holds no tensors")]:
        with pytest.raises(AdapterError, match=message):
            LoraSpec.parse(str(tmp_path / path)).check()
    for scale in ("nan", "inf"):
        with pytest.raises(AdapterError, match=f"a LoRA scale is a finite number; found '{scale}'"):
            LoraSpec.parse(f"a.safetensors:{scale}")


def _frames(omni: Omni) -> list[torch.Tensor]:
    # Two generations of one seed: the cache's state is reset in between, so they match.
    return [torch.from_numpy(omni.generate("a red fox", seed=3).frames.copy()) for _ in range(2)]


def test_omni_with_loras_and_a_cache_matches_the_resident_pipeline(lora_files):
    options = {"lora": [f"{lora_files[0]}:0.5", lora_files[1]], "cache": "first-block:0.2"}
    with Omni("tiny-wan", None, device="cpu", progress=False, **options) as resident:
        ref = _frames(resident)
        plain = torch.from_numpy(resident.generate("a red fox", seed=3, name="x").frames.copy())
    with Omni("tiny-wan", STREAMED, device="cpu", progress=False, **options) as streamed:
        got = _frames(streamed)
        meta = streamed.generate("a red fox", seed=3).metadata
        adapters = [p for n, p in streamed.pipeline.transformer.named_parameters() if "lora_" in n]
    assert torch.equal(ref[0], ref[1]) and torch.equal(plain, ref[0])
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert meta["lora"] == [{"path": lora_files[0], "scale": 0.5}, {"path": lora_files[1], "scale": 1.0}]
    assert meta["cache"] == {"type": "first-block", "threshold": 0.2}
    assert adapters  # the LoRA did load into the streamed DiT
    with Omni("tiny-wan", STREAMED, device="cpu", progress=False) as bare:
        assert not torch.equal(_frames(bare)[0], ref[0])  # and it changes the output


def test_cli_lora_and_cache_flags_reach_the_metadata(lora_files, tmp_path):
    out = tmp_path / "out"
    rc = main(["--lora", f"{lora_files[0]}:0.75", "--cache", "first-block:0.1", "--num-inference-steps", "3",
               "--output-dir", str(out), "--video-format", "gif"])
    assert rc == 0
    meta = json.loads((out / "00000.json").read_text())
    assert meta["lora"] == [{"path": lora_files[0], "scale": 0.75}]
    assert meta["cache"] == {"type": "first-block", "threshold": 0.1}


def test_a_lora_for_another_model_is_named_and_the_offload_freed(lora_files, monkeypatch):
    from omni_dist_offload.apply import OffloadHandle

    removed = []
    discard = OffloadHandle.discard
    monkeypatch.setattr(OffloadHandle, "discard", lambda self: (removed.append(self), discard(self))[1])
    with pytest.raises(AdapterError, match=f"--lora {lora_files[0]}: FluxPipeline could not load it "
                       r"\(.+\)\. Give a LoRA trained for this model"):
        Omni("tiny-flux", STREAMED, device="cpu", progress=False, lora=[lora_files[0]])  # a Wan LoRA
    assert len(removed) == 1


def test_a_missing_lora_file_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import omni_dist_offload.app.api as api
    monkeypatch.setattr(api, "load_and_place", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(AdapterError, match="no such file or folder"):
        Omni("tiny-wan", STREAMED, device="cpu", lora=[str(tmp_path / "missing.safetensors")])


def test_a_lora_spec_holding_a_path_loads(lora_files):
    """LoraSpec(Path(...)) passed the early check, then failed with a TypeError once the model
    was loaded and offloaded: the path is kept as its string. LoraSpec is importable from the
    package, as the README presents it."""
    from pathlib import Path

    import omni_dist_offload

    assert omni_dist_offload.LoraSpec is LoraSpec and "LoraSpec" in omni_dist_offload.__all__
    spec = LoraSpec(Path(lora_files[1]), 0.8)
    assert spec == LoraSpec(lora_files[1], 0.8) and type(spec.path) is str
    assert LoraSpec.parse(Path(lora_files[0])).path == lora_files[0]
    with pytest.raises(TypeError, match="a LoRA's path is a str or a Path, found int 5"):
        LoraSpec(5)
    with Omni("tiny-wan", STREAMED, device="cpu", progress=False, lora=spec) as omni:
        assert omni.loras == [LoraSpec(lora_files[1], 0.8)]
        assert [n for n, _ in omni.pipeline.transformer.named_parameters() if "lora_" in n]


# Options diffusers' config classes take as given, then fail on mid-generation (a raw TypeError or
# RuntimeError after the model loaded): checked against the config class's field types instead.
@pytest.mark.parametrize(("value", "message"), [
    ({"type": "first-block", "threshold": None}, r"threshold is a number, finite and 0 or more, found None"),
    ('{"type": "taylorseer", "cache_interval": null}', r"cache_interval is an integer, 1 or more, found None"),
    ({"type": "taylorseer", "use_lite_mode": "yes"}, r"use_lite_mode is true or false, found 'yes'"),
    ({"type": "taylorseer", "max_order": 1.5}, r"max_order is an integer, found 1.5"),
    ({"type": "taylorseer", "disable_cache_after_step": "8"}, r"disable_cache_after_step is an integer, found '8'"),
    ({"type": "taylorseer", "skip_predict_identifiers": "blocks.*"},
     r"skip_predict_identifiers is a list of strings, found 'blocks.\*'"),
    ({"type": "taylorseer", "taylor_factors_dtype": "float31"},
     (r"taylor_factors_dtype is a floating-point dtype: one of \['bfloat16', 'float16', 'float32', 'float64'\] "
      r"\(or 'torch.float32' alike\), found 'float31'")),
    ({"type": "taylorseer", "taylor_factors_dtype": torch.int8}, r"taylor_factors_dtype is a floating-point dtype"),
    ({"type": "pyramid-attention", "spatial_attention_timestep_skip_range": 5},
     r"spatial_attention_timestep_skip_range is a pair of numbers, e.g. \[100, 800\], found 5"),
    ('{"type": "pyramid-attention", "cross_attention_timestep_skip_range": [1, 2, 3]}',
     r"cross_attention_timestep_skip_range is a pair of numbers, e.g. \[100, 800\], found \[1, 2, 3\]"),
    ({"type": "pyramid-attention", "temporal_attention_timestep_skip_range": ["100", 800]},
     r"temporal_attention_timestep_skip_range is a pair of numbers"),
    ({"type": "pyramid-attention", "spatial_attention_block_identifiers": "blocks"},
     r"spatial_attention_block_identifiers is a list of strings, found 'blocks'"),
])
def test_cache_options_of_the_wrong_type_are_refused_before_anything_loads(value, message):
    with pytest.raises(AdapterError, match=message) as refused:
        CacheSpec.parse(value)
    assert "\n" not in str(refused.value)


def test_cache_options_in_json_forms_become_what_diffusers_takes():
    """A dtype's name becomes the dtype and a JSON list a tuple; None stays where diffusers'
    field takes it; the spec is recorded as JSON and parses back to itself."""
    spec = CacheSpec.parse('{"type": "taylorseer", "cache_interval": 2, "use_lite_mode": true, '
                           '"taylor_factors_dtype": "float32", "disable_cache_after_step": null}')
    assert spec.options["taylor_factors_dtype"] is torch.float32
    assert spec.build().taylor_factors_dtype is torch.float32
    for name, dtype in [("torch.float16", torch.float16), ("bfloat16", torch.bfloat16), (torch.float64, torch.float64),
                        (None, None)]:
        assert CacheSpec.parse({"type": "taylorseer", "taylor_factors_dtype": name}).options["taylor_factors_dtype"] \
            is dtype
    pab = CacheSpec.parse({"type": "pyramid-attention", "spatial_attention_block_skip_range": 2,
                           "temporal_attention_block_skip_range": None,
                           "spatial_attention_timestep_skip_range": [100, 800.5],
                           "cross_attention_block_identifiers": ["blocks"]})
    assert pab.options["spatial_attention_timestep_skip_range"] == (100, 800.5)
    assert pab.options["cross_attention_block_identifiers"] == ("blocks",)
    for s in (spec, pab):
        recorded = json.loads(json.dumps(s.to_dict()))
        assert CacheSpec.parse(recorded) == s
    assert spec.to_dict()["taylor_factors_dtype"] == "float32"


def test_cache_options_given_as_json_run():
    """The converted options reach diffusers' hooks: generation runs (it failed with 'Invalid device
    string' and "'int' object is not subscriptable")."""
    for cache in ({"type": "taylorseer", "cache_interval": 2, "use_lite_mode": True, "taylor_factors_dtype": "float32"},
                  {"type": "pyramid-attention", "spatial_attention_block_skip_range": 2,
                   "spatial_attention_timestep_skip_range": [0, 1000]}):
        with Omni("tiny-wan", {"mode": "layer", "components": ["dit"]}, device="cpu", progress=False,
                  cache=cache) as omni:
            meta = omni.generate("a red fox", seed=3, num_inference_steps=6).metadata
        assert CacheSpec.parse(meta["cache"]) == CacheSpec.parse(cache)


def test_cli_refuses_a_null_cache_option_in_one_line_before_loading(monkeypatch, tmp_path, capsys):
    from omni_dist_offload.app import api
    monkeypatch.setattr(api, "load_and_place", lambda *a, **k: pytest.fail("loaded the model"))
    rc = main(["generate", "--model", "tiny-flux", "--cache", '{"type": "first-block", "threshold": null}',
               "--output-dir", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "threshold is a number, finite and 0 or more, found None" in err
    assert not (tmp_path / "x").exists()
