"""8-bit host storage (``storage_dtype``): bitwise equal to the resident model under diffusers'
layerwise casting at the same dtypes, half the host bytes, and the layout that makes the upcast
two copies. Two ranks (allgather): dist/test_storage_ranks.py; GPU: gpu/test_gpu_storage.py."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models as tiny
from omni_dist_offload import OffloadConfig, OffloadConfigError, apply_offload
from omni_dist_offload.layout import layout_block
from omni_dist_offload.storage import cast_tensors, downcast, upcast

DITS = {
    "wan": (tiny.tiny_wan_transformer, tiny.wan_transformer_inputs),
    "flux": (tiny.tiny_flux_transformer, tiny.flux_transformer_inputs),
    "qwenimage": (tiny.tiny_qwenimage_transformer, tiny.qwenimage_transformer_inputs),
}


def stored(dtype: str = "float8_e4m3fn", **options) -> dict:
    return {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": dtype, **options}}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(DITS))
@torch.no_grad()
def test_outputs_equal_diffusers_layerwise_casting_bit_for_bit(family, dtype):
    build, inputs = DITS[family]
    model = build(dtype=dtype)
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype)
    batches = [inputs(model, seed=0), inputs(model, batch=2, seed=1)]
    refs = [reference(**b)[0] for b in batches]
    plain = model(**batches[0])[0]
    handle = apply_offload(model, stored(), device="cpu")
    assert model.dtype == dtype  # what pipelines cast their latents to
    for _ in range(2):  # the second pass starts from the block the last one prefetched
        for b, ref in zip(batches, refs):
            assert torch.equal(model(**b)[0], ref)
    assert not torch.equal(refs[0], plain)  # 8 bits changed the weights: the test can fail
    (row,) = handle.summary()
    assert row["storage_dtype"] == "float8_e4m3fn"
    handle.remove()
    # Back to ordinary tensors holding the 8-bit values: what the offloaded model computed.
    assert torch.equal(model(**batches[0])[0], refs[0])
    assert not any(t.dtype.itemsize == 1 for t in model.parameters())


@torch.no_grad()
def test_e5m2_resident_blocks_and_a_second_forward_shape():
    model = tiny.tiny_flux_transformer(num_layers=2, num_single_layers=4)
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e5m2, compute_dtype=torch.float32)
    x = tiny.flux_transformer_inputs(model, height=8, width=8)
    y = tiny.flux_transformer_inputs(model, height=4, width=8, seed=3)
    refs = [reference(**x)[0], reference(**y)[0]]
    # Resident blocks stay on the device as 8-bit images (as diffusers keeps a layerwise-cast
    # model), upcast into a slot when they run; they keep no host copy.
    handle = apply_offload(model, stored("float8_e5m2", resident_blocks=[0, 3]), device="cpu")
    ring = handle.rings[0]
    assert ring.held == {0, 3} and not ring.resident
    assert not ring.transfer.has_host_copy(0) and ring.transfer.has_host_copy(1)
    (row,) = handle.summary()
    assert row["resident_blocks"] == [0, 3] and row["num_blocks"] == len(ring.layouts) - 2
    for _ in range(2):
        assert torch.equal(model(**x)[0], refs[0]) and torch.equal(model(**y)[0], refs[1])
    handle.remove()
    assert torch.equal(model(**x)[0], refs[0])


def _fifteen_blocks():
    """A bf16 Flux DiT of 15 blocks, its inputs, its output under diffusers' layerwise casting,
    and its blocks' layouts as 8-bit images."""
    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=14, dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    x = tiny.flux_transformer_inputs(model)
    images = [layout_block(i, n, b, cast=cast_tensors(model, torch.float8_e4m3fn)) for i, (n, b) in
              enumerate([*(("transformer_blocks.%d" % i, b) for i, b in enumerate(model.transformer_blocks)),
                         *(("single_transformer_blocks.%d" % i, b) for i, b in enumerate(model.single_transformer_blocks))])]
    return model, x, reference(**x)[0], images


@torch.no_grad()
def test_a_budget_holds_8_bit_images_and_replans_from_a_measured_forward():
    model, x, ref, images = _fifteen_blocks()
    # Two slots (and the staging spread over them), then room for three of the fifteen images.
    slot = max(l.nbytes for l in images) + max(l.image_nbytes for l in images)
    budget = 2 * slot + 3 * min(l.image_nbytes for l in images)
    assert budget < sum(l.image_nbytes for l in images)
    handle = apply_offload(model, {**stored(), "device_budget": budget}, device="cpu")
    first = set(handle.rings[0].held)  # held through the measured forward: their fills are not timed
    assert first
    for _ in range(4):
        assert torch.equal(model(**x)[0], ref)
    ring = handle.rings[0]
    # Those are priced at the rate the others' images crossed, by their image bytes (what a
    # fill moves), not their bytes in the compute dtype.
    timed = [i for i in range(len(images)) if i not in first]
    rate = sum(ring.costs.copy_ms[i] for i in timed) / sum(images[i].image_nbytes for i in timed)
    assert all(ring.costs.copy_ms[i] == pytest.approx(images[i].image_nbytes * rate) for i in first)
    (row,) = handle.summary()
    assert ring.plan is not None and ring.plan.measured and ring.held and not ring.resident
    assert row["resident_blocks"] == sorted(ring.held)
    # What the plan holds fits the budget: the held images, the slots (each holds the largest
    # block, held ones run from a slot too) and two staging buffers of the largest image that
    # still streams (one on the CPU; a GPU has two).
    held = sum(images[i].image_nbytes for i in ring.held)
    staging = max(images[i].image_nbytes for i in range(len(images)) if i not in ring.held)
    assert ring.transfer.staging_nbytes() == staging
    assert held + sum(s.numel() for s in ring.slots) + 2 * staging <= budget
    assert all(not ring.transfer.has_host_copy(i) for i in ring.held)  # settled: no host copies
    handle.remove()
    assert torch.equal(model(**x)[0], ref)
    # A budget that holds every image: nothing streams, so the prediction is resident's, known
    # before anything is measured (the plan is settled and never measured).
    whole = 2 * slot + sum(l.image_nbytes for l in images)
    handle = apply_offload(model, {**stored(), "device_budget": whole}, device="cpu")
    (row,) = handle.summary()
    assert row["resident_blocks"] == list(range(len(images))) and row["predicted_ratio"] == 1.0
    assert torch.equal(model(**x)[0], ref)
    (row,) = handle.summary()
    assert row["predicted_ratio"] == 1.0
    handle.remove()


