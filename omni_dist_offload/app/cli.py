"""``omni-offload``: generate with a streamed diffusion pipeline, or show what would stream.

    omni-offload generate        # built-in tiny-wan, DiT and text encoder streamed, on CPU or GPU
    omni-offload generate --model Wan-AI/Wan2.2-T2V-A14B-Diffusers \\
        --diffusion-offload-config '{"mode":"layer","components":["dit"]}' \\
        --prompt "a red fox in snow" --num-inference-steps 30 --output-dir out/
    omni-offload inspect --model tiny-flux
    omni-offload bench --preset wan-14b --frames 81 17 --json out.json --png out.png
    omni-offload serve --model tiny-flux --port 8000     # HTTP service; see serve/

Under torchrun (``launch/generate.py``) prompts are split across ranks; see ``dp.py``. ``bench``
runs :mod:`omni_dist_offload.tools.bench`.
Bad flags, a bad config, or an option the pipeline does not take or its input check refuses:
one line on stderr, exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import STORAGE_DTYPES, UPCASTS, OffloadConfig, OffloadConfigError
from ..layout import BlockLayout
from ..loading.adapters import AdapterError, CacheSpec, LoraSpec
from ..loading.checkpoint import CheckpointError
from ..loading.compiling import COMPILE_MODES
from ..loading.parallel import ContextParallel, ContextParallelError, check_attention_backend, check_cache
from ..loading.folders import pipeline_class
from ..loading.pipelines import DTYPES, ModelLoadError, format_bytes
from ..models import BUILTIN_MODELS
from ..runtime.dist import PeerFailed, build_on_every_rank, destroy_dist, maybe_init_dist
from ..runtime.flags import OneLineParser as _Parser
from ..runtime.flags import (
    UsageError,
    expand_home,
    finite_float,
    non_negative_int,
    output_dir_check,
    positive_int,
    user_path,
)
from ..runtime.logs import error_line, rank_prefix, setup_logging
from ..runtime.proc import exit_with
from ..tools import bench
from ..trace import summary_line
from .api import MAX_SEED, GenerationOptionError, Omni, SamplingOptions, with_budget, with_storage, with_upcast
from .dp import PeerStopped, check_same_run, run_prompts, share_usage_error
from .outputs import VIDEO_FORMATS, OutputWriteError, resolve_video_format
from .serve import ServeOptions, add_serve_flags, run_serve, serve_options

__all__ = ["DEFAULT_OFFLOAD_CONFIG", "DEFAULT_PROMPT", "UsageError", "build_parser", "main"]

PROG = "omni-offload"
DEFAULT_MODEL = "tiny-wan"
DEFAULT_OFFLOAD_CONFIG = '{"mode": "layer", "components": ["dit", "text_encoder"]}'
DEFAULT_PROMPT = "a red fox running through snow"
_COMMANDS = ("generate", "inspect", "bench", "serve")
_BUILTINS = ", ".join(BUILTIN_MODELS)


@dataclass(kw_only=True, slots=True)
class RunPlan:
    """Validated flags: everything is checked before a model is touched."""

    command: str
    model: str
    config: OffloadConfig | None
    device: str | None
    dtype: str
    prompts: list[str]
    seed: int
    sampling: SamplingOptions
    output_dir: Path
    video_format: str
    fps: int | None
    progress: bool
    as_json: bool
    serve: ServeOptions | None = None
    cold_start: bool = True
    compile: str | None = None
    lora: list[LoraSpec] = field(default_factory=list)
    cache: CacheSpec | None = None
    context_parallel: ContextParallel | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Generate with layerwise-offloaded diffusion pipelines.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="{generate,inspect,bench,serve}")
    generate = commands.add_parser("generate", help="generate images or videos (the default command)",
                                   description="Generate images or videos; with no flags, the "
                                   "built-in tiny-wan with its DiT and text encoder streamed.")
    _add_model_flags(generate)
    _add_generation_flags(generate)
    inspect = commands.add_parser("inspect", help="show what streams and what stays resident",
                                  description="Load the model, apply the offload config and print "
                                  "the plan (components, blocks, bytes, transfer); generates nothing.")
    _add_model_flags(inspect)
    inspect.add_argument("--json", action="store_true", help="print the plan as JSON")
    serve = commands.add_parser("serve", help="answer generation requests over HTTP",
                                description="Keep the offloaded pipeline warm and answer OpenAI-style "
                                "image and video generation requests over HTTP; under torchrun rank 0 "
                                "serves and every rank generates (docs/serving.md).")
    _add_model_flags(serve, split=False)  # serve runs each request on one rank (or one wave of ranks)
    add_serve_flags(serve)
    # Listed for --help only: main() hands bench's flags to bench.py, which parses its own.
    commands.add_parser("bench", add_help=False, help="time resident, diffusers group offloading "
                        "and streamed forwards side by side (omni-offload bench --help)")
    return parser


def _add_model_flags(parser: argparse.ArgumentParser, *, split: bool = True) -> None:
    """The flags that say which model loads and how it runs; ``split``: with the context-parallel
    degrees, which split one call across ranks."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"built-in name ({_BUILTINS}), local diffusers folder, or hub "
                        "id whose weights are cached (default: %(default)s)")
    offload = parser.add_mutually_exclusive_group()
    offload.add_argument("--diffusion-offload-config", default=DEFAULT_OFFLOAD_CONFIG, metavar="JSON",
                         help="offload config as JSON (default: %(default)s)")
    offload.add_argument("--no-offload", action="store_true",
                         help="keep the whole pipeline resident on the device")
    parser.add_argument("--device-budget", default=None, metavar="SIZE",
                        help="device memory for the streamed block weights, resident blocks plus "
                        "slots (e.g. 24GiB, 40GB, auto); the planner keeps what fits resident "
                        "(sets device_budget in the offload config)")
    parser.add_argument("--storage-dtype", default=None, choices=list(STORAGE_DTYPES),
                        help="store the streamed block weights in 8 bits on the host and upcast them "
                        "on the device, as diffusers' layerwise casting stores them (sets storage_dtype "
                        "for every streamed component in the offload config)")
    parser.add_argument("--upcast", default=None, choices=list(UPCASTS),
                        help="with 8-bit storage, where the DiT's weights are upcast: block (a whole block "
                        "into a slot in the model's dtype, off the compute stream) or layer (blocks stay 8-bit "
                        "on the device, each layer upcast as it runs, so a device budget holds twice the blocks; "
                        "sets upcast for the DiT in the offload config)")
    if split:
        parser.add_argument("--ulysses-degree", type=positive_int, default=1, metavar="N",
                            help="under torchrun: split each sample of the DiT across N ranks with diffusers' "
                            "context parallelism (Ulysses attention); groups of N ranks run one prompt each")
        parser.add_argument("--ring-degree", type=positive_int, default=1, metavar="N",
                            help="the same with ring attention (needs a flash, cuDNN or sage attention backend: "
                            "DIFFUSERS_ATTN_BACKEND=flash, say)")
    parser.add_argument("--device", default=None,
                        help="cuda, cuda:N or cpu (default: the rank's GPU, else cpu)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="weights dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--compile", nargs="?", const="regional", default=None, choices=list(COMPILE_MODES),
                        help="torch.compile the DiT: regional (each block; the default when the flag "
                        "is given alone) or model (whole); compile time is reported apart")
    # Path flags expand ~ as they are parsed (the shell leaves --flag=~/x alone), so what is
    # checked before the model loads is what is read or written after (serve's --output-dir,
    # declared type=Path, gets the same from the parser).
    parser.add_argument("--lora", type=expand_home, action="append", default=[], metavar="PATH[:SCALE]",
                        help="load a LoRA (.safetensors file, or a folder holding "
                        "pytorch_lora_weights.safetensors) at SCALE (default 1); repeatable")
    parser.add_argument("--cache", default=None, metavar="SPEC",
                        help="a step cache on the DiT: first-block:THRESHOLD, taylorseer:INTERVAL, "
                        "pyramid-attention:BLOCKS, or a JSON object with \"type\" and the cache's options")
    parser.add_argument("--no-cold-start", action="store_true",
                        help="load a model folder whole before offloading it, instead of reading "
                        "each streamed block from the safetensors files into host memory")


