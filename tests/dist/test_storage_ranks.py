"""8-bit host storage under allgather, two ranks on gloo: every rank keeps a shard of each
block's 8-bit image; outputs equal diffusers' layerwise casting bit for bit."""

from __future__ import annotations

import copy

import torch

import tiny_models as tiny
from omni_dist_offload import apply_offload
from ranks import Rank, run_ranks


def _config(storage: str | None, gather: str | None = None, **more) -> dict:
    options = {"weight_transfer": "allgather", "chunk_mib": 0.01, "storage_dtype": storage, **more}
    if gather:
        options["gather"] = gather
    return {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}, "collective_timeout_s": 20}


@torch.no_grad()
def stored_allgather(rank: Rank, gather: str | None = None) -> dict:
    """Also run on two GPUs, with each gather (gpu/test_gpu_allgather.py)."""
    out = {}
    device = rank.device
    for family, build, inputs in (("wan", tiny.tiny_wan_transformer, tiny.wan_transformer_inputs),
                                  ("flux", tiny.tiny_flux_transformer, tiny.flux_transformer_inputs)):
        model = build(dtype=torch.float32).to(device)
        reference = copy.deepcopy(model)
        reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        x = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs(model, batch=2).items()}
        ref = reference(**x)[0]
        handle = apply_offload(copy.deepcopy(model), _config(None, gather), device=device)
        plain = handle.summary()[0]
        handle.remove()
        handle = apply_offload(model, _config("float8_e4m3fn", gather), device=device)
        (row,) = handle.summary()
        equal = all(torch.equal(model(**x)[0], ref) for _ in range(2))
        handle.remove()
        out[family] = {"equal": equal, "after_remove": torch.equal(model(**x)[0], ref), "row": row,
                       "plain_host_bytes": plain["host_bytes"]}
        if family == "wan":  # a block held as its image: gathered once, through a slot of the gather's own
            handle = apply_offload(model, _config("float8_e4m3fn", gather, resident_blocks=[1]), device=device)
            out["held"] = {"equal": all(torch.equal(model(**x)[0], ref) for _ in range(2)),
                           "row": handle.summary()[0], "staging": handle.rings[0].transfer.staging_nbytes()}
            handle.remove()
    return out


def test_allgather_shards_hold_8_bit_images_and_outputs_match():
    check_stored_allgather(run_ranks(stored_allgather, 2), "gloo")


def check_stored_allgather(results: list[dict], gather: str) -> None:
    for result in results:
        held = result.pop("held")
        assert held["equal"] and held["row"]["resident_blocks"] == [1], held
        assert held["staging"] > 0  # sized to the shards of the images that still stream
        for family, r in result.items():
            assert r["equal"] and r["after_remove"], family
            row = r["row"]
            assert (row["weight_transfer"], row["gather"], row["storage_dtype"]) == ("allgather", gather, "float8_e4m3fn")
            assert row["host_bytes"] < 0.75 * r["plain_host_bytes"], (family, row["host_bytes"], r["plain_host_bytes"])


@torch.no_grad()
def per_layer_allgather(rank: Rank, gather: str | None = None) -> dict:
    """``upcast: "layer"``: every rank's shard holds 8-bit bytes, the gathered block stays 8-bit
    on the device and each layer upcasts as it runs. Also run on two GPUs (gpu/test_gpu_allgather.py)."""
    device = rank.device
    model = tiny.tiny_flux_transformer(dtype=torch.bfloat16).to(device)
    reference = copy.deepcopy(model)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    x = {k: v.to(device) if torch.is_tensor(v) else v for k, v in tiny.flux_transformer_inputs(model, batch=2).items()}
    ref = reference(**x)[0]
    handle = apply_offload(copy.deepcopy(model), _config("float8_e4m3fn", gather), device=device)
    block = handle.summary()[0]
    handle.remove()
    handle = apply_offload(model, _config("float8_e4m3fn", gather, upcast="layer", resident_blocks=[1]), device=device)
    (row,) = handle.summary()
    equal = all(torch.equal(model(**x)[0], ref) for _ in range(2))
    handle.remove()
    return {"equal": equal, "after_remove": torch.equal(model(**x)[0], ref), "row": row, "block": block}


def test_allgather_shards_with_upcast_per_layer_match():
    check_per_layer_allgather(run_ranks(per_layer_allgather, 2), "gloo")


def check_per_layer_allgather(results: list[dict], gather: str) -> None:
    for r in results:
        assert r["equal"] and r["after_remove"], r
        row, block = r["row"], r["block"]
        assert (row["weight_transfer"], row["gather"], row["upcast"]) == ("allgather", gather, "layer")
        assert row["resident_blocks"] == [1]
        # Each rank's shards: the 8-bit bytes of what streams, as under "block" less the resident one.
        assert row["host_bytes"] < block["host_bytes"]
        assert row["device_slot_bytes"] < 0.6 * block["device_slot_bytes"], (row, block)