@torch.no_grad()
def test_host_bytes_halve_and_the_summary_says_what_is_stored():
    model = tiny.wide_ffn_wan_transformer(num_layers=3).to(torch.bfloat16)
    handle = apply_offload(copy.deepcopy(model), {"mode": "layer", "components": ["dit"]}, device="cpu")
    (plain,) = handle.summary()
    handle.remove()
    handle = apply_offload(model, stored(), device="cpu")
    (row,) = handle.summary()
    assert plain["storage_dtype"] is None and row["storage_dtype"] == "float8_e4m3fn"
    # Norms and biases stay in bf16: a little more than half.
    assert 0.5 < row["host_bytes"] / plain["host_bytes"] < 0.56, (row["host_bytes"], plain["host_bytes"])
    assert 0.5 < row["block_bytes"] / plain["block_bytes"] < 0.56
    # Slots hold the compute dtype; one staging buffer holds the largest stored block.
    staging = handle.rings[0].transfer.staging_bytes
    assert 0.5 < staging / (plain["device_slot_bytes"] / 2) < 0.56
    assert abs(row["device_slot_bytes"] - staging - plain["device_slot_bytes"]) < 0.01 * plain["device_slot_bytes"]
    handle.remove()


def test_the_layout_puts_8_bit_tensors_first_so_the_upcast_is_two_copies():
    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=1)
    block = model.transformer_blocks[0]
    cast = cast_tensors(model, torch.float8_e4m3fn)
    layout = layout_block(0, "transformer_blocks.0", block, cast=cast)
    image = layout.image
    assert [r.stored for r in image.runs] == [torch.float8_e4m3fn, torch.uint8]
    assert image.nbytes < layout.nbytes
    # diffusers' rule: Linear layers outside norms (Flux's AdaLayerNorm keeps its Linear in 32 bits).
    names = [e.name for e, d in zip(layout.entries, image.dtypes) if d == torch.float8_e4m3fn]
    assert "transformer_blocks.0.attn.to_q.weight" in names and "transformer_blocks.0.attn.to_q.bias" in names
    assert not any(".norm" in n for n in names)
    host = torch.zeros(image.nbytes, dtype=torch.uint8)
    for entry, view in zip(layout.entries, layout.image_views(host), strict=True):
        view.copy_(entry.tensor.detach())
    slot = torch.zeros(layout.nbytes, dtype=torch.uint8)
    upcast(image, host, slot)
    for entry, d in zip(layout.entries, image.dtypes):
        want = entry.tensor.detach().to(d).to(entry.dtype)
        assert torch.equal(entry.view_in(slot), want), entry.name
    again = torch.zeros_like(host)
    downcast(image, slot, again)
    assert torch.equal(again, host)  # storing an upcast block again gives back its bytes


def test_bad_storage_dtypes_are_refused_naming_the_key():
    with pytest.raises(OffloadConfigError, match=r"layer_options.dit key 'storage_dtype' has value 'int8'"):
        OffloadConfig.parse(stored("int8"))
    with pytest.raises(OffloadConfigError, match="storage_dtype"):
        OffloadConfig.parse(stored(8))
    assert OffloadConfig.parse(stored()).to_dict()["layer_options"]["dit"]["storage_dtype"] == "float8_e4m3fn"


