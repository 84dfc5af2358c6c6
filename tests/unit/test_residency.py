"""``layer_options.<component>.resident_blocks``: blocks that stay on the device instead of
streaming, bitwise equal to the resident model, with no host copy."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models as tiny
from omni_dist_offload import OffloadConfig, OffloadConfigError, apply_offload
from omni_dist_offload.layout import layout_block
from omni_dist_offload.plan import module_bytes
from toys import ToyDiT


def _cfg(resident, component: str = "dit") -> dict:
    return {"mode": "layer", "components": [component],
            "layer_options": {component: {"resident_blocks": resident}}}


def _generate(pipe):
    return pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), output_type="pt",
                **tiny.TINY_WAN_DEFAULTS).frames


@torch.no_grad()
def test_a_count_keeps_the_blocks_that_shorten_the_copies_most():
    """``resident_blocks`` as a count: the planner picks which. The tiny Flux's two dual-stream
    blocks are twice its single-stream ones: keeping both leaves the single-stream blocks to
    stream, through slots of their size. (An even spread kept one block of each kind, and the
    other dual-stream block streamed through slots of its size.)"""
    model = tiny.tiny_flux_transformer()
    inputs = tiny.flux_transformer_inputs(model)
    ref = model(**inputs)[0]
    double = min(module_bytes(b) for b in model.transformer_blocks)
    single = max(module_bytes(b) for b in model.single_transformer_blocks)
    assert double > 2 * single
    handle = apply_offload(model, _cfg(2))
    (row,) = handle.summary_rows()
    assert row.resident_blocks == [0, 1] and row.device_slot_bytes < 2 * double
    for _ in range(2):
        assert torch.equal(model(**inputs)[0], ref)
    handle.remove()
    assert torch.equal(model(**inputs)[0], ref)


@pytest.mark.parametrize("resident, expected", [([1, 3], [1, 3]), ([4, 0], [0, 4]), (2, [1, 3]), (1, [2]),
                                                (4, [0, 1, 3, 4]), (0, [])])
def test_resident_blocks_stay_put_and_outputs_stay_bitwise_equal(resident, expected):
    model = ToyDiT(5)
    x = torch.randn(2, 8)
    ref = model(x)
    handle = apply_offload(model, _cfg(resident))
    (row,) = handle.summary_rows()
    assert row.resident_blocks == expected and row.num_blocks == 5 - len(expected)
    assert row.resident_bytes == sum(module_bytes(model.blocks[i]) for i in expected)
    assert row.block_bytes + row.resident_bytes == sum(module_bytes(b) for b in model.blocks)
    # Only the streamed blocks have host buffers (the toy's blocks are all of one size).
    full = apply_offload(ToyDiT(5), _cfg(None))
    assert row.host_bytes * 5 == full.summary_rows()[0].host_bytes * (5 - len(expected))
    full.remove()
    def storage(i):
        return [p.data_ptr() for p in model.blocks[i].parameters()]

    before = {i: storage(i) for i in range(5)}
    seen = {i: set() for i in range(5)}
    # A pre-hook registered after the ring's sees what the block runs with.
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: seen[i].add(tuple(storage(i))))
             for i, b in enumerate(model.blocks)]
    with torch.no_grad():
        for _ in range(3):  # across the wrap to block 0
            assert torch.equal(model(x), ref)
    for h in hooks:
        h.remove()
    for i in range(5):  # resident blocks run from where they stay; streamed ones from a slot
        assert (seen[i] == {tuple(before[i])}) == (i in expected)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_a_wan_pipeline_with_resident_dit_and_encoder_blocks_is_bitwise_equal():
    ref = _generate(tiny.tiny_wan_pipeline(seed=1))
    pipe = tiny.tiny_wan_pipeline(seed=1)
    cfg = {"mode": "layer", "components": ["dit", "text_encoder"],
           "layer_options": {"dit": {"resident_blocks": [1]}, "text_encoder": {"resident_blocks": 1}}}
    handle = apply_offload(pipe, cfg)
    assert {r.component: r.resident_blocks for r in handle.summary_rows()} == {"transformer": [1], "text_encoder": [1]}
    assert torch.equal(_generate(pipe), ref) and torch.equal(_generate(pipe), ref)
    handle.remove()


@pytest.mark.parametrize("resident, message", [
    (5, "resident_blocks is 5, but the component has 5 blocks: keep at most 4"),
    ([0, 5], "lists [5], but the component has 5 blocks (indices 0 to 4)"),
    ([0, 1, 2, 3, 4], "lists every block of the component"),
])
def test_out_of_range_is_an_error_before_anything_changes(resident, message):
    model = ToyDiT(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OffloadConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")) as info:
        apply_offload(model, _cfg(resident))
    assert "layer_options.dit.resident_blocks" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(b._forward_pre_hooks for b in model.blocks)


@pytest.mark.parametrize("value", [-1, True, 1.5, "2", [1, 1], [0, -2], [0, 1.0], {"a": 1}])
def test_bad_values_name_the_key(value):
    with pytest.raises(OffloadConfigError, match="layer_options.dit key 'resident_blocks'"):
        OffloadConfig.parse(_cfg(value))


def test_the_config_round_trips():
    cfg = OffloadConfig.parse(_cfg([3, 1]))
    assert cfg.options_for("dit").resident_blocks == (1, 3)
    assert cfg.to_dict()["layer_options"]["dit"]["resident_blocks"] == [1, 3]
    assert OffloadConfig.parse(cfg.to_dict()) == cfg


# -- device_budget ------------------------------------------------------------------------------
def _block_nbytes(model) -> int:
    from omni_dist_offload.layout import layout_block
    return layout_block(0, "blocks.0", model.blocks[0]).nbytes


def _budget_cfg(budget, **extra) -> dict:
    return {"mode": "layer", "components": ["dit"], "device_budget": budget, **extra}


@torch.no_grad()
def test_a_budget_plans_then_replans_once_from_a_measured_forward():
    model = ToyDiT(8, dim=32)
    x = torch.randn(4, 32)
    ref = model(x)
    blk = _block_nbytes(model)
    budget = 5 * blk
    handle = apply_offload(model, _budget_cfg(budget))
    (before,) = handle.summary()
    # Before anything is measured: a plan within the budget, every block keeps its host copy.
    assert before["device_budget"] == budget and before["predicted_ratio"] is None
    assert before["resident_bytes"] + before["device_slot_bytes"] <= budget
    assert before["host_bytes"] == 8 * blk and 0 < len(before["resident_blocks"]) < 8
    rows = []
    for _ in range(4):
        assert torch.equal(model(x), ref)
        rows.append(handle.summary()[0])
    first, second, *later = rows
    assert first == before  # the first forward only warms up
    assert second["predicted_ratio"] is not None and second["predicted_ratio"] >= 1.0 - 1e-9
    assert second["resident_bytes"] + second["device_slot_bytes"] <= budget
    # Settled: the resident blocks gave up their host copies.
    assert second["host_bytes"] == (8 - len(second["resident_blocks"])) * blk
    assert all(r == second for r in later)  # planned once, never again
    ring = handle.rings[0]
    assert ring.tracer is None and ring.plan.measured
    handle.remove()
    assert torch.equal(model(x), ref)


@torch.no_grad()
def test_a_settled_plan_frees_the_host_copies_of_its_resident_blocks():
    """host_bytes dropped, but views the ring kept of those copies held them: the host memory of
    every resident block stayed allocated until remove()."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    model = ToyDiT(8, dim=32)
    x = torch.randn(4, 32)
    handle = apply_offload(model, _budget_cfg(5 * _block_nbytes(model)))
    ring = handle.rings[0]
    copies = [StorageWeakRef(b.tensor.untyped_storage()) if b is not None else None for b in ring.transfer.buffers]
    for _ in range(3):
        model(x)
    resident = handle.summary()[0]["resident_blocks"]
    assert resident and ring.plan.measured
    gc.collect()
    held = [i for i in resident if copies[i] is not None and not copies[i].expired()]
    assert held == [], f"host copies of resident blocks {held} are still allocated"
    assert all(not copies[i].expired() for i in range(8) if i not in resident)
    handle.remove()


