"""Long-run check: many streamed forwards, alternating two input shapes, against the resident model.

Every output must be bitwise equal to the resident model's for its shape. After warm-up the
device memory allocated between forwards must not change, host RSS must not stay above its
value at the end of warm-up by more than a tolerance (a leak raises every later sample; a
passing peak of the allocator, one) and the number of live tensors must not grow; after the
run, ``remove()`` must give back a model with the same outputs. Figures are printed every ``--report-every`` forwards; the
last line is ``soak PASS`` or ``soak FAIL`` with the figures, and the exit status is 1 on FAIL
(2 for a bad flag: one line on stderr, before anything is built).

    python -m omni_dist_offload.tools.soak --model wan-14b --forwards 500                    # one GPU
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 -m omni_dist_offload.tools.soak \
        --model wan-14b --forwards 500 --transfer allgather                           # two GPUs
    python -m omni_dist_offload.tools.soak --model tiny-wan --forwards 60                    # CPU, seconds
    python -m torch.distributed.run --nproc_per_node 2 -m omni_dist_offload.tools.soak \\
        --model tiny-wan --forwards 60 --transfer allgather                            # CPU, gloo

Models are the benchmark presets (``omni_dist_offload.models.PRESETS``: real diffusers DiT classes
at real or tiny block sizes, random weights, nothing downloaded).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from torch import nn

from ..apply import apply_offload
from ..config import GATHERS, Gather
from ..models import PRESETS, build_model, case_inputs
from ..runtime.dist import destroy_dist, maybe_init_dist
from ..runtime.proc import exit_with, rss_mib
from ..runtime.flags import (
    OneLineParser,
    UsageError,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    report_usage_error,
)
from ..runtime.logs import current_rank, rank_prefix
from ..transfer.groups import ALLOW_GLOO_ENV

__all__ = ["DEFAULT_SHAPES", "SoakOptions", "SoakResult", "main", "run_soak"]

#: Two input shapes per preset, alternated forward by forward: (frames, height, width) in pixels
#: for video presets, (side,) in pixels for image presets.
DEFAULT_SHAPES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "wan-14b": ((17, 480, 832), (9, 320, 576)),
    "wan-1.3b": ((17, 480, 832), (9, 320, 576)),
    "flux-12b": ((1024,), (512,)),
    "tiny-wan": ((5, 32, 32), (9, 48, 64)),
    "tiny-flux": ((64,), (128,)),
}

_MIB = 2**20


@dataclass(kw_only=True, slots=True)
class SoakOptions:
    """One soak run."""

    model: str = "tiny-wan"
    """A preset of ``omni_dist_offload.models.PRESETS``."""
    forwards: int = 500
    transfer: Literal["rank-local", "allgather"] = "rank-local"
    blocks: int | None = None
    """Blocks in the model (None: the preset's default)."""
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """The two alternated input shapes (None: :data:`DEFAULT_SHAPES`)."""
    warmup: int = 10
    """Forwards before the memory baselines are taken."""
    report_every: int = 50
    rss_tolerance_mib: float = 64.0
    """Host RSS may stay this much above its value at the end of warm-up (``rss_kept_mib``)."""
    allocated_tolerance_mib: float = 0.0
    """Device memory allocated between forwards may move this much from its warm-up value."""
    chunk_mib: float = 64.0
    gather: Gather = "auto"
    """allgather only: ``LayerOptions.gather``."""
    collective_timeout_s: float = 600.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32


@dataclass(slots=True)
class SoakResult:
    """What one rank saw. Memory in MiB."""

    rank: int
    forwards_done: int = 0
    equal: int = 0
    """Forwards whose output was bitwise equal to the resident model's."""
    equal_after_remove: bool = False
    weight_transfer: str | None = None
    fallback_reason: str | None = None
    allocated_mib: float | None = None
    """Device memory allocated between forwards at the end of warm-up (None on the CPU)."""
    allocated_drift_mib: float = 0.0
    """Largest change of it after warm-up."""
    peak_mib: float | None = None
    rss_warm_mib: float | None = None
    rss_end_mib: float | None = None
    rss_growth_mib: float = 0.0
    """Largest rise of host RSS above its value at the end of warm-up."""
    rss_kept_mib: float = 0.0
    """The rise that stayed: the lowest host RSS over the last third of the forwards after
    warm-up, above its value at the end of warm-up. What the tolerance judges."""
    live_tensors: tuple[int, int] = (0, 0)
    """Python tensor objects alive at the end of warm-up and at the end."""
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def run_soak(opts: SoakOptions, log: Callable[[str], None] | None = None) -> SoakResult:
    """Run the soak in this process (one rank; under torchrun every rank calls it alike).

    ``log`` receives the progress lines (None: silent)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    result = SoakResult(rank=rank)
    _check_options(opts)
    model, inputs = _build(opts)
    with torch.inference_mode():
        refs = [model(**batch)[0] for batch in inputs]
        handle = apply_offload(model, _offload_config(opts), device=opts.device)
        (row,) = handle.summary_rows()
        result.weight_transfer, result.fallback_reason = row.weight_transfer, row.fallback_reason
        try:
            _loop(model, inputs, refs, opts, result, log)
        except BaseException:
            # remove() is collective under allgather: with a peer gone it would only stall again.
            if result.weight_transfer != "allgather":
                handle.remove()
            raise
        handle.remove()
        result.equal_after_remove = bool(torch.equal(model(**inputs[0])[0], refs[0]))
    _judge(opts, result)
    return result


def _loop(model: nn.Module, inputs: Sequence[dict], refs: Sequence[torch.Tensor], opts: SoakOptions,
          result: SoakResult, log: Callable[[str], None] | None) -> None:
    """The forwards, with memory samples after each and a report line every few."""
    device = opts.device
    rss_warm: float | None = None
    allocated_warm: float | None = None
    after_warm: list[float] = []
    start = time.perf_counter()
    for i in range(1, opts.forwards + 1):
        which = (i - 1) % 2
        out = model(**inputs[which])[0]
        result.equal += bool(torch.equal(out, refs[which]))
        del out  # sample memory with no activations alive
        allocated, rss = _allocated_mib(device), rss_mib()
        result.forwards_done = i
        if i == opts.warmup:
            gc.collect()
            rss_warm, allocated_warm = rss_mib(), allocated
            result.rss_warm_mib, result.allocated_mib = rss_warm, allocated
            result.live_tensors = (_live_tensors(), 0)
            _reset_peak(device)
        elif i > opts.warmup:
            if rss is not None and rss_warm is not None:
                result.rss_growth_mib = max(result.rss_growth_mib, rss - rss_warm)
                after_warm.append(rss)
            if allocated is not None and allocated_warm is not None:
                result.allocated_drift_mib = max(result.allocated_drift_mib, abs(allocated - allocated_warm))
        if log is not None and (i % opts.report_every == 0 or i == opts.forwards):
            log(_progress_line(i, opts, result, allocated, rss, rss_warm, time.perf_counter() - start))
    result.seconds = time.perf_counter() - start
    if after_warm and rss_warm is not None:
        result.rss_kept_mib = max(0.0, min(after_warm[-max(1, len(after_warm) // 3):]) - rss_warm)
    gc.collect()
    result.rss_end_mib = rss_mib()
    result.live_tensors = (result.live_tensors[0], _live_tensors())
    result.peak_mib = _peak_mib(device)


def _judge(opts: SoakOptions, r: SoakResult) -> None:
    if r.weight_transfer != opts.transfer:
        r.failures.append(f"asked for {opts.transfer} but the ring runs {r.weight_transfer}: {r.fallback_reason}")
    if r.equal != r.forwards_done:
        r.failures.append(f"{r.forwards_done - r.equal} of {r.forwards_done} outputs differ from the resident model")
    if not r.equal_after_remove:
        r.failures.append("the output after remove() differs from the resident model")
    if r.allocated_drift_mib > opts.allocated_tolerance_mib:
        r.failures.append(f"device memory allocated between forwards moved {r.allocated_drift_mib:.2f} MiB "
                          f"after warm-up (limit {opts.allocated_tolerance_mib:g} MiB)")
    if r.rss_kept_mib > opts.rss_tolerance_mib:
        r.failures.append(f"host RSS grew {r.rss_kept_mib:.1f} MiB after warm-up and stayed there through "
                          f"the last third of the forwards (limit {opts.rss_tolerance_mib:g} MiB)")
    if r.live_tensors[1] > r.live_tensors[0]:
        r.failures.append(f"live tensors grew from {r.live_tensors[0]} to {r.live_tensors[1]} after warm-up")


def _check_options(opts: SoakOptions) -> None:
    if opts.model not in PRESETS:
        raise ValueError(f"model {opts.model!r} is not a preset: use one of {sorted(PRESETS)}.")
    if opts.warmup < 2 or opts.forwards <= opts.warmup:
        raise ValueError(f"need at least 2 warm-up forwards (one per shape) and more forwards than "
                         f"warm-up ones; found warmup {opts.warmup}, forwards {opts.forwards}.")
    if opts.report_every < 1:
        raise ValueError(f"report_every must be at least 1, found {opts.report_every}.")
    if opts.shapes is not None:
        video = PRESETS[opts.model].video
        for shape in opts.shapes:
            if len(shape) != (3 if video else 1) or min(shape) < 1:
                want = "FxHxW pixels (e.g. 17x480x832)" if video else "SIDE pixels (e.g. 1024)"
                raise ValueError(f"shape {'x'.join(map(str, shape))} does not fit {opts.model}, "
                                 f"{'a video' if video else 'an image'} model: give {want}, each above 0.")


def _build(opts: SoakOptions) -> tuple[nn.Module, list[dict[str, Any]]]:
    """The preset's model on the device (the same weights on every rank) and its two inputs."""
    preset = PRESETS[opts.model]
    model = build_model(preset, opts.blocks or preset.default_blocks, opts.device, opts.dtype).eval()
    shapes = opts.shapes or DEFAULT_SHAPES.get(opts.model) or DEFAULT_SHAPES["tiny-wan" if preset.video else "tiny-flux"]
    return model, [case_inputs(preset, model, shape, opts.device, opts.dtype, seed=seed)
                   for seed, shape in enumerate(shapes)]


def _offload_config(opts: SoakOptions) -> dict[str, Any]:
    return {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"weight_transfer": opts.transfer, "chunk_mib": opts.chunk_mib,
                                      "gather": opts.gather}},
            "collective_timeout_s": opts.collective_timeout_s}


