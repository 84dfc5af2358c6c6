"""Per-block tracing on the CPU path: structure, order, and that it changes nothing."""

import pytest
import torch

from omni_dist_offload import apply_offload
from toys import ToyDiT

DIT = {"mode": "layer", "components": ["dit"]}


@torch.no_grad()
def test_trace_report_covers_the_last_forward():
    model = ToyDiT(4, dim=32)
    x = torch.randn(8, 32)
    ref = model(x)
    handle = apply_offload(model, DIT, trace=True)
    for _ in range(3):
        assert torch.equal(model(x), ref)
    (report,) = handle.trace_report()
    assert report["component"] == "transformer"
    blocks = report["blocks"]
    assert [b["index"] for b in blocks] == [0, 1, 2, 3]
    starts = [b["compute_start_ms"] for b in blocks]
    assert starts == sorted(starts) and starts[0] >= 0
    for b in blocks:
        assert b["compute_ms"] > 0 and b["wait_ms"] >= 0 and b["bytes"] > 0
        # Every block was filled for this run: block 0 in the previous forward (negative start).
        assert b["transfer_ms"] is not None and b["gbps"] is not None
    assert blocks[0]["transfer_start_ms"] < 0 < blocks[1]["transfer_start_ms"]
    assert report["forward_ms"] >= blocks[-1]["compute_start_ms"] + blocks[-1]["compute_ms"] - 1e-6
    assert 0 <= report["exposed_share"] <= 1
    handle.remove()


@torch.no_grad()
def test_two_blocks_stay_in_their_slots_and_report_no_transfer():
    model = ToyDiT(2)
    handle = apply_offload(model, DIT, trace=True)
    x = torch.randn(2, 8)
    for _ in range(3):
        model(x)
    assert [b["transfer_ms"] for b in handle.trace_report()[0]["blocks"]] == [None, None]
    handle.remove()


def test_tracing_is_off_by_default(monkeypatch):
    monkeypatch.delenv("OMNI_OFFLOAD_TRACE", raising=False)
    model = ToyDiT(2)
    handle = apply_offload(model, DIT)
    assert handle.rings[0].tracer is None
    with pytest.raises(RuntimeError, match="OMNI_OFFLOAD_TRACE=1"):
        handle.trace_report()
    handle.remove()
    monkeypatch.setenv("OMNI_OFFLOAD_TRACE", "1")
    handle = apply_offload(model, DIT)
    assert handle.rings[0].tracer is not None
    handle.remove()