def _wan_under_budget(share: float):
    import copy

    base = tiny.tiny_wan_transformer(num_layers=6, seed=0)
    total = sum(layout_block(i, f"blocks.{i}", b).nbytes for i, b in enumerate(base.blocks))
    model = copy.deepcopy(base)
    handle = apply_offload(model, _budget_cfg(int(share * total)), device="cpu")
    return base, model, handle, tiny.wan_transformer_inputs(base)


def _give_new_storage(model, i: int, name: str) -> torch.Tensor:
    weight = dict(model.blocks[i].named_parameters())[name]
    weight.data = torch.randn(weight.shape, generator=torch.Generator().manual_seed(7), dtype=weight.dtype)
    return weight.data


@torch.no_grad()
def test_new_storage_on_a_block_kept_on_the_device_is_taken_in_by_the_replan():
    """``tensor.data = new`` (same dtype and shape) on a block the first plan keeps resident:
    the re-plan that streams it again pointed its tensors back at the stale host copy, and
    every later forward (and the model after remove()) silently ran the old values."""
    ref, model, handle, batch = _wan_under_budget(0.6)
    (i, *_) = handle.summary()[0]["resident_blocks"]
    for m in (ref, model):
        _give_new_storage(m, i, "ffn.net.0.proj.weight")
    for _ in range(4):
        assert torch.equal(model(**batch)[0], ref(**batch)[0])
    assert handle.rings[0].plan.measured and i not in handle.summary()[0]["resident_blocks"]  # it moved
    handle.remove()
    assert torch.equal(model(**batch)[0], ref(**batch)[0])


