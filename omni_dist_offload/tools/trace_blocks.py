"""Per-rank, per-block compute under each weight transfer: where an offload's overhead goes.

Run under torchrun with one process per GPU. Builds the benchmark's model (real diffusers class,
random bf16 weights, the same on every rank), times each block of the resident model, then for
each variant applies the offload with tracing on, runs one untimed forward and ``--forwards``
traced ones, back to back (ranks aligned by a barrier before each), and reads ``trace_report()``.
Rank 0 prints per rank: the forward's median (the whole forward, timed with events as the
resident one is), the median span of its blocks (the trace's ``forward_ms``), the median exposed
wait, the median per-block compute (blocks past the first, on both sides) and the median transfer
time; ``--json`` keeps every traced forward.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 -m omni_dist_offload.tools.trace_blocks \\
        --preset wan-14b --blocks 8 --frames 81 --json blocks.json

A variant whose per-block compute is above rank-local's while its exposed wait is zero pays for
its transfer in the model's kernels (shared SMs, memory or links), not in waiting.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Sequence

import torch
import torch.distributed as dist

from ..apply import apply_offload
from ..models import PRESETS, build_model, wan_inputs
from ..runtime.dist import destroy_dist, maybe_init_dist
from ..runtime.flags import OneLineParser, UsageError, expand_home, output_file, positive_int, report_usage_error
from ..runtime.logs import current_rank
from ..runtime.proc import exit_with

CONFIGS = {
    "rank-local": {"mode": "layer", "components": ["dit"]},
    "copy-engine": {"mode": "layer", "components": ["dit"],
                    "layer_options": {"dit": {"weight_transfer": "allgather", "gather": "copy-engine"}}},
    "nccl": {"mode": "layer", "components": ["dit"],
             "layer_options": {"dit": {"weight_transfer": "allgather", "gather": "nccl"}}},
}
# Mirrored, so drift over the run weighs on every variant alike.
ORDER = ["rank-local", "copy-engine", "nccl", "copy-engine", "rank-local"]


PROG = "python -m omni_dist_offload.tools.trace_blocks"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="wan-14b", choices=[k for k, v in PRESETS.items() if v.video])
    p.add_argument("--blocks", type=positive_int, default=8)
    p.add_argument("--frames", type=positive_int, default=81)
    p.add_argument("--height", type=positive_int, default=480)
    p.add_argument("--width", type=positive_int, default=832)
    p.add_argument("--forwards", type=positive_int, default=4, help="traced forwards per pass")
    p.add_argument("--json", type=expand_home, default=None, metavar="PATH", help="write every traced forward here (rank 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """0 when traced; 2 for bad flags or a run outside torchrun on GPUs (one line on stderr,
    before any model is built)."""
    try:
        args = build_parser().parse_args(argv)
        if args.json and current_rank() == 0:  # the rank that writes; its folder is made once the run starts
            output_file("--json", args.json, create=False)
    except UsageError as exc:
        return report_usage_error(PROG, exc, show=current_rank() == 0)
    ctx = maybe_init_dist()
    if ctx.backend != "nccl":
        destroy_dist(ctx)
        return report_usage_error(PROG, "run it under torchrun with one process per GPU (it compares weight "
                                  "transfers across GPUs)", show=ctx.rank == 0)
    if args.json and ctx.rank == 0:
        try:
            output_file("--json", args.json)
        except UsageError as exc:
            destroy_dist(ctx)
            return report_usage_error(PROG, exc)
    dev = ctx.device
    preset = PRESETS[args.preset]
    model = build_model(preset, args.blocks, dev, torch.bfloat16).eval()
    x = wan_inputs(model, args.frames, args.height, args.width, dev, torch.bfloat16,
                   text_tokens=preset.text_tokens)
    out: dict = {}
    with torch.inference_mode():
        out["resident_block_ms"] = _resident_block_ms(model, x)
        out["resident_fwd"] = _forward_ms(model, x, args.forwards)
        for name in ORDER:
            handle = apply_offload(model, CONFIGS[name], trace=True)
            model(**x)
            for _ in range(args.forwards):
                # Forwards back to back, as a generation runs them (no device synchronise between:
                # the next forward waits for the copies the last one issued for it), each timed
                # whole with events, as the resident forward is; the trace's forward_ms spans its
                # blocks only.
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(**x)
                end.record()
                end.synchronize()
                (r,) = handle.trace_report()
                out.setdefault(name, []).append({
                    "fwd": start.elapsed_time(end), "blocks_span": r["forward_ms"], "wait": r["exposed_wait_ms"],
                    "compute": [b["compute_ms"] for b in r["blocks"]],
                    "xfer": [b["transfer_ms"] for b in r["blocks"]]})
            handle.remove()
        out["resident_fwd"] += _forward_ms(model, x, args.forwards)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, out)
    if dist.get_rank() == 0:
        summary = [_summarise(r, o) for r, o in enumerate(ranks)]
        print(json.dumps(summary, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": vars(args), "summary": summary, "raw": ranks}, f)
    destroy_dist(ctx)
    return 0


def _resident_block_ms(model, x) -> list[float]:
    marks: list[torch.cuda.Event] = []

    def mark(*_):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append(e)

    hooks = [b.register_forward_pre_hook(mark) for b in model.blocks]
    hooks.append(model.blocks[-1].register_forward_hook(mark))
    model(**x)
    marks.clear()
    model(**x)
    torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]


def _forward_ms(model, x, n: int) -> list[float]:
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        model(**x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def _summarise(rank: int, o: dict) -> dict:
    # Blocks past the first on both sides (the first streamed block's compute follows the
    # forward's start, not another block); with --blocks 1 there is only the first.
    line = {"rank": rank, "resident_fwd_med": statistics.median(o["resident_fwd"]),
            "resident_block_med": statistics.median(o["resident_block_ms"][1:] or o["resident_block_ms"])}
    for name in CONFIGS:
        rows = o[name]
        xfer = [t for r in rows for t in r["xfer"] if t]
        line[name] = {
            "fwd_med": statistics.median(r["fwd"] for r in rows),
            "blocks_span_med": statistics.median(r["blocks_span"] for r in rows),
            "wait_med": statistics.median(r["wait"] for r in rows),
            "block_compute_med": statistics.median([c for r in rows for c in r["compute"][1:]]
                                                   or [c for r in rows for c in r["compute"]]),
            # None where no block reported a transfer (none timed: nothing to take a median of).
            "xfer_med": statistics.median(xfer) if xfer else None,
        }
    return line


if __name__ == "__main__":
    exit_with(main)