def test_omni_and_the_cli_store_in_8_bits(capsys):
    from omni_dist_offload import Omni
    from omni_dist_offload.app.cli import main

    with Omni("tiny-flux", None, progress=False) as resident:
        resident.pipeline.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
                                                               compute_dtype=torch.float32)
        want = resident.generate("a red fox", seed=3).frames
    with Omni("tiny-flux", storage_dtype="float8_e4m3fn", progress=False) as omni:
        assert omni.config.options_for("dit").storage_dtype == "float8_e4m3fn"
        assert (omni.generate("a red fox", seed=3).frames == want).all()
    with Omni("tiny-flux", storage_dtype="float8_e4m3fn", upcast="layer", progress=False) as omni:
        assert [r["upcast"] for r in omni.handle.summary()] == ["layer"]
        assert (omni.generate("a red fox", seed=3).frames == want).all()
    assert main(["inspect", "--model", "tiny-flux", "--storage-dtype", "float8_e5m2"]) == 0
    out = capsys.readouterr().out
    assert "stored" in out and "e5m2" in out and "e5m2/layer" not in out
    assert main(["inspect", "--model", "tiny-flux", "--storage-dtype", "float8_e5m2", "--upcast", "layer"]) == 0
    out = capsys.readouterr().out  # the DiT per layer; text encoders (transformers) per block
    assert "e5m2/layer" in out and " e5m2 " in out
    assert main(["inspect", "--model", "tiny-flux", "--storage-dtype", "float8_e5m2", "--no-offload"]) == 2
    assert "--storage-dtype stores what streams" in capsys.readouterr().err
    assert main(["inspect", "--model", "tiny-flux", "--upcast", "layer"]) == 2
    assert "--upcast: layer_options.dit key 'upcast' is 'layer' without a storage_dtype" in capsys.readouterr().err


def test_a_device_that_cannot_cast_is_named_and_nothing_changes(monkeypatch):
    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=1)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    real = torch.Tensor.to

    def refuse(self, *args, **kwargs):
        if torch.float8_e5m2 in args or kwargs.get("dtype") == torch.float8_e5m2:
            raise RuntimeError("no float8 here (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", refuse)
    with pytest.raises(OffloadConfigError, match=r"storage_dtype float8_e5m2: cpu cannot cast .*simulated"):
        apply_offload(model, stored("float8_e5m2"), device="cpu")
    monkeypatch.undo()
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


def test_a_ring_that_runs_every_block_from_a_slot_pays_for_its_slots_when_all_are_kept():
    from omni_dist_offload.residency import RingCosts, plan_residency, slots_bytes

    # Images of 10 bytes, blocks of 20 upcast: a slot's share is the block and one image.
    costs = RingCosts((10,) * 4, (30,) * 4, (1.0,) * 4, (2.0,) * 4, run_slot_bytes=20)
    plan = plan_residency(costs, 4 * 10 + 2 * 20)  # four images and the two slots they run from
    assert plan.resident == (0, 1, 2, 3) and plan.slots == 2 and plan.device_bytes == 80
    plan = plan_residency(costs, 79)
    assert len(plan.resident) < 4 and plan.device_bytes <= 79
    # Three slots: three of the block, and still two staging buffers of an image.
    assert slots_bytes(3, 30, run_slot_bytes=20) == 3 * 20 + 2 * 10 and slots_bytes(3, 30) == 90


@pytest.mark.parametrize("fraction", [1.0, 0.97, 0.9, 0.85])
def test_a_budget_plans_exactly_the_bytes_a_ring_of_images_allocates(fraction):
    """The plan's device bytes are what the ring allocates: its slots, the images it keeps and,
    when an image streams, two staging buffers of the largest (one on the CPU, which has no copy
    stream to overlap them). A budget of exactly what every block takes keeps every block."""
    model = tiny.tiny_flux_transformer(num_layers=2, num_single_layers=4)
    probe = apply_offload(model, stored(), device="cpu")
    blocks = probe.rings[0].layouts
    whole = sum(l.image_nbytes for l in blocks) + 2 * max(l.nbytes for l in blocks)
    probe.remove()
    cfg = stored()
    cfg["device_budget"] = int(whole * fraction)
    handle = apply_offload(model, cfg, device="cpu")
    ring = handle.rings[0]
    staging = ring.transfer.staging_nbytes() if len(ring.transfer.held) < len(ring.layouts) else 0
    allocated = (sum(s.numel() for s in ring.slots) + 2 * staging
                 + sum(t.numel() for t in ring.transfer.held.values()))
    assert ring.plan.device_bytes == allocated <= cfg["device_budget"]
    assert (len(ring.transfer.held) == len(ring.layouts)) == (fraction == 1.0)
    handle.remove()