@torch.no_grad()
def test_new_storage_on_a_kept_part_is_what_remove_leaves():
    """A partly kept block's kept tensor given new storage after the last forward: remove()
    rebuilt it from the kept buffer, bringing the old values back."""
    ref, model, handle, batch = _wan_under_budget(0.6)
    for _ in range(3):
        model(**batch)
    ring = handle.rings[0]
    (i, *_) = ring.kept_blocks()
    name = ring.layouts[i].entries[0].name.removeprefix(f"blocks.{i}.")
    new = _give_new_storage(model, i, name)
    _give_new_storage(ref, i, name)
    assert torch.equal(model(**batch)[0], ref(**batch)[0])
    new = _give_new_storage(model, i, name)  # after the last forward
    handle.remove()
    assert dict(model.blocks[i].named_parameters())[name].data_ptr() == new.data_ptr()


@torch.no_grad()
def test_another_shape_on_a_block_kept_on_the_device_is_refused_by_a_plan_change():
    """(A module that takes it: the two tensors of a LoRA grown by a hotswap.)"""
    _, model, handle, batch = _wan_under_budget(0.6)
    ring = handle.rings[0]
    (i, *_) = handle.summary()[0]["resident_blocks"]
    weight = dict(model.blocks[i].named_parameters())["ffn.net.0.proj.weight"]
    old = weight.data
    weight.data = torch.zeros(weight.shape[0], weight.shape[1] + 1)
    with pytest.raises(RuntimeError, match=rf"blocks\.{i}\.ffn\.net\.0\.proj\.weight became torch.float32 "
                                           r"\(\d+, \d+\) after apply_offload \(the ring keeps it on the device"):
        ring.apply_plan((), 2, settle=False)
    assert ring.resident == {i} and weight.shape[1] == old.shape[1] + 1  # nothing changed
    weight.data = old
    ring.apply_plan((), 2, settle=False)
    assert not ring.resident
    handle.remove()


