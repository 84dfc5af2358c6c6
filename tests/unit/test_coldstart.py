"""Cold start: streamed blocks read from safetensors straight into host buffers or shards, in one
process (``wan_folder`` comes from conftest.py). With allgather ranks and their peak host
memory: dist/test_coldstart_ranks.py."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from diffusers import DiffusionPipeline, WanTransformer3DModel
from safetensors.torch import load_file, save_file
from transformers import UMT5EncoderModel

from omni_dist_offload import OffloadConfigError, Omni, apply_offload
import tiny_models as tiny
from omni_dist_offload.loading import checkpoint as checkpoint_module
from omni_dist_offload.loading.checkpoint import CheckpointSource, CheckpointError, SafetensorsCheckpoint
from omni_dist_offload.loading.coldstart import load_offloaded, prepare_cold_start
from omni_dist_offload.loading.folders import pipeline_class
from omni_dist_offload.layout import layout_block
from omni_dist_offload.transfer.sharding import plan_shards, shard_pieces, write_shard

BOTH = {"mode": "layer", "components": ["dit", "text_encoder"]}


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-flux")
    tiny.tiny_flux_pipeline().save_pretrained(folder)  # single files
    return folder


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**module.state_dict(), **dict(module.named_buffers())}


def _assert_same_module(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = _state(a), _state(b)
    assert set(sa) == set(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].cpu(), sb[k].cpu()), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wan_pipeline_matches_ordinary_load(wan_folder, dtype, caplog):
    """Sharded fp32 checkpoint, run in fp32 and bf16 (conversion while reading): the pipeline's
    output and every tensor equal the ordinary load's, ties and computed buffers included."""
    # disable_mmap: the ordinary load would otherwise leave fp32 resident tensors inside the
    # memory-mapped file at unaligned addresses, and CPU GEMMs round differently by alignment
    # (on a GPU every resident tensor is a fresh, aligned device allocation either way).
    ref = DiffusionPipeline.from_pretrained(wan_folder, dtype=dtype, disable_mmap=True)
    ref_handle = apply_offload(ref, BOTH, device="cpu")
    # A cold start never loads a streamed component whole (diffusers would, for a component
    # passed to DiffusionPipeline.from_pretrained that has a default).
    with mock.patch.object(WanTransformer3DModel, "from_pretrained", side_effect=AssertionError("loaded whole")), \
         mock.patch.object(UMT5EncoderModel, "from_pretrained", wraps=UMT5EncoderModel.from_pretrained) as te_load:
        pipe, handle = load_offloaded(wan_folder, BOTH, device="cpu", dtype=dtype)
    assert [c.kwargs.get("device_map") for c in te_load.call_args_list] == ["meta"]
    # Every tensor of the complete checkpoint found its place (UMT5's tied embedding has two keys).
    assert not [r for r in caplog.records if "were not used" in r.getMessage()]
    rows = {r["component"]: r for r in handle.summary()}
    assert set(rows) == {"transformer", "text_encoder"} and all(r["setup_s"] > 0 for r in rows.values())
    kwargs = dict(prompt="a fox", num_inference_steps=2, output_type="np", **{
        k: v for k, v in tiny.TINY_WAN_DEFAULTS.items() if k != "num_inference_steps"})
    out = pipe(generator=torch.Generator().manual_seed(1), **kwargs).frames
    expect = ref(generator=torch.Generator().manual_seed(1), **kwargs).frames
    assert (out == expect).all()
    te = pipe.text_encoder
    assert te.shared.weight is te.encoder.embed_tokens.weight
    handle.remove()
    ref_handle.remove()
    for name in ("transformer", "text_encoder"):
        _assert_same_module(getattr(pipe, name), getattr(ref, name))


