"""The ring on the CPU path: block counts, order, several rings, remove and rollback."""

import gc
import types
import warnings
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from omni_dist_offload import OffloadConfigError, apply_offload
from omni_dist_offload import apply as apply_mod
from omni_dist_offload.layout import TINY_SHARE
from toys import OddDiT, ToyDiT, assert_same, snapshot

DIT = {"mode": "layer", "components": ["dit"]}


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 4, 5])
@torch.no_grad()
def test_parity_for_any_block_count(num_blocks):
    model = ToyDiT(num_blocks)
    x = torch.randn(4, 8)
    ref = model(x)
    handle = apply_offload(model, DIT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # in-order runs never warn
        for _ in range(3):
            assert torch.equal(model(x), ref)
    assert handle.summary()[0]["num_blocks"] == num_blocks
    handle.remove()
    assert torch.equal(model(x), ref)


@torch.no_grad()
def test_between_uses_blocks_point_at_host_copies():
    model = ToyDiT(3)
    handle = apply_offload(model, DIT)
    model(torch.randn(2, 8))
    ring = handle.rings[0]
    for layout, buf in zip(ring.layouts, ring.transfer.buffers):
        lo, hi = buf.tensor.data_ptr(), buf.tensor.data_ptr() + buf.nbytes
        for entry in layout.entries:
            t = entry.tensor
            assert lo <= t.data_ptr() < hi, entry.name
    handle.remove()


@torch.no_grad()
def test_mixed_dtypes_strides_tied_and_buffers():
    model = OddDiT(3)
    x = torch.randn(2, 8)
    ref = model(x)
    strides = {n: p.stride() for n, p in model.named_parameters()}
    assert not model.blocks[0].down.weight.is_contiguous()
    handle = apply_offload(model, DIT)
    for _ in range(2):
        assert torch.equal(model(x), ref)
    # Tied weight stored once; the transposed weight kept its strides on the host.
    entries = handle.rings[0].layouts[0].entries
    assert sum(e.name.endswith("gate.weight") for e in entries) == 1
    # Tensors of no size to speak of first, then the largest first; equal sizes in module order;
    # each after the one before.
    order = [n for n, _ in model.blocks[0].named_parameters()] + [n for n, _ in model.blocks[0].named_buffers()]
    tiny = max(e.nbytes for e in entries) * TINY_SHARE
    key = [(e.nbytes >= tiny, -e.nbytes, order.index(e.name.removeprefix("blocks.0."))) for e in entries]
    assert key == sorted(key) and len({e.nbytes for e in entries}) > 1 and key[0][0] is False
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(entries, entries[1:]))
    assert [e.name for e in entries] != ["blocks.0." + n for n in order if any(e.name == "blocks.0." + n for e in entries)]
    assert model.blocks[1].down.weight.stride() == strides["blocks.1.down.weight"]
    assert model.blocks[1].gate_again.weight is model.blocks[1].gate.weight
    handle.remove()
    assert {n: p.stride() for n, p in model.named_parameters()} == strides
    assert torch.equal(model(x), ref)


class _ConvBlock(torch.nn.Module):
    """A pointwise and a depthwise convolution in channels_last: dense weights whose size-1
    dimensions carry strides the kernels read to pick their memory format."""

    def __init__(self):
        super().__init__()
        self.pw = torch.nn.Conv2d(8, 16, 1).to(memory_format=torch.channels_last)
        self.dw = torch.nn.Conv2d(16, 8, 3, padding=1, groups=8).to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.dw(self.pw(x))


class _ConvDiT(torch.nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_ConvBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("options", [{}, {"resident_blocks": [1]}])
@torch.no_grad()
def test_strides_of_size_one_dimensions_are_kept(options):
    model = _ConvDiT()
    x = torch.randn(2, 8, 5, 5)
    ref = model(x)
    strides = {n: p.stride() for n, p in model.named_parameters()}
    assert strides["blocks.0.pw.weight"] == (8, 1, 8, 8) and model.blocks[0].pw.weight.is_contiguous()
    seen = {}
    hook = model.blocks[0].register_forward_pre_hook(
        lambda block, args: seen.update({n: p.stride() for n, p in block.named_parameters()}))
    handle = apply_offload(model, {**DIT, "layer_options": {"dit": options}})
    for _ in range(2):
        out = model(x)
        assert torch.equal(out, ref) and out.stride() == ref.stride()
    hook.remove()
    assert seen == {n.removeprefix("blocks.0."): s for n, s in strides.items() if n.startswith("blocks.0.")}
    handle.remove()
    assert {n: p.stride() for n, p in model.named_parameters()} == strides
    assert torch.equal(model(x), ref)


@torch.no_grad()
def test_skipped_and_reordered_blocks_stay_correct_and_warn_once():
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    orders = [[0, 1, 2, 3], [0, 2, 3], [3, 1, 0], [0, 1, 2, 3], [1, 1, 2]]
    refs = [model(x, order) for order in orders]
    handle = apply_offload(model, DIT)
    with pytest.warns(RuntimeWarning, match="not prefetched") as record:
        outs = [model(x, order) for order in orders]
    assert sum("not prefetched" in str(w.message) for w in record) == 1
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref)
    handle.remove()


