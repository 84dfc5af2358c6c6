"""CUDA path: parity, no host synchronisation, no per-block allocation, the memory bound."""

import copy
import gc

import pytest
import torch

from omni_dist_offload import apply_offload
import tiny_models as tiny
from toys import OddDiT, ToyDiT

pytestmark = pytest.mark.gpu
DIT = {"mode": "layer", "components": ["dit"]}
BOTH = {"mode": "layer", "components": ["dit", "text_encoder"]}


@pytest.mark.parametrize("family", ["wan", "flux", "qwenimage"])
@torch.inference_mode()
def test_dit_parity_cuda(family):
    build, inputs = {
        "wan": (tiny.tiny_wan_transformer, tiny.wan_transformer_inputs),
        "flux": (tiny.tiny_flux_transformer, tiny.flux_transformer_inputs),
        "qwenimage": (tiny.tiny_qwenimage_transformer, tiny.qwenimage_transformer_inputs),
    }[family]
    model = build(dtype=torch.bfloat16).cuda()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs(model, batch=2).items()}
    ref = model(**batch)[0]
    handle = apply_offload(model, DIT)
    assert handle.rings[0].transfer.buffers[0].pinned
    for _ in range(3):
        assert torch.equal(model(**batch)[0], ref)
    handle.remove()
    assert torch.equal(model(**batch)[0], ref)


def test_wan_pipeline_parity_cuda():
    run = lambda p: p(prompt="a red fox", generator=torch.Generator().manual_seed(0), output_type="pt",
                      **tiny.TINY_WAN_DEFAULTS).frames
    ref = run(tiny.tiny_wan_pipeline(seed=1).to("cuda"))
    pipe = tiny.tiny_wan_pipeline(seed=1)  # starts on the CPU: apply_offload places everything
    handle = apply_offload(pipe, BOTH)
    assert pipe.vae.device.type == "cuda"
    for _ in range(2):
        assert torch.equal(run(pipe), ref)
    handle.remove()


@torch.inference_mode()
def test_per_block_path_never_synchronises_nor_allocates():
    model = OddDiT(5, dim=64).cuda()
    x = torch.randn(16, 64, device="cuda")
    model(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    model(x)
    resident_allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    handle = apply_offload(model, DIT)
    model(x)  # cold start
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(3):
            model(x)
        streamed_allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert streamed_allocs == 3 * resident_allocs
    handle.remove()


@torch.inference_mode()
def test_per_block_path_under_autocast_never_synchronises_nor_allocates_more():
    """Under autocast (a float32 model, each forward its own autocast region, as a pipeline
    call is) a streamed forward makes the resident forward's casts and nothing more."""
    model = ToyDiT(5, dim=256).cuda()
    x = torch.randn(16, 256, device="cuda")

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x)

    want = forward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    forward()
    resident_allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    handle = apply_offload(model, DIT)
    forward()  # cold start
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(3):
            out = forward()
        streamed_allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert streamed_allocs == 3 * resident_allocs
    assert torch.equal(out, want)
    handle.remove()


def test_setup_keeps_no_host_copy_of_what_moved_to_the_device():
    """A model loaded on the CPU: its non-block tensors move to the device, and their host
    storage goes (it was kept for the handle's life, to undo a setup that had succeeded)."""
    model = ToyDiT(3, dim=64)
    kept = model.proj_in.weight.data  # the only other user of its host storage
    handle = apply_offload(model, DIT)
    assert model.proj_in.weight.device.type == "cuda"
    gc.collect()
    uses = lambda t: torch._C._storage_Use_Count(t.untyped_storage()._cdata)  # noqa: E731
    assert uses(kept) == uses(torch.empty(1))  # as a tensor no one else holds
    handle.remove()