class _Mixed(torch.nn.Module):
    """Blocks with and without 8-bit layers (a norm-only block stores nothing in 8 bits)."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 16)),
                                           torch.nn.Sequential(torch.nn.LayerNorm(16)),
                                           torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@torch.no_grad()
def test_a_block_with_nothing_in_8_bits_streams_as_it_is():
    from diffusers.hooks import apply_layerwise_casting

    torch.manual_seed(0)
    model = _Mixed()
    reference = copy.deepcopy(model)
    apply_layerwise_casting(reference, torch.float8_e4m3fn, torch.float32)
    x = torch.randn(4, 16)
    handle = apply_offload(model, stored(), device="cpu")
    assert [l.image is None for l in handle.rings[0].layouts] == [False, True, False]
    for _ in range(2):
        assert torch.equal(model(x), reference(x))
    handle.remove()


@torch.no_grad()
def test_a_text_encoder_stores_its_blocks_in_8_bits_and_keeps_the_rest():
    # diffusers' own layerwise casting cannot run UMT5 (its feed-forward reads wo.weight.dtype
    # outside wo's forward, finds float8 and casts its input to it); the ring can, since a block's
    # weights are upcast before it runs. The reference: the same weights rounded to 8 bits and
    # back, in the blocks only (a transformers model keeps the rest as it is).
    encoder = tiny.tiny_umt5_encoder(num_layers=3)
    reference = copy.deepcopy(encoder)
    cast = cast_tensors(reference, torch.float8_e4m3fn)
    in_blocks = {id(t) for b in reference.encoder.block for t in (*b.parameters(), *b.buffers())}
    for t in (*reference.parameters(), *reference.buffers()):
        if id(t) in cast and id(t) in in_blocks:
            t.data = t.data.to(torch.float8_e4m3fn).to(t.dtype)
    t = tiny.text_encoder_inputs(encoder)
    ref = reference(**t).last_hidden_state
    cfg = {"mode": "layer", "components": ["text_encoder"],
           "layer_options": {"text_encoder": {"storage_dtype": "float8_e4m3fn"}}}
    import types

    handle = apply_offload(types.SimpleNamespace(text_encoder=encoder), cfg, device="cpu")
    assert encoder.shared.weight.dtype == torch.float32 and encoder.dtype == torch.float32
    for _ in range(2):
        assert torch.equal(encoder(**t).last_hidden_state, ref)
    handle.remove()


# -- upcast: "layer" ([Note: upcast per layer]) ------------------------------------------------
@pytest.mark.parametrize("family", sorted(DITS))
@torch.no_grad()
def test_upcast_per_layer_equals_layerwise_casting_and_streams_8_bit_bytes(family):
    build, inputs = DITS[family]
    model = build(dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    batches = [inputs(model, seed=0), inputs(model, batch=2, seed=1)]
    refs = [reference(**b)[0] for b in batches]
    handle = apply_offload(copy.deepcopy(model), stored(), device="cpu")
    (block,) = handle.summary()
    handle.remove()
    handle = apply_offload(model, stored(upcast="layer"), device="cpu")
    assert model.dtype == torch.bfloat16
    for _ in range(2):
        for b, ref in zip(batches, refs):
            assert torch.equal(model(**b)[0], ref)
    # Between forwards the blocks' cast tensors are their 8-bit bytes, where the ring left them.
    assert any(t.dtype == torch.float8_e4m3fn for t in model.parameters())
    (row,) = handle.summary()
    assert (row["storage_dtype"], row["upcast"], block["upcast"]) == ("float8_e4m3fn", "layer", "block")
    # The same 8-bit bytes on the host and over the link; the slots hold them too, where
    # "block" slots hold the compute dtype and add a staging buffer.
    assert abs(row["host_bytes"] - block["host_bytes"]) < 0.02 * block["host_bytes"]
    assert row["block_bytes"] == block["block_bytes"]
    assert row["device_slot_bytes"] < 0.5 * block["device_slot_bytes"], (row, block)
    handle.remove()
    assert torch.equal(model(**batches[0])[0], refs[0])
    assert not any(t.dtype.itemsize == 1 for t in model.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@torch.no_grad()
def test_upcast_per_layer_holds_more_of_a_budget_on_the_device():
    model, x, ref, images = _fifteen_blocks()
    # "block": two compute-dtype slots (and the staging spread over them), then room for three
    # of the fifteen images.
    budget = 2 * (max(l.nbytes for l in images) + max(l.image_nbytes for l in images)) + 3 * min(l.image_nbytes for l in images)
    rows = {}
    for where in ("block", "layer"):
        m = copy.deepcopy(model)
        handle = apply_offload(m, {**stored(upcast=where), "device_budget": budget}, device="cpu")
        for _ in range(3):  # the first forward is measured, then the plan is made for good
            assert torch.equal(m(**x)[0], ref)
        ring = handle.rings[0]
        (rows[where],) = handle.summary()
        assert ring.plan is not None and ring.plan.measured
        if where == "layer":
            # What the plan keeps on the device fits the budget: whole blocks, kept parts and slots.
            on_device = sum(ring.resident_nbytes(i) for i in ring.resident) + ring.kept_tensor_bytes()
            assert on_device + sum(s.numel() for s in ring.slots) <= budget
        handle.remove()
        assert torch.equal(m(**x)[0], ref)
    # Spent on 8-bit slots and blocks, the same budget streams fewer bytes.
    assert rows["layer"]["block_bytes"] < rows["block"]["block_bytes"], rows


def test_upcast_is_checked_and_layer_needs_a_diffusers_model():
    with pytest.raises(OffloadConfigError, match=r"layer_options.dit key 'upcast' has value 'tensor'"):
        OffloadConfig.parse(stored(upcast="tensor"))
    with pytest.raises(OffloadConfigError, match=r"key 'upcast' is 'layer' without a storage_dtype"):
        OffloadConfig.parse({"mode": "layer", "layer_options": {"dit": {"upcast": "layer"}}})
    assert OffloadConfig.parse(stored(upcast="layer")).to_dict()["layer_options"]["dit"]["upcast"] == "layer"
    encoder = tiny.tiny_umt5_encoder(num_layers=2)
    before = {n: t.clone() for n, t in encoder.state_dict().items()}
    cfg = {"mode": "layer", "components": ["text_encoder"],
           "layer_options": {"text_encoder": {"storage_dtype": "float8_e4m3fn", "upcast": "layer"}}}
    with pytest.raises(OffloadConfigError, match=r"upcast 'layer' needs a diffusers model.*T5EncoderModel|UMT5EncoderModel"):
        apply_offload(encoder, cfg, device="cpu")
    assert all(torch.equal(before[n], t) and t.dtype == before[n].dtype for n, t in encoder.state_dict().items())


@torch.no_grad()
def test_a_failed_setup_with_upcast_per_layer_changes_nothing(monkeypatch):
    import omni_dist_offload.apply as apply_mod

    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2, dtype=torch.bfloat16)
    x = tiny.flux_transformer_inputs(model)
    want = model(**x)[0]
    before = {n: t.clone() for n, t in model.state_dict().items()}

    def broken(*args, **kwargs):
        raise RuntimeError("ring failed (simulated)")

    monkeypatch.setattr(apply_mod, "BlockRing", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        apply_offload(model, stored(upcast="layer"), device="cpu")
    monkeypatch.undo()
    assert all(torch.equal(before[n], t) and t.dtype == before[n].dtype for n, t in model.state_dict().items())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert torch.equal(model(**x)[0], want)


@torch.no_grad()
def test_compiled_blocks_with_upcast_per_layer_are_refused_at_the_first_forward():
    from omni_dist_offload.loading.compiling import compile_dits, uncompile

    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=1)
    x = tiny.flux_transformer_inputs(model)
    handle = apply_offload(model, stored(upcast="layer"), device="cpu")
    want = model(**x)[0]
    compile_dits(model, "regional")
    with pytest.raises(RuntimeError, match=r"was compiled, and its 8-bit weights are upcast per layer"):
        model(**x)
    uncompile(model)
    assert torch.equal(model(**x)[0], want)  # refused before anything changed
    handle.remove()


def test_a_lora_fused_into_8_bit_blocks_is_what_every_later_forward_runs():
    fused_8_bit_runs(torch.device("cpu"))


@torch.no_grad()
def fused_8_bit_runs(device: torch.device) -> None:
    """Fusing rounds the fused weights to 8 bits as storing them does; every forward after it,
    the first included (whose block may still sit in a slot from the edit), runs on what is
    stored, with either upcast, and both give the same outputs and weights. Also on CUDA
    (gpu/test_gpu_storage.py)."""
    peft = pytest.importorskip("peft")
    base = tiny.tiny_wan_transformer(num_layers=4, dtype=torch.bfloat16).to(device)
    x = {k: v.to(device) if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(base).items()}

    def add(model):
        torch.manual_seed(3)
        model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                          init_lora_weights=False))

    # The weights to expect: stored in 8 bits, fused in bf16, stored again.
    reference = copy.deepcopy(base)
    add(reference)
    cast = cast_tensors(reference, torch.float8_e4m3fn)
    in_blocks = {id(t) for t in reference.blocks.parameters()}

    def store() -> None:
        for t in reference.parameters():
            if id(t) in cast and id(t) in in_blocks:
                t.data = t.data.to(torch.float8_e4m3fn).to(t.dtype)

    store()
    reference.fuse_lora(lora_scale=0.7)
    store()
    want = {k: v for k, v in reference.state_dict().items() if k.startswith("blocks.")}
    runs = {}
    for where in ("block", "layer"):
        for resident in (None, [1]):
            model = copy.deepcopy(base)
            add(model)
            cfg = stored(upcast=where, resident_blocks=resident)
            handle = apply_offload(model, cfg, device=device)
            model.fuse_lora(lora_scale=0.7)
            first, second = model(**x)[0], model(**x)[0]
            handle.remove()
            assert torch.equal(first, second) and torch.equal(first, model(**x)[0]), (where, resident)
            got = model.state_dict()
            assert all(torch.equal(got[k], v) for k, v in want.items()), (where, resident)
            handle = apply_offload(model, cfg, device=device)
            assert torch.equal(model(**x)[0], first)
            handle.remove()
            runs[where, str(resident)] = first
    assert torch.equal(runs["block", "None"], runs["layer", "None"]) and torch.equal(runs["block", "[1]"], runs["layer", "[1]"])


@torch.no_grad()
def test_an_adapter_loaded_after_offloading_with_upcast_per_layer_is_named():
    peft = pytest.importorskip("peft")
    model = tiny.tiny_wan_transformer(num_layers=2, dtype=torch.bfloat16)
    x = tiny.wan_transformer_inputs(model)
    handle = apply_offload(model, stored(upcast="layer"), device="cpu")
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q"], init_lora_weights=False))
    for _ in range(2):  # said again until the adapter is gone
        with pytest.raises(RuntimeError, match=r"blocks\.0\..*lora_A.* came after offloading, in 8 bits.*Load "
                                               r"adapters before offloading"):
            model(**x)
    handle.remove()


@pytest.mark.parametrize("options", [{}, {"storage_dtype": "float8_e4m3fn"}])
@torch.no_grad()
def test_fused_projections_are_built_from_the_weights_on_the_device(options):
    """diffusers' ``fuse_qkv_projections`` after offloading concatenates q, k and v: it runs as an
    edit, on the weights a block computes with (8-bit blocks park placeholders on the host)."""
    model = tiny.tiny_flux_transformer(dtype=torch.bfloat16)
    batch = tiny.flux_transformer_inputs(model)
    cfg = stored(**options) if options else {"mode": "layer", "components": ["dit"]}
    if options:  # the weights 8-bit storage computes with: rounded once through 8 bits
        handle = apply_offload(model, cfg, device="cpu")
        handle.remove()
    reference = copy.deepcopy(model)
    reference.fuse_qkv_projections()
    want = reference(**batch)[0]
    handle = apply_offload(model, cfg, device="cpu")
    model(**batch)
    model.fuse_qkv_projections()
    for _ in range(2):
        assert torch.equal(model(**batch)[0], want)
    handle.remove()
    assert torch.equal(model(**batch)[0], want)


def test_save_pretrained_is_refused_where_blocks_park_placeholders(tmp_path):
    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2)
    handle = apply_offload(model, stored(), device="cpu")
    with pytest.raises(RuntimeError, match=r"save_pretrained would write placeholders .* Call handle\.remove\(\) first"):
        model.save_pretrained(tmp_path / "fp8")
    assert not (tmp_path / "fp8").exists()
    handle.remove()
    assert "save_pretrained" not in model.__dict__
    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"]}, device="cpu")
    model.save_pretrained(tmp_path / "plain")  # plain host copies hold the values
    handle.remove()
    saved = type(model).from_pretrained(tmp_path / "plain").state_dict()
    assert set(saved) == set(want) and all(torch.equal(saved[k], want[k]) for k in want)


@torch.no_grad()
def test_load_state_dict_is_refused_before_any_write_where_blocks_park_placeholders():
    """torch refused the first write into a streamed placeholder only after copying the 20 tensors
    before it in module order: a model neither old nor new, before and after remove()."""
    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2)
    other = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2, seed=1)
    batch = tiny.flux_transformer_inputs(model)
    handle = apply_offload(model, stored(), device="cpu")
    before = model(**batch)[0]
    with pytest.raises(RuntimeError, match=r"load_state_dict would write transformer_blocks\.0\.\S+ \(and \d+ more\), "
                                           r"which streams .* Nothing was changed"):
        model.load_state_dict(other.state_dict())
    assert torch.equal(model(**batch)[0], before)
    outside = {k: v for k, v in other.state_dict().items() if "_blocks." not in k}
    model.load_state_dict(outside, strict=False)  # what no ring streams loads as usual
    assert not torch.equal(model(**batch)[0], before)
    handle.remove()
    assert "load_state_dict" not in model.__dict__


def test_omni_refuses_loras_with_upcast_per_layer_before_loading(tmp_path):
    from safetensors.torch import save_file

    from omni_dist_offload import Omni
    from omni_dist_offload.loading.adapters import AdapterError

    lora = tmp_path / "style.safetensors"
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 8)}, lora)
    with pytest.raises(AdapterError, match='upcast "layer"'):
        Omni("no-such-model", {"mode": "layer", "components": ["dit"]}, storage_dtype="float8_e4m3fn",
             upcast="layer", lora=[str(lora)], progress=False)


@torch.no_grad()
def test_a_text_encoders_adapters_loaded_before_offloading_stay_unrounded():
    """peft's adapter layers are never stored in 8 bits, in a transformers model too: a text
    encoder's LoRA loaded before ``apply_offload`` runs and comes back in full precision."""
    peft = pytest.importorskip("peft")
    encoder = tiny.tiny_clip_text_model(num_layers=2)
    torch.manual_seed(5)
    encoder = peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False), encoder)
    adapters = {n: p.detach().clone() for n, p in encoder.named_parameters() if "lora_" in n}
    cast = cast_tensors(encoder, torch.float8_e4m3fn)
    assert adapters and not any(id(p) in cast for n, p in encoder.named_parameters() if n in adapters)
    # The reference: the blocks' other stored weights rounded through 8 bits.
    reference = copy.deepcopy(encoder)
    rounded = cast_tensors(reference, torch.float8_e4m3fn)
    for n, p in reference.named_parameters():
        if n.startswith("encoder.layers.") and id(p) in rounded:
            p.data = p.data.to(torch.float8_e4m3fn).to(p.dtype)
    t = tiny.text_encoder_inputs(encoder)
    want = reference(**t).last_hidden_state
    import types

    cfg = {"mode": "layer", "components": ["text_encoder"],
           "layer_options": {"text_encoder": {"storage_dtype": "float8_e4m3fn"}}}
    handle = apply_offload(types.SimpleNamespace(text_encoder=encoder), cfg, device="cpu")
    assert torch.equal(encoder(**t).last_hidden_state, want)
    handle.remove()
    assert all(torch.equal(p, adapters[n]) for n, p in encoder.named_parameters() if n in adapters)


