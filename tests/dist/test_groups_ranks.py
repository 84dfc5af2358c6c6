"""Process groups that ``apply_offload`` creates belong to its handle: the side group for
exchanging facts is gone once setup is agreed, the weight group once the handle is removed, and a
job that tears down its process group and starts another gets fresh groups."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from omni_dist_offload import apply_offload
from ranks import run_ranks
from toys import ToyDiT

AG = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather"}},
      "collective_timeout_s": 20}


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _apply_remove(counts: dict, key: str) -> bool:
    model = ToyDiT(3)
    x = torch.randn(2, 8)
    ref = model(x)
    handle = apply_offload(model, AG)
    counts[f"{key}_during"] = _groups()
    counts[f"{key}_transfer"] = handle.summary_rows()[0].weight_transfer
    equal = torch.equal(model(x), ref)
    handle.remove()
    counts[f"{key}_after"] = _groups()
    return equal


def _owned_groups(rank) -> dict:
    counts = {"before": _groups()}
    counts["equal"] = _apply_remove(counts, "first")
    # The job ends its process group and starts another: nothing of the first may be reused.
    # (A second rendezvous on the launcher's store, under keys of its own.)
    dist.destroy_process_group()
    launcher = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("restarted", launcher), rank=rank.rank,
                            world_size=rank.world)
    counts["restarted"] = _groups()
    counts["equal_again"] = _apply_remove(counts, "second")
    return counts


def test_groups_are_released_with_the_handle_and_never_outlive_the_job():
    for r in run_ranks(_owned_groups, 2):
        assert r["first_transfer"] == r["second_transfer"] == "allgather"
        assert r["equal"] and r["equal_again"]
        # During: the weight group and a gloo group of its ranks that remove() agrees over; both go with it.
        assert r["first_during"] == r["before"] + 2 and r["first_after"] == r["before"]
        assert r["restarted"] == r["before"]
        assert r["second_during"] == r["restarted"] + 2 and r["second_after"] == r["restarted"]


def _fallback_groups(rank) -> dict:
    before = _groups()
    handle = apply_offload(ToyDiT(3), AG)
    during = _groups()
    row = handle.summary_rows()[0]
    handle.remove()
    return {"before": before, "during": during, "after": _groups(), "transfer": row.weight_transfer,
            "reason": row.fallback_reason}


def test_a_fallback_keeps_no_group():
    for r in run_ranks(_fallback_groups, 2, env={"OMNI_OFFLOAD_ALLOW_GLOO": None}):
        assert r["transfer"] == "rank-local" and "OMNI_OFFLOAD_ALLOW_GLOO=1" in r["reason"]
        assert r["before"] == r["during"] == r["after"]
