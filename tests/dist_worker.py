"""One rank of a multi-process allgather test on CPU (gloo). Run by tests/test_allgather.py as
separate processes with torchrun's environment variables; writes its findings as JSON."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import sys
import time
import types
import warnings
from dataclasses import asdict
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from omni_dist_offload import OffloadConfigError, apply_offload  # noqa: E402
from omni_dist_offload import apply as apply_mod  # noqa: E402
import tiny_models as tiny  # noqa: E402
from omni_dist_offload.hostmem import HostBuffer, HostPinner, PinMemoryError  # noqa: E402
from toys import ToyDiT, assert_same, snapshot  # noqa: E402

AG = {"mode": "layer", "components": ["dit", "text_encoder"],
      "layer_options": {"dit": {"weight_transfer": "allgather", "chunk_mib": 0.01},
                        "text_encoder": {"weight_transfer": "allgather"}},
      "collective_timeout_s": 20}
AG_DIT = {"mode": "layer", "components": ["dit"],
          "layer_options": {"dit": {"weight_transfer": "allgather", "chunk_mib": 0.01}},
          "collective_timeout_s": 20}
if os.environ.get("OMNI_TEST_GATHER"):  # GPU tests pick the gather (copy-engine or nccl)
    for _cfg in (AG, AG_DIT):
        for _opts in _cfg["layer_options"].values():
            _opts["gather"] = os.environ["OMNI_TEST_GATHER"]


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


def _status(field: str) -> int:
    """A memory figure of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    return _status("VmRSS")


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


def _toy_after_one_forward(timeout_s: float):
    """A ToyDiT streamed with allgather and a short collective timeout, after one good forward."""
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    handle = apply_offload(model, dict(AG_DIT, collective_timeout_s=timeout_s))
    with torch.no_grad():
        model(x)
    return model, x, handle


def diverge(out: dict) -> None:
    """Rank 1 stops taking part after one forward: rank 0 must raise within the timeout."""
    model, x, handle = _toy_after_one_forward(timeout_s=4)
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


# -- fault injection, shared with tests/test_faults.py ----------------------------------------
@contextlib.contextmanager
def failing_pin(fail_at: int | None):
    """Make the pin path reachable on the CPU: with "pin_memory" set, every host buffer is
    "pinned" (a flag, no cudaHostRegister) except the ``fail_at``-th, which fails the way an
    exhausted memlock limit does."""
    calls = itertools.count()

    def pin(self: HostBuffer) -> None:
        if next(calls) == fail_at:
            raise PinMemoryError("could not page-lock 0.1 MiB of host memory (CUDA error 2)")
        self.pinned = True

    def for_device(cls, pin_memory: bool, on_failure: str, device: torch.device) -> HostPinner:
        return cls(pin_memory, on_failure)

    with mock.patch.object(HostBuffer, "pin", pin), \
            mock.patch.object(HostPinner, "for_device", classmethod(for_device)):
        yield


@contextlib.contextmanager
def failing_shard(fail_at: int):
    """The ``fail_at``-th block's shard cannot be written: setup fails part-way through."""
    calls = itertools.count()
    real = apply_mod.write_shard

    def write_shard(*args):
        if next(calls) == fail_at:
            raise RuntimeError(f"simulated failure writing shard {fail_at}")
        return real(*args)

    with mock.patch.object(apply_mod, "write_shard", write_shard):
        yield


@contextlib.contextmanager
def interrupt(block: nn.Module, where: str, exc: type[BaseException] = KeyboardInterrupt):
    """Raise ``exc`` once, from the block body or between the ring's pre-forward and the body."""
    def raise_once(*args, **kwargs):
        remove()
        raise exc(f"simulated interrupt ({where})")

    if where == "body":
        block.forward = raise_once
        remove = lambda: block.__dict__.pop("forward", None)  # noqa: E731
    else:  # registered after apply_offload, so it runs after the ring's pre-forward
        handle = block.register_forward_pre_hook(lambda m, a: raise_once())
        remove = handle.remove
    try:
        yield
    finally:
        remove()


def _unchanged(before: dict, model: nn.Module) -> bool | str:
    try:
        assert_same(before, model)
        return True
    except AssertionError as exc:
        return str(exc)


