"""allgather steps that fail on one rank only, on two gloo ranks: ``remove()`` (a restored tensor
out of memory), setup (a pin failure, a held 8-bit image out of memory), a residency re-plan
(before its gathers, and part way through them) and an edit. Every fill is a collective paired
with the other ranks' by order only, so a rank that leaves such a step early must not leave the
others in its collectives: every rank raises at once and stays in step (later forwards bitwise
right), or, where a collective already failed, the ring refuses from then on and no rank's
gathers pair with another's (gloo would abort the process on the sizes, or rebuild blocks from
mixed shards). Each worker's collective_timeout_s is short, so a regression fails fast."""

from __future__ import annotations

import time
import types
from unittest import mock

import torch
import torch.distributed as dist

import tiny_models as tiny
from faults import failing_pin
from omni_dist_offload import apply_offload
from omni_dist_offload import ring as ring_mod
from omni_dist_offload.ring import BlockRing
from omni_dist_offload.transfer.casting import CastingTransfer
from ranks import Rank, run_ranks
from toys import ToyDiT, assert_same, snapshot

TIMEOUT_S = 5  # collective_timeout_s: a step that waits for it has waited for a rank that left


def _config(*components: str, **options) -> dict:
    layer = {c: {"weight_transfer": "allgather", "chunk_mib": 0.01, **options} for c in components}
    return {"mode": "layer", "components": list(components), "layer_options": layer,
            "collective_timeout_s": TIMEOUT_S}


def _error(fn) -> tuple[str | None, float]:
    t0 = time.monotonic()
    try:
        fn()
        return None, time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the message is checked
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0


# -- finding: remove() failing on one rank ---------------------------------------------------
@torch.no_grad()
def remove_fails(rank: Rank) -> dict:
    """Rank 1 runs out of memory restoring a tensor of the DiT, the first of two allgather rings.
    It used to stop gathering there and raise; rank 0 went on, and its remaining gathers paired
    with rank 1's next forward: its remove() returned with other blocks' shards bound."""
    pipe = types.SimpleNamespace(transformer=tiny.tiny_wan_transformer(num_layers=3),
                                 text_encoder=tiny.tiny_umt5_encoder(num_layers=2))
    x = tiny.wan_transformer_inputs(pipe.transformer)
    t = tiny.text_encoder_inputs(pipe.text_encoder)

    def run():
        return pipe.transformer(**x)[0], pipe.text_encoder(**t).last_hidden_state

    ref = run()
    before = (snapshot(pipe.transformer), snapshot(pipe.text_encoder))
    handle = apply_offload(pipe, _config("dit", "text_encoder"))
    out = {"rings": [r.component.name for r in handle.rings]}
    run()
    real, calls = ring_mod.restored, [0]

    def restored(entry, view, device):
        calls[0] += 1
        if rank.rank == 1 and calls[0] == 7:  # part way through the DiT's blocks
            raise torch.OutOfMemoryError("CUDA out of memory (simulated) restoring a tensor")
        return real(entry, view, device)

    with mock.patch.object(ring_mod, "restored", restored):
        out["remove"], out["remove_s"] = _error(handle.remove)
    out["active"] = handle.active
    out["forwards"] = [all(torch.equal(a, b) for a, b in zip(run(), ref)) for _ in range(2)]
    out["retry"], _ = _error(handle.remove)
    out["after_retry"] = (all(torch.equal(a, b) for a, b in zip(run(), ref))
                          and _unchanged(before[0], pipe.transformer) and _unchanged(before[1], pipe.text_encoder))
    return out


def _unchanged(before: dict, model: torch.nn.Module) -> bool | str:
    try:
        assert_same(before, model)
        return True
    except AssertionError as exc:
        return str(exc)


def test_remove_failing_on_one_rank_changes_nothing_on_every_rank():
    for r in run_ranks(remove_fails, 2, timeout=90):
        assert r["rings"][0] == "transformer" and len(r["rings"]) == 2, r
        assert r["remove"] == ("RuntimeError: remove() changed nothing; the model is still offloaded: rank 1 failed: "
                               "OutOfMemoryError: CUDA out of memory (simulated) restoring a tensor"), r
        assert r["remove_s"] < TIMEOUT_S and r["active"], r  # at once, not after a peer's timeout
        assert r["forwards"] == [True, True], r  # still offloaded, in step, bitwise right
        assert r["retry"] is None and r["after_retry"] is True, r


