"""The allgather transfer with real processes on gloo (CPU), as torchrun would start them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from omni_dist_offload import apply_offload
from omni_dist_offload import OffloadConfigError
from omni_dist_offload.transfer.groups import (ComponentFacts, _check_same_layout, _gpu_facts, _peer_copy_reason,
                                           _RankFacts, _fallback_reason)
from omni_dist_offload.transfer.sharding import plan_shards, write_shard
from toys import ToyDiT

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, scenarios: str, world: int, local_world: int, allow_gloo: bool = True,
           timeout: float = 240) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                   LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(rank // local_world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   OMNI_OFFLOAD_ALLOW_GLOO="1" if allow_gloo else "0")
        procs.append(subprocess.Popen([sys.executable, WORKER, str(tmp_path), scenarios], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    results = []
    for rank, log in enumerate(logs):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing:\n{log[-3000:]}"
        results.append(json.loads(path.read_text()))
        assert "error" not in results[-1], f"rank {rank}: {results[-1]['error']}\n{log[-3000:]}"
    return results


@pytest.mark.parametrize("world", [2, 4, 8])
def test_parity_shards_and_uneven_blocks(tmp_path, world):
    results = launch(tmp_path, "parity", world, world)
    for r in results:
        assert r["parity"]["equal"] and r["parity"]["equal_after_remove"]
        assert r["flux_equal"] and r["uneven_equal"]
        for row in r["parity"]["summary"]:
            assert row["weight_transfer"] == "allgather" and row["fallback_reason"] is None
            # Each rank holds its share of the block bytes, plus alignment padding only.
            blocks = row["num_blocks"]
            assert row["block_bytes"] / world <= row["host_bytes"] <= row["block_bytes"] / world + blocks * 2 * 256 * 8
        un = r["uneven"]
        assert len(set(un["block_nbytes"])) > 1  # blocks of different sizes in one ring
        assert un["host_bytes"] == sum(un["shard_bytes"])
        for shard, nbytes in zip(un["shard_bytes"], un["block_nbytes"]):
            assert shard * world >= nbytes and shard % 256 == 0


def test_resident_set_drops_by_the_share(tmp_path):
    results = launch(tmp_path, "rss", 2, 2)
    for r in results:
        s = r["rss"]
        assert s["host_bytes"] <= s["block_bytes"] / 2 + 8 * 4 * 256
        assert s["before"] - s["after"] >= 0.3 * s["block_bytes"], s


def test_fallback_when_gloo_not_allowed_and_layout_mismatch(tmp_path):
    results = launch(tmp_path, "fallback_gloo_not_allowed,mismatch", 2, 2, allow_gloo=False)
    for r in results:
        (row,) = r["fallback_summary"]
        assert r["fallback_equal"]
        assert row["weight_transfer"] == "rank-local"
        assert "OMNI_OFFLOAD_ALLOW_GLOO=1" in row["fallback_reason"]
        assert row["host_bytes"] >= row["block_bytes"]
        # Mismatch is an error on every rank, naming the first block that differs.
        assert "rank 1" in r["mismatch"] and "blocks.3" in r["mismatch"], r["mismatch"]
        assert "blocks.0" in r["dtype_mismatch"], r["dtype_mismatch"]
        assert "weights of block blocks.0 differ" in r["value_mismatch"], r["value_mismatch"]


def test_two_hosts_keep_complete_shard_sets(tmp_path):
    results = launch(tmp_path, "host_groups", 4, 2)
    groups = [tuple(r["group_ranks"]) for r in results]
    assert groups == [(0, 1), (0, 1), (2, 3), (2, 3)]
    for r in results:
        assert r["equal"]
        (row,) = r["summary"]
        assert row["weight_transfer"] == "allgather"


def test_one_rank_per_host_falls_back(tmp_path):
    results = launch(tmp_path, "host_groups", 2, 1)
    for r in results:
        (row,) = r["summary"]
        assert r["equal"] and row["weight_transfer"] == "rank-local"
        assert "single rank" in row["fallback_reason"]


def test_a_diverging_rank_raises_within_the_timeout(tmp_path):
    results = launch(tmp_path, "diverge", 2, 2)
    msg = results[0]["diverge"]
    assert msg.startswith("RuntimeError") and "transformer: moving block blocks." in msg, msg
    assert float(msg.split(" after ")[1].split("s")[0]) < 15


def test_not_initialised_falls_back():
    model = ToyDiT(3)
    x = torch.randn(2, 8)
    ref = model(x)
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"],
                                   "layer_options": {"dit": {"weight_transfer": "allgather"}}})
    (row,) = handle.summary()
    assert row["weight_transfer"] == "rank-local" and "not initialised" in row["fallback_reason"]
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    handle.remove()


def _facts(rank, node="h", dtype="cuda", index=None, backend="nccl", allow=False):
    return _RankFacts(rank, node, dtype, rank if index is None else index, backend, allow)


@pytest.mark.parametrize("facts, needle", [
    ([_facts(0, backend="gloo"), _facts(1, backend="gloo")], "needs NCCL"),
    ([_facts(0), _facts(1, index=0)], "share cuda:0"),
    ([_facts(0), _facts(1, dtype="cpu")], "different device types"),
    ([_facts(0, node="a"), _facts(1, node="b")], "single rank"),
    ([_facts(0, dtype="cpu", backend="nccl"), _facts(1, dtype="cpu", backend="nccl")], "needs CUDA devices"),
])
def test_every_fallback_reason(facts, needle):
    reason = _fallback_reason(facts, None)
    if needle is None:
        assert reason is None
    else:
        assert needle in reason


def _gpu(rank, uuid, peers, symm=True, memops=True, index=None):
    return _RankFacts(rank, "h", "cuda", rank if index is None else index, "nccl", False,
                      device_uuid=uuid, peer_uuids=tuple(peers), symmetric_memory=symm, stream_memops=memops)


def test_two_ranks_on_one_gpu_index_but_different_gpus_is_not_sharing():
    # Each rank sees only its own GPU (CUDA_VISIBLE_DEVICES per rank): both say cuda:0, but the
    # UUIDs tell the GPUs apart.
    assert _fallback_reason([_gpu(0, "GPU-a", [], index=0), _gpu(1, "GPU-b", [], index=0)], None) is None
    assert "share cuda:0" in _fallback_reason([_gpu(0, "GPU-a", [], index=0), _gpu(1, "GPU-a", [], index=0)], None)


@pytest.mark.parametrize("facts, needle", [
    ([_gpu(0, "a", ["b", "c"]), _gpu(1, "b", ["a", "c"]), _gpu(2, "c", ["a", "b"])], None),
    ([_gpu(0, "a", ["b"]), _gpu(1, "b", [])], "rank 1's GPU cannot map rank 0's GPU memory"),
    ([_gpu(0, "a", ["b"]), _gpu(1, "b", ["a"], symm=False)], "rank 1's torch has no CUDA symmetric memory"),
    ([_gpu(0, "a", ["b"], memops=False), _gpu(1, "b", ["a"])], "rank 0's CUDA driver has no stream memory"),
    ([_facts(0, dtype="cpu", backend="gloo"), _facts(1, dtype="cpu", backend="gloo")], "not on CUDA devices"),
])
def test_copy_engine_gather_needs_peer_access_everywhere(facts, needle):
    reason = _peer_copy_reason(facts)
    assert reason is None if needle is None else needle in reason


def test_cpu_ranks_report_no_gpu_facts():
    assert _gpu_facts(torch.device("cpu")) == {}


def test_ranks_asking_for_different_gathers_is_an_error():
    def facts(rank, gather):
        comp = ComponentFacts("allgather", 1 << 20, gather, ("b0",), ("d0",))
        return _RankFacts(rank, "h", "cuda", rank, "nccl", False, components={"dit": comp})

    _check_same_layout([facts(0, "auto"), facts(1, "auto")])
    with pytest.raises(OffloadConfigError, match="gather nccl.*gather auto.*same config on every rank"):
        _check_same_layout([facts(0, "auto"), facts(1, "nccl")])


@pytest.mark.parametrize("nbytes, world, chunk", [(1, 2, 1 << 20), (1000, 2, 1 << 20), (70_000, 4, 4096),
                                                  (1 << 20, 3, 1 << 16), (12345, 8, 1 << 12)])
def test_shards_reassemble_the_block(nbytes, world, chunk):
    image = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    plans = [plan_shards(nbytes, world, r, chunk) for r in range(world)]
    assert len({p.chunks for p in plans}) == 1
    out = torch.zeros(plans[0].padded_nbytes, dtype=torch.uint8)
    for p in plans:
        shard = torch.empty(p.shard_nbytes, dtype=torch.uint8)
        write_shard(p, image, shard)
        pos = 0
        for offset, c in p.chunks:
            assert (offset + p.rank * c) % 256 == 0
            out[offset + p.rank * c: offset + (p.rank + 1) * c] = shard[pos: pos + c]
            pos += c
    assert torch.equal(out[:nbytes], image) and not out[nbytes:].any()
    assert plans[0].shard_nbytes <= -(-nbytes // world) + 256 * len(plans[0].chunks)
