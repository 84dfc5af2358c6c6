"""Host memory and layout edge cases: placeholders read by ``state_dict()``, a smaller host copy
that cannot be page-locked under ``pin_failure: "pageable"``, host buffers under
``torch.use_deterministic_algorithms``, tensor subclasses, and tensors with gaps or overlaps."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import tiny_models as tiny
from omni_dist_offload import OffloadConfigError, apply_offload
from omni_dist_offload.hostmem import HostBuffer, HostPinner, PinMemoryError
from omni_dist_offload.layout import layout_block
from omni_dist_offload.transfer.protocol import TransferStreams
from omni_dist_offload.transfer.rank_local import RankLocalTransfer
from toys import ToyDiT


def _config(top: dict | None = None, **dit) -> dict:
    return {"mode": "layer", "components": ["dit"], "layer_options": {"dit": dit}, **(top or {})}


def _placeholder_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "state_dict() holds placeholders" in str(w.message)]


# -- A: state_dict() between forwards where the blocks park placeholders ---------------------------
@torch.no_grad()
def test_state_dict_of_placeholders_warns_once_naming_the_component_and_changes_nothing():
    model, reference = ToyDiT(3), ToyDiT(3)
    x = torch.randn(2, 8)
    handle = apply_offload(model, _config(storage_dtype="float8_e4m3fn"), device="cpu")
    out = model(x)
    with pytest.warns(RuntimeWarning, match=r"transformer: state_dict\(\) holds placeholders .* "
                                            r"blocks\.0\..* handle\.remove\(\) first") as record:
        state = model.state_dict()
    assert len(_placeholder_warnings(record)) == 1  # once, not once per block
    # Keys, shapes and dtypes as the resident model's (what diffusers reads them for); nothing raised.
    assert {k: (v.shape, v.dtype) for k, v in state.items()} == \
        {k: (v.shape, v.dtype) for k, v in reference.state_dict().items()}
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        model.state_dict()
        model.blocks[1].state_dict(keep_vars=True)
    assert not _placeholder_warnings(again)  # once per component
    assert torch.equal(model(x), out)
    handle.remove()
    assert not any(b._state_dict_hooks for b in model.blocks)
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        assert all(not v.isnan().any() for v in model.state_dict().values())
    assert not _placeholder_warnings(after)


def test_a_block_s_own_state_dict_warns_and_discard_takes_the_hooks_off():
    model = ToyDiT(2)
    handle = apply_offload(model, _config(storage_dtype="float8_e4m3fn"), device="cpu")
    with pytest.warns(RuntimeWarning, match=r"\(such as lin\.weight\)|\(such as scale\)"):
        model.blocks[1].state_dict()
    handle.discard()
    assert not any(b._state_dict_hooks for b in model.blocks)


def test_state_dict_read_by_diffusers_or_peft_gets_no_notice():
    """diffusers reads a component's state_dict() for its keys and shapes at every LoRA load: no
    notice there (only user code that may save the values is told), nor for this package's tools."""
    model = ToyDiT(2)
    handle = apply_offload(model, _config(storage_dtype="float8_e4m3fn"), device="cpu")
    for library in ("diffusers.loaders.peft", "peft.utils.save_and_load", "omni_dist_offload.tools.startup"):
        scope = {"__name__": library, "model": model}
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            exec(compile("keys = list(model.state_dict())", f"<{library}>", "exec"), scope)
        assert scope["keys"] and not _placeholder_warnings(record)
    with pytest.warns(RuntimeWarning, match="holds placeholders"):
        model.state_dict()
    handle.remove()


def test_a_plain_host_copy_holds_the_values_and_gets_no_hook():
    model, reference = ToyDiT(2), ToyDiT(2)
    handle = apply_offload(model, _config(), device="cpu")
    assert not any(b._state_dict_hooks for b in model.blocks)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    handle.remove()