# -- measurements --------------------------------------------------------------------------
def _allocated_mib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) / _MIB


def _peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / _MIB if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _live_tensors() -> int:
    # type(), not isinstance(): isinstance may call a deprecated object's __class__, which warns.
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


# -- reporting -----------------------------------------------------------------------------
def _fmt(mib: float | None) -> str:
    return "n/a" if mib is None else f"{mib:.1f} MiB"


def _progress_line(i: int, opts: SoakOptions, r: SoakResult, allocated: float | None, rss: float | None,
                   rss_warm: float | None, elapsed: float) -> str:
    since = f" ({rss - rss_warm:+.1f} since warm-up)" if rss is not None and rss_warm is not None else ""
    return (f"{rank_prefix()}forward {i}/{opts.forwards}: equal {r.equal}/{i}, allocated {_fmt(allocated)}, "
            f"RSS {_fmt(rss)}{since}, {1e3 * elapsed / i:.1f} ms/forward")


def verdict_line(opts: SoakOptions, results: Sequence[SoakResult]) -> str:
    """The last line: PASS or FAIL, with the worst figures over all ranks."""
    ok = all(r.passed for r in results)
    worst_alloc = max(r.allocated_drift_mib for r in results)
    allocated = [r.allocated_mib for r in results if r.allocated_mib is not None]
    live = results[0].live_tensors
    text = (f"soak {'PASS' if ok else 'FAIL'}: {opts.model}, {opts.transfer}, {len(results)} rank(s), "
            f"{min(r.forwards_done for r in results)}/{opts.forwards} forwards in "
            f"{max(r.seconds for r in results):.1f} s; outputs bitwise equal "
            f"{min(r.equal for r in results)}/{opts.forwards}, after remove "
            f"{all(r.equal_after_remove for r in results)}; device allocated "
            f"{_fmt(max(allocated)) if allocated else 'n/a'} (drift {worst_alloc:.2f} MiB, limit "
            f"{opts.allocated_tolerance_mib:g}); host RSS +{max(r.rss_growth_mib for r in results):.1f} MiB "
            f"after warm-up at most, +{max(r.rss_kept_mib for r in results):.1f} MiB kept (limit "
            f"{opts.rss_tolerance_mib:g}); live tensors {live[0]} -> {live[1]}")
    failures = [f"rank {r.rank}: {f}" for r in results for f in r.failures]
    return text + ("; " + "; ".join(failures) if failures else "")


