"""The allgather transfer in one process: the fallback when no group is initialised, every fallback
reason, the checks across ranks (layouts, what each rank asks for, residency), and the shard
plans. With real ranks on gloo: dist/test_allgather_ranks.py, dist/test_mismatch_ranks.py."""

from __future__ import annotations

import re

import pytest
import torch

from omni_dist_offload import apply_offload
from omni_dist_offload import OffloadConfigError
from omni_dist_offload.layout import layout_block
from omni_dist_offload.storage import cast_tensors
from omni_dist_offload.transfer.groups import (ComponentFacts, SetupAsk, _check_same_asks, _check_same_layout,
                                           _check_same_residency, _gpu_facts, _peer_copy_reason, _RankFacts,
                                           _fallback_reason)
from omni_dist_offload.transfer.sharding import layout_digest, plan_shards, write_shard
from toys import ToyDiT


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
    reason = _fallback_reason(facts)
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
    assert _fallback_reason([_gpu(0, "GPU-a", [], index=0), _gpu(1, "GPU-b", [], index=0)]) is None
    assert "share cuda:0" in _fallback_reason([_gpu(0, "GPU-a", [], index=0), _gpu(1, "GPU-a", [], index=0)])


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


def _ask(dit: str = "allgather", te: str | None = "rank-local", group=None, **settings) -> SetupAsk:
    transfers = {"transformer": ("layer_options.dit.weight_transfer", dit)}
    if te is not None:
        transfers["text_encoder"] = ("layer_options.text_encoder.weight_transfer", te)
    keys = {"layer_options.dit.resident_blocks": None, "device_budget": None, **settings}
    return SetupAsk(transfers, {"transformer": keys} if dit != "rank-local" else {}, group)


@pytest.mark.parametrize("asks, needle", [
    # Components rank-local wherever they stream may differ: no rank depends on them.
    ([_ask(), _ask(te=None)], None),
    ([_ask(dit="rank-local", te="rank-local"), _ask(dit="rank-local", te=None)], None),
    ([_ask(), _ask(dit="rank-local")],
     "transformer: layer_options.dit.weight_transfer differs across ranks (rank 0: allgather; rank 1: rank-local)"),
    ([_ask(te="shared"), _ask(te=None), _ask(te="shared")],
     "text_encoder: layer_options.text_encoder.weight_transfer differs across ranks (ranks 0, 2: shared; "
     "rank 1: not streamed)"),
    ([_ask(), _ask(**{"layer_options.dit.resident_blocks": (1, 3)})],
     "layer_options.dit.resident_blocks differs across ranks (rank 0: not set; rank 1: [1, 3])"),
    ([_ask(device_budget=2**20), _ask(device_budget="auto")],
     "device_budget differs across ranks (rank 0: 1048576; rank 1: auto)"),
    # The process groups passed must split the ranks, or none be passed.
    ([_ask(group=(0, 1)), _ask(group=(0, 1)), _ask(group=(2, 3)), _ask(group=(2, 3))], None),
    ([_ask(group=(0, 1)), _ask()], "some ranks pass one and others do not"),
    ([_ask(group=(0, 1)), _ask(group=(1,))], "rank 0's group holds rank 1, which passes another"),
    ([_ask(group=(1,)), _ask(group=(1,))], "rank 0's group does not hold rank 0"),
])
def test_ranks_asking_for_different_things_is_an_error(asks, needle):
    if needle is None:
        _check_same_asks(asks)
    else:
        with pytest.raises(OffloadConfigError, match=re.escape(needle)):
            _check_same_asks(asks)


def test_ranks_of_a_weight_group_must_start_with_the_same_residency():
    def plan(resident, slots=2):
        return {"transformer": {"resident blocks": resident, "slots": slots}}

    # Two hosts: each host's ranks agree; the hosts may differ (their budgets are their own).
    _check_same_residency([((0, 1), plan((0,))), ((0, 1), plan((0,))), ((2, 3), plan((1, 2), 3)),
                           ((2, 3), plan((1, 2), 3))])
    with pytest.raises(OffloadConfigError, match=re.escape(
            "transformer: the ranks of its weight group [2, 3] would start it with different slots (rank 2: 3; "
            "rank 3: 2)")):
        _check_same_residency([((0, 1), plan(())), ((0, 1), plan(())), ((2, 3), plan((1,), 3)),
                               ((2, 3), plan((1,), 2))])