@torch.no_grad()
def test_two_dits_in_one_pipeline():
    """Wan2.2 A14B shape: transformer for high noise, transformer_2 for low noise."""
    pipe = types.SimpleNamespace(transformer=ToyDiT(3, seed=1), transformer_2=ToyDiT(5, seed=2))
    x = torch.randn(2, 8)
    refs = (pipe.transformer(x), pipe.transformer_2(x))
    handle = apply_offload(pipe, DIT)
    assert [r["component"] for r in handle.summary()] == ["transformer", "transformer_2"]
    for _ in range(2):
        for _ in range(2):
            assert torch.equal(pipe.transformer(x), refs[0])
        for _ in range(3):
            assert torch.equal(pipe.transformer_2(x), refs[1])
    handle.remove()


@torch.no_grad()
def test_remove_restores_everything_and_twice_is_harmless():
    model = OddDiT(3)
    x = torch.randn(2, 8)
    ref = model(x)
    before = snapshot(model)
    handle = apply_offload(model, DIT)
    model(x)
    handle.remove()
    assert_same(before, model)
    for p in model.parameters():  # ordinary tensors, not views into a shared buffer
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    handle.remove()
    assert_same(before, model)
    assert handle.summary() == []
    # After remove() the model runs resident: no hooks, same output, nothing changes.
    assert torch.equal(model(x), ref)
    assert_same(before, model)


@torch.no_grad()
def test_a_remove_that_fails_while_binding_is_finished_by_the_next(monkeypatch):
    """remove() past its point of no return (the streamed blocks restored): the device out of
    memory for a resident block's new storage in the second ring. The next remove() finishes
    from there (it used to raise IndexError, the first ring released but still listed, and
    apply_offload then refused the model for good)."""
    from omni_dist_offload import ring as ring_module

    pipe = types.SimpleNamespace(transformer=ToyDiT(4), transformer_2=ToyDiT(4))
    x = torch.randn(2, 8)
    refs = [pipe.transformer(x), pipe.transformer_2(x)]
    before = [snapshot(pipe.transformer), snapshot(pipe.transformer_2)]
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_blocks": [1]}}}
    handle = apply_offload(pipe, config)
    second = {id(p) for p in pipe.transformer_2.parameters()}
    real, real_bind, binding, failed = ring_module.restored, ring_module.BlockRing.bind_restored, [], []

    def bind_restored(self, streamed, device):
        binding.append(self.component.name)
        return real_bind(self, streamed, device)

    def restored(entry, view, device):  # a resident block's new storage (streamed ones come before)
        if binding and id(entry.tensor) in second and not failed:
            failed.append(entry.name)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(entry, view, device)

    monkeypatch.setattr(ring_module, "restored", restored)
    monkeypatch.setattr(ring_module.BlockRing, "bind_restored", bind_restored)
    with pytest.raises(torch.OutOfMemoryError) as info:
        handle.remove()
    assert "call remove() again to finish it" in "\n".join(info.value.__notes__)
    assert handle.active and [r.component.name for r in handle.rings] == ["transformer_2"]
    assert torch.equal(pipe.transformer(x), refs[0]) and torch.equal(pipe.transformer_2(x), refs[1])
    handle.remove()
    assert not handle.active and handle.summary() == []
    for model, snap, ref in zip((pipe.transformer, pipe.transformer_2), before, refs):
        assert_same(snap, model)
        assert torch.equal(model(x), ref)
        assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0
    apply_offload(pipe, config).remove()  # it can be applied again


@torch.no_grad()
def test_apply_twice_is_an_error():
    model = ToyDiT(2)
    x = torch.randn(2, 8)
    ref = model(x)
    handle = apply_offload(model, DIT)
    streamed = {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()}
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    summary = handle.summary()
    with pytest.raises(OffloadConfigError, match=r"belongs to an earlier apply_offload \(streaming \['transformer'\].*call remove"):
        apply_offload(model, DIT)
    with pytest.raises(OffloadConfigError, match="belongs to an earlier apply_offload"):  # through a pipeline too
        apply_offload(types.SimpleNamespace(transformer=model), DIT)
    # The failed calls changed nothing: same tensors where they were, same hooks, same output.
    assert {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()} == streamed
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == hooks
    assert handle.summary() == summary and torch.equal(model(x), ref)
    handle.remove()
    apply_offload(model, DIT).remove()  # after remove() it can be applied again