def _gather(result: SoakResult) -> list[SoakResult]:
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [result]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, asdict(result))
    return [SoakResult(**{**g, "live_tensors": tuple(g["live_tensors"])}) for g in gathered]


# -- command line --------------------------------------------------------------------------
def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not FxHxW (video) or SIDE (image), e.g. 17x480x832") from None


PROG = "python -m omni_dist_offload.tools.soak"


def _device(text: str) -> torch.device:
    """``--device``: cuda, cuda:N or cpu, and a visible one (checked before anything is built)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cuda, cuda:N or cpu") from None
    if device.type not in ("cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"{text!r} is not supported: use cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is visible; use --device cpu")
    return device


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-wan", choices=sorted(PRESETS), help="benchmark preset")
    p.add_argument("--forwards", type=positive_int, default=500)
    p.add_argument("--transfer", default="rank-local", choices=["rank-local", "allgather"])
    p.add_argument("--blocks", type=positive_int, default=None, help="blocks in the model (preset default)")
    p.add_argument("--shapes", type=_shape, nargs=2, default=None, metavar="SHAPE",
                   help="the two alternated input shapes: FxHxW pixels for video, SIDE for images")
    p.add_argument("--warmup", type=non_negative_int, default=10)
    p.add_argument("--report-every", type=positive_int, default=50)
    p.add_argument("--rss-tolerance-mib", type=non_negative_float, default=64.0)
    p.add_argument("--allocated-tolerance-mib", type=non_negative_float, default=0.0)
    p.add_argument("--chunk-mib", type=positive_float, default=64.0, help="allgather chunk size")
    p.add_argument("--gather", default="auto", choices=list(GATHERS),
                   help="allgather: how shards move between GPUs (LayerOptions.gather)")
    p.add_argument("--timeout-s", type=positive_float, default=600.0, help="allgather collective timeout")
    p.add_argument("--device", type=_device, default=None, help="default: this rank's GPU, else the CPU")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on a GPU, float32 on the CPU")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak; 0 on PASS, 1 on FAIL, 2 for bad flags (one line on stderr, found before
    anything is built or a process group starts)."""
    try:
        args = build_parser().parse_args(argv)
        opts = SoakOptions(model=args.model, forwards=args.forwards, transfer=args.transfer, blocks=args.blocks,
                           shapes=tuple(args.shapes) if args.shapes else None, warmup=args.warmup,
                           report_every=args.report_every, rss_tolerance_mib=args.rss_tolerance_mib,
                           allocated_tolerance_mib=args.allocated_tolerance_mib, chunk_mib=args.chunk_mib,
                           gather=args.gather, collective_timeout_s=args.timeout_s)
        try:
            _check_options(opts)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    except UsageError as exc:
        return report_usage_error(PROG, exc, show=current_rank() == 0)
    ctx = maybe_init_dist(str(args.device) if args.device is not None else None)
    device = args.device if args.device is not None else ctx.device
    if args.transfer == "allgather" and device.type == "cpu":
        os.environ.setdefault(ALLOW_GLOO_ENV, "1")  # gloo allgather is for tests like this one
    opts.device = device
    opts.dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    say = (lambda line: print(line, flush=True)) if ctx.is_main else None
    try:
        result = run_soak(opts, log=say)
    except Exception as exc:  # a failed run is a FAIL with its reason, not a traceback
        result = SoakResult(rank=ctx.rank, failures=[f"{type(exc).__name__}: {exc}"])
    results = _gather(result)
    if ctx.is_main:
        for r in results if len(results) > 1 else []:
            print(f"[rank{r.rank}] equal {r.equal}/{r.forwards_done}, allocated {_fmt(r.allocated_mib)} "
                  f"(drift {r.allocated_drift_mib:.2f}, peak {_fmt(r.peak_mib)}), RSS {_fmt(r.rss_warm_mib)} -> "
                  f"{_fmt(r.rss_end_mib)} (max +{r.rss_growth_mib:.1f}, kept +{r.rss_kept_mib:.1f}), live tensors "
                  f"{r.live_tensors[0]} -> {r.live_tensors[1]}", flush=True)
        print(verdict_line(opts, results), flush=True)
    destroy_dist(ctx)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    exit_with(main)