def _expect(out: dict, key: str, exc_type: type[BaseException], fn) -> None:
    try:
        fn()
        out[key] = "no error"
    except exc_type as exc:
        out[key] = f"{type(exc).__name__}: {exc}"


def setup_faults(out: dict) -> None:
    """Setup fails part-way on every rank: each rank's model is left as it was; then a clean
    apply works."""
    cfg = dict(AG_DIT, pin_memory=True)
    model = ToyDiT(4)
    before = snapshot(model)
    with failing_shard(2):
        _expect(out, "shard_fault", RuntimeError, lambda: apply_offload(model, cfg))
    out["shard_fault_unchanged"] = _unchanged(before, model)
    with failing_pin(1):
        _expect(out, "pin_fault", PinMemoryError, lambda: apply_offload(model, cfg))
    out["pin_fault_unchanged"] = _unchanged(before, model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
        with failing_pin(1), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = apply_offload(model, dict(cfg, pin_failure="pageable"))
        out["pageable_warnings"] = [str(w.message) for w in caught if "page-lock" in str(w.message)]
        out["pageable_pinned"] = [s.pinned for s in handle.rings[0].transfer.shards]
        out["pageable_transfer"] = handle.summary()[0]["weight_transfer"]
        out["pageable_equal"] = all(torch.equal(model(x), ref) for _ in range(2))
        handle.remove()
    out["pageable_unchanged_after_remove"] = _unchanged(before, model)


@torch.no_grad()
def interrupts(out: dict) -> None:
    """Every rank is interrupted at the same block (as a deterministic error would be): the
    next forward is correct and the ranks stay in lockstep."""
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    ref = model(x)
    before = snapshot(model)
    handle = apply_offload(model, AG_DIT)
    results = {}
    for where in ("body", "pre-hook"):
        model(x)
        with interrupt(model.blocks[2], where):
            try:
                model(x)
                results[where] = "not interrupted"
            except KeyboardInterrupt:
                results[where] = all(torch.equal(model(x), ref) for _ in range(2))
    out["interrupts"] = results
    handle.remove()
    out["interrupts_unchanged_after_remove"] = _unchanged(before, model)


def soak_short(out: dict) -> None:
    """The CI-sized soak: 60 forwards alternating two shapes, allgather on gloo."""
    from omni_dist_offload.tools.soak import SoakOptions, run_soak

    torch.set_num_threads(1)
    result = run_soak(SoakOptions(model="tiny-wan", forwards=60, transfer="allgather", warmup=10,
                                  rss_tolerance_mib=8, chunk_mib=0.01, collective_timeout_s=20))
    out["soak"] = {**asdict(result), "passed": result.passed}


def one_rank_setup_fault(out: dict) -> None:
    """Only rank 1's setup fails: every rank undoes its setup and raises, rank 0 naming rank 1's
    error, at once rather than at its first forward."""
    cfg = dict(AG_DIT, pin_memory=True, collective_timeout_s=20)
    model = ToyDiT(4)
    before = snapshot(model)
    t0 = time.monotonic()
    if dist.get_rank() == 1:
        with failing_pin(2):
            _expect(out, "one_rank_fault", PinMemoryError, lambda: apply_offload(model, cfg))
    else:
        with failing_pin(None):
            _expect(out, "one_rank_fault", RuntimeError, lambda: apply_offload(model, cfg))
    out["one_rank_fault_s"] = time.monotonic() - t0
    out["one_rank_fault_unchanged"] = _unchanged(before, model)
    _after_one_rank_fault()


def _after_one_rank_fault() -> None:
    # Rank 1 waits here until rank 0's gather has timed out, so the next scenario's collectives
    # start together.
    dist.barrier()


def rank_dies(out: dict) -> None:
    """Rank 1 exits (os._exit) in the middle of a forward: rank 0 raises within the timeout,
    naming the ring and block. Runs last: the job is broken afterwards."""
    model, x, handle = _toy_after_one_forward(timeout_s=3)
    with torch.no_grad():
        if dist.get_rank() == 1:
            def die(module, args):
                out["rank_dies"] = "exited in the pre-forward of blocks.2"
                _write(out)
                os._exit(1)
            model.blocks[2].register_forward_pre_hook(die)
        t0 = time.monotonic()
        _expect(out, "rank_dies", RuntimeError, lambda: [model(x) for _ in range(3)])
    out["rank_dies_s"] = time.monotonic() - t0
    del handle


@torch.no_grad()
def cold_start(out: dict) -> None:
    """Cold start with allgather from the folder in OMNI_TEST_FOLDER against the ordinary load:
    bitwise equal DiT and text-encoder outputs, and the summary (cold_start_rss checks memory)."""
    from diffusers import DiffusionPipeline
    from omni_dist_offload.loading.coldstart import load_offloaded

    folder = os.environ["OMNI_TEST_FOLDER"]
    cfg = dict(AG, layer_options={"dit": {"weight_transfer": "allgather", "chunk_mib": 0.02},
                                  "text_encoder": {"weight_transfer": "allgather"}})
    dtype = torch.bfloat16
    ref = DiffusionPipeline.from_pretrained(folder, dtype=dtype, disable_mmap=True)  # aligned, see test_coldstart
    handle = apply_offload(ref, cfg)
    x = tiny.wan_transformer_inputs(ref.transformer, batch=1)
    x = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in x.items()}
    t = tiny.text_encoder_inputs(ref.text_encoder)
    expect = (ref.transformer(**x)[0], ref.text_encoder(**t).last_hidden_state)
    handle.remove()
    del ref, handle
    gc.collect()
    pipe, handle = load_offloaded(folder, cfg, device="cpu", dtype=dtype)
    got = (pipe.transformer(**x)[0], pipe.text_encoder(**t).last_hidden_state)
    out["cold_start"] = {"equal": all(torch.equal(a, b) for a, b in zip(got, expect)),
                         "summary": handle.summary()}
    handle.remove()


