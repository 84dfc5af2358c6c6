"""Ranks that ask ``apply_offload`` for different things, on two gloo ranks in one launch. Every
rank raises the same ``OffloadConfigError`` before anything changes, naming the key and each
rank's value: the ranks compare what they ask for before any other exchange, and an allgather
ring's starting residency once it is planned. An agreement at the end of setup that cannot
complete undoes the rank's setup. A rank whose config streams only rank-local exchanges
nothing, so a peer asking for allgather times out, saying why (docs/design.md, [Note: setup
phases])."""

from __future__ import annotations

import sys
import time
import types
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist

from omni_dist_offload import OffloadConfigError, apply_offload
from omni_dist_offload.layout import layout_block
from omni_dist_offload.transfer.groups import GroupSession
from ranks import Rank, run_ranks, shared_copy_mappings
from toys import ToyDiT, assert_same, snapshot

AG = {"weight_transfer": "allgather"}


def _config(dit: dict, te: dict | None = None, **top) -> dict:
    options = {"dit": dit, **({"text_encoder": te} if te is not None else {})}
    return {"mode": "layer", "components": list(options), "layer_options": options, "collective_timeout_s": 20,
            **top}


def _pipe(rank: int, text_encoder: bool = True) -> types.SimpleNamespace:
    pipe = types.SimpleNamespace(transformer=ToyDiT(6, dim=32))
    if text_encoder:
        pipe.text_encoder = ToyDiT(2, dim=32, seed=1)
    return pipe


def _modules(target) -> dict:
    return vars(target) if isinstance(target, types.SimpleNamespace) else {"transformer": target}


def _unchanged(target, before: dict) -> None:
    for name, module in _modules(target).items():
        assert_same(before[name], module)


def _refused(target, config: dict, **kwargs) -> str:
    """The error ``apply_offload`` raises; the target is left as it was."""
    before = {name: snapshot(m) for name, m in _modules(target).items()}
    try:
        apply_offload(target, config, **kwargs)
    except OffloadConfigError as exc:
        _unchanged(target, before)
        return str(exc)
    raise AssertionError(f"applied: {config}")


_mapped = shared_copy_mappings


def mismatches(rank: Rank) -> dict:
    r = rank.rank
    blk = layout_block(0, "b", ToyDiT(1, dim=32).blocks[0]).nbytes
    fp8 = "float8_e4m3fn" if r == 0 else "float8_e5m2"
    pg = dist.new_group([0, 1])  # collective: made on every rank, passed on rank 0 only
    out = {
        "resident_blocks": _refused(ToyDiT(4, dim=32), _config(AG | {"resident_blocks": [1] if r == 0 else None})),
        "device_budget": _refused(ToyDiT(8, dim=32), _config(AG, **({"device_budget": 5 * blk} if r == 0 else {}))),
        "storage_allgather": _refused(ToyDiT(3, dim=32), _config(AG | {"storage_dtype": fp8})),
        "storage_shared": _refused(ToyDiT(3, dim=32), _config({"weight_transfer": "shared", "storage_dtype": fp8})),
        # The text encoder shared on rank 0, rank-local on rank 1: before, the ranks reached
        # different exchanges and failed with unrelated errors, rank 1's model half set up.
        "crossed": _refused(_pipe(r), _config(AG, {"weight_transfer": "shared" if r == 0 else "rank-local"})),
        "process_group": _refused(ToyDiT(3, dim=32), _config(AG), process_group=pg if r == 0 else None),
        # The same config, but rank 0 also streams a rank-local text encoder, which takes a share
        # of the budget: the DiT's plan differs.
        "residency": _refused(_pipe(r, text_encoder=r == 0),
                              _config(AG, {} if r == 0 else None, device_budget=5 * blk + 100)),
    }

    # The agreement at the end of setup fails (as when a peer dies there): this rank undoes its
    # setup, its allgather ring and its shared ring alike, and keeps no group or shared memory.
    real_agree = GroupSession.agree

    def agree(self, error):
        if sys._getframe(1).f_code.co_name == "_agree_all_or_nothing":
            raise RuntimeError("Connection closed by peer")
        return real_agree(self, error)

    pipe = _pipe(r)
    x = torch.randn(2, 32)
    with torch.no_grad():
        ref = pipe.transformer(x)
    before = {name: snapshot(m) for name, m in _modules(pipe).items()}
    groups = len(dist.distributed_c10d._world.pg_map)
    with mock.patch.object(GroupSession, "agree", agree):
        try:
            apply_offload(pipe, _config(AG, {"weight_transfer": "shared"}))
        except RuntimeError as exc:
            out["agreement"] = f"{exc} {exc.__notes__}"
    _unchanged(pipe, before)
    with torch.no_grad():
        out["agreement_equal"] = torch.equal(pipe.transformer(x), ref)
    out["agreement_left"] = {"groups": len(dist.distributed_c10d._world.pg_map) - groups, "mapped": _mapped()}

    # Last (it leaves rank 0's side group half made): rank 1 asks for rank-local and exchanges
    # nothing; rank 0, asking for allgather, waits for it until collective_timeout_s.
    store = dist.distributed_c10d._get_default_store()
    model = ToyDiT(3, dim=32)
    config = _config(AG if r == 0 else {"weight_transfer": "rank-local"}, collective_timeout_s=2)
    if r == 1:
        apply_offload(model, config).remove()
        store.wait(["rank 0 timed out"], timedelta(seconds=60))
        return out
    before = snapshot(model)
    t0 = time.monotonic()
    try:
        apply_offload(model, config)
    except RuntimeError as exc:
        out["rank_local_peer"] = (str(exc), time.monotonic() - t0)
    assert_same(before, model)
    store.set("rank 0 timed out", "1")
    return out


def test_ranks_asking_for_different_things_raise_alike_and_change_nothing():
    r0, r1 = run_ranks(mismatches, 2, broken_group=True, timeout=120)
    for key in ("resident_blocks", "device_budget", "storage_allgather", "storage_shared", "crossed",
                "process_group", "residency"):
        assert r0[key] == r1[key], key  # the same error on every rank
    assert "layer_options.dit.resident_blocks differs across ranks (rank 0: [1]; rank 1: not set)" in r0["resident_blocks"]
    assert "device_budget differs across ranks (rank 0: " in r0["device_budget"]
    fp8 = "storage_dtype differs across ranks (rank 0: float8_e4m3fn; rank 1: float8_e5m2)"
    assert fp8 in r0["storage_allgather"] and fp8 in r0["storage_shared"]
    assert ("text_encoder: layer_options.text_encoder.weight_transfer differs across ranks (rank 0: shared; "
            "rank 1: rank-local)") in r0["crossed"]
    assert "process_group differs across ranks (rank 0: [0, 1]; rank 1: None" in r0["process_group"]
    assert "transformer: the ranks of its weight group [0, 1] would start it with different resident blocks" \
        in r0["residency"], r0["residency"]
    for r in (r0, r1):
        assert "Connection closed by peer" in r["agreement"] and "undid its setup" in r["agreement"]
        assert r["agreement_equal"] and r["agreement_left"] == {"groups": 0, "mapped": []}
    message, waited = r0["rank_local_peer"]
    assert "not every rank joined the comparison of configs" in message and "rank-local" in message, message
    assert 1.5 < waited < 15