class _Wrapper(torch.nn.Module):
    """A model around another, declaring the inner model's blocks as its own."""

    _layerwise_offload_blocks_attrs = ["inner.blocks"]

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@torch.no_grad()
def test_a_wrapper_around_an_offloaded_model_is_refused():
    # It used to be accepted: a second host copy of every block and a second ring's hooks on it.
    model = ToyDiT(2)
    handle = apply_offload(model, DIT)
    hooks = sum(len(b._forward_pre_hooks) for b in model.blocks)
    with pytest.raises(OffloadConfigError, match=r"transformer\.inner \(ToyDiT\) belongs to an earlier apply_offload"):
        apply_offload(_Wrapper(model), DIT)
    assert sum(len(b._forward_pre_hooks) for b in model.blocks) == hooks
    handle.remove()
    apply_offload(_Wrapper(model), DIT).remove()  # after remove() it can be


@pytest.mark.parametrize("fail_at", [0, 2])
def test_failure_during_setup_leaves_model_as_it_was(monkeypatch, fail_at):
    model = OddDiT(4)
    before = snapshot(model)
    calls = {"n": 0}
    real = apply_mod.HostBuffer

    def flaky(nbytes):
        if calls["n"] == fail_at:
            raise MemoryError("simulated allocation failure")
        calls["n"] += 1
        return real(nbytes)

    monkeypatch.setattr(apply_mod, "HostBuffer", flaky)
    with pytest.raises(MemoryError, match="simulated"):
        apply_offload(model, DIT)
    assert_same(before, model)


def test_failure_after_consolidation_leaves_model_as_it_was(monkeypatch):
    model = ToyDiT(3)
    before = snapshot(model)

    def boom(self):
        raise RuntimeError("simulated hook failure")

    monkeypatch.setattr(apply_mod.BlockRing, "install_hooks", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        apply_offload(model, DIT)
    assert_same(before, model)


def test_grad_mode_warns():
    model = ToyDiT(2)
    handle = apply_offload(model, DIT)
    with pytest.warns(RuntimeWarning, match="autograd"):
        model(torch.randn(2, 8))
    handle.remove()


def test_summary_byte_counts():
    model = OddDiT(3)
    tensors = {id(t): t for b in model.blocks for t in list(b.parameters()) + list(b.buffers())}
    expected = sum(t.numel() * t.element_size() for t in tensors.values())
    handle = apply_offload(model, DIT)
    (row,) = handle.summary()
    assert row["block_bytes"] == expected
    layouts = handle.rings[0].layouts
    assert row["host_bytes"] == sum(layout.nbytes for layout in layouts) >= expected
    assert row["device_slot_bytes"] == 2 * max(layout.nbytes for layout in layouts)
    assert all(e.offset % 256 == 0 for layout in layouts for e in layout.entries)
    handle.remove()


@pytest.mark.parametrize("options", [{}, {"resident_blocks": [1]}, {"storage_dtype": "float8_e4m3fn"},
                                     {"storage_dtype": "float8_e4m3fn", "upcast": "layer"}])
def test_remove_under_inference_mode_gives_back_ordinary_tensors(options):
    """``remove()`` inside ``torch.inference_mode()`` (where forwards run) leaves tensors as they
    were before offloading: ordinary ones that autograd and in-place updates accept."""
    import tiny_models as tiny

    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2)
    inputs = tiny.flux_transformer_inputs(model)
    assert not any(t.is_inference() for t in model.state_dict().values())
    handle = apply_offload(model, {**DIT, "layer_options": {"dit": options}}, device="cpu")
    with torch.inference_mode():
        model(**inputs)
        handle.remove()
    assert [n for n, t in model.state_dict().items() if t.is_inference()] == []
    model(**inputs)[0].sum().backward()
    assert model.transformer_blocks[0].ff.net[2].weight.grad is not None