def _peak_reset() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS, and return that."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss()


def _peak() -> int:
    return _status("VmHWM")


@torch.no_grad()
def cold_start_rss(out: dict) -> None:
    """Peak host memory of a cold start (fp32 checkpoint, bf16 run) against the ordinary load of
    the same DiT (OMNI_TEST_BIG_FOLDER, a pipeline folder holding only the transformer)."""
    from diffusers import WanTransformer3DModel
    from omni_dist_offload.loading.coldstart import load_offloaded, prepare_cold_start

    big = os.environ["OMNI_TEST_BIG_FOLDER"]
    cfg = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 60,
           "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    dtype = torch.bfloat16
    warm, handle = load_offloaded(os.environ["OMNI_TEST_FOLDER"], cfg, device="cpu", dtype=dtype)  # imports, pools
    handle.remove()
    del warm, handle
    dist.barrier()
    base = _peak_reset()
    cold = prepare_cold_start(big, cfg, device=torch.device("cpu"), dtype=dtype, threads=2)
    model = cold.components["transformer"]
    handle = apply_offload(types.SimpleNamespace(transformer=model), cfg, block_sources=cold.sources)
    cold.close()
    peak_cold = _peak() - base
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
    peak_ordinary = _peak() - base
    y_ordinary = model(**x)[0]
    handle.remove()
    out["cold_start_rss"] = {
        "peak_cold": peak_cold, "peak_ordinary": peak_ordinary, "host_bytes": row["host_bytes"],
        "block_bytes": row["block_bytes"], "max_block": row["device_slot_bytes"] // 2,  # a slot holds the largest block
        "nonblock_bytes": nonblock, "device_slot_bytes": row["device_slot_bytes"], "transfer": row["weight_transfer"],
        "equal": torch.equal(y_cold, y_ordinary),
    }


SCENARIOS = {"cold_start_rss": cold_start_rss, "cold_start": cold_start, "parity": parity, "rss": rss, "fallback_gloo_not_allowed": fallback_gloo_not_allowed,
             "mismatch": mismatch, "diverge": diverge, "host_groups": host_groups,
             "setup_faults": setup_faults, "interrupts": interrupts, "soak_short": soak_short,
             "one_rank_setup_fault": one_rank_setup_fault, "rank_dies": rank_dies}
OUT_DIR = "."


def _write(out: dict) -> None:
    with open(os.path.join(OUT_DIR, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f, default=str)


def main() -> None:
    global DEVICE, OUT_DIR
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    OUT_DIR = out_dir
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
    _write(out)
    if {"diverge", "rank_dies"} & set(names):
        os._exit(0)  # the process group is broken on purpose: skip the teardown barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
