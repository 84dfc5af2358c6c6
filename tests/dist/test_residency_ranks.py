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
