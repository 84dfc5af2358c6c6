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


PRESETS: dict[str, Preset] = {
    # Wan2.1/2.2 14B: 40 heads x 128, FFN 13824, text dim 4096; a block is ~703 MB in bf16.
    "wan-14b": Preset("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024), "num_layers", 8, True),
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
    with torch.device(device):
        model = cls(**{**preset.config, preset.blocks_key: blocks})
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


def run_case(preset_name: str, blocks: int, frames: int, height: int, width: int, *,
             device: torch.device, dtype: torch.dtype, warmup: int, repeats: int,
             bandwidth: float | None) -> list[CaseResult]:
    preset = PRESETS[preset_name]
    model = build_model(preset, blocks, device, dtype).eval()
    inputs = wan_inputs(model, frames, height, width, device, dtype)
    shape = f"{frames}x{height}x{width}"
    forward = lambda: model(**inputs)[0]

    with torch.inference_mode():
        reference = forward()
        _reset_peak(device)
        resident = _time(forward, device, warmup, repeats)
        resident_peak = _peak(device)

        t0 = time.perf_counter()
        handle = apply_offload(model, {"mode": "layer", "components": ["dit"]}, device=device)
        _sync(device)
        setup_s = time.perf_counter() - t0
        (row,) = handle.summary()
        _reset_peak(device)
        streamed = _time(forward, device, warmup, repeats)
        streamed_peak = _peak(device)
        equal = torch.equal(forward(), reference)
        handle.remove()

        resident += _time(forward, device, 1, repeats)

    res_ms = statistics.median(resident)
    block_bytes = row["block_bytes"]
    floor = max(res_ms, block_bytes / bandwidth * 1e3) if bandwidth else res_ms
    common = dict(preset=preset_name, blocks=blocks, shape=shape, floor_ms=floor)
    out = [
        CaseResult(variant="resident", forward_ms=res_ms, overhead=1.0, peak_device_mib=resident_peak,
                   host_mib=0.0, setup_s=0.0, bitwise_equal=True, **common),
        CaseResult(variant="rank-local", forward_ms=statistics.median(streamed),
                   overhead=statistics.median(streamed) / res_ms, peak_device_mib=streamed_peak,
                   host_mib=row["host_bytes"] / 2**20, setup_s=setup_s, bitwise_equal=equal, **common),
    ]
    del model, inputs, reference
    _empty(device)
    return out


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omni_dist_offload.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="wan-14b", choices=sorted(PRESETS))
    p.add_argument("--blocks", type=int, default=None, help="blocks in the model (preset default)")
    p.add_argument("--frames", type=int, nargs="+", default=[81, 17])
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = PRESETS[args.preset]
    blocks = args.blocks or preset.default_blocks
    bandwidth = h2d_bandwidth(device)
    results: list[CaseResult] = []
    for frames in args.frames:
        results += run_case(args.preset, blocks, frames, args.height, args.width, device=device,
                            dtype=dtype, warmup=args.warmup, repeats=args.repeats, bandwidth=bandwidth)
    print(_table(results))
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "h2d_bytes_per_s": bandwidth, "argv": sys.argv[1:] if argv is None else argv}
    if bandwidth:
        print(f"pinned H2D: {bandwidth / 1e9:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)
    return 0 if all(r.bitwise_equal for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