def _add_generation_flags(parser: argparse.ArgumentParser) -> None:
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", action="append", default=None,
                         help=f"a prompt; repeat for several (default: {DEFAULT_PROMPT!r})")
    prompts.add_argument("--prompts-file", type=user_path, default=None, metavar="FILE",
                         help="one prompt per line (UTF-8, with or without a BOM; a line ends at \\n or "
                         "\\r\\n only, as wc -l counts); blank lines and lines starting with # are skipped")
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--num-inference-steps", type=positive_int, default=None, metavar="N")
    parser.add_argument("--height", type=positive_int, default=None)
    parser.add_argument("--width", type=positive_int, default=None)
    parser.add_argument("--num-frames", type=positive_int, default=None, metavar="N",
                        help="video pipelines only")
    parser.add_argument("--guidance-scale", type=finite_float, default=None, metavar="G")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of prompt 0; prompt k uses seed + k, at most 2**64 - 1 (default: %(default)s)")
    parser.add_argument("--output-dir", type=user_path, default=Path("outputs"),
                        help="where outputs and their JSON sidecars go, checked writable before the model "
                        "loads; output k replaces an earlier run's k, in whatever format (default: %(default)s)")
    parser.add_argument("--video-format", default="auto", choices=VIDEO_FORMATS,
                        help="auto: MP4 when imageio-ffmpeg is installed, else GIF")
    parser.add_argument("--fps", type=positive_int, default=None, help="video frame rate (default: 16)")
    parser.add_argument("--no-progress", action="store_true", help="hide denoising progress bars")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for bad flags, config or options)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in (*_COMMANDS, "-h", "--help", "--version"):
        args = ["generate", *args]  # generate is the default command
    if args[0] == "bench":
        return bench.main(args[1:], prog=f"{PROG} bench")
    try:
        plan = _validate(build_parser().parse_args(args))
    except UsageError as exc:
        where = f"{PROG} {args[0]}" if args[0] in _COMMANDS else PROG
        _report(f"{where}: error: {exc} (see {where} --help)")
        _share_usage_error(args, str(exc))
        return 2
    try:
        return _COMMAND_FUNCS[plan.command](plan)
    except (UsageError, OffloadConfigError, GenerationOptionError, AdapterError, ContextParallelError) as exc:
        _report(f"{PROG} {plan.command}: error: {exc}")
        return 2
    except (ModelLoadError, CheckpointError, PeerStopped, PeerFailed) as exc:
        _report(f"{PROG} {plan.command}: error: {exc}")
        return 1
    except OutputWriteError as exc:  # a full disk mid-run: the file and the reason, not a traceback
        _report(f"{PROG} {plan.command}: error: {exc}")
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT (outputs already written stay)
        _report(f"{PROG} {plan.command}: interrupted")
        return 130


