"""Side-by-side benchmark: resident vs streamed forwards of real diffusers DiTs.

Models are real diffusers classes built from config at real block sizes with random weights
(nothing is downloaded), cast the way ``from_pretrained(torch_dtype=bf16)`` casts them. For each
case the variants run in one process, resident timed before and after the streamed variants so
drift does not favour either side; each figure is the median of several timed forwards after
warm-up, timed with CUDA events.

    python -m omni_dist_offload.bench --preset wan-14b --blocks 8 --frames 81 17 --json out.json
    python -m omni_dist_offload.bench --preset tiny-wan          # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

from . import apply_offload
from .tiny import cast_like_pretrained

__all__ = ["PRESETS", "CaseResult", "main", "run_case"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A DiT class and config at real (or tiny) block sizes, and how to build its inputs."""

    cls_name: str
    config: dict[str, Any]
    blocks_key: str
    default_blocks: int
    video: bool

    def block_config(self, blocks: int) -> dict[str, Any]:
        if self.blocks_key == "flux":  # dual-stream then single-stream blocks, 1:2 as in Flux
            double = max(1, round(blocks / 3))
            return {**self.config, "num_layers": double, "num_single_layers": max(1, blocks - double)}
        return {**self.config, self.blocks_key: blocks}


PRESETS: dict[str, Preset] = {
    # Wan2.1/2.2 14B: 40 heads x 128, FFN 13824, text dim 4096; a block is ~703 MB in bf16.
    "wan-14b": Preset("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024), "num_layers", 8, True),
    # Flux.1-dev 12B: 19 dual-stream + 38 single-stream blocks of 3072; 415 MB a block on average.
    "flux-12b": Preset("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56)), "flux", 57, False),
    # A small Wan for CPU smoke runs of the benchmark itself.
    "tiny-wan": Preset("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=64, freq_dim=32, ffn_dim=64, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64), "num_layers", 4, True),
}


@dataclasses.dataclass
class CaseResult:
    preset: str
    blocks: int
    shape: str
    variant: str
    forward_ms: float
    overhead: float
    floor_ms: float
    peak_device_mib: float
    host_mib: float
    setup_s: float
    bitwise_equal: bool


def build_model(preset: Preset, blocks: int, device: torch.device, dtype: torch.dtype):
    import diffusers

    cls = getattr(diffusers, preset.cls_name)
    torch.manual_seed(0)  # the same weights on every rank: allgather assembles blocks from all
    with torch.device(device):
        model = cls(**preset.block_config(blocks))
    return cast_like_pretrained(model, dtype)


def wan_inputs(model, frames: int, height: int, width: int, device, dtype, seed: int = 0) -> dict:
    """Inputs for one denoising forward at a pixel size (the VAE is 4x in time, 8x in space)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cfg = model.config
    lat = (1, cfg.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    return dict(
        hidden_states=torch.randn(lat, generator=gen).to(device, dtype),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=torch.randn(1, 512, cfg.text_dim, generator=gen).to(device, dtype),
        return_dict=False,
    )


def flux_inputs(model, px: int, device, dtype, seed: int = 0) -> dict:
    """Inputs for one denoising forward of a square image (VAE 8x, then 2x2 packing)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cfg = model.config
    side = px // 16
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    return dict(
        hidden_states=torch.randn(1, side * side, cfg.in_channels, generator=gen).to(device, dtype),
        encoder_hidden_states=torch.randn(1, 512, cfg.joint_attention_dim, generator=gen).to(device, dtype),
        pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=gen).to(device, dtype),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=ids.reshape(-1, 3).to(device, dtype),
        txt_ids=torch.zeros(512, 3, device=device, dtype=dtype),
        guidance=torch.tensor([3.5], device=device, dtype=torch.float32),
        return_dict=False,
    )


def _time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds per call, CUDA events on the GPU, wall clock after a sync elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Measured pinned host-to-device bandwidth in bytes/s (None on the CPU)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = statistics.median(_time(lambda: dst.copy_(src, non_blocking=True), device, 2, 5))
    del src, dst
    return nbytes / (ms / 1e3)


def _variants(world: int, names: list[str]) -> list[tuple[str, dict[str, Any] | None]]:
    """Resident first and last (its median covers both), streamed variants between."""
    dit = {"mode": "layer", "components": ["dit"]}
    out: list[tuple[str, dict[str, Any] | None]] = [("resident", None)]
    if "rank-local" in names:
        out.append(("rank-local", dit))
    if world > 1 and "allgather" in names:
        out.append(("allgather", {**dit, "layer_options": {"dit": {"weight_transfer": "allgather"}}}))
    return out + [("resident", None)]


def run_case(preset_name: str, blocks: int, shape: tuple[int, ...], *, device: torch.device,
             dtype: torch.dtype, warmup: int, repeats: int, bandwidth: float | None,
             world: int = 1, variants: tuple[str, ...] = ("rank-local", "allgather")) -> list[CaseResult]:
    """All variants of one case in this process; ``shape`` is (frames, height, width) for video
    presets and (px,) for image presets."""
    preset = PRESETS[preset_name]
    model = build_model(preset, blocks, device, dtype).eval()
    if preset.video:
        inputs = wan_inputs(model, *shape, device, dtype)
    else:
        inputs = flux_inputs(model, shape[0], device, dtype)
    label = "x".join(map(str, shape))
    forward = lambda: model(**inputs)[0]
    times: dict[str, list[float]] = {}
    rows: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        reference = forward()
        for name, config in _variants(world, list(variants)):
            handle, setup_s = None, 0.0
            if config is not None:
                t0 = time.perf_counter()
                handle = apply_offload(model, config, device=device)
                _sync(device)
                setup_s = time.perf_counter() - t0
            _reset_peak(device)
            times.setdefault(name, []).extend(_time(forward, device, warmup, repeats))
            info = rows.setdefault(name, {"peak": _peak(device), "setup_s": setup_s, "equal": True,
                                          "host": 0, "transfer": name})
            info["equal"] = info["equal"] and torch.equal(forward(), reference)
            if handle is not None:
                (row,) = handle.summary()
                info.update(host=row["host_bytes"], transfer=row["weight_transfer"], block_bytes=row["block_bytes"])
                handle.remove()
    medians = _slowest_rank({name: statistics.median(ts) for name, ts in times.items()}, world)
    res_ms = medians["resident"]
    out = []
    for name in times:
        info = rows[name]
        share = world if info["transfer"] == "allgather" else 1
        link_ms = info.get("block_bytes", 0) / share / bandwidth * 1e3 if bandwidth else 0.0
        ms = medians[name]
        out.append(CaseResult(preset=preset_name, blocks=blocks, shape=label, variant=info["transfer"]
                              if name != "resident" else name, forward_ms=ms, overhead=ms / res_ms,
                              floor_ms=max(res_ms, link_ms), peak_device_mib=info["peak"],
                              host_mib=info["host"] / 2**20, setup_s=info["setup_s"],
                              bitwise_equal=info["equal"]))
    del model, inputs, reference
    _empty(device)
    return out


def _slowest_rank(medians: dict[str, float], world: int) -> dict[str, float]:
    """Per variant, the slowest rank's median. Ranks of a data-parallel job run side by side, and
    allgather ties them together: a job moves at its slowest GPU's pace, so that is the figure
    to compare, for resident and streamed alike (GPUs of one host differ by a few percent)."""
    if world == 1:
        return medians
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, medians)
    return {name: max(g[name] for g in gathered) for name in medians}


def transfer_case(mib: float, chunks_mib: list[float], *, device: torch.device, warmup: int,
                  repeats: int) -> list[dict[str, Any]]:
    """Time moving one block of ``mib`` MiB into a device slot: rank-local full copy vs the
    allgather transfer (shard copy + all-gather, pipelined) at several chunk sizes."""
    from .distributed import ComponentFacts, resolve_weight_group
    from .hostmem import HostBuffer
    from .sharding import plan_shards
    from .transfer import AllGatherTransfer, RankLocalTransfer

    nbytes = int(mib * 2**20) // 256 * 256
    copy_stream, comm_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    full = HostBuffer(nbytes)
    full.tensor.random_(0, 255)
    full.pin()
    slot = torch.empty(nbytes + (1 << 20), dtype=torch.uint8, device=device)
    after, ready = torch.cuda.Event(), torch.cuda.Event()

    def timed(transfer, size) -> float:
        def once():
            transfer.fill(0, slot[:size], after, ready)
            torch.cuda.current_stream(device).wait_event(ready)
        return statistics.median(_time(once, device, warmup, repeats))

    results = [{"variant": "rank-local", "chunk_mib": None,
                "ms": timed(RankLocalTransfer([full], copy_stream), nbytes)}]
    facts = {"block": ComponentFacts("allgather", 0, ("block",), ("x",))}
    group, reason = resolve_weight_group(facts, device, None, 600.0)
    if group is None:
        results[0]["allgather"] = f"not run: {reason}"
        return results
    for chunk in chunks_mib:
        plan = plan_shards(nbytes, group.size, group.rank, int(chunk * 2**20) if chunk else nbytes)
        shard = HostBuffer(plan.shard_nbytes)
        shard.tensor.copy_(full.tensor[: plan.shard_nbytes])
        shard.pin()
        transfer = AllGatherTransfer([shard], [plan], group, copy_stream, comm_stream)
        results.append({"variant": "allgather", "chunk_mib": chunk or "whole block",
                        "ms": timed(transfer, plan.padded_nbytes)})
        shard.release()
    full.release()
    for r in results:
        r["ratio_to_rank_local"] = r["ms"] / results[0]["ms"]
    return results


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def _empty(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _table(results: list[CaseResult]) -> str:
    head = f"{'case':<34}{'variant':<12}{'fwd ms':>10}{'x res':>8}{'floor ms':>10}{'peak MiB':>10}{'host MiB':>10}{'setup s':>9}{'equal':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.preset + ' ' + str(r.blocks) + 'b ' + r.shape:<34}{r.variant:<12}{r.forward_ms:>10.2f}"
                     f"{r.overhead:>8.3f}{r.floor_ms:>10.2f}{r.peak_device_mib:>10.0f}{r.host_mib:>10.0f}"
                     f"{r.setup_s:>9.2f}{str(r.bitwise_equal):>7}")
    return "\n".join(lines)


def _init_distributed() -> tuple[torch.device, int, int]:
    """Under torchrun: one GPU per rank, NCCL. Otherwise the current device, world 1."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return device, world, rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omni_dist_offload.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="wan-14b", choices=sorted(PRESETS))
    p.add_argument("--blocks", type=int, default=None, help="blocks in the model (preset default)")
    p.add_argument("--frames", type=int, nargs="+", default=[81, 17], help="video presets")
    p.add_argument("--height", type=int, default=480, help="video presets")
    p.add_argument("--width", type=int, default=832, help="video presets")
    p.add_argument("--px", type=int, nargs="+", default=[1024], help="image presets: square sizes")
    p.add_argument("--transfer-mib", type=float, default=None,
                   help="instead of model cases, time moving one block of this size")
    p.add_argument("--chunk-mib", type=float, nargs="+", default=[16, 32, 64, 128, 0],
                   help="with --transfer-mib: allgather chunk sizes to try (0: whole block)")
    p.add_argument("--variants", nargs="+", default=["rank-local", "allgather"],
                   choices=["rank-local", "allgather"], help="streamed variants beside resident")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    device, world, rank = _init_distributed()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = h2d_bandwidth(device)
    meta = {"date": time.strftime("%Y-%m-%d"), "world_size": world, "torch": torch.__version__,
            "nccl_max_ctas": os.environ.get("OMNI_OFFLOAD_NCCL_MAX_CTAS"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "h2d_bytes_per_s": bandwidth, "argv": sys.argv[1:] if argv is None else argv}
    if args.transfer_mib is not None:
        results: list[Any] = transfer_case(args.transfer_mib, args.chunk_mib, device=device,
                                           warmup=args.warmup, repeats=args.repeats)
        text = "\n".join(f"{r['variant']:<12}chunk {str(r['chunk_mib']):<12}{r['ms']:>9.2f} ms"
                          f"{r['ratio_to_rank_local']:>8.3f}x" for r in results)
        ok = True
    else:
        preset = PRESETS[args.preset]
        blocks = args.blocks or preset.default_blocks
        shapes = [(f, args.height, args.width) for f in args.frames] if preset.video else [(px,) for px in args.px]
        cases: list[CaseResult] = []
        for shape in shapes:
            cases += run_case(args.preset, blocks, shape, device=device, dtype=dtype, warmup=args.warmup,
                              repeats=args.repeats, bandwidth=bandwidth, world=world,
                              variants=tuple(args.variants))
        results = [dataclasses.asdict(r) for r in cases]
        text, ok = _table(cases), all(r.bitwise_equal for r in cases)
    if rank == 0:
        print(text)
        if bandwidth:
            print(f"pinned H2D: {bandwidth / 1e9:.1f} GB/s; world size {world}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
