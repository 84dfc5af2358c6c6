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
