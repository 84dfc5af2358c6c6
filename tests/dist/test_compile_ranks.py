"""Regional torch.compile on an allgather ring under a budget (gloo ranks): bitwise equal to the
compiled resident model on every rank, and the same graphs."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import tiny_models as tiny
from omni_dist_offload import apply_offload
from ranks import run_ranks


def compiled(rank, offload: bool, gather: str = "auto") -> dict:
    """Also run on GPUs, bf16 (gpu/test_gpu_allgather.py)."""
    torch._dynamo.reset()
    counters.clear()
    cuda = rank.device.type == "cuda"
    model = tiny.tiny_wan_transformer(num_layers=4, dtype=torch.bfloat16 if cuda else torch.float32).to(rank.device)
    batch = {k: v.to(rank.device) if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(model).items()}
    handle = None
    if offload:
        cfg = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 60,
               "device_budget": "48KiB" if cuda else "96KiB",  # about half the blocks, either dtype
               "layer_options": {"dit": {"weight_transfer": "allgather", "gather": gather}}}
        handle = apply_offload(model, cfg)
    model.compile_repeated_blocks(fullgraph=False)
    with torch.no_grad():
        outs = [model(**batch)[0].float().cpu() for _ in range(4)]
    row = handle.summary()[0] if handle is not None else None
    if handle is not None:
        handle.remove()
    # Every element, exactly: floats survive JSON round trips.
    return {"outs": [o.flatten().tolist() for o in outs], "graphs": counters["stats"]["unique_graphs"], "row": row}


def resident_then_offloaded(rank) -> list[dict]:
    """The compiled resident model, then the compiled offloaded one, in one rank's process."""
    return [compiled(rank, False), compiled(rank, True)]


def test_regional_compile_on_an_allgather_ring_under_a_budget():
    for r, g in run_ranks(resident_then_offloaded, 2, timeout=240):
        assert g["row"]["weight_transfer"] == "allgather" and g["row"]["num_blocks"] >= 2
        assert g["outs"] == r["outs"]
        assert g["graphs"] == r["graphs"]