@pytest.mark.parametrize("upcast_at", ["block", "layer"])
@torch.no_grad()
def test_an_adapter_loaded_after_offloading_on_an_8_bit_layer_outside_the_blocks_is_named(upcast_at):
    """Flux's ``x_embedder`` is stored in 8 bits by diffusers' own hook: an adapter peft adds
    there takes its 8-bit dtype and cannot compute (diffusers' ``enable_layerwise_casting`` fails
    alike). Every forward refuses before anything runs, naming it, until it is gone."""
    peft = pytest.importorskip("peft")
    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=1)
    x = tiny.flux_transformer_inputs(model)
    handle = apply_offload(model, stored(upcast=upcast_at), device="cpu")
    want = model(**x)[0]
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=["x_embedder"], init_lora_weights=False),
                      adapter_name="late")
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"x_embedder\.lora_A\.late\.weight .*came after offloading, in 8 bits.*"
                                               r"Load the adapter before apply_offload"):
            model(**x)
    model.delete_adapters("late")
    assert torch.equal(model(**x)[0], want)
    handle.remove()


def test_a_model_already_layerwise_cast_is_refused_before_setup(monkeypatch):
    import omni_dist_offload.apply as apply_mod

    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=1, dtype=torch.bfloat16)
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    x = tiny.flux_transformer_inputs(model)
    with torch.no_grad():
        want = model(**x)[0]
    with monkeypatch.context() as m:  # phase 1: no handle, no host copy
        m.setattr(apply_mod, "OffloadHandle", lambda *a, **k: pytest.fail("setup started"))
        for upcast_at in ("block", "layer"):
            with pytest.raises(OffloadConfigError, match=r"transformer \(FluxTransformer2DModel\): already "
                                                         r"layerwise-cast \(time_text_embed\..* and \d+ more layers .*"
                                                         r"enable_layerwise_casting.*Drop storage_dtype"):
                apply_offload(model, stored(upcast=upcast_at), device="cpu")
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"]}, device="cpu")  # what it says to do
    with torch.no_grad():
        assert torch.equal(model(**x)[0], want)
    handle.remove()