def test_the_notice_never_makes_state_dict_fail(monkeypatch):
    from omni_dist_offload import tenants

    model = ToyDiT(2)
    handle = apply_offload(model, _config(storage_dtype="float8_e4m3fn"), device="cpu")

    def broken(*args):
        raise RuntimeError("simulated")

    monkeypatch.setattr(tenants, "_placeholder_key", broken)
    assert len(model.state_dict()) == len(ToyDiT(2).state_dict())
    handle.remove()


# -- B: a smaller host copy (a kept part) that cannot be page-locked -------------------------------
def _pinned_transfer(monkeypatch, policy: str) -> tuple[RankLocalTransfer, HostBuffer, torch.Tensor, HostPinner]:
    """A rank-local transfer whose one host copy a pinner page-locked at setup (a flag on the
    CPU); every buffer made after it fails to be, the way an exhausted memlock limit does."""
    image = torch.randint(0, 256, (70_000,), dtype=torch.uint8)
    buf = HostBuffer(image.numel())
    buf.tensor.copy_(image)

    def pin(self: HostBuffer) -> None:
        if self is not buf:
            raise PinMemoryError("could not page-lock 0.1 MiB of host memory (CUDA error 2)")
        self.pinned = True

    monkeypatch.setattr(HostBuffer, "pin", pin)
    monkeypatch.setattr(HostBuffer, "release", lambda self: setattr(self, "pinned", False))
    pinner = HostPinner(True, policy)
    assert pinner.pin(buf, "transformer", "blocks.3")
    transfer = RankLocalTransfer([buf], [image.numel()], TransferStreams(), torch.device("cpu"))
    return transfer, buf, image, pinner


def test_a_kept_part_s_host_copy_stays_pageable_under_pageable(monkeypatch):
    start = 20_480
    transfer, old, image, pinner = _pinned_transfer(monkeypatch, "pageable")
    with pytest.warns(RuntimeWarning, match=r'transformer: page-locking the new host copy of block blocks\.3 '
                                            r'failed: .*"pin_failure": "pageable"'):
        host = transfer.keep_part(0, start, image[start:])
    new = transfer.buffers[0]
    assert new is not old and not new.pinned and not old.pinned and torch.equal(host, image[start:])
    dst = torch.zeros(image.numel() - start, dtype=torch.uint8)
    transfer.fill(0, dst, None, None, start=start)
    assert torch.equal(dst, image[start:])
    # Once per pinner: the next block's smaller copy stays pageable without another warning.
    other, _, image2, _ = _pinned_transfer(monkeypatch, "pageable")
    other.buffers[0].pinned_by = (pinner, "transformer", "blocks.4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.keep_part(0, start, image2[start:])
    assert not other.buffers[0].pinned


def test_a_kept_part_s_host_copy_that_cannot_be_pinned_names_the_block_under_error(monkeypatch):
    start = 20_480
    transfer, old, image, _ = _pinned_transfer(monkeypatch, "error")
    with pytest.raises(PinMemoryError, match=r"transformer: page-locking the host copy of block blocks\.3 "
                                             r"failed: could not page-lock"):
        transfer.keep_part(0, start, image[start:])
    assert transfer.buffers[0] is old and old.pinned  # as it was: streams from the old copy
    dst = torch.zeros(image.numel(), dtype=torch.uint8)
    transfer.fill(0, dst, None, None)
    assert torch.equal(dst, image)


# -- C: host buffers under torch.use_deterministic_algorithms --------------------------------------
@pytest.mark.parametrize("fail", [False, True])
def test_host_buffers_skip_the_deterministic_fill_and_restore_it(monkeypatch, fail):
    import torch.utils.deterministic as deterministic

    seen = []
    real = torch.empty

    def empty(*args, **kwargs):
        seen.append(deterministic.fill_uninitialized_memory)
        if fail:
            raise MemoryError("simulated")
        return real(*args, **kwargs)

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        monkeypatch.setattr(torch, "empty", empty)
        if fail:
            with pytest.raises(MemoryError):
                HostBuffer(3 << 20)
        else:
            assert HostBuffer(3 << 20).nbytes == 3 << 20
        monkeypatch.undo()
        # Filled would mean every page written before the huge-page advice: off for the
        # allocation only, and on again after it, also when it fails.
        assert seen == [False] and deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(before)


# -- D: tensor subclasses -------------------------------------------------------------------------
def _two_tensor(t: torch.Tensor) -> nn.Parameter:
    from torch.testing._internal.two_tensor import TwoTensor

    return nn.Parameter(TwoTensor(t.detach().clone(), t.detach().clone()), requires_grad=False)


def test_a_tensor_subclass_in_a_block_is_refused_as_quantized_before_anything_changes():
    model = ToyDiT(3)
    model.blocks[1].lin.weight = _two_tensor(model.blocks[1].lin.weight)
    data = {n: t.data_ptr() for n, t in model.named_parameters()}
    with pytest.raises(OffloadConfigError, match=r"tensor blocks\.1\.lin\.weight is quantized \(.*TwoTensor, a "
                                                 r"tensor subclass\): .* quantize_"):
        apply_offload(model, _config(), device="cpu")
    assert all(t.data_ptr() == data[n] for n, t in model.named_parameters())
    assert not model._forward_pre_hooks and not any(b._forward_pre_hooks for b in model.blocks)
    with pytest.raises(OffloadConfigError, match="a tensor subclass"):
        layout_block(1, "blocks.1", model.blocks[1])


@torch.no_grad()
def test_a_tensor_subclass_outside_the_blocks_is_left_alone():
    model = ToyDiT(2)
    model.proj_in.weight = _two_tensor(model.proj_in.weight)
    x = torch.randn(2, 8)
    ref = model(x)
    handle = apply_offload(model, _config(), device="cpu")
    assert torch.equal(model(x), ref)
    handle.remove()


# -- E: tensors with gaps, expanded ones and overlapping ones --------------------------------------
class _GappedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 128)[:, ::2])                  # strides (128, 2)
        self.v = nn.Parameter(torch.randn(128, 64).t()[:, ::2])              # column-major, gaps
        self.register_buffer("table", torch.randn(1, 64).expand(256, 64))    # strides (0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.t()) @ self.v + self.table[: x.shape[0]]


