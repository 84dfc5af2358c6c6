"""CUDA path under a device budget: the memory bound (blocks streamed as they are, and as 8-bit
images), bitwise parity, no synchronisation once the plan is final, and ``auto`` under a capped
device."""

import copy
import gc

import pytest
import torch

import tiny_models as tiny
from omni_dist_offload import apply_offload

pytestmark = pytest.mark.gpu


def _measured_model():
    """The wide-FFN Wan DiT on the GPU, resident, and what it takes there: (model, batch, output,
    device bytes allocated before it, per-block bytes, non-block bytes, activation bytes)."""
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    model = tiny.wide_ffn_wan_transformer(num_layers=8).cuda()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(model).items()}
    block_bytes = [sum(t.numel() * t.element_size() for t in [*b.parameters(), *b.buffers()]) for b in model.blocks]
    total = torch.cuda.memory_allocated() - start
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        out = model(**batch)[0]
    activations = torch.cuda.max_memory_allocated() - start - total
    return model, batch, out, start, block_bytes, total - sum(block_bytes), activations


@pytest.mark.parametrize("share", [0.45, 0.7])
def test_peak_memory_is_nonblock_plus_budget_plus_activations(share):
    model, batch, ref, start, block_bytes, nonblock, activations = _measured_model()
    budget = int(share * sum(block_bytes))
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "device_budget": budget})
    with torch.inference_mode():
        for _ in range(3):  # warm-up, the measured forward, the plan in force
            assert torch.equal(model(**batch)[0], ref)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = model(**batch)[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, ref)
    (row,) = handle.summary()
    assert row["predicted_ratio"] is not None and (row["resident_blocks"] or row["kept_blocks"])
    assert row["resident_bytes"] + row["device_slot_bytes"] <= budget + 256 * len(block_bytes)
    peak = torch.cuda.max_memory_allocated() - start
    assert peak <= nonblock + budget + activations + 64 * 1024
    handle.remove()
    del out, ref


@pytest.mark.parametrize(("share", "upcast"), [(0.45, None), (0.7, None), (0.45, "block")])
def test_the_plan_change_keeps_to_the_budget(share, upcast):
    """The plan made after the measured forward comes in within the budget too: what it makes
    resident or keeps in part is copied straight to where it stays, after the old slots went,
    so the change adds no more than the budget leaves beside the old plan (no block passes
    through a staging buffer next to its own)."""
    model, batch, ref, start, block_bytes, nonblock, activations = _measured_model()
    config = {"mode": "layer", "components": ["dit"], "device_budget": int(share * sum(block_bytes))}
    if upcast is not None:
        del ref
        config["layer_options"] = {"dit": {"storage_dtype": "float8_e4m3fn", "upcast": upcast}}
    handle = apply_offload(model, config)
    ring, changes = handle.rings[0], []
    real = ring.apply_plan

    def measured(*args, **kwargs):
        (row,) = handle.summary()  # the plan in force until now, within the budget
        torch.cuda.synchronize()
        entry = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        real(*args, **kwargs)
        torch.cuda.synchronize()
        changes.append((torch.cuda.max_memory_allocated() - entry,
                        config["device_budget"] - row["resident_bytes"] - row["device_slot_bytes"]))

    ring.apply_plan = measured
    with torch.inference_mode():
        for _ in range(3):  # warm-up, the measured forward (then the change), the plan in force
            out = model(**batch)[0]
            if upcast is None:
                assert torch.equal(out, ref)
    (row,) = handle.summary()
    assert changes and (row["resident_blocks"] or row["kept_blocks"])
    for added, room in changes:
        assert added <= max(room, 0) + 64 * 1024, (added, room)
    handle.remove()


