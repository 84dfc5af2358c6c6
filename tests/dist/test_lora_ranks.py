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


def hotswap_on_one_rank(rank) -> dict:
    """An adapter loaded before apply_offload on a shared ring; rank 1 alone hotswaps another in."""
    import torch.distributed as dist

    from unit.test_lora import lora_state_dict

    a, b = lora_state_dict(1), lora_state_dict(2)
    model = tiny.tiny_wan_transformer(num_layers=3, dtype=torch.float32)
    model.load_lora_adapter({k: v.clone() for k, v in a.items()}, adapter_name="h", prefix="transformer")
    batch = tiny.wan_transformer_inputs(model)
    with torch.no_grad():
        want = model(**batch)[0]
    handle = apply_offload(model, {"mode": "layer", "components": ["dit"], "collective_timeout_s": 60,
                                   "layer_options": {"dit": {"weight_transfer": "shared"}}})
    error = None
    if rank.rank == 1:
        try:
            model.load_lora_adapter({k: v.clone() for k, v in b.items()}, adapter_name="h", hotswap=True,
                                    prefix="transformer")
        except RuntimeError as exc:
            error = str(exc)
    dist.barrier()
    with torch.no_grad():
        equal = [torch.equal(model(**batch)[0], want) for _ in range(2)]
    out = {"transfer": handle.summary()[0]["weight_transfer"], "error": error, "equal": equal}
    dist.barrier()
    handle.remove()
    return out


def test_a_hotswap_on_one_rank_of_a_shared_ring_is_refused_and_changes_no_rank():
    """The hotswap wrote into the host copy every rank of the host shares: rank 0, which never
    swapped, ran a mix of both adapters."""
    r0, r1 = run_ranks(hotswap_on_one_rank, 2, timeout=120)
    assert r0["transfer"] == r1["transfer"] == "shared"
    assert r0["error"] is None
    assert r1["error"] is not None and "hotswapping adapter 'h'" in r1["error"], r1
    assert "every rank on this host shares (shared)" in r1["error"] and "Nothing was changed" in r1["error"]
    assert r0["equal"] == r1["equal"] == [True, True]