def test_layout_digest_covers_how_blocks_are_stored():
    model = ToyDiT(1, dim=32)
    block = model.blocks[0]

    def digest(stored=None):
        cast = cast_tensors(model, getattr(torch, stored)) if stored else None
        return layout_digest([layout_block(0, "b", block, cast=cast)])[0]

    assert digest("float8_e4m3fn") == digest("float8_e4m3fn")
    assert len({digest(), digest("float8_e4m3fn"), digest("float8_e5m2")}) == 3


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


def _transfer(image: torch.Tensor, world: int, rank: int, chunk: int):
    """rank's AllGatherTransfer of one block, with no collective behind it (keep_part needs none)."""
    import types

    from omni_dist_offload.hostmem import HostBuffer
    from omni_dist_offload.transfer.allgather import AllGatherTransfer
    from omni_dist_offload.transfer.protocol import TransferStreams

    plan = plan_shards(image.numel(), world, rank, chunk)
    shard = HostBuffer(plan.shard_nbytes)
    write_shard(plan, image, shard.tensor)
    group = types.SimpleNamespace(backend="gloo", size=world, rank=rank, group=None)
    return AllGatherTransfer([shard], [plan], group, TransferStreams(), torch.device("cpu"))


def test_keep_part_cuts_each_shard_again_from_what_streams(monkeypatch):
    from faults import only_pinned
    from omni_dist_offload.hostmem import PinMemoryError

    image = torch.randint(0, 256, (70_000,), dtype=torch.uint8)
    start, world, chunk = 20_480, 2, 1 << 14
    ranks = [_transfer(image, world, r, chunk) for r in range(world)]
    whole = ranks[0].device_nbytes(0)
    for t in ranks:
        t.keep_part(0, start, image[start:])
    # Every rank holds its half of the rest only, and the gathered rest lands after the kept bytes.
    plans = [t.plans[0] for t in ranks]
    rest = torch.zeros(plans[0].padded_nbytes, dtype=torch.uint8)
    for t, p in zip(ranks, plans):
        for offset, mine, c, pos in t._chunks[0]:
            rest[mine : mine + c] = t.shards[0].tensor[pos : pos + c]
    assert torch.equal(rest[: image.numel() - start], image[start:]) and not rest[image.numel() - start :].any()
    assert ranks[0].device_nbytes(0) == start + plans[0].padded_nbytes <= whole + 256 * world * len(plans[0].chunks)
    assert ranks[0].host_bytes() == plans[0].shard_nbytes < (image.numel() - start) // world + 256 * len(plans[0].chunks)
    assert ranks[0].part_nbytes(0, image.numel() - start) == plans[0].padded_nbytes
    # The ring fills and writes back from exactly the cut; bad input says what it found.
    with pytest.raises(ValueError, match="from byte 20480 on .* found start=0"):
        ranks[0].fill(0, rest, None, None)
    with pytest.raises(ValueError, match="already keeps its first 20480 bytes"):
        ranks[0].keep_part(0, start, image[start:])
    resident = _transfer(image, world, 0, chunk)
    resident.drop(0)
    with pytest.raises(ValueError, match="has no shard"):
        resident.keep_part(0, start, image[start:])

    # A page-locked shard: the old one is unlocked first, and locked again if the new one
    # cannot be; the block then streams as before.
    t = _transfer(image, world, 1, chunk)
    old, old_plan = t.shards[0], t.plans[0]
    calls = only_pinned(monkeypatch, old)
    with pytest.raises(PinMemoryError):
        t.keep_part(0, start, image[start:])
    assert calls == ["release", "pin", "pin"] and old.pinned
    assert t.shards[0] is old and t.plans[0] is old_plan and t.device_nbytes(0) == old_plan.padded_nbytes