@torch.inference_mode()
def test_blocks_kept_in_part_come_in_without_a_staging_buffer():
    """A plan that keeps most of every block on the device and streams the rest through small
    slots: each kept part is copied straight to its buffer. It used to come through a staging
    buffer of the whole block beside it, so the change held a block more than its plan (the
    new slots, of the small rests, had no room for it)."""
    model, batch, ref, start, block_bytes, nonblock, activations = _measured_model()
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"]})
    ring = handle.rings[0]
    assert torch.equal(model(**batch)[0], ref)
    (before,) = handle.summary()
    kept = {i: max(cuts) for i, cuts in enumerate(ring.cuts())}
    torch.cuda.synchronize()
    entry = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ring.apply_plan((), 2, settle=False, kept=kept)
    added = torch.cuda.max_memory_allocated() - entry
    (after,) = handle.summary()
    assert after["kept_blocks"] == sorted(kept)
    room = (after["resident_bytes"] + after["device_slot_bytes"]) - (before["resident_bytes"] + before["device_slot_bytes"])
    largest = max(block_bytes)
    assert after["device_slot_bytes"] < largest  # the slots hold the rests only
    assert added <= room + 64 * 1024, (added, room, largest)
    for _ in range(2):
        assert torch.equal(model(**batch)[0], ref)
    handle.remove()


@pytest.mark.parametrize("upcast", ["block", "layer"])
@pytest.mark.parametrize("share", [0.45, 0.7])
def test_8_bit_images_under_a_budget_keep_to_it(share, upcast):
    """A ring of 8-bit images under a budget: its slots (the largest block, held ones run from a
    slot too), its two staging buffers and its held images fit the budget. Upcast per layer: its
    8-bit slots and blocks fit it; beside them, one layer's upcast (as the baseline's)."""
    # Non-block bytes in the compute dtype: more than the model keeps outside its blocks in 8 bits.
    model, batch, out, start, block_bytes, nonblock, activations = _measured_model()
    del out
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with torch.inference_mode():
        ref = reference(**batch)[0]
    del reference
    gc.collect()
    budget = int(share * sum(block_bytes))
    largest_layer = max(sum(t.numel() * t.element_size() for t in m.parameters(recurse=False))
                        for m in model.blocks.modules() if isinstance(m, torch.nn.Linear))
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "device_budget": budget,
                                   "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn", "upcast": upcast}}})
    with torch.inference_mode():
        for _ in range(3):  # warm-up, the measured forward, the plan in force
            assert torch.equal(model(**batch)[0], ref)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = model(**batch)[0]
    assert torch.equal(out, ref)
    (row,) = handle.summary()
    assert row["upcast"] == upcast
    # Some images held (at 0.7 all of them: the plan needs no forward); per layer, blocks or parts.
    assert row["resident_blocks"] or (upcast == "layer" and row["kept_blocks"])
    assert row["resident_bytes"] + row["device_slot_bytes"] <= budget
    peak = torch.cuda.max_memory_allocated() - start - ref.numel() * ref.element_size()
    upcasts = largest_layer if upcast == "layer" else 0
    assert peak <= nonblock + budget + activations + upcasts + 64 * 1024, (peak, nonblock, budget, activations)
    handle.remove()
    del out, ref


@torch.inference_mode()
def test_auto_under_a_capped_device_streams_what_does_not_fit():
    model = tiny.wide_ffn_wan_transformer(num_layers=8).cuda()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(model).items()}
    ref = model(**batch)[0]
    blocks = sum(t.numel() * t.element_size() for b in model.blocks for t in [*b.parameters(), *b.buffers()])
    nonblock = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) - blocks
    model.cpu()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    used = torch.cuda.memory_allocated()
    # Room for about half the blocks once the reserve is set aside.
    reserve = 512 * 2**20  # the activations of the wide FFN
    torch.cuda.set_per_process_memory_fraction((used + nonblock + reserve + blocks // 2) / total)
    try:
        handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "device_budget": "auto",
                                       "activation_reserve": reserve})
        (row,) = handle.summary()
        assert 0 < row["device_budget"] < blocks and row["num_blocks"] > 0
        for _ in range(3):
            assert torch.equal(model(**batch)[0], ref)
        (row,) = handle.summary()
        assert row["predicted_ratio"] is not None
        handle.remove()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