@torch.no_grad()
def test_a_failure_while_storing_the_layers_outside_the_blocks_takes_their_hooks_off(monkeypatch):
    import omni_dist_offload.storage as storage_mod

    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=1, dtype=torch.bfloat16)
    x = tiny.flux_transformer_inputs(model)
    want = model(**x)[0]
    before = {n: t.clone() for n, t in model.state_dict().items()}
    real, calls = storage_mod.apply_layerwise_casting_hook, []

    def flaky(module, *args, **kwargs):
        calls.append(module)
        if len(calls) == 3:
            raise RuntimeError("hook failed (simulated)")
        real(module, *args, **kwargs)

    monkeypatch.setattr(storage_mod, "apply_layerwise_casting_hook", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        apply_offload(model, stored(), device="cpu")
    monkeypatch.undo()
    assert len(calls) == 3
    hooked = [n for n, m in model.named_modules()
              if "_diffusers_hook" in m.__dict__ and m._diffusers_hook.get_hook("layerwise_casting") is not None]
    assert not hooked
    assert all(torch.equal(before[n], t) and t.dtype == before[n].dtype for n, t in model.state_dict().items())
    assert torch.equal(model(**x)[0], want)


@pytest.mark.parametrize("upcast_at", ["block", "layer"])
def test_pickling_an_8bit_model_names_the_fix_before_any_hook(upcast_at, tmp_path):
    """diffusers' layerwise-casting hooks (local functions) sit on layers that pickle reaches
    before any block: the refusal is met on the model itself, for pickle, torch.save and deepcopy;
    after remove() the model pickles as usual."""
    import pickle

    model = tiny.tiny_flux_transformer()
    handle = apply_offload(model, stored(upcast=upcast_at), device="cpu")
    # copy.copy too: pickling's __reduce_ex__ is what it calls (a shallow copy would share the ring).
    for attempt in (pickle.dumps, copy.deepcopy, copy.copy, lambda m: torch.save(m, tmp_path / "m.pt")):
        with pytest.raises(TypeError, match=r"transformer: an offloaded model cannot be copied \(copy.copy or "
                                            r"copy.deepcopy\) or pickled"):
            attempt(model)
    handle.remove()
    assert "__reduce_ex__" not in vars(model) and "__deepcopy__" not in vars(model)
    x = tiny.flux_transformer_inputs(model)
    with torch.no_grad():
        assert torch.equal(pickle.loads(pickle.dumps(model))(**x)[0], model(**x)[0])


@torch.no_grad()
def test_save_pretrained_under_upcast_layer_writes_what_layerwise_casting_writes(tmp_path):
    """Under upcast "layer" the blocks' tensors are their 8-bit bytes: the file is the one
    diffusers' enable_layerwise_casting model writes, bitwise, before and after a forward."""
    from safetensors.torch import load_file

    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2, dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    reference.save_pretrained(tmp_path / "ref")
    want = load_file(tmp_path / "ref" / "diffusion_pytorch_model.safetensors")
    assert any(t.dtype == torch.float8_e4m3fn for t in want.values())
    handle = apply_offload(model, stored(upcast="layer"), device="cpu")
    for forward_first in (False, True):
        if forward_first:
            model(**tiny.flux_transformer_inputs(model))
        model.save_pretrained(tmp_path / "layer")
        got = load_file(tmp_path / "layer" / "diffusion_pytorch_model.safetensors")
        assert set(got) == set(want)
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
    handle.remove()


@pytest.mark.parametrize("upcast_at", ["block", "layer"])
def test_exporting_an_adapter_that_streams_in_8_bit_blocks_is_refused(upcast_at, tmp_path):
    """Under 8-bit ``"block"`` storage an adapter loaded before ``apply_offload`` holds placeholders
    between forwards: peft's export (and diffusers' save_lora_adapter, which calls it) would read
    NaN. Refused, naming the routes that work; under ``"layer"`` its tensors hold their values, and
    after remove() the adapter (never stored in 8 bits) is given back as it was loaded."""
    peft = pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict

    model = tiny.tiny_wan_transformer(num_layers=2, dtype=torch.bfloat16)
    torch.manual_seed(3)
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q"], init_lora_weights=False))
    want = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    handle = apply_offload(model, stored(upcast=upcast_at), device="cpu")
    if upcast_at == "block":
        with pytest.raises(RuntimeError, match=r"get_peft_model_state_dict would read adapter 'default' from "
                                               r"placeholders .*Export the adapter from the file.*remove\(\) first"):
            get_peft_model_state_dict(model)
        with pytest.raises(RuntimeError, match=r"save_lora_adapter would read adapter 'default' from placeholders"):
            model.save_lora_adapter(tmp_path / "lora")
        assert not (tmp_path / "lora").exists()
        handle.remove()
        assert "save_lora_adapter" not in model.__dict__
    got = get_peft_model_state_dict(model)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    model.save_lora_adapter(tmp_path / "lora")
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").exists()
    if upcast_at == "layer":
        handle.remove()


def test_enable_layerwise_casting_after_offloading_is_refused_changing_nothing():
    model = tiny.tiny_wan_transformer(num_layers=2)
    x = tiny.wan_transformer_inputs(model)
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"]}, device="cpu")
    with torch.no_grad():
        want = model(**x)[0]
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"enable_layerwise_casting\(\) after apply_offload is refused, and nothing "
                                           r"was changed.*storage_dtype.*handle\.remove\(\) first"):
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert {k: v.dtype for k, v in model.state_dict().items()} == dtypes
    with torch.no_grad():
        assert torch.equal(model(**x)[0], want)
    handle.remove()
    assert "enable_layerwise_casting" not in model.__dict__
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)  # what it says