@pytest.mark.parametrize("budget", ["1KiB", 100])
def test_a_budget_below_two_slots_is_an_error_before_anything_changes(budget):
    model = ToyDiT(4, dim=32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    smallest = 2 * _block_nbytes(model)
    with pytest.raises(OffloadConfigError, match=rf"config key 'device_budget' is .* below the smallest budget "
                                                 rf"that works here, .* \({smallest} bytes\)"):
        apply_offload(model, _budget_cfg(budget))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(b._forward_pre_hooks for b in model.blocks)


@torch.no_grad()
def test_a_budget_that_holds_every_block_keeps_them_all_resident():
    model = ToyDiT(4, dim=32)
    x = torch.randn(2, 32)
    ref = model(x)
    handle = apply_offload(model, _budget_cfg(4 * _block_nbytes(model)))
    (row,) = handle.summary()
    assert row["resident_blocks"] == [0, 1, 2, 3] and row["num_blocks"] == 0
    assert row["host_bytes"] == 0 and row["device_slot_bytes"] == 0
    assert torch.equal(model(x), ref) and torch.equal(model(x), ref)
    handle.remove()
    assert torch.equal(model(x), ref)


@torch.no_grad()
def test_auto_keeps_a_model_that_fits_resident_and_says_so(caplog):
    model = ToyDiT(4, dim=32)
    x = torch.randn(2, 32)
    ref = model(x)
    with caplog.at_level("INFO", logger="omni_dist_offload.budget"):
        handle = apply_offload(model, _budget_cfg("auto"))
    assert "every block of ['transformer'] fits and stays resident" in caplog.text
    (row,) = handle.summary()
    assert row["resident_blocks"] == [0, 1, 2, 3] and row["predicted_ratio"] == 1.0
    assert torch.equal(model(x), ref)
    handle.remove()


@torch.no_grad()
def test_auto_under_a_small_device_plans_the_fewest_resident_blocks(monkeypatch):
    import omni_dist_offload.budget as budget_mod
    model = ToyDiT(8, dim=32)
    x = torch.randn(4, 32)
    ref = model(x)
    blk = _block_nbytes(model)
    monkeypatch.setattr(budget_mod, "free_device_bytes", lambda dev: 6 * blk)
    handle = apply_offload(model, _budget_cfg("auto", activation_reserve=blk))
    (row,) = handle.summary()
    assert row["device_budget"] == 5 * blk  # free, less the reserve (the rest is already on the device)
    for _ in range(3):
        assert torch.equal(model(x), ref)
    (row,) = handle.summary()
    plan = handle.rings[0].plan
    # Planned from the measured forward, within the budget (which plan is fewest depends on CPU
    # timings here; test_planner checks that choice on fixed costs).
    assert plan.measured and plan.predicted_ratio is not None
    assert plan.device_bytes <= 5 * blk and row["resident_bytes"] + row["device_slot_bytes"] <= 5 * blk
    handle.remove()


@torch.no_grad()
def test_the_budget_goes_to_the_dit_first_then_the_text_encoder():
    pipe = tiny.tiny_wan_pipeline(seed=1)
    from omni_dist_offload.layout import layout_block
    dit_blocks = [layout_block(i, "b", b).nbytes for i, b in enumerate(pipe.transformer.blocks)]
    enc_blocks = [layout_block(i, "b", b).nbytes for i, b in enumerate(pipe.text_encoder.encoder.block)]
    floors = 2 * max(dit_blocks) + 2 * max(enc_blocks)
    budget = floors + sum(dit_blocks) - 2 * max(dit_blocks)  # exactly what the DiT could use
    cfg = {"mode": "layer", "components": ["dit", "text_encoder"], "device_budget": budget}
    handle = apply_offload(pipe, cfg)
    shares = {r["component"]: r["device_budget"] for r in handle.summary()}
    assert shares == {"transformer": sum(dit_blocks), "text_encoder": 2 * max(enc_blocks)}
    handle.remove()


@torch.no_grad()
def test_resident_blocks_override_the_planner_for_their_component():
    pipe = tiny.tiny_wan_pipeline(seed=1)
    cfg = {"mode": "layer", "components": ["dit", "text_encoder"], "device_budget": "1GiB",
           "layer_options": {"text_encoder": {"resident_blocks": [0]}}}
    handle = apply_offload(pipe, cfg)
    rows = {r["component"]: r for r in handle.summary()}
    assert rows["text_encoder"]["resident_blocks"] == [0] and rows["text_encoder"]["device_budget"] is None
    assert rows["transformer"]["device_budget"] is not None
    handle.remove()


def test_budget_keys_round_trip():
    cfg = OffloadConfig.parse(_budget_cfg("24GiB"))
    assert cfg.device_budget == 24 * 2**30 and OffloadConfig.parse(cfg.to_dict()) == cfg
    cfg = OffloadConfig.parse(_budget_cfg("auto", activation_reserve="512MiB"))
    assert cfg.device_budget == "auto" and cfg.activation_reserve == 512 * 2**20
    assert OffloadConfig.parse(cfg.to_dict()) == cfg
    # A reserve is what "auto" leaves free: with any other budget it would do nothing.
    for budget in ("24GiB", None):
        with pytest.raises(OffloadConfigError, match=r"'activation_reserve' \('512MiB'\) is what device_budget "
                                                     r"\"auto\" leaves free"):
            OffloadConfig.parse(_budget_cfg(budget, activation_reserve="512MiB"))


def test_a_plan_made_under_inference_mode_leaves_ordinary_tensors():
    """The re-plan runs inside the forward (often under inference_mode): remove() afterwards,
    outside it, must still be able to write the slots and buffers it made."""
    model = ToyDiT(8, dim=32)
    x = torch.randn(4, 32)
    ref = model(x)
    handle = apply_offload(model, _budget_cfg(5 * _block_nbytes(model)))
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), ref)
    assert handle.rings[0].plan.measured
    assert not any(s.is_inference() for s in handle.rings[0].slots)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(x), ref)