@pytest.mark.parametrize("options", [{}, {"resident_blocks": [0]}, {"storage_dtype": "float8_e4m3fn"}])
def test_a_model_offloaded_under_inference_mode_runs_and_changes_outside_it(options):
    """Set up inside ``torch.inference_mode()``, then run as a pipeline does (``no_grad``), write
    weights between forwards in either mode, and remove() outside it: the ring's buffers are
    ordinary tensors, so every fill and every write goes through, and each is seen."""
    model, other = ToyDiT(4), ToyDiT(4, seed=1)
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = other(x)
    with torch.inference_mode():
        handle = apply_offload(model, {**DIT, "layer_options": {"dit": options}})
        first = model(x)
    with torch.no_grad():
        assert torch.equal(model(x), first)
    if "storage_dtype" not in options:  # 8-bit host copies park on placeholders: no writes
        with torch.inference_mode():
            model.load_state_dict(other.state_dict())
        with torch.no_grad():
            assert torch.equal(model(x), want)
        model.load_state_dict({k: v + 0 for k, v in other.state_dict().items()})
        with torch.inference_mode():
            assert torch.equal(model(x), want)
        first = want
    handle.remove()
    assert not any(t.is_inference() for t in model.state_dict().values())
    with torch.no_grad():
        assert torch.equal(model(x), first)  # 8-bit: the weights as streamed, upcast


def test_a_model_built_under_inference_mode_runs_in_either_mode():
    """Its parameters are inference tensors, which cannot point at ordinary storage: the ring's
    tensors are inference tensors too, and fills outside inference_mode still go through."""
    with torch.inference_mode():
        model, x = ToyDiT(4), torch.randn(4, 8)
        ref = model(x)
    handle = apply_offload(model, DIT)
    for _ in range(2):
        with torch.no_grad():
            assert torch.equal(model(x), ref)
        with torch.inference_mode():
            assert torch.equal(model(x), ref)
    handle.remove()
    assert all(t.is_inference() for t in model.state_dict().values())
    with torch.no_grad():
        assert torch.equal(model(x), ref)


