"""load_offloaded on several ranks (gloo), one of which cannot load (a shard missing on its host):
the ranks agree that every one loaded before the offload's collectives, as Omni does, so the
others name that rank and its error at once instead of waiting collective_timeout_s for it."""

from __future__ import annotations

import shutil
import time

import torch
import torch.distributed as dist

from ranks import Rank, run_ranks

#: Far longer than an agreement takes, far shorter than the test's own timeout: a rank that waits
#: for the failed one in the offload's setup instead ends here.
TIMEOUT_S = 15


def _config(transfer: str) -> dict:
    return {"mode": "layer", "components": ["dit"], "collective_timeout_s": TIMEOUT_S,
            "layer_options": {"dit": {"weight_transfer": transfer, "chunk_mib": 0.02}}}


def one_rank_fails(rank: Rank, good: str, bad: str) -> list:
    """Rank 1, then rank 0, is given a folder missing a shard (allgather, then shared); then both
    load the good folder, which still works (the agreements pair up across calls)."""
    from omni_dist_offload.loading.coldstart import load_offloaded

    found = []
    for failing, transfer in ((1, "allgather"), (0, "shared")):
        start = time.monotonic()
        try:
            load_offloaded(bad if rank.rank == failing else good, _config(transfer), device="cpu",
                           dtype=torch.float32)
            found.append(None)
        except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
            found.append([type(exc).__name__, str(exc), time.monotonic() - start])
        dist.barrier()  # the next round starts together, however long a rank waited in this one
    pipe, handle = load_offloaded(good, _config("allgather"), device="cpu", dtype=torch.float32)
    found.append(handle.summary()[0]["weight_transfer"])
    handle.remove()
    return found


def test_a_rank_that_cannot_load_is_named_by_the_others_at_once(wan_folder, tmp_path):
    bad = tmp_path / "missing-shard"
    shutil.copytree(wan_folder, bad)
    shard = sorted((bad / "transformer").glob("*.safetensors"))[1]
    shard.unlink()
    r0, r1 = run_ranks(one_rank_fails, 2, args=(str(wan_folder), str(bad)), timeout=120)
    for me, other, (mine, theirs) in ((1, 0, (r1[0], r0[0])), (0, 1, (r0[1], r1[1]))):
        # The rank that failed raises its own error, naming the shard.
        assert mine[0] == "CheckpointError" and str(shard) in mine[1], mine
        # The other names it and its error, long before collective_timeout_s.
        assert theirs[0] == "PeerFailed", theirs
        assert theirs[1].startswith(f"rank {me} could not load the model (CheckpointError: {bad}/transformer/"), theirs
        assert str(shard) in theirs[1] and "every rank stops" in theirs[1], theirs
        assert theirs[2] < TIMEOUT_S / 2, theirs
    assert r0[2] == r1[2] == "allgather"
