"""8-bit host storage on CUDA: the image crosses the link in 8 bits, the upcast runs on the copy
stream (``upcast: "block"``) or per layer on the compute stream (``"layer"``), and the outputs
equal diffusers' layerwise casting bit for bit (bf16 compute)."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models as tiny
from omni_dist_offload import apply_offload

pytestmark = pytest.mark.gpu

DITS = {
    "wan": (tiny.tiny_wan_transformer, tiny.wan_transformer_inputs),
    "flux": (tiny.tiny_flux_transformer, tiny.flux_transformer_inputs),
}


@pytest.mark.parametrize("upcast", ["block", "layer"])
@pytest.mark.parametrize("resident", [None, [1]])
@pytest.mark.parametrize("family", sorted(DITS))
@torch.no_grad()
def test_cuda_outputs_equal_layerwise_casting(family, resident, upcast):
    build, inputs = DITS[family]
    model = build(dtype=torch.bfloat16).cuda()
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs(model, batch=2).items()}
    ref = reference(**batch)[0]
    options = {"storage_dtype": "float8_e4m3fn", "resident_blocks": resident, "upcast": upcast}
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}})
    ring = handle.rings[0]
    # "block": a staging buffer for the 8-bit image, upcast into the slot; "layer": none.
    assert (getattr(ring.transfer, "staging_bytes", 0) > 0) == (upcast == "block")
    for _ in range(3):
        assert torch.equal(model(**batch)[0], ref)
    (row,) = handle.summary()
    assert (row["storage_dtype"], row["upcast"]) == ("float8_e4m3fn", upcast)
    handle.remove()
    assert torch.equal(model(**batch)[0], ref)


@pytest.mark.parametrize("upcast", ["block", "layer"])
@torch.no_grad()
def test_the_8_bit_path_never_synchronises_nor_allocates_per_block(upcast):
    model = tiny.tiny_wan_transformer(dtype=torch.bfloat16).cuda()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(model, batch=2).items()}
    model(**batch)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    model(**batch)
    resident_allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    options = {"storage_dtype": "float8_e4m3fn", "resident_blocks": [1], "upcast": upcast}  # a held image too
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}})
    model(**batch)  # cold start
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(3):
            model(**batch)
        streamed_allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert streamed_allocs == 3 * resident_allocs
    handle.remove()


def test_a_lora_fused_into_8_bit_blocks_is_what_every_later_forward_runs_on_cuda():
    from unit.test_storage import fused_8_bit_runs

    fused_8_bit_runs(torch.device("cuda"))