@torch.inference_mode()
def test_a_plan_for_a_model_offloaded_under_inference_mode():
    model = ToyDiT(8, dim=32)
    x = torch.randn(4, 32)
    ref = model(x)
    handle = apply_offload(model, _budget_cfg(5 * _block_nbytes(model)))
    for _ in range(4):
        assert torch.equal(model(x), ref)
    assert handle.rings[0].plan.measured
    handle.remove()
    assert torch.equal(model(x), ref)


def test_a_ring_resident_for_good_installs_no_hooks():
    model = ToyDiT(4, dim=32)
    handle = apply_offload(model, _budget_cfg(4 * _block_nbytes(model)))
    assert handle.summary()[0]["resident_blocks"] == [0, 1, 2, 3]
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in model.blocks)
    handle.remove()


def test_a_pipeline_under_a_budget_replans_each_ring_and_stays_bitwise_equal():
    """DiT and text encoder share a budget; each ring plans from its own measured forward (the
    DiT's second call is the first step's second guidance pass, the encoder's its second
    prompt), and generations before and after the plans match the resident pipeline."""
    ref = _generate(tiny.tiny_wan_pipeline(seed=1))
    pipe = tiny.tiny_wan_pipeline(seed=1)
    from omni_dist_offload.layout import layout_block
    dit = sum(layout_block(i, "b", b).nbytes for i, b in enumerate(pipe.transformer.blocks))
    enc = sum(layout_block(i, "b", b).nbytes for i, b in enumerate(pipe.text_encoder.encoder.block))
    cfg = {"mode": "layer", "components": ["dit", "text_encoder"], "device_budget": int(0.7 * (dit + enc))}
    handle = apply_offload(pipe, cfg)
    for _ in range(2):
        assert torch.equal(_generate(pipe), ref)
    rows = {r["component"]: r for r in handle.summary()}
    assert all(r["device_budget"] is not None for r in rows.values())
    assert sum(r["resident_bytes"] + r["device_slot_bytes"] for r in rows.values()) <= cfg["device_budget"] + 4096
    assert all(ring.plan is not None and (ring.plan.measured or not ring.streamed) for ring in handle.rings)
    handle.remove()
    assert torch.equal(_generate(pipe), ref)


