"""One rank of a multi-process allgather test on CPU (gloo). Run by tests/test_allgather.py as
separate processes with torchrun's environment variables; writes its findings as JSON."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import types

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from omni_dist_offload import OffloadConfigError, apply_offload  # noqa: E402
from omni_dist_offload import tiny  # noqa: E402
from toys import ToyDiT  # noqa: E402

AG = {"mode": "layer", "components": ["dit", "text_encoder"],
      "layer_options": {"dit": {"weight_transfer": "allgather", "chunk_mib": 0.01},
                        "text_encoder": {"weight_transfer": "allgather"}},
      "collective_timeout_s": 20}
AG_DIT = {"mode": "layer", "components": ["dit"],
          "layer_options": {"dit": {"weight_transfer": "allgather", "chunk_mib": 0.01}},
          "collective_timeout_s": 20}


class UnevenBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class UnevenDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, hiddens=(8, 64, 3, 200, 16)):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(UnevenBlock(16, h) for h in hiddens)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


DEVICE = torch.device(os.environ.get("OMNI_TEST_DEVICE", "cpu"))


def _to(batch: dict) -> dict:
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch.items()}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@torch.no_grad()
def parity(out: dict) -> None:
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    pipe = types.SimpleNamespace(transformer=tiny.tiny_wan_transformer(num_layers=3, dtype=dtype).to(DEVICE),
                                 text_encoder=tiny.tiny_umt5_encoder(num_layers=3).to(DEVICE))
    x = _to(tiny.wan_transformer_inputs(pipe.transformer, batch=2))
    t = _to(tiny.text_encoder_inputs(pipe.text_encoder))
    ref = (pipe.transformer(**x)[0], pipe.text_encoder(**t).last_hidden_state)
    handle = apply_offload(pipe, AG)
    rows = handle.summary()
    eq = all(torch.equal(pipe.transformer(**x)[0], ref[0]) and
             torch.equal(pipe.text_encoder(**t).last_hidden_state, ref[1]) for _ in range(2))
    handle.remove()
    eq_after = torch.equal(pipe.transformer(**x)[0], ref[0])
    out["parity"] = {"equal": eq, "equal_after_remove": eq_after, "summary": rows}

    flux = tiny.tiny_flux_transformer(dtype=dtype).to(DEVICE)
    fx = _to(tiny.flux_transformer_inputs(flux))
    fref = flux(**fx)[0]
    handle = apply_offload(flux, AG_DIT)
    out["flux_equal"] = all(torch.equal(flux(**fx)[0], fref) for _ in range(2))
    handle.remove()

    uneven = UnevenDiT().to(DEVICE)
    ux = torch.randn(4, 16).to(DEVICE)
    uref = uneven(ux)
    handle = apply_offload(uneven, AG_DIT)
    out["uneven_equal"] = all(torch.equal(uneven(ux), uref) for _ in range(3))
    ring = handle.rings[0]
    out["uneven"] = {"shard_bytes": [p.shard_nbytes for p in ring.transfer.plans],
                     "block_nbytes": [l.nbytes for l in ring.layouts],
                     "host_bytes": handle.summary()[0]["host_bytes"]}
    handle.remove()


def rss(out: dict) -> None:
    model = ToyDiT(8, dim=1024)  # 8 blocks of ~4 MiB
    block_bytes = sum(p.numel() * p.element_size() for b in model.blocks for p in list(b.parameters()) + list(b.buffers()))
    gc.collect()
    before = _rss()
    handle = apply_offload(model, AG_DIT)
    gc.collect()
    after = _rss()
    model(torch.randn(2, 1024))
    out["rss"] = {"before": before, "after": after, "block_bytes": block_bytes,
                  "host_bytes": handle.summary()[0]["host_bytes"]}
    handle.remove()


def fallback_gloo_not_allowed(out: dict) -> None:
    os.environ.pop("OMNI_OFFLOAD_ALLOW_GLOO", None)
    model = ToyDiT(3)
    x = torch.randn(2, 8)
    ref = model(x)
    handle = apply_offload(model, AG_DIT)
    with torch.no_grad():
        out["fallback_equal"] = torch.equal(model(x), ref)
    out["fallback_summary"] = handle.summary()
    handle.remove()
    os.environ["OMNI_OFFLOAD_ALLOW_GLOO"] = "1"


def mismatch(out: dict) -> None:
    layers = 3 if dist.get_rank() == 0 else 4
    model = tiny.tiny_wan_transformer(num_layers=layers)
    try:
        apply_offload(model, AG_DIT)
        out["mismatch"] = None
    except OffloadConfigError as exc:
        out["mismatch"] = str(exc)
    model = tiny.tiny_wan_transformer(num_layers=3, dtype=torch.bfloat16 if dist.get_rank() == 1 else torch.float32)
    try:
        apply_offload(model, AG_DIT)
        out["dtype_mismatch"] = None
    except OffloadConfigError as exc:
        out["dtype_mismatch"] = str(exc)
    model = tiny.tiny_wan_transformer(num_layers=3, seed=dist.get_rank())
    try:
        apply_offload(model, AG_DIT)
        out["value_mismatch"] = None
    except OffloadConfigError as exc:
        out["value_mismatch"] = str(exc)


def diverge(out: dict) -> None:
    """Rank 1 stops taking part after one forward: rank 0 must raise within the timeout."""
    cfg = dict(AG_DIT, collective_timeout_s=4)
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    handle = apply_offload(model, cfg)
    with torch.no_grad():
        model(x)
    if dist.get_rank() == 1:
        time.sleep(12)
        out["diverge"] = "idle"
        return
    t0 = time.monotonic()
    try:
        with torch.no_grad():
            model(x)
            model(x)
        out["diverge"] = "no error"
    except Exception as exc:  # gloo raises RuntimeError on timeout
        out["diverge"] = f"{type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}"[:400]
    del handle


def host_groups(out: dict) -> None:
    model = ToyDiT(3, dim=64)
    x = torch.randn(2, 64)
    ref = model(x)
    handle = apply_offload(model, AG_DIT)
    with torch.no_grad():
        out["equal"] = all(torch.equal(model(x), ref) for _ in range(2))
    g = handle.rings[0].transfer.group if handle.summary()[0]["weight_transfer"] == "allgather" else None
    out["group_ranks"] = list(g.ranks) if g else None
    out["summary"] = handle.summary()
    handle.remove()


SCENARIOS = {"parity": parity, "rss": rss, "fallback_gloo_not_allowed": fallback_gloo_not_allowed,
             "mismatch": mismatch, "diverge": diverge, "host_groups": host_groups}


def main() -> None:
    global DEVICE
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    if DEVICE.type == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        DEVICE = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=DEVICE)
    else:
        dist.init_process_group("gloo")
    out: dict = {"rank": dist.get_rank()}
    try:
        for name in names:
            SCENARIOS[name](out)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f, default=str)
    if "diverge" in names:
        os._exit(0)  # the process group is broken on purpose: skip the teardown barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
