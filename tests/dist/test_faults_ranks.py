"""Faults with allgather on two gloo ranks: setup failing part-way (on every rank or on one),
host memory that cannot be pinned, interrupted forwards, a soak, and a rank that dies. The
model is never lost and no rank hangs. In one process: unit/test_faults.py."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from faults import failing_pin, failing_shard, interrupt
from omni_dist_offload import apply_offload
from omni_dist_offload.hostmem import PinMemoryError
from ranks import Rank, run_ranks
from toys import ToyDiT, assert_same, snapshot

AG_DIT = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 20,
          "layer_options": {"dit": {"weight_transfer": "allgather", "chunk_mib": 0.01}}}


def _unchanged(before: dict, model: nn.Module) -> bool | str:
    try:
        assert_same(before, model)
        return True
    except AssertionError as exc:
        return str(exc)


def _expect(out: dict, key: str, exc_type: type[BaseException], fn) -> None:
    try:
        fn()
        out[key] = "no error"
    except exc_type as exc:
        out[key] = f"{type(exc).__name__}: {exc}"


# -- setup failing on every rank -------------------------------------------------------------
def setup_faults(rank: Rank) -> dict:
    """Setup fails part-way on every rank: each rank's model is left as it was; then a clean
    apply works."""
    out = {}
    cfg = dict(AG_DIT, pin_memory=True)
    model = ToyDiT(4)
    before = snapshot(model)
    with failing_shard(2):
        _expect(out, "shard_fault", RuntimeError, lambda: apply_offload(model, cfg))
    out["shard_fault_unchanged"] = _unchanged(before, model)
    with failing_pin(1):
        _expect(out, "pin_fault", PinMemoryError, lambda: apply_offload(model, cfg))
    out["pin_fault_unchanged"] = _unchanged(before, model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
        with failing_pin(1), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = apply_offload(model, dict(cfg, pin_failure="pageable"))
        out["pageable_warnings"] = [str(w.message) for w in caught if "page-lock" in str(w.message)]
        out["pageable_pinned"] = [s.pinned for s in handle.rings[0].transfer.shards]
        out["pageable_transfer"] = handle.summary()[0]["weight_transfer"]
        out["pageable_equal"] = all(torch.equal(model(x), ref) for _ in range(2))
        handle.remove()
    out["pageable_unchanged_after_remove"] = _unchanged(before, model)
    return out


@pytest.fixture(scope="module")
def setup_fault_ranks() -> list[dict]:
    return run_ranks(setup_faults, 2)


def test_allgather_setup_failing_part_way_leaves_every_rank_unchanged(setup_fault_ranks):
    for r in setup_fault_ranks:
        assert r["shard_fault"] == "RuntimeError: simulated failure writing shard 2", r["shard_fault"]
        assert r["shard_fault_unchanged"] is True, r["shard_fault_unchanged"]
        assert r["pin_fault"].startswith("PinMemoryError: transformer: page-locking the host copy of "
                                         "block blocks.1 failed"), r["pin_fault"]
        assert r["pin_fault_unchanged"] is True, r["pin_fault_unchanged"]


def test_allgather_pin_failure_pageable(setup_fault_ranks):
    for r in setup_fault_ranks:
        (warning,) = r["pageable_warnings"]
        assert "block blocks.1" in warning and "several times slower" in warning
        assert r["pageable_pinned"] == [True, False, False, False]
        assert r["pageable_transfer"] == "allgather" and r["pageable_equal"] is True
        assert r["pageable_unchanged_after_remove"] is True


# -- interrupted forwards --------------------------------------------------------------------
@torch.no_grad()
def interrupts(rank: Rank) -> dict:
    """Every rank is interrupted at the same block (as a deterministic error would be): the
    next forward is correct and the ranks stay in lockstep."""
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    ref = model(x)
    before = snapshot(model)
    handle = apply_offload(model, AG_DIT)
    results = {}
    for where in ("body", "pre-hook"):
        model(x)
        with interrupt(model.blocks[2], where):
            try:
                model(x)
                results[where] = "not interrupted"
            except KeyboardInterrupt:
                results[where] = all(torch.equal(model(x), ref) for _ in range(2))
    handle.remove()
    return {"interrupts": results, "interrupts_unchanged_after_remove": _unchanged(before, model)}


def test_allgather_interrupt_then_correct_forwards():
    for r in run_ranks(interrupts, 2):
        assert r["interrupts"] == {"body": True, "pre-hook": True}
        assert r["interrupts_unchanged_after_remove"] is True, r["interrupts_unchanged_after_remove"]


# -- soak ------------------------------------------------------------------------------------
def soak_short(rank: Rank) -> dict:
    """The CI-sized soak: 60 forwards alternating two shapes, allgather on gloo."""
    from omni_dist_offload.tools.soak import SoakOptions, run_soak

    torch.set_num_threads(1)
    result = run_soak(SoakOptions(model="tiny-wan", forwards=60, transfer="allgather", warmup=10,
                                  rss_tolerance_mib=8, chunk_mib=0.01, collective_timeout_s=20))
    return {**asdict(result), "passed": result.passed}


def test_allgather_soak_alternating_shapes():
    for soak in run_ranks(soak_short, 2):
        assert soak["passed"], soak["failures"]
        assert soak["weight_transfer"] == "allgather"
        assert soak["equal"] == soak["forwards_done"] == 60 and soak["equal_after_remove"]
        assert soak["rss_kept_mib"] <= 8 and soak["live_tensors"][1] <= soak["live_tensors"][0]


# -- setup failing on one rank ---------------------------------------------------------------
def one_rank_setup_fault(rank: Rank) -> dict:
    """Only rank 1's setup fails: every rank undoes its setup and raises, rank 0 naming rank 1's
    error, at once rather than at its first forward."""
    out = {}
    cfg = dict(AG_DIT, pin_memory=True, collective_timeout_s=20)
    model = ToyDiT(4)
    before = snapshot(model)
    t0 = time.monotonic()
    if rank.rank == 1:
        with failing_pin(2):
            _expect(out, "one_rank_fault", PinMemoryError, lambda: apply_offload(model, cfg))
    else:
        with failing_pin(None):
            _expect(out, "one_rank_fault", RuntimeError, lambda: apply_offload(model, cfg))
    out["one_rank_fault_s"] = time.monotonic() - t0
    out["one_rank_fault_unchanged"] = _unchanged(before, model)
    dist.barrier()  # the group still works after the failed setup
    return out


def test_one_rank_failing_setup_undoes_setup_on_every_rank():
    ranks = run_ranks(one_rank_setup_fault, 2, timeout=60)
    failed, other = ranks[1], ranks[0]
    assert failed["one_rank_fault"].startswith("PinMemoryError: transformer: page-locking the host "
                                               "copy of block blocks.2"), failed["one_rank_fault"]
    msg = other["one_rank_fault"]
    assert msg.startswith("RuntimeError: apply_offload failed on rank 1 (PinMemoryError: "), msg
    assert "every rank undid its setup" in msg
    for r in ranks:
        assert r["one_rank_fault_unchanged"] is True, r["one_rank_fault_unchanged"]
        assert r["one_rank_fault_s"] < 10  # at setup, not a collective timeout later


def facts_read_fault(rank: Rank) -> dict:
    """Rank 1 cannot read its weights' first bytes (a cold start's checkpoint read failing on its
    host) while the ranks compare them, for each transfer that shares weights; then the same
    setup again, which works."""
    from unittest import mock

    from omni_dist_offload import apply as apply_module

    out = {}
    real = apply_module.sample_digest

    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error")

    for transfer in ("allgather", "shared"):
        cfg = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 20,
               "layer_options": {"dit": {"weight_transfer": transfer}}}
        model = ToyDiT(4)
        before = snapshot(model)
        t0 = time.monotonic()
        with mock.patch.object(apply_module, "sample_digest", failing if rank.rank == 1 else real):
            _expect(out, transfer, OSError if rank.rank == 1 else RuntimeError, lambda: apply_offload(model, cfg))
        out[f"{transfer}_s"] = time.monotonic() - t0
        out[f"{transfer}_unchanged"] = _unchanged(before, model)
        handle = apply_offload(model, cfg)
        out[f"{transfer}_again"] = handle.summary()[0]["weight_transfer"]
        handle.remove()
    return out


def test_a_rank_that_cannot_read_its_weights_facts_is_named_by_the_others():
    """They waited for it in the comparison's exchange and met a lost connection (gloo's
    'Connection closed by peer'), naming neither the rank nor the cause."""
    other, failed = run_ranks(facts_read_fault, 2, timeout=90)
    for transfer in ("allgather", "shared"):
        assert failed[transfer] == "OSError: [Errno 5] Input/output error", failed
        assert other[transfer] == ("RuntimeError: apply_offload failed on rank 1 (OSError: [Errno 5] Input/output "
                                   "error) while reading its weights to compare them with the other ranks'; no rank "
                                   "changed anything, since the ranks share weights (allgather or shared). Fix the "
                                   "error on that rank and apply again."), other
        for r in (failed, other):
            assert r[f"{transfer}_unchanged"] is True and r[f"{transfer}_s"] < 15, r
            assert r[f"{transfer}_again"] == transfer, r


# -- a rank that dies ------------------------------------------------------------------------
def rank_dies(rank: Rank) -> dict:
    """Rank 1 exits (os._exit) in the middle of a forward: rank 0 raises within the timeout,
    naming the ring and block."""
    out = {}
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    handle = apply_offload(model, dict(AG_DIT, collective_timeout_s=3))
    with torch.no_grad():
        model(x)
        if rank.rank == 1:
            def die(module, args):
                rank.report({"rank_dies": "exited in the pre-forward of blocks.2"})
                os._exit(1)
            model.blocks[2].register_forward_pre_hook(die)
        t0 = time.monotonic()
        _expect(out, "rank_dies", RuntimeError, lambda: [model(x) for _ in range(3)])
    out["rank_dies_s"] = time.monotonic() - t0
    del handle
    return out


def test_a_rank_that_dies_mid_forward_makes_the_others_raise():
    ranks = run_ranks(rank_dies, 2, broken_group=True, timeout=60)
    assert ranks[1]["rank_dies"] == "exited in the pre-forward of blocks.2"
    msg = ranks[0]["rank_dies"]
    assert msg.startswith("RuntimeError: transformer: moving block blocks.") and "every rank" in msg, msg
    assert ranks[0]["rank_dies_s"] < 3 + 10
