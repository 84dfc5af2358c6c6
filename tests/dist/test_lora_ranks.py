"""LoRA on an allgather ring (gloo ranks): adapters added after offloading, fused into every
rank's shard and unfused, bitwise equal to the resident model on every rank; also run on GPUs
(gpu/test_gpu_lora.py)."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tiny
from omni_dist_offload import apply_offload
from ranks import run_ranks

pytest.importorskip("peft")
from unit.test_lora import TARGETS  # noqa: E402


def fused_on_shards(rank, budget: str | None = None) -> dict:
    from peft import LoraConfig

    cuda = rank.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def build():
        model = tiny.tiny_wan_transformer(num_layers=4, dtype=dtype).to(rank.device)
        batch = {k: v.to(rank.device) if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(model).items()}
        return model, batch

    def add(model):
        torch.manual_seed(5)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))

    def steps(model, batch):
        with torch.no_grad():
            outs = [model(**batch)[0]]
            model.fuse_lora(lora_scale=0.7)
            outs += [model(**batch)[0], model(**batch)[0]]
            model.unfuse_lora()
            outs.append(model(**batch)[0])
        return outs

    ref_model, batch = build()
    add(ref_model)
    ref = steps(ref_model, batch)
    model, batch = build()
    cfg = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 60,
           "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    if budget is not None:
        cfg["device_budget"] = budget
    handle = apply_offload(model, cfg)
    add(model)
    outs = steps(model, batch)
    (row,) = handle.summary()
    handle.remove()
    state_equal = all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), ref_model.state_dict().values()))
    return {"equal": [torch.equal(a, b) for a, b in zip(outs, ref)], "state_equal": state_equal,
            "transfer": row["weight_transfer"]}


@pytest.mark.parametrize("budget", [None, "100KiB"], ids=["streamed", "budget"])
def test_fuse_and_unfuse_on_allgather_shards(budget):
    for r in run_ranks(fused_on_shards, 2, args=(budget,), timeout=240):
        assert r["transfer"] == "allgather"
        assert r["equal"] == [True] * 4 and r["state_equal"], r