def test_flux_single_files_through_omni(flux_folder):
    """Single-file checkpoints, two text encoders (CLIP with a computed position_ids buffer, T5),
    through Omni: same image as the ordinary load."""
    cfg = {"mode": "layer", "components": ["dit", "text_encoder"]}
    with mock.patch("diffusers.FluxTransformer2DModel.from_pretrained", side_effect=AssertionError("loaded whole")):
        cold = Omni(str(flux_folder), cfg, device="cpu", progress=False)
    plain = Omni(str(flux_folder), cfg, device="cpu", progress=False, cold_start=False,
                 load_kwargs={"disable_mmap": True})  # aligned resident tensors, as above
    assert cold.cold_start and not plain.cold_start
    assert {r["component"] for r in cold.summary()} == {"transformer", "text_encoder", "text_encoder_2"}
    a = cold.generate("a red fox", seed=3, num_inference_steps=2, height=32, width=32)
    b = plain.generate("a red fox", seed=3, num_inference_steps=2, height=32, width=32)
    assert (a.frames == b.frames).all()
    cold.handle.remove()
    plain.handle.remove()
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        _assert_same_module(getattr(cold.pipeline, name), getattr(plain.pipeline, name))
    cold.close()
    plain.close()


def _copy_folder(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_source_for_a_component_that_does_not_stream_is_an_error(wan_folder):
    cold = prepare_cold_start(wan_folder, BOTH, device=torch.device("cpu"), dtype=torch.float32)
    pipe = pipeline_class(wan_folder).from_pretrained(wan_folder, dtype=torch.float32, **cold.components)
    assert pipe.transformer is cold.components["transformer"]
    placeholders = [p.data_ptr() for p in pipe.transformer.blocks.parameters()]
    with pytest.raises(OffloadConfigError, match=r"block_sources has sources for \['transformer'\]"):
        apply_offload(pipe, {"mode": "layer", "components": ["text_encoder"]}, device="cpu",
                      block_sources=cold.sources)
    assert [p.data_ptr() for p in pipe.transformer.blocks.parameters()] == placeholders
    assert not hasattr(pipe.text_encoder, "_omni_offload_handle")
    cold.close()


def test_missing_tensor_is_named(wan_folder, tmp_path):
    folder = _copy_folder(wan_folder, tmp_path / "broken")
    index = json.loads((folder / "transformer/diffusion_pytorch_model.safetensors.index.json").read_text())
    victim = "blocks.1.ffn.net.0.proj.weight"
    shard = folder / "transformer" / index["weight_map"][victim]
    tensors = load_file(shard)
    del tensors[victim]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no tensor for \['blocks\.1\.ffn\.net\.0\.proj\.weight'\]"):
        load_offloaded(folder, BOTH, device="cpu", dtype=torch.float32)


def test_a_missing_tied_tensor_is_named_once(wan_folder, tmp_path):
    # UMT5's ``shared`` and ``encoder.embed_tokens`` are one tensor, held by two modules.
    folder = _copy_folder(wan_folder, tmp_path / "untied")
    index_path = folder / "text_encoder/model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / "text_encoder" / index["weight_map"].pop("shared.weight")
    tensors = load_file(shard)
    del tensors["shared.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"no tensor for \['shared\.weight'\] \(1 in all\)"):
        load_offloaded(folder, {"mode": "layer", "components": ["text_encoder"]}, device="cpu", dtype=torch.float32)


def test_mismatched_shape_is_named(wan_folder, tmp_path):
    folder = _copy_folder(wan_folder, tmp_path / "other-config")
    config_path = folder / "transformer/config.json"
    config = json.loads(config_path.read_text())
    config["ffn_dim"] = 64
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.ffn\.net\.0\.proj\.weight \(model \(64, 24\), checkpoint \(48, 24\)\)"):
        load_offloaded(folder, BOTH, device="cpu", dtype=torch.float32)


def test_a_text_encoder_shape_mismatch_is_named_in_one_line(wan_folder, tmp_path, capsys):
    """transformers raises a bare RuntimeError after a log report: the cold start names the
    tensors in a CheckpointError, and the CLI gives one line either way."""
    from omni_dist_offload.app.cli import main

    folder = _copy_folder(wan_folder, tmp_path / "other-te-config")
    config_path = folder / "text_encoder/config.json"
    config = json.loads(config_path.read_text())
    config["d_ff"] += 8
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"text_encoder .*tensor shapes differ .*DenseReluDense\.wi_0\.weight"):
        load_offloaded(folder, BOTH, device="cpu", dtype=torch.float32)
    for cold in ([], ["--no-cold-start"]):
        rc = main(["generate", "--model", str(folder), "--num-inference-steps", "1", "--no-progress",
                   "--output-dir", str(tmp_path / "out"), *cold])
        err = capsys.readouterr().err
        assert rc == 1 and "omni-offload generate: error:" in err and "Traceback" not in err, err


def test_a_component_saved_quantized_is_refused_before_anything_loads(wan_folder, tmp_path):
    folder = _copy_folder(wan_folder, tmp_path / "quantized")
    config_path = folder / "transformer/config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "quanto", "weights_dtype": "int8"}
    config_path.write_text(json.dumps(config))
    with pytest.raises(OffloadConfigError, match=r"transformer \(WanTransformer3DModel, .*config\.json\) is "
                                                 r"quantized \(quanto\)"):
        prepare_cold_start(folder, BOTH, device=torch.device("cpu"), dtype=torch.float32)


def test_truncated_file_is_an_error(wan_folder, tmp_path):
    folder = _copy_folder(wan_folder, tmp_path / "truncated")
    shard = sorted((folder / "transformer").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="damaged|truncated"):
        load_offloaded(folder, BOTH, device="cpu", dtype=torch.float32)


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = __import__("struct").unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header = edit(header) or header
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _overlap(h):  # b reads a's bytes
    h["b"]["data_offsets"] = h["a"]["data_offsets"]


def _before_data(h):  # a starts inside the header
    begin, end = h["a"]["data_offsets"]
    h["a"]["data_offsets"] = [begin - 16, end - 16]


def _hole(h):  # the last tensor ends short of the file
    h["b"]["data_offsets"][1] -= 4
    h["b"]["shape"] = [3]


@pytest.mark.parametrize("edit, found", [
    (_overlap, r"tensor 'b' starts at byte 0 of the data, where the tensors before it end at 16 \(an overlap\)"),
    (_before_data, r"data_offsets \[-16, 0\] are not two increasing byte offsets"),
    (_hole, r"the tensors end at byte \d+ of \d+"),
    (lambda h: h["a"].pop("data_offsets") and None, r"tensor 'a': its entry is not an object with dtype, shape and data_offsets"),
    (lambda h: h.update(a=[1, 2]), r"tensor 'a': its entry is not an object"),
    (lambda h: h["a"].update(shape=["4"]), r"shape \['4'\] is not a list of sizes"),
    (lambda h: [1, 2], r"its header is not a JSON object"),
])
def test_a_damaged_header_is_refused_as_safetensors_refuses_it(tmp_path, edit, found):
    """A header whose byte ranges overlap, start before the data or leave a hole would read one
    tensor's bytes (or the header's) as another's; safetensors refuses such files, and so does
    the cold start, naming the file, instead of loading garbage or raising a KeyError."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(4)}, path)
    SafetensorsCheckpoint([path]).close()  # intact: read
    _rewrite_header(path, edit)
    with pytest.raises(CheckpointError, match=rf"m\.safetensors: .*{found}.*download it again"):
        SafetensorsCheckpoint([path])


class _CountingCheckpoint(SafetensorsCheckpoint):
    def __init__(self, files):
        super().__init__(files)
        self.bytes_read = 0

    def read_into(self, name, dst, start=0):
        self.bytes_read += dst.numel() * self.info(name).dtype.itemsize
        super().read_into(name, dst, start)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_fill_reads_only_its_ranges(wan_folder, world):
    """Each rank's shard, filled from the checkpoint, equals the shard cut from the whole block
    image, and the rank reads no more checkpoint bytes than its shard holds."""
    model = WanTransformer3DModel.from_pretrained(wan_folder, subfolder="transformer")
    cold = prepare_cold_start(wan_folder, {"mode": "layer", "components": ["dit"]},
                              device=torch.device("cpu"), dtype=torch.float32, threads=3)
    source = cold.sources["transformer"]
    counting = _CountingCheckpoint(source.checkpoint.files)
    source = CheckpointSource(counting, source.keys, threads=3)
    cold_blocks = cold.components["transformer"].blocks
    for i, (block, cold_block) in enumerate(zip(model.blocks, cold_blocks)):
        full = layout_block(i, f"blocks.{i}", block)
        layout = layout_block(i, f"blocks.{i}", cold_block)
        image = torch.zeros(full.nbytes, dtype=torch.uint8)
        for e in full.entries:
            e.view_in(image).copy_(e.tensor.detach())
        for rank in range(world):
            plan = plan_shards(layout.nbytes, world, rank, chunk_bytes=4096)
            want = torch.empty(plan.shard_nbytes, dtype=torch.uint8)
            write_shard(plan, image, want)
            got = torch.full((plan.shard_nbytes,), 7, dtype=torch.uint8)
            before = counting.bytes_read
            source.fill(layout, shard_pieces(plan), got)
            assert counting.bytes_read - before <= plan.shard_nbytes
            # Alignment gaps between tensors are never read; compare the tensor bytes and the tail.
            mask = torch.zeros(full.nbytes + world * 4096, dtype=torch.bool)
            for e in full.entries:
                mask[e.offset : e.offset + e.nbytes] = True
            mask[full.nbytes :] = True
            keep = torch.empty(plan.shard_nbytes, dtype=torch.bool)
            write_shard(plan, mask.view(torch.uint8), keep.view(torch.uint8))
            assert torch.equal(got[keep], want[keep]), (i, rank)
    source.close()
    cold.close()


def test_cli_cold_start_and_opt_out(wan_folder, tmp_path):
    from omni_dist_offload.app.cli import main

    for flag in ([], ["--no-cold-start"]):
        out = tmp_path / ("cold" if not flag else "plain")
        rc = main(["generate", "--model", str(wan_folder), "--prompt", "a cat", "--num-inference-steps", "2",
                   "--height", "32", "--width", "32", "--num-frames", "5", "--no-progress",
                   "--output-dir", str(out), *flag])
        assert rc == 0
    sidecars = [json.loads(next(p.glob("*.json")).read_text()) for p in (tmp_path / "cold", tmp_path / "plain")]
    assert sidecars[0]["offload_summary"][0]["component"] == "transformer"
    frames = [sorted(p.glob("*.gif")) or sorted(p.glob("*.mp4")) for p in (tmp_path / "cold", tmp_path / "plain")]
    assert frames[0][0].read_bytes() == frames[1][0].read_bytes()


@pytest.mark.parametrize("residency", [{"layer_options": {"dit": {"resident_blocks": [0]},
                                                            "text_encoder": {"resident_blocks": 1}}},
                                       {"device_budget": "1MiB"}])
def test_resident_blocks_are_read_from_the_checkpoint(wan_folder, residency):
    """A block that stays on the device from the start is filled from the checkpoint like a
    streamed one (its tensors were placeholders), whether resident_blocks or a budget keeps it."""
    ref = DiffusionPipeline.from_pretrained(wan_folder, dtype=torch.float32, disable_mmap=True)
    config = {**BOTH, **residency}
    pipe, handle = load_offloaded(wan_folder, config, device="cpu", dtype=torch.float32)
    rows = {r["component"]: r for r in handle.summary()}
    assert rows["transformer"]["resident_blocks"] and rows["text_encoder"]["resident_blocks"]
    handle.remove()
    for name in ("transformer", "text_encoder"):
        _assert_same_module(getattr(pipe, name), getattr(ref, name))


@pytest.mark.parametrize(("dtype", "scratch"), [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 96)])
def test_8_bit_storage_reads_the_checkpoint_into_8_bit_images(wan_folder, dtype, scratch, monkeypatch):
    """fp32 files, run in fp32 or bf16, stored in 8 bits while reading (through the run dtype,
    as loading then casting rounds, a scratch buffer's worth at a time: ``scratch`` bytes, which
    splits every tensor): the DiT equals the ordinary load under diffusers' layerwise casting,
    bit for bit, and its host copy is the 8-bit size."""
    if scratch is not None:
        monkeypatch.setattr(checkpoint_module, "_SCRATCH_BYTES", scratch)
    stored = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}
    ref = WanTransformer3DModel.from_pretrained(wan_folder, subfolder="transformer", torch_dtype=dtype)
    ref.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype)
    with mock.patch.object(WanTransformer3DModel, "from_pretrained", side_effect=AssertionError("loaded whole")):
        pipe, handle = load_offloaded(wan_folder, stored, device="cpu", dtype=dtype)
    (row,) = handle.summary()
    assert row["storage_dtype"] == "float8_e4m3fn" and row["setup_s"] > 0
    x = tiny.wan_transformer_inputs(ref, batch=2)
    with torch.no_grad():
        assert torch.equal(pipe.transformer(**x)[0], ref(**x)[0])
    handle.remove()


def test_a_checkpoint_saved_in_8_bits_is_read_without_a_round_trip(wan_folder, tmp_path):
    """A DiT saved after layerwise casting (8-bit weights in the files): its 8-bit tensors are
    read straight into the images, and the outputs equal loading it and casting it again."""
    stored = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}
    saved = WanTransformer3DModel.from_pretrained(wan_folder, subfolder="transformer", torch_dtype=torch.bfloat16)
    saved.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    saved.save_pretrained(tmp_path / "transformer")
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(next((tmp_path / "transformer").glob("*.safetensors"))).values())
    folder = tmp_path / "pipe"
    pipe = DiffusionPipeline.from_pretrained(wan_folder)
    pipe.save_pretrained(folder)
    for f in (folder / "transformer").glob("*"):
        f.unlink()
    for f in (tmp_path / "transformer").glob("*"):
        (folder / "transformer" / f.name).write_bytes(f.read_bytes())
    ref = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=torch.bfloat16)
    ref.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with mock.patch.object(SafetensorsCheckpoint, "read_into", autospec=True,
                           side_effect=SafetensorsCheckpoint.read_into) as reads:
        pipe, handle = load_offloaded(folder, stored, device="cpu", dtype=torch.bfloat16)
    x = tiny.wan_transformer_inputs(ref, batch=2)
    with torch.no_grad():
        assert torch.equal(pipe.transformer(**x)[0], ref(**x)[0])
    # The 8-bit tensors went from the file into the image as they are: no conversion.
    fp8 = [c for c in reads.call_args_list if c.args[2].dtype == torch.float8_e4m3fn]
    assert fp8 and all(c.args[0].info(c.args[1]).dtype == torch.float8_e4m3fn for c in fp8)
    handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cold_start_with_upcast_per_layer_reads_8_bit_blocks(wan_folder, dtype):
    """``upcast: "layer"`` plans the blocks in 8 bits: the checkpoint's fp32 tensors are read
    through the model's dtype into 8 bits (rounded as loading, then casting, rounds) and the
    output equals the ordinary load under diffusers' layerwise casting."""
    cfg = {"mode": "layer", "components": ["dit"],
           "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn", "upcast": "layer"}}}
    ref = DiffusionPipeline.from_pretrained(wan_folder, dtype=dtype, disable_mmap=True)
    ref.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype)
    with mock.patch.object(WanTransformer3DModel, "from_pretrained", side_effect=AssertionError("loaded whole")):
        pipe, handle = load_offloaded(wan_folder, cfg, device="cpu", dtype=dtype)
    (row,) = handle.summary()
    assert (row["storage_dtype"], row["upcast"]) == ("float8_e4m3fn", "layer")
    kwargs = dict(prompt="a fox", num_inference_steps=2, output_type="np", **{
        k: v for k, v in tiny.TINY_WAN_DEFAULTS.items() if k != "num_inference_steps"})
    out = pipe(generator=torch.Generator().manual_seed(1), **kwargs).frames
    assert (out == ref(generator=torch.Generator().manual_seed(1), **kwargs).frames).all()
    handle.remove()