def _share_usage_error(args: Sequence[str], error: str) -> None:
    """Under torchrun, a rank whose flags were refused still joins the job to say so: the other
    ranks wait for it in the group's start-up, and on another host torchrun does not stop them
    (they would wait out the process group's timeout, half an hour). They stop with exit status 2,
    naming this rank (:func:`check_same_run`). ``--help`` and ``--version`` never get here."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) < 2 or not args or args[0] not in ("generate", "inspect", "serve"):
        return
    device = _flag_value(args, "--device")
    try:
        _check_device(device)
    except UsageError:
        device = None  # the others' default: a GPU where there is one
    try:
        ctx = maybe_init_dist(device)
        try:
            share_usage_error(error, ctx)
        finally:
            destroy_dist(ctx)
    except Exception:  # noqa: BLE001 - the job is going down anyway; this rank's line is printed
        pass


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), the last one wins."""
    value = None
    for k, arg in enumerate(args):
        if arg == flag and k + 1 < len(args):
            value = args[k + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def run_setup(plan: RunPlan) -> dict[str, Any]:
    """What every rank of a job must share besides the prompts and sampling flags, by flag (for
    :func:`check_same_run`). A local folder counts by the pipeline class it holds, not its path
    (each host may keep its copy elsewhere); a LoRA file by its name, size and scale."""
    model = plan.model
    # os.path's expanduser leaves a ~user it cannot expand as it is; Path's raises RuntimeError.
    folder = Path(os.path.expanduser(model))
    if model not in BUILTIN_MODELS and folder.is_dir():  # a built-in's name loads the built-in, as the loader does
        model = f"a folder of {pipeline_class(folder).__name__}"
    loras = []
    for spec in plan.lora:
        path = Path(spec.path).expanduser()
        size = path.stat().st_size if path.is_file() else None
        loras.append([path.name, size, spec.scale])
    return {
        "--model": model,
        "--dtype": plan.dtype,
        "--diffusion-offload-config": plan.config.to_dict() if plan.config is not None else None,
        "--no-cold-start": not plan.cold_start,
        "--compile": plan.compile,
        "--lora": loras,
        "--cache": plan.cache.to_dict() if plan.cache is not None else None,
        "--ulysses-degree/--ring-degree": plan.context_parallel.to_dict() if plan.context_parallel else None,
    }


def _validate(ns: argparse.Namespace) -> RunPlan:
    config = None
    if ns.no_offload and ns.device_budget is not None:
        raise UsageError("--device-budget plans what streams; with --no-offload nothing does: drop one of them.")
    if ns.no_offload and ns.storage_dtype is not None:
        raise UsageError("--storage-dtype stores what streams; with --no-offload nothing does: drop one of them.")
    if ns.no_offload and ns.upcast is not None:
        raise UsageError("--upcast says how streamed 8-bit weights are upcast; with --no-offload nothing streams: "
                         "drop one of them.")
    if not ns.no_offload:
        try:
            config = OffloadConfig.parse(ns.diffusion_offload_config)
        except OffloadConfigError as exc:
            raise UsageError(f"--diffusion-offload-config: {exc}") from None
        try:
            config = with_budget(config, ns.device_budget)
        except OffloadConfigError as exc:
            raise UsageError(f"--device-budget: {exc}") from None
        config = with_storage(config, ns.storage_dtype)
        try:
            config = with_upcast(config, ns.upcast)
        except OffloadConfigError as exc:
            raise UsageError(f"--upcast: {exc}") from None
    _check_model(ns.model)
    _check_device(ns.device)
    try:
        loras = [LoraSpec.parse(x) for x in ns.lora]
        for spec in loras:
            spec.check()
        cache = CacheSpec.parse(ns.cache) if ns.cache is not None else None
    except AdapterError as exc:
        raise UsageError(str(exc)) from None
    # serve has no degrees: it runs each request on one rank (or one wave of ranks).
    context_parallel = ContextParallel.parse({"ulysses_degree": getattr(ns, "ulysses_degree", 1),
                                              "ring_degree": getattr(ns, "ring_degree", 1)})
    try:
        check_cache(context_parallel, cache, flags=True)  # --cache first-block does not run split
        if context_parallel is not None:  # DIFFUSERS_ATTN_BACKEND, or --ring-degree on torch's SDPA
            check_attention_backend(context_parallel)
    except ContextParallelError as exc:
        raise UsageError(f"{exc}.") from None
    generating = ns.command == "generate"
    if generating:
        try:
            resolve_video_format(ns.video_format)
        except ValueError as exc:
            raise UsageError(f"--video-format: {exc}") from None
        output_dir_check("--output-dir", ns.output_dir)
    sampling = SamplingOptions(
        num_inference_steps=ns.num_inference_steps, height=ns.height, width=ns.width,
        num_frames=ns.num_frames, guidance_scale=ns.guidance_scale,
        negative_prompt=ns.negative_prompt) if generating else SamplingOptions()
    prompts = _prompts(ns) if generating else []
    if generating:
        _check_seed(ns.seed, len(prompts))
    return RunPlan(
        command=ns.command, model=ns.model, config=config, device=ns.device, dtype=ns.dtype,
        prompts=prompts, seed=getattr(ns, "seed", 0), sampling=sampling,
        output_dir=getattr(ns, "output_dir", Path("outputs")),
        video_format=getattr(ns, "video_format", "auto"), fps=getattr(ns, "fps", None),
        progress=not getattr(ns, "no_progress", True), as_json=getattr(ns, "json", False),
        serve=_serve_options(ns) if ns.command == "serve" else None,
        cold_start=not getattr(ns, "no_cold_start", False), compile=getattr(ns, "compile", None),
        lora=loras, cache=cache, context_parallel=context_parallel)


def _prompts(ns: argparse.Namespace) -> list[str]:
    if ns.prompts_file is None:
        prompts = ns.prompt or [DEFAULT_PROMPT]
        if any(not p.strip() for p in prompts):
            raise UsageError("--prompt is empty: give some text.")
        return prompts
    path: Path = ns.prompts_file
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a BOM, as some editors write, is dropped
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts-file {str(path)!r} cannot be read ({type(exc).__name__}: "
                         f"{getattr(exc, 'strerror', None) or exc}).") from None
    # Only "\n" (or "\r\n") ends a line, as wc -l and editors count them: splitlines() also breaks
    # at U+2028, U+0085, form feeds and the like inside a prompt, shifting every later prompt's
    # number and seed.
    # A byte order mark goes wherever it is: files joined with cat carry one at each start.
    lines = [line.removesuffix("\r") for line in text.replace("\ufeff", "").split("\n")]
    for number, line in enumerate(lines, 1):
        if "\r" in line:  # a carriage return alone ends lines on classic Mac OS: not a prompt's text
            raise UsageError(f"--prompts-file {str(path)!r} line {number} holds a carriage return that ends no "
                             "line (classic Mac line endings?): end each prompt with a line feed.")
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise UsageError(f"--prompts-file {str(path)!r} has no prompts: write one per line.")
    return prompts


def _check_seed(seed: int, count: int) -> None:
    """Prompt k uses seed + k (a padding call repeats a prompt, and its seed: ``dp.plan_jobs``).
    Every one of those seeds must be one torch takes."""
    last = seed + count - 1
    if last > MAX_SEED:
        raise UsageError(f"--seed {seed}: prompt k uses seed + k, up to {last} here, past {MAX_SEED} (2**64 - 1, "
                         f"the largest seed torch takes): give --seed {seed - (last - MAX_SEED)} or less.")


def _check_model(model: str) -> None:
    if model.startswith("~"):  # as the path flags say it (Path.expanduser would raise a bare RuntimeError)
        try:
            expand_home(model)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"argument --model: {exc}") from None
    path = Path(os.path.expanduser(model))
    if model.startswith((".", "/", "~")) and not path.is_dir():
        raise UsageError(f"--model {model!r}: no such folder; give a diffusers folder, a hub id or "
                         f"a built-in name ({_BUILTINS}).")


