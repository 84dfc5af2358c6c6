"""Per-block tracing on the CPU path: structure, order, and that it changes nothing."""

import warnings

import pytest
import torch

from omni_dist_offload import OffloadConfigError, apply_offload
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


@pytest.mark.parametrize("order", [[0, 0, 1, 1, 2, 2, 3, 3], [3, 2, 1, 0], [0, 2, 1, 3, 1]])
@torch.no_grad()
def test_a_forward_that_repeats_or_reorders_blocks_is_one_report(order):
    """The report frames the component's forward: every block that ran is in it once (a block
    run twice by its first run), in the order they first ran; pre and post are measured."""
    model = ToyDiT(4, dim=32)
    x = torch.randn(8, 32)
    ref = model(x, order=order)
    handle = apply_offload(model, DIT, trace=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # blocks out of order: fetched on demand
        for _ in range(2):
            assert torch.equal(model(x, order=order), ref)
    (report,) = handle.trace_report()
    assert [b["index"] for b in report["blocks"]] == list(dict.fromkeys(order))
    assert report["pre_ms"] is not None and report["post_ms"] is not None
    assert all(b["compute_ms"] >= 0 for b in report["blocks"])
    handle.remove()


def test_trace_and_progress_take_booleans_only():
    model = ToyDiT(2)
    for kwargs in ({"trace": "false"}, {"trace": 1}, {"progress": "yes"}):
        with pytest.raises(OffloadConfigError, match=f"{next(iter(kwargs))} must be True or False"):
            apply_offload(model, DIT, **kwargs)
    assert not hasattr(model, "_omni_offload_handle")


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


@pytest.mark.parametrize("how", ["kept", "fp8"])
@torch.no_grad()
def test_the_bytes_a_trace_reports_are_what_a_fill_copies(how):
    """A partly kept block's fill copies only the streamed part, an 8-bit ring's the image: the
    report counted the whole block in the compute dtype, overstating the bandwidth (for Flux's
    648 MiB blocks streaming 90 MiB, about 7x)."""
    import tiny_models as tiny
    from omni_dist_offload.layout import layout_block

    model = tiny.tiny_wan_transformer(num_layers=6, seed=0)
    batch = tiny.wan_transformer_inputs(model)
    total = sum(layout_block(i, f"blocks.{i}", b).nbytes for i, b in enumerate(model.blocks))
    cfg = ({**DIT, "device_budget": int(0.6 * total)} if how == "kept" else
           {**DIT, "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}})
    handle = apply_offload(model, cfg, device="cpu", trace=True)
    for _ in range(4):
        model(**batch)
    ring = handle.rings[0]
    if how == "kept":
        assert ring.kept_blocks()
        moved = {i: ring.layouts[i].nbytes - ring.kept_bytes(i) for i in range(6)}
    else:
        moved = {i: ring.transfer.inner.device_nbytes(i) for i in range(6)}
    (report,) = handle.trace_report()
    assert {b["index"]: b["bytes"] for b in report["blocks"]} == {i: moved[i] for i in range(6)}
    assert all(b["bytes"] < ring.layouts[b["index"]].tensor_bytes for b in report["blocks"])
    handle.remove()