def test_weight_files_are_chosen_as_each_library_chooses_them(tmp_path):
    """A folder saved twice can hold a single file and an index: diffusers' loader reads the
    index first, transformers' the single file first, and so does the cold start."""
    from omni_dist_offload.loading.checkpoint import find_weight_files

    def index(folder, stem, shards):
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {f"w{i}": name for i, name in enumerate(shards)}}))

    dit = tmp_path / "dit"
    dit.mkdir()
    for name in ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model-00001-of-00002.safetensors",
                 "diffusion_pytorch_model-00002-of-00002.safetensors"):
        (dit / name).touch()
    index(dit, "diffusion_pytorch_model", ["diffusion_pytorch_model-00001-of-00002.safetensors",
                                           "diffusion_pytorch_model-00002-of-00002.safetensors"])
    assert [p.name for p in find_weight_files(dit)] == ["diffusion_pytorch_model-00001-of-00002.safetensors",
                                                        "diffusion_pytorch_model-00002-of-00002.safetensors"]
    encoder = tmp_path / "encoder"
    encoder.mkdir()
    (encoder / "model.safetensors").touch()
    index(encoder, "model", ["model-00001-of-00002.safetensors"])  # stale: its shards are gone
    assert find_weight_files(encoder) == [encoder / "model.safetensors"]
    (encoder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="names shard"):
        find_weight_files(encoder)