@pytest.mark.parametrize("options", [{}, {"storage_dtype": "float8_e4m3fn"}])
@torch.no_grad()
def test_a_dropped_text_encoder_gives_its_device_memory_back(options):
    """pipe.text_encoder = None after encoding: its slots and the tensors it kept on the device
    (embedding, norms) go; the DiT streams on, bitwise equal."""
    pipe = tiny.tiny_wan_pipeline()
    ref = copy.deepcopy(pipe.transformer).cuda()
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    config = {"mode": "layer", "components": ["dit", "text_encoder"],
              "layer_options": {"text_encoder": options}}
    handle = apply_offload(pipe, config)
    embeds = pipe.encode_prompt(prompt="a red fox", max_sequence_length=16, device=torch.device("cuda"))[0]
    torch.cuda.synchronize()
    with_encoder = torch.cuda.memory_allocated() - start
    encoder_row = next(r for r in handle.summary() if r["component"] == "text_encoder")
    pipe.text_encoder = None
    gc.collect()
    torch.cuda.synchronize()
    freed = with_encoder - (torch.cuda.memory_allocated() - start)
    assert freed >= encoder_row["device_slot_bytes"] + 0.9 * sum(
        p.numel() * p.element_size() for p in tiny.tiny_umt5_encoder().shared.parameters()), (freed, encoder_row)
    x = {k: v.cuda() if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(ref).items()}
    assert torch.equal(pipe.transformer(**x)[0], ref(**x)[0])
    assert embeds.isfinite().all()
    handle.remove()


def test_peak_memory_is_nonblock_plus_two_blocks_plus_activations():
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    model = tiny.wide_ffn_wan_transformer(num_layers=6)  # blocks large next to the activations
    model.cuda()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(model).items()}
    block_bytes = [sum(t.numel() * t.element_size() for t in list(b.parameters()) + list(b.buffers()))
                   for b in model.blocks]
    total = torch.cuda.memory_allocated() - start
    nonblock = total - sum(block_bytes)
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        ref = model(**batch)[0]
    activations = torch.cuda.max_memory_allocated() - start - total
    del ref
    handle = apply_offload(model, DIT)
    slots = handle.summary()[0]["device_slot_bytes"]
    assert slots <= 2 * (max(block_bytes) + 256 * 64)  # two slots, alignment padding aside
    torch.cuda.synchronize()
    resident_after_apply = torch.cuda.memory_allocated() - start
    assert resident_after_apply <= nonblock + slots + 4096, "block weights left on the device"
    with torch.inference_mode():
        model(**batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(**batch)
    peak = torch.cuda.max_memory_allocated() - start
    assert peak <= nonblock + slots + activations + 4096
    assert peak < total + activations  # and it is a real saving
    handle.remove()


@torch.no_grad()
def test_autocast_keeps_no_copy_of_streamed_blocks_on_the_device():
    """Under autocast a float32 model's bf16 weight copies are cached until the region ends;
    a streamed block's go when it is done, so they do not pile up on the device."""
    model = ToyDiT(8, dim=1024).cuda()
    x = torch.randn(64, 1024, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = model(x)

    def bf16_bytes(mod: torch.nn.Module) -> int:
        return sum(p.numel() * 2 for p in mod.parameters())

    handle = apply_offload(model, DIT)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        # The resident model's own casts (proj_in, proj_out) stay, as without offloading; the
        # blocks' (8 times one block's) do not.
        assert held <= bf16_bytes(model.proj_in) + bf16_bytes(model.proj_out) + bf16_bytes(model.blocks[0]) // 2
    assert torch.equal(out, want)
    handle.remove()


@torch.inference_mode()
def test_tracing_on_cuda_records_events_without_synchronising():
    model = OddDiT(4, dim=256).cuda()
    x = torch.randn(64, 256, device="cuda")
    ref = model(x)
    handle = apply_offload(model, DIT, trace=True)
    model(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, ref)
    (report,) = handle.trace_report()
    assert [b["index"] for b in report["blocks"]] == [0, 1, 2, 3]
    assert all(b["transfer_ms"] > 0 and b["gbps"] > 0 for b in report["blocks"])
    assert report["forward_ms"] > 0
    handle.remove()


def test_a_failed_page_lock_leaves_no_error_for_the_next_kernel():
    """cudaHostRegister's failure is also the thread's last CUDA error, which torch's next kernel
    launch check on that thread raised as its own ("part or all of the requested memory range is
    already mapped"): after a re-plan's smaller host copy could not be locked under "pin_failure":
    "pageable", the next forward failed; so did a caller's after catching PinMemoryError."""
    from omni_dist_offload import hostmem
    from omni_dist_offload.hostmem import HostBuffer, PinMemoryError

    buf = HostBuffer(1 << 20)
    buf.pin()
    twin = HostBuffer.wrap(buf.tensor)  # the same pages: registering them again fails
    with pytest.raises(PinMemoryError):
        twin.pin()
    assert float((torch.ones(8, device="cuda") * 2).sum()) == 16.0
    buf.release()
    hostmem._unregister(buf.tensor, buf.tensor.data_ptr())  # no longer registered: fails, quietly
    assert float((torch.ones(8, device="cuda") * 3).sum()) == 24.0
