"""Cold start on real ranks (gloo): allgather and shared from a checkpoint folder equal the
ordinary load bitwise, and peak host memory stays near this rank's final host copy. In one process:
unit/test_coldstart.py."""

from __future__ import annotations

import ctypes
import gc
import json
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

import tiny_models as tiny
from omni_dist_offload import apply_offload
from ranks import Rank, proc_status, run_ranks

def _config(transfer: str) -> dict:
    return {"mode": "layer", "components": ["dit", "text_encoder"], "collective_timeout_s": 20,
            "layer_options": {"dit": {"weight_transfer": transfer, "chunk_mib": 0.02},
                              "text_encoder": {"weight_transfer": transfer}}}


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory) -> Path:
    """A pipeline folder holding one Wan DiT of 6 blocks of 17 MB (fp32 checkpoint)."""
    folder = tmp_path_factory.mktemp("wan-big")
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64,
                                  in_channels=16, out_channels=16, text_dim=tiny.TINY_TEXT_DIM, freq_dim=32,
                                  ffn_dim=2048, num_layers=6, cross_attn_norm=True,
                                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    model.save_pretrained(folder / "transformer", max_shard_size="30MB")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "WanTransformer3DModel"]}))
    return folder


def _peak_reset() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS, and return that. Freed heap the
    C allocator still holds goes back to the system first: a later load would otherwise reuse it
    without raising RSS, and its peak would read low by however much an earlier phase left."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


@torch.no_grad()
def cold_start(folder: str, transfer: str) -> dict:
    """Cold start with ``transfer`` from ``folder`` against the ordinary load: bitwise equal DiT
    and text-encoder outputs, and the summary."""
    from diffusers import DiffusionPipeline
    from omni_dist_offload.loading.coldstart import load_offloaded

    dtype = torch.bfloat16
    ref = DiffusionPipeline.from_pretrained(folder, dtype=dtype, disable_mmap=True)  # aligned, see unit/test_coldstart
    handle = apply_offload(ref, _config(transfer))
    x = tiny.wan_transformer_inputs(ref.transformer, batch=1)
    x = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in x.items()}
    t = tiny.text_encoder_inputs(ref.text_encoder)
    expect = (ref.transformer(**x)[0], ref.text_encoder(**t).last_hidden_state)
    handle.remove()
    del ref, handle
    gc.collect()
    pipe, handle = load_offloaded(folder, _config(transfer), device="cpu", dtype=dtype)
    got = (pipe.transformer(**x)[0], pipe.text_encoder(**t).last_hidden_state)
    out = {"equal": all(torch.equal(a, b) for a, b in zip(got, expect)), "summary": handle.summary()}
    handle.remove()
    return out


@torch.no_grad()
def cold_start_rss(folder: str, big: str, transfer: str) -> dict:
    """Peak host memory of a cold start (fp32 checkpoint, bf16 run) against the ordinary load of
    the same DiT (``big``, a pipeline folder holding only the transformer)."""
    from omni_dist_offload.loading.coldstart import load_offloaded, prepare_cold_start

    cfg = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 60,
           "layer_options": {"dit": {"weight_transfer": transfer}}}
    dtype = torch.bfloat16
    warm, handle = load_offloaded(folder, cfg, device="cpu", dtype=dtype)  # imports, pools
    handle.remove()
    del warm, handle
    dist.barrier()
    base = _peak_reset()
    cold = prepare_cold_start(big, cfg, device=torch.device("cpu"), dtype=dtype, threads=2)
    model = cold.components["transformer"]
    handle = apply_offload(types.SimpleNamespace(transformer=model), cfg, block_sources=cold.sources)
    cold.close()
    peak_cold = proc_status("VmHWM") - base
    row = handle.summary()[0]
    nonblock = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if not n.startswith("blocks."))
    x = tiny.wan_transformer_inputs(model, batch=1)
    y_cold = model(**x)[0]
    handle.remove()
    del model, handle, cold
    dist.barrier()
    base = _peak_reset()
    model = WanTransformer3DModel.from_pretrained(big, subfolder="transformer", dtype=dtype)
    handle = apply_offload(types.SimpleNamespace(transformer=model), cfg)
    peak_ordinary = proc_status("VmHWM") - base
    y_ordinary = model(**x)[0]
    handle.remove()
    return {
        "peak_cold": peak_cold, "peak_ordinary": peak_ordinary, "host_bytes": row["host_bytes"],
        "block_bytes": row["block_bytes"], "max_block": row["device_slot_bytes"] // 2,  # a slot holds the largest block
        "nonblock_bytes": nonblock, "device_slot_bytes": row["device_slot_bytes"], "transfer": row["weight_transfer"],
        "equal": torch.equal(y_cold, y_ordinary),
    }


def cold_starts(rank: Rank, folder: str, big: str, transfer: str) -> dict:
    return {"cold_start": cold_start(folder, transfer), "cold_start_rss": cold_start_rss(folder, big, transfer)}


@pytest.mark.parametrize("world,transfer", [(1, "allgather"), (2, "allgather"), (2, "shared")])
def test_peak_host_memory_and_parity(wan_folder, big_folder, world, transfer):
    """Real processes (gloo): cold start with allgather (each rank reads its shards) or shared
    (each rank reads its part of the blocks into the host copy) equals the ordinary load bitwise,
    and peak host memory during start-up stays within this rank's final host copy (its share)
    plus one block (plus the non-block tensors and scratch), far below the ordinary load's."""
    results = run_ranks(cold_starts, world, args=(str(wan_folder), str(big_folder), transfer))
    for r in results:
        assert r["cold_start"]["equal"]
        rows = r["cold_start"]["summary"]
        assert all(row["weight_transfer"] == (transfer if world > 1 else "rank-local") for row in rows)
        m = r["cold_start_rss"]
        assert m["equal"] and m["transfer"] == (transfer if world > 1 else "rank-local")
        if world > 1:
            assert m["host_bytes"] <= m["block_bytes"] / world + 6 * 4096 * world
        # On the CPU the "device" is host memory too: the non-block tensors and the ring's two
        # slots count here. Slack: reader scratch (2 threads x 4 MiB), allocator and interpreter.
        slack = 16 * 2**20
        device = m["nonblock_bytes"] + m["device_slot_bytes"]
        bound = m["host_bytes"] + m["max_block"] + device + slack
        assert m["peak_cold"] <= bound, (m, (m["peak_cold"] - m["host_bytes"] - device) / 2**20)
        assert m["peak_ordinary"] > m["peak_cold"] + m["block_bytes"] / 2, m