def _check_device(device: str | None) -> None:
    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device: use cuda, cuda:N or cpu.") from None
    if dev.type not in ("cuda", "cpu"):
        raise UsageError(f"--device {device!r} is not supported: use cuda, cuda:N or cpu.")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device!r}: no CUDA device is visible; use --device cpu.")
    world, local = os.environ.get("WORLD_SIZE", "1"), os.environ.get("LOCAL_RANK", "0")
    if dev.type == "cuda" and dev.index is not None and world.isdigit() and int(world) > 1 and local.isdigit() \
            and dev.index != int(local):
        # Under torchrun each rank joins NCCL on its own GPU, cuda:LOCAL_RANK (runtime.dist):
        # every rank's pipeline on cuda:N would share one GPU while their collectives ran on others.
        raise UsageError(f"--device {device!r}: under torchrun each rank runs on its own GPU, cuda:LOCAL_RANK "
                         f"(cuda:{int(local)} on this rank): give --device cuda, or leave it out (choose the GPUs "
                         "with CUDA_VISIBLE_DEVICES).")


# -- commands ------------------------------------------------------------------------------
def _cmd_generate(plan: RunPlan) -> int:
    setup_logging()
    ctx = maybe_init_dist(plan.device)
    teardown = True
    try:
        # Before anything loads: a rank given other prompts would drop or mix outputs.
        check_same_run(plan.prompts, plan.seed, plan.sampling, plan.fps, ctx, setup=run_setup(plan))
        omni = _load(plan)
        try:
            omni.call_kwargs(**plan.sampling.to_kwargs())  # an option it does not take: exit 2 now
            # Waves or free work sharing, by whether a ring needs lockstep (omni.lockstep).
            report = run_prompts(omni, plan.prompts, plan.seed, ctx, sampling=plan.sampling,
                                 output_dir=plan.output_dir, video_format=plan.video_format, fps=plan.fps)
            if ctx.is_main:
                print(report.line(ctx.world_size, omni.timings.setup_s), flush=True)
                if omni.handle is not None and any(r.tracer is not None for r in omni.handle.rings):
                    print(summary_line(omni.handle.trace_report()), flush=True)
        except BaseException:
            # In lockstep the other ranks wait in this wave's collectives: a teardown that
            # destroys the process groups (close() does) would not match theirs, and gloo would
            # abort (NCCL hang) before this error is seen. Leave without it: the exit ends the job.
            # run_jobs has told the others why in the store (or, PeerStopped, learnt why another
            # rank left): those gathering with this rank name it when their collective fails, and
            # the others (other hosts) between waves or at the end.
            teardown = not (ctx.world_size > 1 and omni.lockstep)
            raise
        finally:
            if teardown:
                omni.close()
        return 0
    finally:
        if teardown:
            destroy_dist(ctx)