@pytest.mark.parametrize("resident", [[0, 1], []])
@torch.no_grad()
def test_a_ctrl_c_inside_an_upcast_layer_leaves_no_layer_on_the_upcast_buffer(resident):
    """torch skips even always_call hooks on a KeyboardInterrupt: an upcast layer of a block kept
    on the device stayed pointed at the buffer every layer's upcast is written to, so each later
    forward read another layer's weights there (no error), and remove() kept them."""
    build, inputs = DITS["wan"]
    model = build(dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    x = inputs(model, seed=0)
    want = reference(**x)[0]
    handle = apply_offload(model, stored(upcast="layer", resident_blocks=resident), device="cpu")
    layer = model.blocks[0].ffn.net[0].proj

    def interrupt(mod, args):  # after the upcast pre-hook: the layer points at the buffer
        raise KeyboardInterrupt

    hook = layer.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(**x)
    hook.remove()
    assert torch.equal(model(**x)[0], want)
    assert layer.weight.dtype == torch.float8_e4m3fn
    # Cut short in a later block, then in block 0 (the later block never runs again): its
    # layer's saved views are of a slot other blocks have filled since.
    later = model.blocks[2].ffn.net[0].proj
    for where in (later, layer):
        hook = where.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(**x)
        hook.remove()
    assert torch.equal(model(**x)[0], want)
    for where in (later, layer):
        hook = where.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(**x)
        hook.remove()
    handle.remove()  # the interrupted layers' 8-bit bytes, upcast for good
    assert torch.equal(model(**x)[0], want)


@pytest.mark.parametrize("upcast", ["block", "layer"])
def test_remove_leaves_every_module_as_it_was_and_frees_it_without_a_collection(upcast):
    """Flux's layers outside the blocks are stored in 8 bits by diffusers' casting hook, whose
    removal left an empty hook registry and the bound forward on each: cycles through the module
    that kept its weights until a garbage collection."""
    import gc
    import weakref

    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2)
    before = {name: sorted(vars(m)) for name, m in model.named_modules()}
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"],
                                   "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn", "upcast": upcast}}})
    handle.remove()
    assert {name: sorted(vars(m)) for name, m in model.named_modules()} == before
    weight = weakref.ref(model.context_embedder.weight)
    del handle
    gc.disable()
    try:
        del model
        assert weight() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("upcast_where", ["block", "layer"])