def test_a_stale_single_file_beside_shards_is_read_as_transformers_reads_it(wan_folder, tmp_path):
    """The text encoder re-saved unsharded over a sharded save keeps the old index beside the
    new file; transformers loads the file, and the cold start reads the same weights."""
    folder = _copy_folder(wan_folder, tmp_path / "resaved")
    te = UMT5EncoderModel.from_pretrained(folder / "text_encoder")
    with torch.no_grad():
        for p in te.parameters():
            p.add_(1.0)
    shards = sorted((folder / "text_encoder").glob("model-*.safetensors"))
    te.save_pretrained(folder / "text_encoder", max_shard_size="100GB")  # one file, the index stays
    for shard in shards:  # as if the old shards had been cleaned up
        shard.unlink(missing_ok=True)
    assert (folder / "text_encoder/model.safetensors.index.json").is_file()
    pipe, handle = load_offloaded(folder, BOTH, device="cpu", dtype=torch.float32)
    handle.remove()
    want = UMT5EncoderModel.from_pretrained(folder / "text_encoder")
    _assert_same_module(pipe.text_encoder, want)
    # Omni and the CLI check the folder's indexes first: only the one the loader reads (the stale
    # index used to be refused as naming shards that do not exist).
    omni = Omni(str(folder), BOTH, device="cpu", dtype="float32", progress=False)
    omni.handle.remove()
    _assert_same_module(omni.pipeline.text_encoder, want)
    omni.close()