# -- blocks that keep a part on the device ---------------------------------------------------------
def test_a_rank_local_host_copy_gives_up_a_kept_part(monkeypatch):
    from faults import only_pinned
    from omni_dist_offload.hostmem import HostBuffer, PinMemoryError
    from omni_dist_offload.transfer.protocol import TransferStreams
    from omni_dist_offload.transfer.rank_local import RankLocalTransfer

    image = torch.randint(0, 256, (70_000,), dtype=torch.uint8)
    start = 20_480

    def transfer() -> RankLocalTransfer:
        buf = HostBuffer(image.numel())
        buf.tensor.copy_(image)
        return RankLocalTransfer([buf], [image.numel()], TransferStreams(), torch.device("cpu"))

    t = transfer()
    host = t.keep_part(0, start, image[start:])
    assert t.host_bytes() == image.numel() - start and torch.equal(host, image[start:])
    # Fills and write-backs still address the block: from the cut on, and nothing before it.
    dst = torch.zeros(image.numel() - start, dtype=torch.uint8)
    t.fill(0, dst, None, None, start=start)
    assert torch.equal(dst, image[start:])
    t.write_back(0, torch.full((10,), 7, dtype=torch.uint8), start=start + 5)
    assert host[5:15].eq(7).all() and torch.equal(host[15:], image[start + 15:])
    with pytest.raises(ValueError, match="starts at byte 20480 .* found start=0"):
        t.fill(0, torch.zeros(image.numel(), dtype=torch.uint8), None, None)
    with pytest.raises(ValueError, match="already keeps its first 20480 bytes"):
        t.keep_part(0, start, image[start:])
    for bad in (0, image.numel()):
        with pytest.raises(ValueError, match="cannot keep"):
            transfer().keep_part(0, bad, image[bad:])
    dropped = transfer()
    dropped.drop(0)
    with pytest.raises(ValueError, match="no host copy"):
        dropped.keep_part(0, start, image[start:])

    # A page-locked copy: the old one is unlocked first, and locked again if the new one cannot
    # be; the block then streams from it as before.
    t = transfer()
    old = t.buffers[0]
    calls = only_pinned(monkeypatch, old)
    with pytest.raises(PinMemoryError):
        t.keep_part(0, start, image[start:])
    assert calls == ["release", "pin", "pin"] and old.pinned and t.buffers[0] is old
    dst = torch.zeros(image.numel(), dtype=torch.uint8)
    t.fill(0, dst, None, None)
    assert torch.equal(dst, image)


@pytest.mark.parametrize("how", ["copy_", "unseen"])  # unseen: .data.copy_, as peft's hotswap writes
@torch.no_grad()
def test_weights_written_to_blocks_on_the_device_reach_a_plan_that_streams_them_again(how):
    """A plan that is not final keeps host copies of what it keeps on the device; a write
    between forwards lands on the device only, and a later plan that streams those blocks
    again first writes it back (a re-plan used to bring the stale host copies back)."""
    model, other = ToyDiT(6, dim=32), ToyDiT(6, dim=32, seed=1)
    x = torch.randn(4, 32)
    want = other(x)
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"]})
    ring = handle.rings[0]
    cuts = ring.cuts()
    ring.apply_plan((1, 4), 2, settle=False, kept={2: cuts[2][0]})
    for p, q in zip(model.state_dict(keep_vars=True).values(), other.state_dict().values()):
        if how == "copy_":
            p.copy_(q)
        else:
            p.data.copy_(q)
    if how == "unseen":
        ring.forget_slots()  # what the wrapper of load_lora_adapter does after a hotswap
    assert torch.equal(model(x), want)
    ring.apply_plan((0,), 2, settle=False)  # 1, 4 and the kept part of 2 stream again
    for _ in range(2):
        assert torch.equal(model(x), want)
    handle.remove()
    assert torch.equal(model(x), want)