@torch.no_grad()
def test_a_cast_to_the_dtype_the_model_computes_in_changes_nothing(upcast_where):
    """A float32 model stored in 8 bits reports float32; pipe.to(torch.float32), .float() and
    .to(torch.float32) were refused ("float8_e4m3fn tensors to torch.float32"), where the same
    calls go through without storage_dtype and under diffusers' own layerwise casting. They now
    change nothing: the 8-bit tensors stay 8-bit, the outputs bitwise as before. A cast to
    another dtype is still refused."""
    pipe = tiny.tiny_flux_pipeline()
    run = lambda: pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), output_type="pt",
                       **tiny.TINY_FLUX_DEFAULTS).images
    handle = apply_offload(pipe, stored(upcast=upcast_where), device="cpu")
    eight = lambda: sorted(n for n, t in pipe.transformer.named_parameters() if t.dtype.itemsize == 1)
    held = eight()
    assert held and pipe.transformer.dtype == torch.float32
    want = run()
    pipe.to(torch.float32)
    pipe.transformer.to(torch.float32)
    pipe.transformer.float()
    pipe.transformer.to("cpu", torch.float32)
    assert eight() == held
    assert torch.equal(run(), want)
    with pytest.raises(RuntimeError, match=r"casting FluxTransformer2DModel \(torch.float32 tensors to torch.bfloat16\)"):
        pipe.to(torch.bfloat16)
    assert eight() == held and torch.equal(run(), want)
    handle.remove()