class _GappedDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, num_blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_GappedBlock() for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _strides(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: t.stride() for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("how", ["streamed", "resident", "budget"])
@torch.no_grad()
def test_tensors_with_gaps_keep_their_strides_and_outputs_bitwise(how):
    model, x = _GappedDiT(6), torch.randn(2, 64)
    ref, strides = model(x), _strides(model)
    total = sum(layout_block(i, f"blocks.{i}", b).nbytes for i, b in enumerate(model.blocks))
    config = {"streamed": _config(), "resident": _config(resident_blocks=[1]),
              # a plan from sizes, then one from the measured forward (blocks kept, or partly)
              "budget": _config({"device_budget": int(0.8 * total)})}[how]
    handle = apply_offload(model, config, device="cpu")
    seen = {}
    hook = model.blocks[2].register_forward_pre_hook(lambda block, args: seen.update(_strides(block)))
    for _ in range(3):
        assert torch.equal(model(x), ref)
    assert seen["w"] == (128, 2) and seen["v"] == (1, 128)
    # A gap costs host memory (the span from first to last element), an expanded buffer its values.
    layout = layout_block(0, "blocks.0", _GappedDiT().blocks[0])
    spans = {e.name.rpartition(".")[2]: e.nbytes for e in layout.entries}
    assert spans["w"] == (63 * 128 + 63 * 2 + 1) * 4 and spans["table"] == 256 * 64 * 4
    hook.remove()
    handle.remove()
    # (The expanded buffer keeps its values, stored dense: see layout._placement.)
    assert {n: s for n, s in _strides(model).items() if not n.endswith("table")} == \
        {n: s for n, s in strides.items() if not n.endswith("table")}
    assert torch.equal(model(x), ref)


@torch.no_grad()
def test_gapped_tensors_under_8_bit_storage_keep_the_strides_layerwise_casting_gives():
    """A tensor stored in 8 bits keeps the strides ``Tensor.to`` gives it (what diffusers' layerwise
    casting stores and upcasts, so outputs match it); one that is not keeps its own."""
    def build() -> nn.Module:
        model = tiny.tiny_wan_transformer(num_layers=2, seed=0)
        torch.manual_seed(1)
        for block in model.blocks:
            q = block.attn1.to_q.weight
            block.attn1.to_q.weight = nn.Parameter((torch.randn(q.shape[1], 2 * q.shape[0]) * 0.05).t()[::2])
            t = block.scale_shift_table
            block.scale_shift_table = nn.Parameter((torch.randn(*t.shape[:-1], 2 * t.shape[-1]) * 0.1)[..., ::2])
        return model

    model, reference = build(), build()
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    inputs = tiny.wan_transformer_inputs(model, seed=0)
    ref = reference(**inputs)[0]
    want = {"q": model.blocks[1].attn1.to_q.weight.to(torch.float8_e4m3fn).stride(),
            "table": model.blocks[1].scale_shift_table.stride()}
    assert want == {"q": (1, 24), "table": (288, 48, 2)}
    handle = apply_offload(model, _config(storage_dtype="float8_e4m3fn"), device="cpu")
    seen = {}
    hook = model.blocks[1].register_forward_pre_hook(lambda block, args: seen.update(
        q=block.attn1.to_q.weight.stride(), table=block.scale_shift_table.stride()))
    for _ in range(2):
        assert torch.equal(model(**inputs)[0], ref)
    assert seen == want
    hook.remove()
    handle.remove()
    assert model.blocks[1].scale_shift_table.stride() == want["table"]
    assert torch.equal(model(**inputs)[0], ref)


def test_overlapping_elements_are_refused_naming_the_tensor_before_anything_changes():
    model = ToyDiT(2)
    model.blocks[1].register_buffer("rolling", torch.arange(10.0).as_strided((4, 4), (2, 1)))
    data = {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    with pytest.raises(OffloadConfigError, match=r"blocks\.1\.rolling has strides \(2, 1\) for its shape \(4, 4\): "
                                                 r"its elements overlap .* \.contiguous\(\)"):
        apply_offload(model, _config(), device="cpu")
    assert all(t.data_ptr() == data[n] for n, t in [*model.named_parameters(), *model.named_buffers()])
    # Stored in 8 bits, the same tensor is what Tensor.to makes of it (diffusers' casting): no refusal.
    lin = model.blocks[0].lin
    lin.weight = nn.Parameter(torch.randn(22).as_strided((8, 8), (2, 1)))
    cast = {id(lin.weight): torch.float8_e4m3fn}
    (entry,) = [e for e in layout_block(0, "blocks.0", model.blocks[0], cast=cast).entries if e.tensor is lin.weight]
    assert entry.stride == (8, 1)


@torch.no_grad()
def test_placeholder_like_and_copied_models_still_stream():
    """A tensor holding one value over all its elements (how a cold start's block tensors look
    before their bytes are read) is stored row-major, and a copy of a gapped model (dense again)
    streams as any other."""
    model, x = _GappedDiT(), torch.randn(2, 64)
    model.blocks[0].register_buffer("one", torch.tensor(3.0).expand(16, 4))
    (entry,) = [e for e in layout_block(0, "blocks.0", model.blocks[0]).entries if e.name.endswith("one")]
    assert entry.stride == (4, 1) and entry.nbytes == 64 * 4
    copied = copy.deepcopy(model)
    ref = copied(x)
    handle = apply_offload(copied, _config(), device="cpu")
    assert torch.equal(copied(x), ref)
    handle.remove()