def test_streamed_blocks_that_keep_their_first_tensors_stay_bitwise_equal():
    model = tiny.tiny_wan_transformer(num_layers=4)
    batch = tiny.wan_transformer_inputs(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(**batch)[0]
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"]})
    ring = handle.rings[0]
    cuts = ring.cuts()
    (before,) = handle.summary()
    halves = {i: cuts[i][len(cuts[i]) // 2] for i in (0, 2, 3)}
    for bad in ({0: 1}, {1: cuts[1][0], 5: 256}):  # not a cut; no such block
        with pytest.raises(ValueError, match="cannot keep"):
            ring.apply_plan((), 2, settle=False, kept=bad)
        assert handle.summary() == [before]  # bad input changed nothing
    # A plan that does not settle keeps whole host copies: another plan may follow it.
    ring.apply_plan((), 2, settle=False, kept=halves)
    (row,) = handle.summary()
    assert row["kept_blocks"] == [0, 2, 3] and row["host_bytes"] == before["host_bytes"]
    with torch.no_grad():
        assert torch.equal(model(**batch)[0], ref)
    ring.apply_plan((1,), 2, settle=True, kept=halves)
    (row,) = handle.summary()
    assert row["kept_blocks"] == [0, 2, 3] and row["resident_blocks"] == [1]
    kept = ring.kept_tensor_bytes()
    assert 0 < kept and row["resident_bytes"] == module_bytes(model.blocks[1]) + kept
    # Settled: the kept parts left the host copies, as the resident block did.
    resident_host = layout_block(1, "b", model.blocks[1]).nbytes
    assert row["host_bytes"] == before["host_bytes"] - resident_host - sum(halves.values())
    # Slots hold only the parts that stream: smaller than the largest block.
    assert row["device_slot_bytes"] < before["device_slot_bytes"]
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(**batch)[0], ref)
    # The kept tensors live on the device for good, the others only while their block runs.
    # The layout puts the largest first, so the kept part is the block's largest tensors.
    first, *_, last = ring.layouts[0].entries
    assert first.tensor.data_ptr() == ring._kept_bufs[0].data_ptr()
    assert first.nbytes == max(t.nbytes for t in model.blocks[0].parameters()) >= last.nbytes
    # The plan is final: another is refused, and changes nothing.
    with pytest.raises(ValueError, match="no other plan"):
        ring.apply_plan((), 2, settle=True)
    assert handle.summary() == [row]
    # An edit of a partly kept block lands in both parts: the kept one on the device, the rest
    # in the host copy that now starts at the cut.
    edited = tiny.tiny_wan_transformer(num_layers=4)
    edited.load_state_dict(state)
    with torch.no_grad():
        for t in edited.blocks[0].parameters():
            t.mul_(2)
        want = edited(**batch)[0]
        ring.edit_block(0, lambda: [t.mul_(2) for t in model.blocks[0].parameters()])
        for _ in range(2):
            assert torch.equal(model(**batch)[0], want)
    handle.remove()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in edited.state_dict().items())


@torch.no_grad()
def test_a_forward_cut_short_is_not_counted_as_the_gap_before_the_measured_one():
    """The forward after one that raised is measured with no gap before it (the end before the
    failed forward says nothing of it), and outputs stay equal."""
    model = ToyDiT(8, dim=32)
    x = torch.randn(4, 32)
    ref = model(x)
    handle = apply_offload(model, _budget_cfg(5 * _block_nbytes(model)))
    assert torch.equal(model(x), ref)  # the warm-up forward

    def boom(module, args):
        raise RuntimeError("boom")

    hook = model.blocks[5].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    hook.remove()
    assert torch.equal(model(x), ref)  # measured, then planned
    ring = handle.rings[0]
    assert ring.plan.measured and ring.costs.gap_ms == 0.0
    handle.remove()


@torch.no_grad()
def test_a_forward_in_which_a_cache_skips_a_resident_block_is_not_measured():
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip

    model = tiny.tiny_wan_transformer(num_layers=8, seed=0)
    inputs = tiny.wan_transformer_inputs(model)
    nbytes = module_bytes(model.blocks[0])
    handle = apply_offload(model, _budget_cfg(5 * nbytes))
    ring = handle.rings[0]
    skipped = sorted(ring.on_device())[1]
    apply_layer_skip(model, LayerSkipConfig(indices=[skipped], fqn="blocks", skip_attention=True, skip_ff=True))
    for _ in range(3):
        model(**inputs)
    assert not ring.plan.measured and ring.costs is None  # waits for a forward that runs every block
    handle.remove()


@torch.no_grad()
def test_a_plan_change_that_cannot_allocate_its_slots_leaves_a_ring_that_recovers():
    """The re-plan's new slots cannot be had (the device out of memory): the error reaches the
    forward that planned; a ring left with no slots says so at its next block, and streams again
    once they can be had; remove() gives the weights back. Bad plans change nothing."""
    model = ToyDiT(8, dim=32)
    x = torch.randn(4, 32)
    ref = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    block = layout_block(0, "b", model.blocks[0]).nbytes
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "device_budget": 5 * block})
    ring = handle.rings[0]
    before = sorted(ring.resident)
    for resident, slots, message in (([1.5], 2, "no block 1.5"), ([-1], 2, "no block -1"), ([9], 2, "no block 9"),
                                     ([0], 1, "needs at least 2 slots, found 1")):
        with pytest.raises(ValueError, match=message):
            ring.apply_plan(resident, slots, settle=False)
        assert sorted(ring.resident) == before and len(ring.slots) == 2
    assert torch.equal(model(x), ref)  # the first forward: not measured
    real = ring.transfer.allocate_slots

    def no_memory(nbytes, count):
        if nbytes:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real(nbytes, count)

    ring.transfer.allocate_slots = no_memory
    with pytest.raises(torch.OutOfMemoryError):
        model(x)  # measured: the re-plan cannot have its slots
    with pytest.raises(RuntimeError, match=r"has no device slots to stream it through .* call remove\(\)"):
        model(x)
    ring.transfer.allocate_slots = real
    assert torch.equal(model(x), ref) and torch.equal(model(x), ref)
    handle.remove()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@torch.no_grad()