@pytest.mark.parametrize("num_blocks", [2, 4])
@pytest.mark.parametrize("options", [{}, {"resident_blocks": [0]}])
@torch.no_grad()
def test_weights_written_in_place_between_forwards_are_what_later_forwards_run(num_blocks, options):
    """``load_state_dict`` (``copy_`` into the parked host views) between forwards: blocks the
    slots still hold from the last forward are copied again; resident blocks change in place."""
    model, other = ToyDiT(num_blocks), ToyDiT(num_blocks, seed=1)
    x = torch.randn(4, 8)
    want = other(x)
    handle = apply_offload(model, {**DIT, "layer_options": {"dit": options}})
    model(x)  # leaves blocks in the slots
    model.load_state_dict(other.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copies again are no ordering problem
        for _ in range(2):
            assert torch.equal(model(x), want)
    handle.remove()
    assert torch.equal(model(x), want)


@torch.no_grad()
def test_tensors_given_new_storage_between_forwards():
    """New storage of the same dtype and shape is taken into the host copy; another dtype is
    refused: ``model.to(dtype)`` at once, changing nothing (it used to cast everything and fail
    at the next forward), ``tensor.data = ...`` at the next forward, naming the tensor."""
    model, other = ToyDiT(3), ToyDiT(3, seed=1)
    x = torch.randn(4, 8)
    handle = apply_offload(model, DIT)
    ref = model(x)
    model.blocks[1].lin.weight.data = other.blocks[1].lin.weight.detach().clone()
    model.blocks[0].lin.weight.data = other.blocks[0].lin.weight.detach().clone()  # in a slot
    mixed = ToyDiT(3)
    mixed.blocks[1].lin.weight.data = other.blocks[1].lin.weight.detach().clone()
    mixed.blocks[0].lin.weight.data = other.blocks[0].lin.weight.detach().clone()
    for _ in range(2):
        assert torch.equal(model(x), mixed(x))
    host = handle.rings[0].transfer.buffers[1].tensor
    assert host.data_ptr() <= model.blocks[1].lin.weight.data_ptr() < host.data_ptr() + host.numel()
    for cast in (lambda m: m.to(torch.float64), lambda m: m.double(), lambda m: m.half()):
        with pytest.raises(RuntimeError, match=r"transformer: casting ToyDiT \(torch.float32 tensors to torch.float"
                                               r"(64|16)\) after apply_offload is refused, and nothing was changed"):
            cast(model)
        assert {t.dtype for t in model.state_dict().values()} == {torch.float32}
    model.to("cpu")  # a move goes through
    weight = model.blocks[0].lin.weight
    kept = weight.data
    weight.data = kept.double()
    with pytest.raises(RuntimeError, match=r"blocks\.0\.lin\.weight became torch\.float64 .* cast the model before apply_offload"):
        model(x)
    weight.data = kept
    assert torch.equal(model(x), mixed(x)) and not torch.equal(model(x), ref)
    handle.remove()
    assert torch.equal(model(x), mixed(x))


@pytest.mark.parametrize("options", [{}, {"resident_blocks": [1]}, {"storage_dtype": "float8_e4m3fn"}])
@torch.no_grad()
def test_remove_keeps_what_was_given_since_the_last_forward(options):
    """``tensor.data = ...`` after the last forward, then remove(): the model is what it would be
    without offloading; ``model.to(dtype)`` is refused while offloaded and works after remove()."""
    model, other = ToyDiT(3), ToyDiT(3, seed=1)
    x = torch.randn(4, 8)
    handle = apply_offload(model, {**DIT, "layer_options": {"dit": options}})
    model(x)
    new = other.blocks[1].lin.weight.detach().clone()
    model.blocks[1].lin.weight.data = new
    handle.remove()
    assert model.blocks[1].lin.weight.data_ptr() == new.data_ptr()
    handle = apply_offload(model, {**DIT, "layer_options": {"dit": options}})
    model(x)
    with pytest.raises(RuntimeError, match=r"after apply_offload is refused, and nothing was changed"):
        model.to(torch.float64)
    handle.remove()
    model.to(torch.float64)
    assert {t.dtype for t in model.state_dict().values()} == {torch.float64}
    if "storage_dtype" not in options:  # 8-bit: the weights are the stored ones, upcast
        want = ToyDiT(3)
        want.blocks[1].lin.weight.data = new.clone()
        assert torch.equal(model(x.double()), want.double()(x.double()))


@torch.no_grad()
def test_new_storage_for_an_8_bit_block_is_refused():
    import tiny_models as tiny

    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2)
    inputs = tiny.flux_transformer_inputs(model)
    handle = apply_offload(model, {**DIT, "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}, device="cpu")
    ref = model(**inputs)[0]
    weight = model.single_transformer_blocks[1].proj_out.weight
    kept = weight.data
    weight.data = torch.zeros_like(weight)
    with pytest.raises(RuntimeError, match="rank-local ring of 8-bit images cannot take in"):
        model(**inputs)
    weight.data = kept
    assert torch.equal(model(**inputs)[0], ref)
    handle.remove()


def test_a_block_module_registered_outside_the_blocks_is_refused_and_an_aliased_block_list_is_not():
    class Reused(ToyDiT):
        def __init__(self):
            super().__init__(3)
            self.final_norm = self.blocks[-1].norm  # runs outside the block, on its parked copy

        def forward(self, x):
            return self.final_norm(super().forward(x))

    model = Reused()
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"module transformer\.final_norm is also transformer\.blocks\.2's module LayerNorm"):
        apply_offload(model, DIT)
    assert_same(before, model)

    class Aliased(ToyDiT):
        def __init__(self):
            super().__init__(3)
            self.layers = self.blocks  # the same blocks under a second name: their hooks run either way

    model = Aliased()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
        handle = apply_offload(model, DIT)
        assert torch.equal(model(x), ref)
    handle.remove()


def test_a_backward_through_streamed_blocks_raises_instead_of_giving_wrong_gradients():
    """Forwards with autograd on give the resident model's output; a backward through a
    streamed block (whose slot later blocks reused) raises, naming it, where it used to give
    wrong gradients behind a warning. Resident blocks, and the model after remove(), train."""
    model, x = ToyDiT(4), torch.randn(4, 8)
    want = model(x)
    want.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    handle = apply_offload(model, {**DIT, "layer_options": {"dit": {"resident_blocks": [3]}}}, device="cpu")
    with pytest.warns(RuntimeWarning, match=r"autograd enabled"):
        out = model(x)
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match=r"transformer: backward through streamed block blocks\.2\. "
                                           r"Offloading is for inference"):
        out.sum().backward()
    with torch.no_grad():  # the guard is gone once the block is: nothing else is affected
        assert torch.equal(model(x), want)
    torch.randn(3, requires_grad=True).exp().sum().backward()
    handle.remove()
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())


