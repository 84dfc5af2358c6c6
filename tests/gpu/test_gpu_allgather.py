"""allgather on two GPUs and on all of a larger host (copy-engine and NCCL gathers): bitwise
parity, shards, uneven blocks, with the parity worker of the gloo test (one GPU per rank)."""

import pytest
import torch

from dist.test_allgather_ranks import check_partly_kept, parity, partly_kept
from dist.test_compile_ranks import compiled
from dist.test_storage_ranks import check_per_layer_allgather, check_stored_allgather, per_layer_allgather, stored_allgather
from ranks import run_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("gather", ["copy-engine", "nccl"])
@pytest.mark.parametrize("ranks", [2, "all"])
def test_parity_on_gpus(gather, ranks):
    world = torch.cuda.device_count() if ranks == "all" else ranks
    if ranks == "all" and world <= 2:
        pytest.skip("the two-GPU case covers this host")
    results = run_ranks(parity, world, args=(gather,), device="cuda")
    for r in results:
        assert r["parity"]["equal"] and r["parity"]["equal_after_remove"], r
        assert r["flux_equal"] and r["uneven_equal"], r
        for row in r["parity"]["summary"]:
            assert row["weight_transfer"] == "allgather" and row["gather"] == gather, row
            assert row["host_bytes"] <= row["block_bytes"] / world + row["num_blocks"] * 4096


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("gather", ["copy-engine", "nccl"])
def test_regional_compile_on_an_allgather_ring_under_a_budget_on_gpus(gather):
    """Compiled after offloading, streamed by allgather under a budget: bitwise equal to the
    compiled resident model on both ranks, with the same graphs."""
    ref = run_ranks(compiled, 2, args=(False,), device="cuda", timeout=300)
    got = run_ranks(compiled, 2, args=(True, gather), device="cuda", timeout=300)
    for r, g in zip(ref, got):
        assert g["row"]["weight_transfer"] == "allgather" and g["row"]["gather"] == gather, g["row"]
        assert g["row"]["num_blocks"] >= 2
        assert g["outs"] == r["outs"]
        assert g["graphs"] == r["graphs"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("gather", ["copy-engine", "nccl"])
def test_partly_kept_blocks_on_gpus(gather):
    """Blocks that keep their first tensors on the device, the rest gathered from shards cut
    again from it: the gloo test's checks, on two GPUs."""
    check_partly_kept(run_ranks(partly_kept, 2, args=(gather,), device="cuda"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("gather", ["copy-engine", "nccl"])
def test_8_bit_images_under_allgather_on_gpus(gather):
    """8-bit images gathered on two GPUs, one of them held on the device (gathered once through a
    slot of the gather's own: the copy-engine gather's are mapped into both ranks): equal to
    diffusers' layerwise casting, as on gloo."""
    check_stored_allgather(run_ranks(stored_allgather, 2, args=(gather,), device="cuda"), gather)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("gather", ["copy-engine", "nccl"])
def test_8_bit_blocks_upcast_per_layer_under_allgather_on_gpus(gather):
    """``upcast: "layer"`` on two GPUs: the gathered blocks stay 8-bit, each layer upcasts as it
    runs; equal to diffusers' layerwise casting, as on gloo."""
    check_per_layer_allgather(run_ranks(per_layer_allgather, 2, args=(gather,), device="cuda"), gather)
