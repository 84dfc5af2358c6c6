"""How much a resident model's forward slows while copies run beside it: the floor under which
no residency plan brings a streamed forward, whatever it hides.

    python -m omni_dist_offload.tools.contention --preset flux-12b --blocks 19 --px 1024 --mib 1900

Nothing is offloaded. Each round runs one forward in each mode, in an order that turns every
round (so drift weighs on every mode alike), each timed with CUDA events on the compute stream
after a synchronise:

- ``alone``: nothing else runs;
- ``spread``: a side stream copies ``--mib`` MiB from page-locked host memory to the device, one
  piece per block, each enqueued as its block starts, as a streaming ring enqueues prefetches
  (no event ties a copy to compute: only sharing the GPU can slow the forward);
- ``burst``: the same pieces, all enqueued as the forward starts;
- ``device``: the same pieces copied device to device, also as each block starts (memory
  traffic on the GPU without the host link).

Prints the median forward of each mode and its ratio to ``alone``, and how long the copies took
(a copy that outlasts the forward is not hidden by it: ``copy_ms`` says so). ``--mib`` is the
bytes a plan streams per forward: for Flux-12B at 1024 px with 75% of the block bytes on the
device, about a quarter of 7.4 GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch

from ..config import OffloadConfig
from ..models import PRESETS, build_model, case_inputs
from ..plan import discover
from ..runtime.flags import (
    OneLineParser,
    UsageError,
    output_file,
    positive_float,
    positive_int,
    report_usage_error,
    user_path,
)
from ..runtime.proc import exit_with

MODES = ("alone", "spread", "burst", "device")
PROG = "python -m omni_dist_offload.tools.contention"


def build_parser() -> argparse.ArgumentParser:
    # The docstring's first paragraph, whole: its first sentence runs over two lines.
    p = OneLineParser(prog=PROG, description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--preset", default="flux-12b", choices=sorted(PRESETS))
    p.add_argument("--blocks", type=positive_int, default=19)
    p.add_argument("--px", type=positive_int, default=1024, help="image presets")
    p.add_argument("--frames", type=positive_int, default=17, help="video presets")
    p.add_argument("--height", type=positive_int, default=480, help="video presets")
    p.add_argument("--width", type=positive_int, default=832, help="video presets")
    p.add_argument("--mib", type=positive_float, default=1900.0, help="MiB copied beside each forward")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--warmup", type=positive_int, default=3, help="untimed rounds")
    p.add_argument("--rounds", type=positive_int, default=12, help="timed rounds")
    # user_path: ~ expanded as the flag is parsed, so the path checked before the run is the one
    # written after it (the shell leaves --json=~/x alone).
    p.add_argument("--json", type=user_path, default=None, metavar="PATH", help="write every timing here")
    return p


class _Copies:
    """One piece per block of ``nbytes`` in all, from page-locked host memory (or from device
    memory), into a device buffer, on a side stream."""

    def __init__(self, nbytes: int, pieces: int, device: torch.device) -> None:
        piece = -(-nbytes // pieces)
        self.host = torch.empty(piece * pieces, dtype=torch.uint8, pin_memory=True)
        self.src_dev = torch.empty(piece * pieces, dtype=torch.uint8, device=device)
        self.dst = torch.empty(piece * pieces, dtype=torch.uint8, device=device)
        self.piece, self.pieces = piece, pieces
        # The copies' own stream: beside compute, as a ring's copy stream is.
        self.stream = torch.cuda.Stream(device)
        # start/end bracket the copies on the side stream: how long they took in all.
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.src = self.host
        self.issued = 0

    def begin(self, src: torch.Tensor) -> None:
        self.src, self.issued = src, 0
        self.start.record(self.stream)

    def issue(self, count: int = 1) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(min(count, self.pieces - self.issued)):
                lo = self.issued * self.piece
                self.dst[lo : lo + self.piece].copy_(self.src[lo : lo + self.piece], non_blocking=True)
                self.issued += 1

    def finish(self) -> None:
        self.issue(self.pieces)  # a forward that ran fewer blocks than pieces still moves every byte
        self.end.record(self.stream)


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("contention times copies beside a forward on the GPU; no CUDA device is visible")
    dev = torch.device("cuda", torch.cuda.current_device())
    preset = PRESETS[args.preset]
    model = build_model(preset, args.blocks, dev, torch.bfloat16).eval()
    shape = (args.frames, args.height, args.width) if preset.video else (args.px,)
    x = case_inputs(preset, model, shape, dev, torch.bfloat16)
    (component,) = discover(model, OffloadConfig.parse({"mode": "layer", "components": ["dit"]}))
    blocks = [b for _, b in component.blocks]
    copies = _Copies(int(args.mib * 2**20), len(blocks), dev)
    mode = ["alone"]

    def pre_forward(_module, _args) -> None:
        if mode[0] in ("spread", "device"):
            copies.issue()

    hooks = [b.register_forward_pre_hook(pre_forward) for b in blocks]
    fwd_start, fwd_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def forward(m: str) -> tuple[float, float | None]:
        mode[0] = m
        torch.cuda.synchronize(dev)
        fwd_start.record()
        if m != "alone":
            copies.begin(copies.src_dev if m == "device" else copies.host)
            if m == "burst":
                copies.issue(copies.pieces)
        with torch.no_grad():
            model(**x)
        fwd_end.record()
        if m != "alone":
            copies.finish()
        torch.cuda.synchronize(dev)
        return fwd_start.elapsed_time(fwd_end), (copies.start.elapsed_time(copies.end) if m != "alone" else None)

    timings: dict[str, list[float]] = {m: [] for m in args.modes}
    copy_ms: dict[str, list[float]] = {m: [] for m in args.modes if m != "alone"}
    modes = list(args.modes)
    try:
        for r in range(args.warmup + args.rounds):
            order = modes[r % len(modes):] + modes[: r % len(modes)]  # turns every round
            for m in order:
                ms, cms = forward(m)
                if r >= args.warmup:
                    timings[m].append(ms)
                    if cms is not None:
                        copy_ms[m].append(cms)
    finally:
        for h in hooks:
            h.remove()
    alone = statistics.median(timings["alone"]) if "alone" in timings else None
    rows = []
    for m in args.modes:
        med = statistics.median(timings[m])
        rows.append({"mode": m, "forward_ms": med, "vs_alone": med / alone if alone else None,
                     "copy_ms": statistics.median(copy_ms[m]) if m in copy_ms else None,
                     "min_ms": min(timings[m]), "max_ms": max(timings[m])})
    return {"meta": {"preset": args.preset, "blocks": args.blocks, "shape": list(shape), "mib": args.mib,
                     "pieces": len(blocks), "rounds": args.rounds, "warmup": args.warmup,
                     "device": torch.cuda.get_device_name(dev), "torch": torch.__version__},
            "rows": rows, "timings_ms": timings, "copy_ms": copy_ms}


def format_rows(result: dict) -> str:
    meta = result["meta"]
    lines = [f"{meta['preset']} {meta['blocks']} blocks {'x'.join(map(str, meta['shape']))}, "
             f"{meta['mib']:g} MiB beside each forward in {meta['pieces']} pieces, median of {meta['rounds']} rounds",
             f"{'mode':<8} {'forward ms':>11} {'/ alone':>8} {'copies ms':>10} {'min..max ms':>17}"]
    for row in result["rows"]:
        ratio = f"{row['vs_alone']:.3f}" if row["vs_alone"] is not None else "-"
        copy = f"{row['copy_ms']:.2f}" if row["copy_ms"] is not None else "-"
        lines.append(f"{row['mode']:<8} {row['forward_ms']:>11.2f} {ratio:>8} {copy:>10} "
                     f"{row['min_ms']:>8.2f}..{row['max_ms']:<8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    """0 when measured; 2 for bad flags or a host without CUDA (one line on stderr, before any
    model is built)."""
    try:
        args = build_parser().parse_args(argv)
        if "alone" not in args.modes:
            raise UsageError("--modes must include alone (the other modes are read against it)")
        if not torch.cuda.is_available():
            raise UsageError("contention times copies beside a forward on the GPU; no CUDA device is visible")
        if args.json:
            output_file("--json", args.json)
    except UsageError as exc:
        return report_usage_error(PROG, exc)
    result = run(args)
    out(format_rows(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    exit_with(main)