def test_a_module_that_streams_nothing_casts_as_usual_and_an_interrupt_leaves_no_guard():
    """The cast refusal sits on the streamed components only (a VAE kept in float32 beside a bf16
    DiT is cast after offloading). A Ctrl-C inside a streamed block with autograd on skips its
    post-forward: the backward guard it pushed is off (and popped) by the ring's next forward or
    remove(), so unrelated autograd code in the thread works again."""
    model = ToyDiT(3)
    pipe = types.SimpleNamespace(transformer=model, vae=torch.nn.Linear(4, 4))
    handle = apply_offload(pipe, DIT, device="cpu")
    pipe.vae.to(torch.float64)
    assert pipe.vae.weight.dtype == torch.float64
    with pytest.raises(RuntimeError, match=r"casting ToyDiT .* after apply_offload is refused"):
        model.to(torch.float64)

    def unrelated_backward():
        a = torch.randn(3, requires_grad=True)
        (a * a).sum().backward()
        return torch.equal(a.grad, 2 * a.detach())

    def ctrl_c(*_):
        raise KeyboardInterrupt

    x = torch.randn(4, 8)
    for end in ("forward", "remove"):
        hook = model.blocks[1].lin.register_forward_pre_hook(ctrl_c)
        with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
            warnings.simplefilter("ignore", RuntimeWarning)  # autograd on: warned once
            model(x)
        hook.remove()
        if end == "forward":
            with torch.no_grad():
                model(x)
        else:
            handle.remove()
        assert unrelated_backward()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class _Casts(TorchDispatchMode):
    """Weak references to the low-precision copies autocast makes of the watched tensors."""

    def __init__(self, watched: set[int]) -> None:
        super().__init__()
        self.watched = watched
        self.copies: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.watched:
            self.copies.append(weakref.ref(out))
        return out