def test_cli_reports_a_damaged_checkpoint_in_one_line(wan_folder, tmp_path, capsys):
    from omni_dist_offload.app.cli import main

    folder = _copy_folder(wan_folder, tmp_path / "damaged")
    shard = sorted((folder / "transformer").glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    rc = main(["generate", "--model", str(folder), "--num-inference-steps", "1", "--no-progress",
               "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and "omni-offload generate: error:" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_tensor_for_a_non_persistent_buffer_is_not_loaded(wan_folder, tmp_path, caplog):
    """A checkpoint holding a buffer the model does not save (an older save, a renamed key):
    from_pretrained leaves it unused, and so does the cold start, quietly. A tensor the model has
    no place for at all is named in a warning, as both libraries' loaders do."""
    folder = _copy_folder(wan_folder, tmp_path / "extra")
    index_path = folder / "transformer/diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / "transformer" / next(iter(index["weight_map"].values()))
    tensors = load_file(shard)
    model = WanTransformer3DModel.from_pretrained(wan_folder, subfolder="transformer")
    name, buffer = next((n, b) for n, b in model.named_buffers() if n not in model.state_dict())
    tensors[name] = torch.zeros_like(buffer)
    tensors["blocks.0.stray.weight"] = torch.zeros(3)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"][name] = index["weight_map"]["blocks.0.stray.weight"] = shard.name
    index_path.write_text(json.dumps(index))
    with caplog.at_level("WARNING", logger="omni_dist_offload.loading.coldstart"):
        pipe, handle = load_offloaded(folder, {"mode": "layer", "components": ["dit"]}, device="cpu",
                                      dtype=torch.float32)
    unused = [r.getMessage() for r in caplog.records if "were not used" in r.getMessage()]
    assert len(unused) == 1 and "1 checkpoint tensor(s)" in unused[0], unused
    assert "blocks.0.stray.weight" in unused[0] and name not in unused[0] and "transformer" in unused[0]
    handle.remove()
    got = dict(pipe.transformer.named_buffers())[name]
    assert torch.equal(got, buffer) and got.abs().sum() > 0


def test_load_offloaded_defaults_to_omnis_dtype_and_hides_bars_without_progress(wan_folder, capfd):
    """load_offloaded took bfloat16 on the CPU, where Omni takes float32; a cold start showed
    transformers' "Loading weights" bar with progress=False."""
    from omni_dist_offload import Omni

    pipe, handle = load_offloaded(wan_folder, BOTH, device="cpu")
    assert pipe.transformer.dtype == torch.float32
    handle.remove()
    capfd.readouterr()
    with Omni(str(wan_folder), BOTH, device="cpu", progress=False):
        pass
    assert "Loading" not in capfd.readouterr().err


def test_a_cold_start_reads_into_host_memory_whatever_the_default_device(wan_folder):
    """The meta-built components and their computed buffers (rotary tables) are made on the host
    even under torch.set_default_device: they followed it, and the load failed."""
    ref = DiffusionPipeline.from_pretrained(wan_folder, dtype=torch.float32, disable_mmap=True)
    torch.set_default_device("meta")
    try:
        pipe, handle = load_offloaded(wan_folder, BOTH, device="cpu", dtype=torch.float32)
    finally:
        torch.set_default_device(None)
    handle.remove()
    for name in ("transformer", "text_encoder"):
        _assert_same_module(getattr(pipe, name), getattr(ref, name))


def _add_text_encoder_tensor(folder: Path, key: str, value_of) -> None:
    """Write ``key`` into the text encoder's checkpoint beside ``shared.weight`` (the shard that
    holds it, and the index if there is one)."""
    te = folder / "text_encoder"
    index_path = te / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    shard = te / (index["weight_map"]["shared.weight"] if index else "model.safetensors")
    tensors = load_file(shard)
    tensors[key] = value_of(tensors["shared.weight"])
    save_file(tensors, shard, metadata={"format": "pt"})
    if index:
        index["weight_map"][key] = shard.name
        index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("equal", [True, False], ids=["equal", "different"])
def test_both_names_of_a_tied_embedding_load_as_transformers_loads_them(wan_folder, tmp_path, equal):
    """A checkpoint holding both names of T5's tied embedding (saves converted from ``.bin``):
    transformers ties them where the values match (one tensor, not two on the device) and keeps
    them apart where they differ; the cold start must do the same."""
    folder = _copy_folder(wan_folder, tmp_path / "both-names")
    _add_text_encoder_tensor(folder, "encoder.embed_tokens.weight",
                             (lambda t: t.clone()) if equal else (lambda t: t + 1))
    ordinary = UMT5EncoderModel.from_pretrained(folder / "text_encoder", dtype=torch.float32)
    assert (ordinary.shared.weight is ordinary.encoder.embed_tokens.weight) is equal
    pipe, handle = load_offloaded(folder, BOTH, device="cpu", dtype=torch.float32)
    te = pipe.text_encoder
    assert (te.shared.weight is te.encoder.embed_tokens.weight) is equal
    handle.remove()
    _assert_same_module(te, ordinary)


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "no-cold-start"])
@pytest.mark.parametrize("damage", ["model_index", "model_index_list", "weight_map", "transformer/config.json",
                                    "text_encoder/config.json", "transformer/config.json missing"])
def test_a_damaged_index_file_is_named_in_one_line(wan_folder, tmp_path, capsys, damage, cold):
    from omni_dist_offload.app.cli import main

    folder = _copy_folder(wan_folder, tmp_path / "damaged")
    if damage.startswith("model_index"):
        target = folder / "model_index.json"
        target.write_text("[]" if damage == "model_index_list" else "{'not': json")
    elif damage.endswith("config.json"):  # a component's config (cold start: an OSError's traceback)
        target = folder / damage
        target.write_text(target.read_text()[:-10])
    elif damage.endswith("missing"):
        target = folder / damage.removesuffix(" missing")
        target.unlink()
        target = target.parent  # diffusers names the folder it looked in
    else:
        target = folder / "transformer/diffusion_pytorch_model.safetensors.index.json"
        target.write_text(json.dumps({"weight_map": ["x"]}))
    # Without cold start diffusers reads the folder: its own errors were an AttributeError's traceback.
    rc = main(["inspect", "--model", str(folder), *([] if cold else ["--no-cold-start"])])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and str(target) in err, err


def test_load_offloaded_takes_the_dtype_once(wan_folder):
    # torch_dtype in the loader's keywords reached from_pretrained beside the dtype it passes.
    with pytest.raises(ValueError, match=r"pass dtype=\.\.\. instead"):
        load_offloaded(wan_folder, BOTH, device="cpu", torch_dtype=torch.float32)


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "no-cold-start"])
def test_a_damaged_folder_is_a_model_load_error_either_way(wan_folder, tmp_path, cold):
    """The docs promise ModelLoadError for a damaged model_index.json; the default path (cold
    start) raised CheckpointError, a sibling class, which `except ModelLoadError` missed."""
    from omni_dist_offload import Omni
    from omni_dist_offload.loading import ModelLoadError

    folder = _copy_folder(wan_folder, tmp_path / "damaged")
    (folder / "model_index.json").write_text("{'not': json")
    with pytest.raises(ModelLoadError, match=r"model_index\.json"):
        Omni(str(folder), BOTH, device="cpu", progress=False, cold_start=cold)


def test_a_loader_runtime_error_is_not_blamed_on_a_shape_mismatch(wan_folder, tmp_path, monkeypatch):
    """A quantized folder on a host without a GPU: diffusers' 'No GPU found' was reported as a
    checkpoint that does not match its config, with a report above that did not exist."""
    from diffusers import DiffusionPipeline

    from omni_dist_offload.loading import ModelLoadError, load_pipeline

    def refuse(*args, **kwargs):
        raise RuntimeError("No GPU found. A GPU is needed for quantization.")

    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", refuse)
    with pytest.raises(ModelLoadError) as info:
        load_pipeline(str(wan_folder), torch.float32, {})
    assert str(info.value).endswith("(RuntimeError: No GPU found. A GPU is needed for quantization.).")
    assert "does not match" not in str(info.value)