def test_a_final_plan_cut_short_part_way_through_its_kept_blocks_is_applied_again_as_it_was(monkeypatch):
    """The re-plan fails at its second partly kept block (the device out of memory), after the
    first gave up its host bytes: every later forward used to be refused ("keep parts on the
    device for good"). The same plan is applied again after the next forward, and the ring
    streams on, bitwise."""
    from omni_dist_offload import ring as ring_module

    base = tiny.tiny_wan_transformer(num_layers=6, seed=0)
    total = sum(layout_block(i, f"blocks.{i}", b).nbytes for i, b in enumerate(base.blocks))
    model = copy.deepcopy(base)
    inputs = tiny.wan_transformer_inputs(base)
    ref = base(**inputs)[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "device_budget": int(0.6 * total)})
    real, calls = ring_module.BlockRing._filled_on_device, []

    def whole(self, i, *args):
        calls.append(i)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real(self, i, *args)

    monkeypatch.setattr(ring_module.BlockRing, "_filled_on_device", whole)
    assert torch.equal(model(**inputs)[0], ref)  # the first forward: not measured
    with pytest.raises(torch.OutOfMemoryError):
        model(**inputs)  # measured: the plan fails at its second kept block
    ring = handle.rings[0]
    assert len(ring._kept_off_host) == 1
    for _ in range(3):
        assert torch.equal(model(**inputs)[0], ref)
    assert len(handle.summary()[0]["kept_blocks"]) >= 2 and ring.plan is not None
    assert sorted(ring.kept_blocks()) == sorted(i for i, _ in ring.plan.kept)
    handle.remove()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@torch.no_grad()
def test_an_8_bit_ring_whose_images_cannot_be_held_streams_on():
    model = tiny.tiny_wan_transformer(num_layers=6)
    inputs = tiny.wan_transformer_inputs(model)
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}
    probe = apply_offload(model, config, device="cpu")
    ring = probe.rings[0]
    whole = sum(ring.transfer.inner.device_nbytes(i) for i in range(6)) + 2 * max(l.nbytes for l in ring.layouts)
    ref = model(**inputs)[0]
    probe.remove()
    handle = apply_offload(model, dict(config, device_budget=int(0.7 * whole)), device="cpu")
    ring = handle.rings[0]
    assert torch.equal(model(**inputs)[0], ref)
    real = ring.transfer.hold
    ring.transfer.hold = lambda blocks: (_ for _ in ()).throw(torch.OutOfMemoryError("out of memory (test)"))
    with pytest.raises(torch.OutOfMemoryError):
        model(**inputs)  # measured: the re-plan cannot hold its images
    assert len(ring.slots) == 2  # streaming on through the fewest slots
    ring.transfer.hold = real
    assert torch.equal(model(**inputs)[0], ref) and torch.equal(model(**inputs)[0], ref)
    handle.remove()
