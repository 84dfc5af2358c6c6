"""8-bit host storage under allgather, two ranks on gloo: every rank keeps a shard of each
block's 8-bit image; outputs equal diffusers' layerwise casting bit for bit."""

from __future__ import annotations

import copy

import torch

import tiny_models as tiny
from omni_dist_offload import apply_offload
from ranks import Rank, run_ranks


def _config(storage: str | None) -> dict:
    options = {"weight_transfer": "allgather", "chunk_mib": 0.01, "storage_dtype": storage}
    return {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}, "collective_timeout_s": 20}


@torch.no_grad()
def stored_allgather(rank: Rank) -> dict:
    out = {}
    for family, build, inputs in (("wan", tiny.tiny_wan_transformer, tiny.wan_transformer_inputs),
                                  ("flux", tiny.tiny_flux_transformer, tiny.flux_transformer_inputs)):
        model = build(dtype=torch.float32)
        reference = copy.deepcopy(model)
        reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        x = inputs(model, batch=2)
        ref = reference(**x)[0]
        handle = apply_offload(copy.deepcopy(model), _config(None), device="cpu")
        plain = handle.summary()[0]
        handle.remove()
        handle = apply_offload(model, _config("float8_e4m3fn"), device="cpu")
        (row,) = handle.summary()
        equal = all(torch.equal(model(**x)[0], ref) for _ in range(2))
        handle.remove()
        out[family] = {"equal": equal, "after_remove": torch.equal(model(**x)[0], ref), "row": row,
                       "plain_host_bytes": plain["host_bytes"]}
    return out


def test_allgather_shards_hold_8_bit_images_and_outputs_match():
    for result in run_ranks(stored_allgather, 2):
        for family, r in result.items():
            assert r["equal"] and r["after_remove"], family
            row = r["row"]
            assert (row["weight_transfer"], row["gather"], row["storage_dtype"]) == ("allgather", "gloo", "float8_e4m3fn")
            assert row["host_bytes"] < 0.75 * r["plain_host_bytes"], (family, row["host_bytes"], r["plain_host_bytes"])
