"""allgather on two GPUs (copy-engine and NCCL gathers): bitwise parity, shards, uneven blocks (as on gloo)."""

import pytest
import torch

from test_allgather import launch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("gather", ["copy-engine", "nccl"])
def test_parity_on_two_gpus(tmp_path, monkeypatch, gather):
    monkeypatch.setenv("OMNI_TEST_DEVICE", "cuda")
    monkeypatch.setenv("OMNI_TEST_GATHER", gather)
    results = launch(tmp_path, "parity", 2, 2)
    for r in results:
        assert r["parity"]["equal"] and r["parity"]["equal_after_remove"], r
        assert r["flux_equal"] and r["uneven_equal"], r
        for row in r["parity"]["summary"]:
            assert row["weight_transfer"] == "allgather" and row["gather"] == gather, row
            assert row["host_bytes"] <= row["block_bytes"] / 2 + row["num_blocks"] * 4096
