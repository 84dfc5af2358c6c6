"""torch.compile on streamed models (CPU): the ring's hooks stay outside compiled regions, so
regional compilation after ``apply_offload`` compiles the same graphs as on the resident model,
never recompiles as slots alternate and the ring wraps, and matches it bitwise."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import tiny_models as tiny
from omni_dist_offload import apply_offload


def _regional(offload: dict | None) -> tuple[list[torch.Tensor], dict]:
    torch._dynamo.reset()
    counters.clear()
    model = tiny.tiny_wan_transformer(num_layers=4)
    batch = tiny.wan_transformer_inputs(model)
    handle = apply_offload(model, offload) if offload is not None else None
    model.compile_repeated_blocks(fullgraph=False)
    with torch.no_grad():
        # Across the wrap to block 0, and (under a budget) across the re-plan after the second.
        outs = [model(**batch)[0] for _ in range(4)]
    stats = dict(counters["stats"])
    if handle is not None:
        (row,) = handle.summary()
        stats["streamed_blocks"] = row["num_blocks"]
        handle.remove()
    return outs, stats


@pytest.mark.parametrize("offload", [{"mode": "layer"}, {"mode": "layer", "device_budget": "96KiB"}],
                         ids=["streamed", "budget"])
def test_regional_compile_after_offload_matches_compiled_resident(offload):
    ref, resident = _regional(None)
    outs, streamed = _regional(offload)
    assert streamed["streamed_blocks"] >= 2  # under the budget: one block resident, the rest streamed
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    # The same graphs as the compiled resident model: streaming adds none, and none recompiles.
    assert streamed["unique_graphs"] == resident["unique_graphs"]
    assert streamed["calls_captured"] == resident["calls_captured"]


def test_omni_compiles_the_dit_after_offloading_and_reports_compile_time_apart():
    from omni_dist_offload import Omni

    kwargs = dict(prompt="a red fox", seed=0, num_inference_steps=2)
    torch._dynamo.reset()  # compiled code is shared in a process: start from none
    with Omni("tiny-wan", {"mode": "layer", "components": ["dit", "text_encoder"]}, compile=True) as omni:
        assert omni.compile == "regional" and omni.compiled == ["transformer"]
        first = omni.generate(**kwargs)
        second = omni.generate(**kwargs)
    with Omni("tiny-wan", None, compile="regional") as resident:
        ref = resident.generate(**kwargs).frames
    assert (first.frames == ref).all() and (second.frames == ref).all()
    timings = first.metadata["timings"]
    assert first.metadata["compile"] == "regional" and timings["compile_s"] > 0
    assert second.metadata["timings"]["compile_s"] == 0  # compiled once: nothing recompiles
    assert timings["generation_s"] > 0


@pytest.mark.parametrize("value", ["fast", 1, "max-autotune"])
def test_a_bad_compile_mode_is_refused_before_loading(value):
    from omni_dist_offload import Omni

    with pytest.raises(ValueError, match=r"compile=.*use True or \"regional\""):
        Omni("tiny-wan", None, compile=value)


def test_offloading_an_already_compiled_model():
    """compile_repeated_blocks() first, apply_offload after: the hooks added later run outside
    the compiled blocks too; bitwise equal, no graph beyond the compiled resident model's."""
    ref, resident = _regional(None)
    torch._dynamo.reset()
    counters.clear()
    model = tiny.tiny_wan_transformer(num_layers=4)
    batch = tiny.wan_transformer_inputs(model)
    model.compile_repeated_blocks(fullgraph=False)
    handle = apply_offload(model, {"mode": "layer"})
    with torch.no_grad():
        outs = [model(**batch)[0] for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    assert counters["stats"]["unique_graphs"] == resident["unique_graphs"]
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(**batch)[0], ref[0])
