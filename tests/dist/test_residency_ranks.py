"""Resident blocks under allgather: every rank keeps the same blocks on the device and shards
only the streamed ones; outputs stay bitwise equal."""

from __future__ import annotations

import torch

from omni_dist_offload import apply_offload
from ranks import run_ranks
from toys import ToyDiT


def _resident_allgather(rank) -> dict:
    model = ToyDiT(6)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    ref = model(x)
    cfg = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 20,
           "layer_options": {"dit": {"weight_transfer": "allgather", "resident_blocks": 2}}}
    handle = apply_offload(model, cfg)
    (row,) = handle.summary_rows()
    with torch.no_grad():
        equal = all(torch.equal(model(x), ref) for _ in range(3))
    handle.remove()
    with torch.no_grad():
        after = torch.equal(model(x), ref)
    cfg["layer_options"]["dit"]["resident_blocks"] = None
    full = apply_offload(ToyDiT(6), cfg)
    full_host = full.summary_rows()[0].host_bytes
    full.remove()
    return {"row": row.as_dict(), "equal": equal, "after": after, "full_host": full_host}


def test_allgather_shards_only_the_streamed_blocks():
    for r in run_ranks(_resident_allgather, 2):
        row = r["row"]
        assert r["equal"] and r["after"]
        assert row["weight_transfer"] == "allgather" and row["resident_blocks"] == [1, 4]
        assert row["num_blocks"] == 4
        # The shards of 4 blocks of 6 (the toy's blocks are all of one size).
        assert row["host_bytes"] * 6 == r["full_host"] * 4


def _budget_allgather(rank) -> dict:
    from omni_dist_offload.layout import layout_block
    model = ToyDiT(8, dim=16)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    ref = model(x)
    blk = layout_block(0, "b", model.blocks[0]).nbytes
    cfg = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 20, "device_budget": 5 * blk,
           "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    handle = apply_offload(model, cfg)
    first = handle.summary()[0]
    with torch.no_grad():
        equal = all(torch.equal(model(x), ref) for _ in range(4))
    row = handle.summary()[0]
    handle.remove()
    with torch.no_grad():
        after = torch.equal(model(x), ref)
    return {"first": first, "row": row, "equal": equal, "after": after, "plan": handle_plan(row)}


def handle_plan(row: dict) -> tuple:
    return tuple(row["resident_blocks"]), tuple(row["kept_blocks"]), row["device_slot_bytes"], row["predicted_ratio"]


def test_every_rank_of_a_weight_group_takes_the_same_measured_plan():
    results = run_ranks(_budget_allgather, 2)
    for r in results:
        assert r["equal"] and r["after"]
        assert r["row"]["weight_transfer"] == "allgather" and r["row"]["predicted_ratio"] is not None
        # Settled: shards of the streamed blocks only.
        assert r["row"]["host_bytes"] < r["first"]["host_bytes"]
    # Planned from the slowest rank's figures: the same plan everywhere.
    assert results[0]["plan"] == results[1]["plan"]