# -- finding: setup failing late on one rank -------------------------------------------------
def setup_fails(rank: Rank) -> dict:
    """8-bit allgather ring with a resident block: its image is gathered before the end of setup.
    Rank 1's setup fails (a pin failure while filling its shards; its device out of memory for
    the held image). The others used to wait in that gather until collective_timeout_s."""
    cfg = dict(_config("dit", storage_dtype="float8_e4m3fn", resident_blocks=1), pin_memory=True)
    model = tiny.tiny_wan_transformer(num_layers=4)
    before = snapshot(model)
    out = {}
    with failing_pin(0 if rank.rank == 1 else None):
        out["pin"], out["pin_s"] = _error(lambda: apply_offload(model, cfg))
    out["pin_unchanged"] = _unchanged(before, model)
    real_hold = CastingTransfer.hold

    def hold(self, blocks):  # rank 1's device cannot hold the images
        def no_room(i):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated) holding an image")
        with mock.patch.object(self.inner, "device_nbytes", no_room):
            return real_hold(self, blocks)

    with mock.patch.object(CastingTransfer, "hold", hold if rank.rank == 1 else real_hold):
        out["hold"], out["hold_s"] = _error(lambda: apply_offload(model, dict(cfg, pin_memory=False)))
    out["hold_unchanged"] = _unchanged(before, model)
    dist.barrier()  # the ranks are still in step
    x = tiny.wan_transformer_inputs(model)
    with torch.no_grad():
        # The reference stores the weights in 8 bits too: rank-local, alone.
        local = apply_offload(model, {"mode": "layer", "components": ["dit"],
                                      "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}})
        ref = model(**x)[0]
        local.remove()
        handle = apply_offload(model, dict(cfg, pin_memory=False))
        out["then"] = [torch.equal(model(**x)[0], ref) for _ in range(2)]
        handle.remove()
    return out


def test_setup_failing_late_on_one_rank_is_heard_at_once():
    r0, r1 = run_ranks(setup_fails, 2, timeout=90)
    assert r1["pin"].startswith("PinMemoryError: transformer: page-locking the host copy of block blocks.0"), r1
    assert r0["pin"].startswith("RuntimeError: apply_offload failed on rank 1 (PinMemoryError: "), r0
    assert r1["hold"] == "OutOfMemoryError: CUDA out of memory (simulated) holding an image", r1
    assert r0["hold"].startswith("RuntimeError: transformer: holding 8-bit images on the device failed on "
                                 "rank 1"), r0
    for r in (r0, r1):
        assert r["pin_s"] < TIMEOUT_S and r["hold_s"] < TIMEOUT_S, r
        assert r["pin_unchanged"] is True and r["hold_unchanged"] is True, r
        assert r["then"] == [True, True], r


# -- finding: a residency re-plan failing on one rank ----------------------------------------
def _budgeted(model: torch.nn.Module) -> dict:
    # Tight enough that the measured forward's plan keeps some blocks (or parts) on the device:
    # each is gathered into a buffer of its own.
    return dict(_config("dit"), device_budget=150_000)


@torch.no_grad()
def replan_fails(rank: Rank) -> dict:
    """The re-plan after the measured (second) forward fails on rank 1. Before its first gather
    (here: taking in storage given since the last forward runs out of memory): every rank raises
    in that forward, keeps streaming as it was, and re-plans at the next. Part way through its
    gathers: rank 1's ring refuses from then on, rank 0's gathers time out and it refuses too;
    rank 1 used to go on, and its next forward's fills paired with rank 0's plan gathers (gloo
    aborted the process on the sizes)."""
    model = tiny.tiny_wan_transformer(num_layers=6)
    x = tiny.wan_transformer_inputs(model)
    ref = model(**x)[0]
    handle = apply_offload(model, _budgeted(model))
    ring = handle.rings[0]
    out = {"first": torch.equal(model(**x)[0], ref)}
    start = (sorted(ring.resident), ring.kept_blocks(), len(ring.slots))
    real_adopt = BlockRing._adopt_given_storage

    def adopt(self):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated) preparing the plan")

    with mock.patch.object(BlockRing, "_adopt_given_storage", adopt if rank.rank == 1 else real_adopt):
        out["measured"], out["measured_s"] = _error(lambda: model(**x))
    out["unchanged"] = (sorted(ring.resident), ring.kept_blocks(), len(ring.slots)) == start
    out["broken"] = ring._broken
    out["next"] = [torch.equal(model(**x)[0], ref) for _ in range(3)]  # the first of them re-plans
    out["planned"] = (sorted(ring.resident), ring.kept_blocks()) != start[:2]
    out["status"] = handle.lockstep_status()
    handle.remove()
    out["after_remove"] = torch.equal(model(**x)[0], ref)

    # Part way through the plan's gathers: after rank 1's second block comes in.
    handle = apply_offload(model, _budgeted(model))
    model(**x)
    real_whole, calls = BlockRing._whole_on_device, [0]

    def whole(self, i, *args):
        calls[0] += 1
        got = real_whole(self, i, *args)
        if rank.rank == 1 and calls[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated) after a gather")
        return got

    with mock.patch.object(BlockRing, "_whole_on_device", whole):
        out["part_way"], out["part_way_s"] = _error(lambda: model(**x))
    out["gathers"] = calls[0]  # begun
    out["later"], out["later_s"] = _error(lambda: model(**x))
    return out


def test_a_replan_failing_on_one_rank_keeps_the_ranks_in_step():
    r0, r1 = run_ranks(replan_fails, 2, timeout=90, broken_group=True)
    assert r0["gathers"] >= 3, r0  # the plan gathers several blocks: rank 1 left after its second
    assert r1["measured"] == "OutOfMemoryError: CUDA out of memory (simulated) preparing the plan", r1
    assert r0["measured"].startswith("RuntimeError: transformer: preparing its residency plan failed on rank 1"), r0
    for r in (r0, r1):
        assert r["first"] and r["measured_s"] < TIMEOUT_S and r["unchanged"] and r["broken"] is None, r
        assert r["next"] == [True, True, True] and r["planned"] and r["after_remove"], r
    assert r0["status"] == r1["status"], (r0["status"], r1["status"])
    # Part way: rank 1 raises its own error and refuses from then on, without a collective.
    assert r1["part_way"] == "OutOfMemoryError: CUDA out of memory (simulated) after a gather", r1
    assert r1["part_way_s"] < TIMEOUT_S and r1["later_s"] < 1, r1
    assert "can no longer move blocks in lockstep" in r1["later"], r1
    # Rank 0's next plan gather found no partner: it raises within the timeout, and refuses too.
    assert r0["part_way"].startswith("RuntimeError"), r0
    assert r0["part_way_s"] < TIMEOUT_S + 5, r0
    assert "can no longer move blocks in lockstep" in r0["later"], r0


# -- an edit that raises on one rank ---------------------------------------------------------
@torch.no_grad()
def edit_fails(rank: Rank) -> dict:
    """Rank 1's edit of a streamed block raises (a LoRA fusion out of memory): it used to skip
    the comparison's all-reduces, which rank 0 made, pairing them with rank 1's next fills."""
    model = ToyDiT(3, dim=64)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    ref = model(x)
    handle = apply_offload(model, _config("dit"))
    ring = handle.rings[0]
    model(x)

    def edit():
        model.blocks[1].lin.weight.add_(1.0)
        if rank.rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated) fusing an adapter")

    out = {}
    out["edit"], out["edit_s"] = _error(lambda: ring.edit_block(1, edit))
    out["unchanged"] = [torch.equal(model(x), ref) for _ in range(2)]
    ring.edit_block(1, lambda: model.blocks[1].lin.weight.add_(1.0))
    reference = ToyDiT(3, dim=64)
    reference.blocks[1].lin.weight.add_(1.0)
    out["same_edit"] = torch.equal(model(x), reference(x))
    handle.remove()
    return out


def test_an_edit_failing_on_one_rank_is_refused_on_every_rank():
    r0, r1 = run_ranks(edit_fails, 2, timeout=60)
    assert r1["edit"] == "OutOfMemoryError: CUDA out of memory (simulated) fusing an adapter", r1
    assert r0["edit"].startswith("RuntimeError: transformer: editing block blocks.1 failed on rank 1"), r0
    for r in (r0, r1):
        assert r["edit_s"] < TIMEOUT_S and r["unchanged"] == [True, True] and r["same_edit"], r
