"""The handle's typed rows, a transfer complete at construction, and rank-aware logging."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle

import pytest
import torch
from toys import ToyDiT

from omni_dist_offload import OffloadConfigError, RingSummary, apply_offload
from omni_dist_offload.config import OffloadConfig
from omni_dist_offload.hostmem import HostBuffer
from omni_dist_offload.layout import layout_block
from omni_dist_offload.plan import discover
from omni_dist_offload.ring import BlockRing
from omni_dist_offload.runtime.logs import RankFilter, setup_logging
from omni_dist_offload.transfer import RankLocalTransfer, TransferStreams

#: The summary keys the README documents, in its order.
SUMMARY_KEYS = ["component", "category", "module_class", "num_blocks", "weight_transfer", "gather",
                "fallback_reason", "block_bytes", "host_bytes", "device_slot_bytes", "setup_s",
                "resident_blocks", "resident_bytes", "predicted_ratio", "device_budget", "kept_blocks",
                "found_by", "storage_dtype", "upcast", "shared_host_bytes", "host_ranks"]


def test_summary_is_the_typed_rows_as_dicts():
    model = ToyDiT(3)
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"]})
    try:
        (row,) = handle.summary_rows()
        assert isinstance(row, RingSummary)
        (as_dict,) = handle.summary()
        assert list(as_dict) == SUMMARY_KEYS == [f.name for f in dataclasses.fields(RingSummary)]
        assert as_dict == dataclasses.asdict(row)
        assert (row.component, row.num_blocks, row.weight_transfer, row.gather) == ("transformer", 3, "rank-local", None)
        assert row.host_bytes >= row.block_bytes > 0 and row.setup_s is not None and row.setup_s >= 0
        with pytest.raises(dataclasses.FrozenInstanceError):
            row.num_blocks = 4  # type: ignore[misc]
    finally:
        handle.remove()


@pytest.mark.parametrize("budget", [None, 3000])  # two slots: the plan adds hooks on the root module
def test_copying_or_pickling_an_offloaded_model_is_refused_and_changes_nothing(budget, tmp_path):
    """A deep copy would share the ring's host memory, streams and threads with the original (or
    lose them): refused with a message that names the fix, before and after a forward, and the
    model runs on; after remove() the ordinary model copies as usual."""
    model = ToyDiT(3)
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "device_budget": budget})
    for forward_first in (False, True):
        if forward_first:
            with torch.no_grad():
                model(x)
        for attempt in (copy.deepcopy, pickle.dumps, lambda m: torch.save(m, tmp_path / "m.pt"),
                        lambda m: copy.deepcopy(handle)):
            with pytest.raises(TypeError, match=r"transformer: an offloaded model cannot be copied \(copy.copy "
                                                r"or copy.deepcopy\) or pickled .* call remove\(\) on its handle first"):
                attempt(model)
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    handle.remove()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(x), ref) and torch.equal(pickle.loads(pickle.dumps(model))(x), ref)


def test_the_ring_sizes_the_transfer_slots_for_its_plan():
    model = ToyDiT(3)
    (comp,) = discover(model, OffloadConfig.parse({"mode": "layer", "components": ["dit"]}))
    layouts = [layout_block(i, n, b) for i, (n, b) in enumerate(comp.blocks)]
    buffers = [HostBuffer(l.nbytes) for l in layouts]
    transfer = RankLocalTransfer(buffers, [l.nbytes for l in layouts], TransferStreams(), torch.device("cpu"))
    assert transfer.gather is None and transfer.fallback_reason is None and transfer.slots == []
    views = [[e.view_in(b.tensor) for e in l.entries] for l, b in zip(layouts, buffers)]
    ring = BlockRing(comp, layouts, transfer, torch.device("cpu"), views, num_slots=3)
    assert [s.numel() for s in transfer.slots] == [max(l.nbytes for l in layouts)] * 3 and ring.num_slots == 3
    with pytest.raises(ValueError, match="needs at least 2 slots, found 1"):
        BlockRing(comp, layouts, transfer, torch.device("cpu"), views, num_slots=1)
    transfer.release()
    assert transfer.slots == [] and transfer.host_bytes() == sum(b.nbytes for b in buffers)


def _record(level: int, msg: str = "m") -> logging.LogRecord:
    return logging.LogRecord("omni_dist_offload.apply", level, __file__, 1, msg, None, None)


def test_the_rank_filter_applies_log_rank_and_prefixes(monkeypatch, capsys):
    flt = RankFilter()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("LOG_RANK", raising=False)  # default: rank 0 only
    info, warning = _record(logging.INFO), _record(logging.WARNING)
    assert not flt.filter(info)
    assert flt.filter(warning) and warning.rank_prefix == "[rank1] "
    monkeypatch.setenv("LOG_RANK", "0,1")
    assert flt.filter(_record(logging.INFO))
    monkeypatch.setenv("LOG_RANK", "not-a-rank")  # malformed: rank 0 only, said once
    assert not flt.filter(_record(logging.INFO)) and not flt.filter(_record(logging.INFO))
    err = capsys.readouterr().err
    assert err.count("LOG_RANK='not-a-rank' is not a comma-separated list of ranks") == 1, err


def test_the_library_never_filters_ranks_itself(monkeypatch, caplog):
    """Rank 1's INFO lines reach the handlers; which ranks show is the entry point's choice."""
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="omni_dist_offload"):
        apply_offload(ToyDiT(2), {"mode": "layer", "components": ["dit"]}).remove()
    assert any(r.name == "omni_dist_offload.apply" and "streaming transformer" in r.getMessage()
               for r in caplog.records)


def test_an_error_line_is_one_write(monkeypatch):
    """Ranks sharing torchrun's stderr: a line written in two parts (print's text, then its
    newline) let another rank's line land between them."""
    import io
    import sys

    from omni_dist_offload.app import cli
    from omni_dist_offload.runtime.flags import report_usage_error

    writes = []

    class Recording(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recording())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cli._report("omni-offload generate: error: bad")
    assert report_usage_error("omni-offload", "worse") == 2
    assert writes == ["[rank1] omni-offload generate: error: bad\n",
                      "omni-offload: error: worse (see omni-offload --help)\n"], writes