def _cmd_inspect(plan: RunPlan) -> int:
    setup_logging()
    ctx = maybe_init_dist(plan.device)
    try:
        check_same_run((), 0, None, None, ctx, setup=run_setup(plan))  # a rank loading another model would hang
        with _load(plan) as omni:
            rows = plan_rows(omni)
            if ctx.is_main:
                print(json.dumps(rows, indent=2) if plan.as_json else format_plan(omni, rows), flush=True)
        return 0
    finally:
        destroy_dist(ctx)


def _cmd_serve(plan: RunPlan) -> int:
    setup_logging()
    factory = functools.partial(Omni, plan.model, plan.config, device=plan.device, dtype=plan.dtype,
                                progress=False, cold_start=plan.cold_start, compile=plan.compile,
                                lora=plan.lora, cache=plan.cache)
    return run_serve(factory, plan.device, plan.serve or ServeOptions(), setup=run_setup(plan))


def _serve_options(ns: argparse.Namespace) -> ServeOptions:
    try:
        return serve_options(ns)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


_COMMAND_FUNCS: dict[str, Callable[[RunPlan], int]] = {
    "generate": _cmd_generate,
    "inspect": _cmd_inspect,
    "serve": _cmd_serve,
}


def _load(plan: RunPlan) -> Omni:
    """The pipeline, built on every rank: a rank that cannot (a folder missing on its host) tells
    the others, which stop with it instead of waiting for it in their first collective."""
    return build_on_every_rank("load the model", functools.partial(_build, plan))


