"""The allgather transfer with real ranks on gloo (CPU), as torchrun would start them: bitwise
parity at 2, 4 and 8 ranks, each rank's share of host memory, the fallbacks, layout mismatches,
host groups and a diverging rank. Each test's worker runs on every rank (tests/ranks.py)."""

from __future__ import annotations

import gc
import os
import time
import types
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import tiny_models as tiny
from omni_dist_offload import OffloadConfigError, apply_offload
from ranks import Rank, proc_status, run_ranks
from toys import ToyDiT, UnevenDiT


def allgather_config(gather: str | None = None, text_encoder: bool = True, **top) -> dict:
    """allgather for the DiT (small chunks: several per block) and the text encoder; ``gather``
    picks the GPU gather (copy-engine or nccl)."""
    options = {"dit": {"weight_transfer": "allgather", "chunk_mib": 0.01}}
    if text_encoder:
        options["text_encoder"] = {"weight_transfer": "allgather"}
    if gather:
        for opts in options.values():
            opts["gather"] = gather
    return {"mode": "layer", "components": list(options), "layer_options": options, "collective_timeout_s": 20,
            **top}


AG_DIT = allgather_config(text_encoder=False)


# -- parity ----------------------------------------------------------------------------------
@torch.no_grad()
def parity(rank: Rank, gather: str | None = None, full: bool = True) -> dict:
    """Wan DiT and UMT5 encoder, a Flux DiT, and a model of uneven blocks (``full``; else the
    first two only): bitwise equal outputs with allgather, and after remove(). Also run on GPUs
    (gpu/test_gpu_allgather.py)."""
    device = rank.device
    ag, ag_dit = allgather_config(gather), allgather_config(gather, text_encoder=False)

    def to(batch: dict) -> dict:
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = types.SimpleNamespace(transformer=tiny.tiny_wan_transformer(num_layers=3, dtype=dtype).to(device),
                                 text_encoder=tiny.tiny_umt5_encoder(num_layers=3).to(device))
    x = to(tiny.wan_transformer_inputs(pipe.transformer, batch=2))
    t = to(tiny.text_encoder_inputs(pipe.text_encoder))
    ref = (pipe.transformer(**x)[0], pipe.text_encoder(**t).last_hidden_state)
    handle = apply_offload(pipe, ag)
    rows = handle.summary()
    eq = all(torch.equal(pipe.transformer(**x)[0], ref[0]) and
             torch.equal(pipe.text_encoder(**t).last_hidden_state, ref[1]) for _ in range(2))
    handle.remove()
    eq_after = torch.equal(pipe.transformer(**x)[0], ref[0])
    out = {"parity": {"equal": eq, "equal_after_remove": eq_after, "summary": rows}}
    if not full:
        return out

    flux = tiny.tiny_flux_transformer(dtype=dtype).to(device)
    fx = to(tiny.flux_transformer_inputs(flux))
    fref = flux(**fx)[0]
    handle = apply_offload(flux, ag_dit)
    out["flux_equal"] = all(torch.equal(flux(**fx)[0], fref) for _ in range(2))
    handle.remove()

    uneven = UnevenDiT().to(device)
    ux = torch.randn(4, 16).to(device)
    uref = uneven(ux)
    handle = apply_offload(uneven, ag_dit)
    out["uneven_equal"] = all(torch.equal(uneven(ux), uref) for _ in range(3))
    ring = handle.rings[0]
    out["uneven"] = {"shard_bytes": [p.shard_nbytes for p in ring.transfer.plans],
                     "block_nbytes": [l.nbytes for l in ring.layouts],
                     "host_bytes": handle.summary()[0]["host_bytes"]}
    handle.remove()
    return out


@pytest.mark.parametrize("world", [4, 3, 2])
def test_parity_shards_and_uneven_blocks(world):
    # Three ranks: shards of a world size that divides no block evenly.
    results = run_ranks(parity, world, args=(None, True))
    for r in results:
        assert r["parity"]["equal"] and r["parity"]["equal_after_remove"]
        for row in r["parity"]["summary"]:
            assert row["weight_transfer"] == "allgather" and row["fallback_reason"] is None
            # Each rank holds its share of the block bytes, plus alignment padding only.
            blocks = row["num_blocks"]
            assert row["block_bytes"] / world <= row["host_bytes"] <= row["block_bytes"] / world + blocks * 2 * 256 * 8
        assert r["flux_equal"] and r["uneven_equal"]
        un = r["uneven"]
        assert len(set(un["block_nbytes"])) > 1  # blocks of different sizes in one ring
        assert un["host_bytes"] == sum(un["shard_bytes"])
        for shard, nbytes in zip(un["shard_bytes"], un["block_nbytes"]):
            assert shard * world >= nbytes and shard % 256 == 0