@torch.no_grad()
def test_autocast_keeps_no_copy_of_streamed_blocks():
    """Autocast caches its bf16 copy of each float32 parameter until the outermost autocast
    region ends; for streamed blocks that would keep a copy of every block's weights on the
    device. The copies of a streamed block's weights go once the block is done; the output is
    the resident model's, under autocast, bitwise."""
    model, x = ToyDiT(3), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
    handle = apply_offload(model, DIT, device="cpu")
    watched: set[int] = set()
    for block in model.blocks:  # a block's weights live in its slot while it runs
        block.register_forward_pre_hook(lambda mod, args: watched.update(p.data_ptr() for p in mod.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _Casts(watched) as casts:
            out = model(x)
        gc.collect()
        assert len(casts.copies) == 6  # each block's linear weight and bias
        assert all(copy() is None for copy in casts.copies)
        assert torch.equal(out, want)
        assert torch.equal(model(x), want)
    handle.remove()


@pytest.mark.parametrize("storage", [None, "float8_e4m3fn"])
@torch.no_grad()
def test_host_copies_are_host_memory_whatever_the_default_device(storage):
    """torch.set_default_device (a notebook's "cuda", or "meta") does not move the host copies:
    they used to follow it, and apply_offload failed (or, with "cuda", put them on the device)."""
    model, x = OddDiT(3), torch.randn(4, 8)
    config = {**DIT, "layer_options": {"dit": {"storage_dtype": storage}}} if storage else DIT
    same = OddDiT(3)
    handle = apply_offload(same, config, device="cpu")  # an 8-bit ring's output is its own
    want = same(x)
    handle.remove()
    torch.set_default_device("meta")
    try:
        handle = apply_offload(model, config, device="cpu")
    finally:
        torch.set_default_device(None)
    with warnings.catch_warnings(record=True) as seen:  # an 8-bit ring's blocks hold placeholders: said once
        warnings.simplefilter("always")
        assert all(t.device.type == "cpu" for t in model.state_dict(keep_vars=True).values())
    assert len(seen) == (1 if storage else 0) and all("state_dict() holds placeholders" in str(w.message) for w in seen)
    assert torch.equal(model(x), want)
    handle.remove()


@pytest.mark.parametrize("storage", [None, "float8_e4m3fn"])
@torch.no_grad()
def test_a_blocks_own_hooks_see_the_weights_it_computes_with(storage):
    """A pre-hook registered before apply_offload, and a forward hook registered after it, ran
    outside the ring's binding (on parked host views, or NaN placeholders on an 8-bit ring)."""
    model, x = ToyDiT(3), torch.randn(4, 8)
    config = {**DIT, "layer_options": {"dit": {"storage_dtype": storage}}} if storage else DIT
    seen: dict[str, list] = {"pre": [], "inside": [], "post": [], "once": []}
    block = model.blocks[1]
    block.register_forward_pre_hook(lambda mod, args: seen["pre"].append(mod.lin.weight.data_ptr()))
    handle = apply_offload(model, config, device="cpu")
    block.lin.register_forward_pre_hook(lambda mod, args: seen["inside"].append(mod.weight.data_ptr()))
    block.register_forward_hook(lambda mod, args, out: seen["post"].append(mod.lin.weight.data_ptr()))
    block.register_forward_hook(lambda mod, args, out: out + mod.lin.bias)  # as the resident model's
    want = ToyDiT(3)
    want.blocks[1].register_forward_hook(lambda mod, args, out: out + mod.lin.bias)
    if storage:  # the resident model of an 8-bit ring: the ring's own output without the hook
        handle_want = apply_offload(want, config, device="cpu")
    for _ in range(2):
        out = model(x)
    assert seen["pre"] == seen["inside"] == seen["post"] and len(seen["inside"]) == 2
    for _ in range(2):  # registered and removed around each call: the count comes back the same
        once = block.register_forward_hook(lambda mod, args, out: seen["once"].append(mod.lin.weight.data_ptr()))
        model(x)
        once.remove()
    assert seen["once"] == seen["inside"][-2:]
    assert torch.equal(out, want(x))
    handle.remove()
    if storage:
        handle_want.remove()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
@torch.no_grad()
def test_a_block_called_inside_another_is_refused_and_an_export_or_trace_is_refused():
    """Block 1 calling block 0 in its forward lost its own weights halfway (block 0's pre-forward
    took it for an interrupted block and released it): refused, naming both. torch.export and
    torch.jit.trace kept the parked host copies (or placeholders) as the program's weights:
    refused. Either way the model runs as before afterwards."""
    model, x = ToyDiT(3), torch.randn(4, 8)
    want = model(x)
    handle = apply_offload(model, DIT, device="cpu")
    inner = model.blocks[0]
    hook = model.blocks[1].register_forward_pre_hook(lambda mod, args: (inner(args[0]),))
    with pytest.raises(RuntimeError, match=r"block blocks\.0 was called from inside block blocks\.1's forward"):
        model(x)
    hook.remove()
    with pytest.raises(RuntimeError, match=r"block blocks\.0 ran under torch\.jit\.trace\. .* before apply_offload"):
        torch.jit.trace(model, (x,), check_trace=False)
    with pytest.raises(RuntimeError, match=r"block blocks\.0 ran under torch\.export"):
        torch.export.export(model, (x,), strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an interrupted forward's refetch does not warn
        assert torch.equal(model(x), want)
    handle.remove()


@torch.no_grad()
def test_cached_parametrizations_and_a_hook_that_raises_before_the_ring():
    """parametrize.cached() kept a view parametrization's result over the slot across forwards
    (later blocks' bytes). A pre-hook that runs before the ring's and raises is an interrupted
    forward: the next forward's refetch does not warn about the order."""
    from torch.nn.utils import parametrize

    class Transposed(torch.nn.Module):
        def forward(self, w):
            return w.t()

        def right_inverse(self, w):
            return w.t()

    models = [ToyDiT(3), ToyDiT(3)]
    for m in models:
        for block in m.blocks:
            parametrize.register_parametrization(block.lin, "weight", Transposed())
    model, resident = models
    x = torch.randn(4, 8)
    handle = apply_offload(model, DIT, device="cpu")
    with parametrize.cached():
        for _ in range(3):
            assert torch.equal(model(x), resident(x))

    def fail(mod, args):
        raise ValueError("a user's hook")

    hook = model.blocks[2].register_forward_pre_hook(fail, prepend=True)
    with pytest.raises(ValueError, match="a user's hook"):
        model(x)
    hook.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(x), resident(x))
    handle.remove()


@torch.no_grad()
def test_large_tensors_added_to_blocks_after_offloading_warn():
    """weight_norm after apply_offload gives each block new tensors the ring cannot stream: they
    stay on the device, over half the block's bytes, with a warning saying so."""
    model, x = ToyDiT(3, dim=64), torch.randn(4, 64)
    handle = apply_offload(model, DIT, device="cpu")
    for block in model.blocks:
        torch.nn.utils.parametrizations.weight_norm(block.lin)
    want = [b.lin.weight.clone() for b in model.blocks]
    with pytest.warns(RuntimeWarning, match=r"MiB of tensors added to block blocks\.0 after apply_offload \(such "
                                            r"as blocks\.0\.lin\.parametrizations\.weight\.original0; 3 blocks"):
        model(x)
    assert all(torch.equal(b.lin.weight, w) for b, w in zip(model.blocks, want))
    handle.remove()


@torch.no_grad()
def test_a_model_dropped_without_remove_is_freed():
    """The handle's watch of the blocks listens to torch's process-wide registration hooks; they
    held it, and through it the rings and the whole model, for the life of the process once a
    handle was dropped without remove() (a notebook re-running its cell kept every old model)."""
    model = ToyDiT(3)
    handle = apply_offload(model, DIT, device="cpu")
    model(torch.randn(4, 8))
    other = ToyDiT(3)
    kept = apply_offload(other, DIT, device="cpu")  # another handle, still watching
    gone = weakref.ref(model)
    del model, handle
    gc.collect()
    assert gone() is None
    other.blocks[0].extra = torch.nn.Parameter(torch.ones(2))
    assert kept.rings[0].adopt_pending  # the watch that is left still sees its blocks change
    kept.remove()


def test_a_pipeline_cast_after_offloading_changes_nothing():
    """diffusers' pipe.to(dtype) casts module by module: the text encoders (before the DiT in its
    order) were cast before the streamed DiT refused, so every later Flux call failed on mixed
    dtypes. The pipeline asks every streamed component first; moves go through, and after
    remove() the pipeline casts as usual."""
    import tiny_models as tiny

    pipe = tiny.tiny_flux_pipeline()
    handle = apply_offload(pipe, DIT, device="cpu")
    for call in (lambda: pipe.to(torch.bfloat16), lambda: pipe.to(dtype=torch.bfloat16),
                 lambda: pipe.to("cpu", torch.bfloat16)):
        with pytest.raises(RuntimeError, match=r"casting FluxTransformer2DModel \(torch.float32 tensors to "
                                               r"torch.bfloat16\) after apply_offload is refused"):
            call()
        assert {p.dtype for m in pipe.components.values() if isinstance(m, torch.nn.Module)
                for p in m.parameters()} == {torch.float32}
    assert pipe.to("cpu") is pipe and pipe.to(torch.float32) is pipe  # a move, and no change of dtype
    handle.remove()
    assert "to" not in vars(pipe)
    pipe.to(torch.bfloat16)
    assert pipe.transformer.dtype == pipe.text_encoder.dtype == torch.bfloat16


@pytest.mark.parametrize("options", [{}, {"storage_dtype": "float8_e4m3fn"}])
@torch.no_grad()
def test_a_component_dropped_from_the_pipeline_is_freed(options):
    """diffusers' recipe: encode the prompt, then `pipe.text_encoder = None` to free it. The
    handle held the module (and its rings, host copies and device tensors) until remove(), which
    then even restored the dropped encoder. It goes now; the rest runs, reports and removes."""
    import tiny_models as tiny

    config = {"mode": "layer", "components": ["dit", "text_encoder"],
              "layer_options": {"text_encoder": options, "dit": options}}
    reference = tiny.tiny_wan_pipeline()
    pipe = tiny.tiny_wan_pipeline()
    handle = apply_offload(pipe, config, device="cpu")
    embeds = [pipe.encode_prompt(prompt="a red fox", negative_prompt="blurry", max_sequence_length=16,
                                 device=torch.device("cpu")) for pipe in (reference, pipe)]
    assert options or all(torch.equal(a, b) for a, b in zip(*embeds))  # 8 bits: the ring's own
    gone = weakref.ref(pipe.text_encoder)
    (ring,) = [r for r in handle.rings if r.component.name == "text_encoder"]
    transfer = getattr(ring.transfer, "inner", ring.transfer)
    copies = [StorageWeakRef(b.tensor.untyped_storage()) for b in transfer.buffers if b is not None]
    del ring, transfer
    # Freed as it is dropped, not at a garbage collection: the module and its offload referred
    # to each other (cycles), and the host copy waited for a collection that may never come.
    save = pipe.text_encoder.save_pretrained  # does not keep it alive (a strong one made a cycle)
    gc.disable()
    try:
        pipe.text_encoder = None
        assert gone() is None and copies and all(c.expired() for c in copies)
    finally:
        gc.enable()
    with pytest.raises(ReferenceError, match="keep a reference to the component itself"):
        save("/nonexistent")
    reference.text_encoder = None
    assert [row["component"] for row in handle.summary()] == ["transformer"]
    run = lambda p, e: p(prompt_embeds=e[0], negative_prompt_embeds=e[1], output_type="pt",  # noqa: E731
                         generator=torch.Generator().manual_seed(0), **tiny.TINY_WAN_DEFAULTS).frames
    want = run(reference, embeds[0]) if not options else None
    got = run(pipe, embeds[1])
    assert want is None or torch.equal(got, want)
    handle.remove()
    assert "to" not in vars(pipe) and not hasattr(pipe.transformer, "_omni_offload_handle")


@torch.no_grad()
def test_an_edit_after_a_ctrl_c_is_between_forwards():
    """After a KeyboardInterrupt the interrupted block stayed bound, and every edit (fuse_lora,
    and the unfuse that disable_lora schedules) was refused as "during a forward" until another
    forward ran."""
    import copy

    model, x = ToyDiT(3), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    handle = apply_offload(model, DIT, device="cpu")
    ring = handle.rings[0]

    def interrupt(mod, args):
        raise KeyboardInterrupt

    hook = model.blocks[1].lin.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    hook.remove()

    def bump():
        model.blocks[1].lin.weight.add_(1.0)

    ring.edit_block(1, bump)
    reference.blocks[1].lin.weight.add_(1.0)
    assert torch.equal(model(x), reference(x))
    handle.remove()
    assert torch.equal(model(x), reference(x))