def _build(plan: RunPlan) -> Omni:
    return Omni(plan.model, plan.config, device=plan.device, dtype=plan.dtype, progress=plan.progress,
                cold_start=plan.cold_start, compile=plan.compile, lora=plan.lora, cache=plan.cache,
                context_parallel=plan.context_parallel)


# -- the plan table ------------------------------------------------------------------------
def plan_rows(omni: Omni) -> list[dict[str, Any]]:
    """One row per pipeline module: its streamed ring (if any) and what stays on the device."""
    streamed = {row.component: row for row in omni.summary_rows()}
    rings = {ring.component.name: ring for ring in omni.handle.rings} if omni.handle is not None else {}
    rows = []
    for name, module in omni.components().items():
        ring = streamed.get(name)
        layouts = rings[name].layouts if ring else ()
        outside = _outside_block_bytes(module, layouts)
        block_bytes = ring.block_bytes if ring else 0
        rows.append({
            "component": name,
            "category": ring.category if ring else "resident",
            "module_class": type(module).__name__,
            "num_blocks": ring.num_blocks if ring else 0,
            "block_bytes": block_bytes,
            "host_bytes": ring.host_bytes if ring else 0,
            "device_slot_bytes": ring.device_slot_bytes if ring else 0,
            # What stays on the device: the tensors outside the blocks, and the ring's resident
            # blocks and kept parts as it holds them (summary's resident_bytes counts the latter
            # only, hence another name).
            "on_device_bytes": outside + (ring.resident_bytes if ring else 0),
            "weight_transfer": ring.weight_transfer if ring else None,
            "gather": ring.gather if ring else None,
            "fallback_reason": ring.fallback_reason if ring else None,
            "setup_s": ring.setup_s if ring else None,
            "resident_blocks": list(ring.resident_blocks) if ring else [],
            "kept_blocks": list(ring.kept_blocks) if ring else [],
            "device_budget": ring.device_budget if ring else None,
            "predicted_ratio": ring.predicted_ratio if ring else None,
            # The share of the module's bytes that stream, both as stored (8-bit blocks count
            # 8 bits), and how its blocks were found.
            "streamed_share": block_bytes / max(1, outside + sum(l.stored_tensor_bytes for l in layouts)),
            "found_by": ring.found_by if ring else None,
            "storage_dtype": ring.storage_dtype if ring else None,
            "upcast": ring.upcast if ring else None,
            "shared_host_bytes": ring.shared_host_bytes if ring else None,
            "host_ranks": ring.host_ranks if ring else None,
        })
    return rows