# -- host memory -----------------------------------------------------------------------------
def resident_set(rank: Rank) -> dict:
    # Warm up first: the code of the allgather path (the library pages and the allocator pools
    # it touches the first time) must not count against the weights released below.
    warm = ToyDiT(8, dim=64)
    handle = apply_offload(warm, AG_DIT)
    warm(torch.randn(2, 64))
    # Meanwhile: state_dict() between forwards holds placeholders (no rank holds a block whole),
    # said once per component, naming it; keys and shapes are the model's, nothing raises, and
    # remove() takes the notice off.
    reference = ToyDiT(8, dim=64).state_dict()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        shapes = {k: tuple(v.shape) for k, v in warm.state_dict().items()}
        warm.state_dict()
    told = [str(w.message) for w in record if "holds placeholders" in str(w.message)]
    handle.remove()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        values = all(torch.equal(v, reference[k]) for k, v in warm.state_dict().items())
    after = [str(w.message) for w in record if "holds placeholders" in str(w.message)]
    state_dict = {"told": told, "shapes": shapes == {k: tuple(v.shape) for k, v in reference.items()},
                  "values": values, "after": after}
    model = ToyDiT(8, dim=1024)  # 8 blocks of ~4 MiB
    block_bytes = sum(p.numel() * p.element_size() for b in model.blocks for p in list(b.parameters()) + list(b.buffers()))
    gc.collect()
    before = proc_status("VmRSS")
    handle = apply_offload(model, AG_DIT)
    gc.collect()
    after = proc_status("VmRSS")
    model(torch.randn(2, 1024))
    out = {"before": before, "after": after, "block_bytes": block_bytes, "host_bytes": handle.summary()[0]["host_bytes"],
           "state_dict": state_dict}
    handle.remove()
    return out


def test_resident_set_drops_by_the_share():
    for s in run_ranks(resident_set, 2):
        assert s["host_bytes"] <= s["block_bytes"] / 2 + 8 * 4 * 256
        assert s["before"] - s["after"] >= 0.3 * s["block_bytes"], s
        # state_dict() of an allgather component: one warning on every rank (see resident_set).
        sd = s["state_dict"]
        (told,) = sd["told"]
        assert told.startswith("transformer: state_dict() holds placeholders") and "sharded over the ranks" in told
        assert "handle.remove() first (on every rank" in told and sd["shapes"] and sd["values"] and not sd["after"]


# -- blocks that keep a part on the device ---------------------------------------------------
def _bump(block: torch.nn.Module) -> None:
    for p in block.parameters():  # every tensor: the kept part and the streamed part alike
        p.add_(1.0)


@torch.no_grad()
def partly_kept(rank: Rank, gather: str | None = None) -> dict:
    """A plan where streamed blocks keep their first tensors on the device, on an allgather ring
    (what the planner makes after a measured forward): refused unless final, then bitwise equal,
    each rank holding its share of only what streams; an edit of both parts; no later plan.
    Also run on GPUs (gpu/test_gpu_allgather.py)."""
    device = rank.device
    model = tiny.tiny_wan_transformer(num_layers=4).to(device)
    edited = tiny.tiny_wan_transformer(num_layers=4).to(device)  # the resident model, edited alike below
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(model).items()}
    ref = model(**batch)[0]
    _bump(edited.blocks[0])
    ref_edited = edited(**batch)[0]
    handle = apply_offload(model, allgather_config(gather, text_encoder=False))
    ring = handle.rings[0]
    (before,) = handle.summary()
    cuts = ring.cuts()
    every = [tuple(e.offset for e in l.entries[1:] if e.offset > 0) for l in ring.layouts]
    halves = {i: cuts[i][len(cuts[i]) // 2] for i in (0, 2, 3)}
    out: dict = {"cuts": [len(c) for c in cuts], "offsets": [len(c) for c in every], "errors": []}
    for bad in ({"resident": (), "settle": False, "kept": halves},  # not final
                {"resident": (), "settle": True, "kept": {0: 1}}):  # not a cut
        try:
            ring.apply_plan(bad["resident"], 2, settle=bad["settle"], kept=bad["kept"])
        except ValueError as exc:
            out["errors"].append(str(exc))
    out["unchanged"] = handle.summary() == [before]
    ring.apply_plan((1,), 2, settle=True, kept=halves)
    (row,) = handle.summary()
    out["before"], out["row"] = before, row
    out["kept"] = {i: ring.kept_bytes(i) for i in halves}
    out["streamed_nbytes"] = {i: ring.layouts[i].nbytes - halves[i] for i in halves}
    out["shard_nbytes"] = {i: ring.transfer.plans[i].shard_nbytes for i in halves}
    out["slot_bytes"] = ring.slots[0].numel()
    out["gathered"] = {i: ring.transfer.device_nbytes(i) for i in halves}
    out["equal"] = all(torch.equal(model(**batch)[0], ref) for _ in range(3))
    try:
        ring.apply_plan((), 2, settle=True)
    except ValueError as exc:
        out["errors"].append(str(exc))
    ring.edit_block(0, lambda: _bump(model.blocks[0]))
    out["edited_equal"] = all(torch.equal(model(**batch)[0], ref_edited) for _ in range(2))
    handle.remove()
    out["removed_equal"] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                  edited.state_dict().values()))
    return out