def test_setup_logging_installs_one_handler(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    setup_logging()
    setup_logging()
    package = logging.getLogger("omni_dist_offload")
    assert sum(type(h).__name__ == "_StderrHandler" for h in package.handlers) == 1
    logging.getLogger("omni_dist_offload.plan").info("hello")
    assert capsys.readouterr().err == "[rank0] hello\n"


@pytest.mark.parametrize("upcast", ["block", "layer"])
def test_discard_leaves_no_hook_of_8_bit_storage(upcast):
    """The layers outside the blocks kept diffusers' casting hooks, the root its adapter check,
    and under upcast "layer" every layer in a block its upcast hooks, with their device buffer."""
    import tiny_models as tiny

    model = tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2)
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "layer_options": {
        "dit": {"storage_dtype": "float8_e4m3fn", "upcast": upcast}}}, device="cpu")
    with torch.no_grad():
        model(**tiny.flux_transformer_inputs(model))
    handle.discard()
    assert [name for name, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks] == []
    assert [name for name, m in model.named_modules() if "_diffusers_hook" in vars(m)] == []


@pytest.mark.parametrize("options", [
    {},
    {"layer_options": {"dit": {"resident_blocks": [1]}}},  # a resident block's device buffer too
    {"layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}},
], ids=["streamed", "resident-block", "8-bit"])
def test_discard_frees_the_offload_without_restoring_it(options):
    """``discard()`` (what ``Omni.close()`` calls): hooks off, rings, slots and host copies freed,
    every streamed tensor left empty; what did not stream is untouched. ``remove()`` after it,
    or a second ``discard()``, does nothing."""
    import gc
    import weakref

    model = ToyDiT(3)
    outside = {name: p.detach().clone() for name, p in model.proj_in.named_parameters()}
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], **options})
    with torch.no_grad():
        model(torch.ones(2, 8))
    rings = [weakref.ref(r) for r in handle.rings]
    hooks = sum(len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks)
    assert hooks > 0 and handle.active
    handle.discard()
    assert not handle.active and handle.summary() == []
    assert all(p.numel() == 0 for p in model.blocks.parameters())
    assert sum(len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks) == 0
    assert all(torch.equal(p, outside[name]) for name, p in model.proj_in.named_parameters())
    handle.discard()
    handle.remove()
    gc.collect()
    assert all(r() is None for r in rings)
    # Offloading the emptied model again is refused up front, naming why (it had planned empty
    # blocks, then failed in the forward, or divided by zero bytes under a budget).
    for config in ({}, {"device_budget": "100KiB"}):
        with pytest.raises(OffloadConfigError, match=r"transformer \(ToyDiT\) was emptied by OffloadHandle.discard"):
            apply_offload(model, {"mode": "layer", "components": ["dit"], **config})


@pytest.mark.parametrize("options", [{}, {"resident_blocks": [0]}], ids=["streamed", "resident-block"])
def test_load_state_dict_into_a_model_built_under_inference_mode_is_what_the_next_forward_runs(options):
    """Its tensors are inference tensors, which keep no version counter: a write into the host
    copy is not seen by the ring, so the component's ``load_state_dict`` forgets the slots after
    it (two blocks, two slots: the last forward left every streamed block in one)."""
    with torch.inference_mode():
        model, other, x = ToyDiT(2), ToyDiT(2, seed=1), torch.randn(4, 8)
        want = other(x)
        handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}})
        first = model(x)
        model.load_state_dict(other.state_dict())
        assert not torch.equal(first, want) and torch.equal(model(x), want)
    handle.remove()