def _outside_block_bytes(module: torch.nn.Module, layouts: Sequence[BlockLayout]) -> int:
    """Bytes of the module's distinct tensors outside the ring's blocks, in the dtype they are
    held in (8 bits where ``storage_dtype`` stores layers outside the blocks)."""
    in_blocks = {id(e.tensor) for layout in layouts for e in layout.entries}
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()] if id(t) not in in_blocks}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _fmt_transfer(row: dict[str, Any]) -> str:
    """``allgather (copy-engine)``, ``rank-local``, or ``-`` for a resident module."""
    if not row["weight_transfer"]:
        return "-"
    return f"{row['weight_transfer']} ({row['gather']})" if row.get("gather") else row["weight_transfer"]


def _fmt_stored(row: dict[str, Any]) -> str:
    """``e4m3fn`` (upcast per block), ``e4m3fn/layer`` (per layer), or ``-``."""
    if not row["weight_transfer"] or not row.get("storage_dtype"):
        return "-"
    return row["storage_dtype"].removeprefix("float8_") + ("/layer" if row.get("upcast") == "layer" else "")


def format_plan(omni: Omni, rows: list[dict[str, Any]]) -> str:
    """The plan as a fixed-width table, with a header and device totals."""
    # "resident": how many blocks the plan keeps on the device (summary's resident_blocks);
    # "on-device": the bytes that stay there (on_device_bytes), beside "slots".
    header = ["component", "category", "class", "blocks", "resident", "streamed", "share", "host", "slots",
              "on-device", "budget", "transfer", "stored", "found", "setup", "fallback"]
    table = [header] + [[
        r["component"], r["category"], r["module_class"], str(r["num_blocks"]), _fmt_resident(r),
        _fmt_bytes(r["block_bytes"]), f"{100 * r['streamed_share']:.0f}%" if r["weight_transfer"] else "-",
        _fmt_bytes(r["host_bytes"]), _fmt_bytes(r["device_slot_bytes"]),
        _fmt_bytes(r["on_device_bytes"]), _fmt_budget(r), _fmt_transfer(r),
        _fmt_stored(r),
        {"built-in table": "table"}.get(r["found_by"], r["found_by"] or "-"), _fmt_setup(r),
        r["fallback_reason"] or "-",
    ] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    numeric = {3, 4, 5, 6, 7, 8, 9, 10}
    lines = ["  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(line, widths, strict=True))).rstrip()
             for line in table]
    config = json.dumps(omni.config.to_dict()) if omni.config else "none (all resident)"
    device_bytes = sum(r["on_device_bytes"] + r["device_slot_bytes"] for r in rows)
    host_bytes = sum(r["host_bytes"] for r in rows)
    shared = [r for r in rows if r.get("shared_host_bytes") is not None]
    host_total = (f"; shared with the other ranks of this host: {_fmt_bytes(sum(r['shared_host_bytes'] for r in shared))} "
                  f"in one copy for {shared[0]['host_ranks']} ranks" if shared else "")
    return "\n".join([
        f"model {omni.model} ({type(omni.pipeline).__name__}) on {omni.device}, "
        f"{str(omni.dtype).removeprefix('torch.')}",
        f"offload config {config}",
        "",
        *lines,
        "",
        f"weights on the device: {_fmt_bytes(device_bytes)} (resident + slots); "
        f"in host memory on this rank: {_fmt_bytes(host_bytes)}{host_total}",
    ])


def _fmt_resident(row: dict[str, Any]) -> str:
    """Blocks kept resident by the residency plan (``layer_options.resident_blocks`` or the
    budget's planner)."""
    return str(len(row["resident_blocks"])) if row["weight_transfer"] else "-"


def _fmt_budget(row: dict[str, Any]) -> str:
    """The ring's share of ``device_budget``, and the plan's predicted forward / resident once a
    forward was measured (``inspect`` runs none: the plan shown is the one made from sizes)."""
    if row["device_budget"] is None:
        return "-"
    ratio = row["predicted_ratio"]
    return _fmt_bytes(row["device_budget"]) + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _fmt_setup(row: dict[str, Any]) -> str:
    """Seconds to fill and page-lock the ring's host copy, and the block bytes made ready per
    second (on this rank; with allgather each rank reads only its shard of those bytes)."""
    seconds = row.get("setup_s")
    if seconds is None:
        return "-"
    rate = row["block_bytes"] / seconds / 1e9 if seconds > 0 else float("inf")
    return f"{seconds:.2f}s@{rate:.1f}GB/s"


def _fmt_bytes(n: int) -> str:
    return format_bytes(n) if n else "0"


# -- plumbing ------------------------------------------------------------------------------
def _report(message: str) -> None:
    """An error, on stderr, from whichever rank met it (``[rankN]`` under torchrun): a rank's own
    input (its prompts file, its pipeline call) can fail there alone, and must not fail silently."""
    error_line(f"{rank_prefix()}{message}")


def _version() -> str:
    try:
        return importlib.metadata.version("omni_dist_offload")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


if __name__ == "__main__":
    exit_with(main)