def test_partly_kept_blocks_on_an_allgather_ring():
    check_partly_kept(run_ranks(partly_kept, 2))


def check_partly_kept(results: list[dict]) -> None:
    for r in results:
        # Some cuts of every block survive the padding rule, not always all of them.
        assert all(0 < c <= o for c, o in zip(r["cuts"], r["offsets"])), r
        not_final, not_a_cut, later = r["errors"]
        assert "only in a final plan" in not_final and "cannot keep 1 bytes" in not_a_cut, r["errors"]
        assert "no other plan can follow it" in later
        assert r["unchanged"]
        row, before = r["row"], r["before"]
        assert row["kept_blocks"] == [0, 2, 3] and row["resident_blocks"] == [1]
        assert r["equal"] and r["edited_equal"] and r["removed_equal"]
        for i, kept in r["kept"].items():
            # Each rank holds its half of what streams (plus chunk padding), nothing of the kept part.
            assert kept > 0 and r["shard_nbytes"][i] * 2 - r["streamed_nbytes"][i] < 2 * 256 * 8
            assert r["gathered"][i] - kept <= r["slot_bytes"]
        # Host memory drops by the kept parts and the resident block, on every rank.
        dropped = before["host_bytes"] - row["host_bytes"]
        assert dropped >= (sum(r["kept"].values()) + before["block_bytes"] // 4) / 2 - 4 * 8 * 256, (dropped, r)
        assert row["device_slot_bytes"] < before["device_slot_bytes"]


# -- fallbacks and mismatches ----------------------------------------------------------------
def fallback_then_mismatch(rank: Rank) -> dict:
    """Started without OMNI_OFFLOAD_ALLOW_GLOO: the fallback; then, with it, models that differ
    between the ranks in block count, dtype and values."""
    out = {}
    model = ToyDiT(3)
    x = torch.randn(2, 8)
    ref = model(x)
    handle = apply_offload(model, AG_DIT)
    with torch.no_grad():
        out["fallback_equal"] = torch.equal(model(x), ref)
    out["fallback_summary"] = handle.summary()
    handle.remove()

    os.environ["OMNI_OFFLOAD_ALLOW_GLOO"] = "1"
    models = {"mismatch": tiny.tiny_wan_transformer(num_layers=3 if rank.rank == 0 else 4),
              "dtype_mismatch": tiny.tiny_wan_transformer(num_layers=3, dtype=torch.bfloat16 if rank.rank == 1 else torch.float32),
              "value_mismatch": tiny.tiny_wan_transformer(num_layers=3, seed=rank.rank),
              "tail_mismatch": tiny.tiny_wan_transformer(num_layers=3)}
    if rank.rank == 1:  # the same weights but the last row of one tensor: past its first bytes
        with torch.no_grad():
            models["tail_mismatch"].blocks[1].ffn.net[2].weight[-1].mul_(2)
    for key, model in models.items():
        try:
            apply_offload(model, AG_DIT)
            out[key] = None
        except OffloadConfigError as exc:
            out[key] = str(exc)
    return out


def test_fallback_when_gloo_not_allowed_and_layout_mismatch():
    results = run_ranks(fallback_then_mismatch, 2, env={"OMNI_OFFLOAD_ALLOW_GLOO": None})
    for r in results:
        (row,) = r["fallback_summary"]
        assert r["fallback_equal"]
        assert row["weight_transfer"] == "rank-local"
        assert "OMNI_OFFLOAD_ALLOW_GLOO=1" in row["fallback_reason"]
        assert row["host_bytes"] >= row["block_bytes"]
        # Mismatch is an error on every rank: block counts first, else the first block that differs.
        assert "rank 0 has 3 blocks in transformer, rank 1 has 4" in r["mismatch"], r["mismatch"]
        assert "blocks.0" in r["dtype_mismatch"], r["dtype_mismatch"]
        assert "weights of block blocks.0 differ" in r["value_mismatch"], r["value_mismatch"]
        assert "weights of block blocks.1 differ" in r["tail_mismatch"], r["tail_mismatch"]


# -- host groups -----------------------------------------------------------------------------
def host_groups(rank: Rank) -> dict:
    model = ToyDiT(3, dim=64)
    x = torch.randn(2, 64)
    ref = model(x)
    handle = apply_offload(model, AG_DIT)
    out = {}
    with torch.no_grad():
        out["equal"] = all(torch.equal(model(x), ref) for _ in range(2))
    g = handle.rings[0].transfer.group if handle.summary()[0]["weight_transfer"] == "allgather" else None
    out["group_ranks"] = list(g.ranks) if g else None
    out["summary"] = handle.summary()
    if rank.rank >= 2:  # the second host comes to remove() later: the first does not wait for it
        time.sleep(3.0)
    t0 = time.monotonic()
    handle.remove()
    out["remove_s"] = time.monotonic() - t0
    return out


def test_two_hosts_keep_complete_shard_sets():
    results = run_ranks(host_groups, 4, local_world=2)
    groups = [tuple(r["group_ranks"]) for r in results]
    assert groups == [(0, 1), (0, 1), (2, 3), (2, 3)]
    for r in results:
        assert r["equal"]
        (row,) = r["summary"]
        assert row["weight_transfer"] == "allgather"
    # remove() is collective over the weight group (the host), not the world.
    assert max(r["remove_s"] for r in results[:2]) < 2.0, [r["remove_s"] for r in results]


def test_one_rank_per_host_falls_back():
    results = run_ranks(host_groups, 2, local_world=1)
    for r in results:
        (row,) = r["summary"]
        assert r["equal"] and row["weight_transfer"] == "rank-local"
        assert "single rank" in row["fallback_reason"]


# -- a diverging rank ------------------------------------------------------------------------
def diverge(rank: Rank) -> str:
    """Rank 1 stops taking part after one forward (it idles until rank 0 is done, at most 12 s):
    rank 0 must raise within the timeout."""
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    handle = apply_offload(model, dict(AG_DIT, collective_timeout_s=4))
    with torch.no_grad():
        model(x)
    store = dist.distributed_c10d._get_default_store()  # outside the gloo group rank 0 gives up on
    if rank.rank == 1:
        try:
            store.wait(["rank0 done"], timedelta(seconds=12))
        except Exception:  # noqa: BLE001 - waited the 12 s: the same idling
            pass
        return "idle"
    t0 = time.monotonic()
    try:
        with torch.no_grad():
            model(x)
            model(x)
        result = "no error"
    except Exception as exc:  # gloo raises RuntimeError on timeout
        result = f"{type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}"[:400]
    # From then on the ring refuses at once (its fills no longer pair with the others'), and a
    # remove() that cannot gather changes nothing: the model stays offloaded, hooks and all.
    t0 = time.monotonic()
    after = []
    for call in (lambda: model(x), handle.remove):
        try:
            with torch.no_grad():
                call()
            after.append("no error")
        except RuntimeError as exc:
            after.append(str(exc)[:300])
    refused_in = time.monotonic() - t0
    still_offloaded = bool(handle.rings) and len(model.blocks[0]._forward_hooks) > 0
    store.set("rank0 done", "1")
    del handle
    return {"first": result, "after": after, "refused_in": refused_in, "still_offloaded": still_offloaded}


def test_a_diverging_rank_raises_within_the_timeout():
    r = run_ranks(diverge, 2, broken_group=True, timeout=60)[0]
    msg = r["first"]
    assert msg.startswith("RuntimeError") and "transformer: moving block blocks." in msg, msg
    assert float(msg.split(" after ")[1].split("s")[0]) < 15
    forward, remove = r["after"]
    assert "an earlier fill of this ring failed" in forward and "end the job on every rank" in forward, forward
    assert remove.startswith("remove() changed nothing; the model is still offloaded"), remove
    assert r["refused_in"] < 2 and r["still_offloaded"]


@torch.no_grad()
def one_rank_raises(rank: Rank) -> dict:
    """Rank 1's forward raises (inside block 3, before block 0, and a Ctrl-C in block 2) and
    rank 1 goes on, as a server answering one bad request does; rank 0 runs every forward. Its
    fills used to stay behind rank 0's: later gathers paired with other blocks' and rebuilt
    blocks from mixed shards (same sizes: no error, wrong outputs on both ranks)."""
    model, ref = ToyDiT(6), ToyDiT(6)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    want = ref(x)
    handle = apply_offload(model, AG_DIT)
    equal = [torch.equal(model(x), want)]
    for fault in ("in block", "before the blocks", "interrupt"):
        if rank.rank == 1:
            if fault == "before the blocks":
                bad = (lambda: model(torch.randn(2, 7)))  # noqa: E731 - proj_in refuses the width
            else:
                def boom(mod, args, fault=fault):
                    raise KeyboardInterrupt if fault == "interrupt" else RuntimeError("simulated out of memory")
                hook = model.blocks[2 if fault == "interrupt" else 3].register_forward_pre_hook(boom)
                bad = (lambda: model(x))  # noqa: E731
            try:
                bad()
            except (RuntimeError, KeyboardInterrupt):
                pass
            else:
                raise AssertionError("the fault did not raise")
            finally:
                if fault != "before the blocks":
                    hook.remove()
        else:
            equal.append(torch.equal(model(x), want))
        equal += [torch.equal(model(x), want) for _ in range(2)]
    status = handle.lockstep_status()
    handle.remove()
    return {"equal": equal, "after_remove": torch.equal(model(x), want), "status": status}


def test_a_forward_that_raises_on_one_rank_leaves_the_ranks_in_step():
    results = run_ranks(one_rank_raises, 2)
    for r in results:
        assert all(r["equal"]) and r["after_remove"], r
    # Every fill counted alike on both ranks (what serve compares after each lockstep wave).
    assert results[0]["status"] == results[1]["status"] and results[0]["status"][0] >= 6 * 10


@torch.no_grad()
def uneven_counts(rank: Rank) -> dict:
    """The ranks made different numbers of fills (here: rank 1's count is bumped, as if it had
    moved a block the others did not): remove() says so on every rank and changes nothing."""
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    handle = apply_offload(model, AG_DIT)
    model(x)
    if rank.rank == 1:
        handle.rings[0]._fills += 1
    try:
        handle.remove()
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    return {"message": message, "hooks": len(model.blocks[0]._forward_hooks)}


def test_remove_names_ranks_out_of_step_and_changes_nothing():
    for r in run_ranks(uneven_counts, 2):
        assert "out of step at remove()" in r["message"] and "rank 0: " in r["message"], r
        assert r["message"].startswith("remove() changed nothing") and r["hooks"] > 0


@torch.no_grad()
def different_edits(rank: Rank) -> dict:
    """Rank 1 edits a streamed block differently from rank 0 (as fusing another adapter, or
    another scale, does): each would write back its own shard of a different edit, and the next
    gather would stitch them, wrong on both. Then the same edit on both ranks, kept."""
    model = ToyDiT(3, dim=64)
    x = torch.randn(2, 64)
    ref = model(x)
    handle = apply_offload(model, allgather_config(text_encoder=False))
    ring = handle.rings[0]
    out = {"transfer": handle.summary()[0]["weight_transfer"]}
    try:
        ring.edit_block(1, lambda: model.blocks[1].lin.weight.add_(1.0 + rank.rank))
        out["edit"] = None
    except RuntimeError as exc:
        out["edit"] = str(exc)
    out["unchanged"] = torch.equal(model(x), ref)  # the shards kept the block as it was
    ring.edit_block(1, lambda: model.blocks[1].lin.weight.add_(1.0))
    reference = ToyDiT(3, dim=64)
    reference.blocks[1].lin.weight.add_(1.0)
    out["same_edit"] = torch.equal(model(x), reference(x))
    handle.remove()
    return out


def test_ranks_that_edit_a_block_differently_are_refused():
    for r in run_ranks(different_edits, 2):
        assert r["transfer"] == "allgather", r
        assert "edited block blocks.1 differently" in r["edit"] and r["unchanged"] and r["same_edit"], r
