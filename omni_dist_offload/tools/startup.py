"""Start-up time and peak host memory: cold start against loading whole, and against diffusers
group offloading's setup.

    # a Wan-14B-size pipeline folder with random weights (40 blocks of 703 MB in bf16: 28 GB)
    python -m omni_dist_offload.tools.startup write /tmp/wan14b --blocks 40 --dtype bf16
    # each measurement in a fresh process, so its peak RSS is its own
    torchrun --standalone --nproc_per_node 2 -m omni_dist_offload.tools.startup load /tmp/wan14b \\
        --mode cold --transfer allgather
    torchrun --standalone --nproc_per_node 2 -m omni_dist_offload.tools.startup load /tmp/wan14b \\
        --mode ordinary --transfer allgather
    python -m omni_dist_offload.tools.startup load /tmp/wan14b --mode peer    # group offloading setup
    # the folder is a runnable Wan pipeline (tiny text encoder and VAE, full-size DiT)
    NGPU=2 launch/generate.sh --model /tmp/wan14b --height 480 --width 832 --num-frames 17 \
        --num-inference-steps 4 --prompt "a fox" --prompt "a cat"

``cold``: the cold start that :class:`~omni_dist_offload.Omni` runs
(:func:`omni_dist_offload.loading.load_and_place`: streamed blocks read from the safetensors
files into this rank's host buffer or shard). ``ordinary``: ``from_pretrained`` then
:func:`~omni_dist_offload.apply_offload` (the same function with ``cold_start=False``). ``peer``: ``from_pretrained``, then diffusers'
``enable_group_offload`` (block_level, one block per group, use_stream) on the DiT, timed alone.
Every rank prints one JSON line: seconds to ready, the DiT's fill-and-pin seconds and GB/s, peak
and final RSS, PSS (shared pages counted a share per process: a ``shared`` host copy adds up to
one copy over the host's ranks) and two digests. ``weights_digest`` is of the loaded DiT's
weights (every tensor of its state dict: name, dtype, shape and bytes, in name order; a streamed
block's as its forward sees it, whole under allgather): equal digests, bitwise equal weights, and
every mode must give the same. ``digest`` is of one small DiT forward's output: equal on a GPU
for equal weights, but on the CPU it may differ between modes with equal weights, as CPU matmul
results depend on the memory alignment of the tensors (``from_pretrained`` leaves the non-block
tensors at unaligned offsets; cold start aligns them). ``--share-gpus`` runs more ranks than GPUs
(gloo), for the host-side figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from diffusers import DiffusionPipeline, WanTransformer3DModel
from safetensors.torch import save_file

from ..apply import resolve_device
from ..config import OffloadConfig
from ..hostmem import huge_pages_wanted
from ..loading.folders import dtype_kwarg
from ..loading.checkpoint import CheckpointError
from ..loading.pipelines import ModelLoadError, load_and_place
from ..models import PRESETS
from ..models.tiny import TINY_TEXT_DIM, tiny_wan_pipeline, wan_transformer_inputs
from ..plan import module_bytes
from ..runtime.dist import DistContext, destroy_dist, maybe_init_dist
from ..runtime.flags import (
    OneLineParser,
    UsageError,
    output_dir_check,
    output_file,
    positive_int,
    report_usage_error,
)
from ..runtime.logs import current_rank, error_line, rank_prefix
from ..runtime.proc import exit_with

__all__ = ["main", "write_folder"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_SHARD_BYTES = 5 * 2**30


def write_folder(folder: Path, blocks: int, dtype: torch.dtype, preset: str = "wan-14b", seed: int = 0) -> int:
    """A Wan pipeline folder: the tiny text encoder, VAE and tokenizer, and a DiT of the benchmark
    preset (Wan-14B-size blocks by default) with ``blocks`` blocks of random weights in ``dtype``,
    sharded as diffusers shards. Returns the DiT's bytes. Tensors are made one at a time (on the
    GPU when there is one), never all at once."""
    pipe = tiny_wan_pipeline(seed=seed)
    # Everything but the DiT the ordinary way (model_index.json, configs, the small parts).
    pipe.save_pretrained(folder)
    # The tiny text encoder's width, so the folder runs as a pipeline (omni-offload generate).
    config = dict(PRESETS[preset].block_config(blocks), text_dim=TINY_TEXT_DIM)
    with init_empty_weights():
        meta = WanTransformer3DModel(**config)
    dit = folder / "transformer"
    for f in dit.glob("diffusion_pytorch_model*"):
        f.unlink()
    meta.save_config(dit)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    files: list[list[str]] = []
    total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            files.append(list(shard))
            save_file(shard, dit / f"part-{len(files):05d}.safetensors", metadata={"format": "pt"})
            shard, shard_bytes = {}, 0

    for name, t in meta.state_dict().items():
        value = (torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
        shard[name] = value.cpu()
        shard_bytes += value.numel() * value.element_size()
        total += value.numel() * value.element_size()
        if shard_bytes >= _SHARD_BYTES:
            flush()
    flush()
    weight_map = {}
    for i, names in enumerate(files, 1):
        final = f"diffusion_pytorch_model-{i:05d}-of-{len(files):05d}.safetensors"
        (dit / f"part-{i:05d}.safetensors").rename(dit / final)
        weight_map.update(dict.fromkeys(names, final))
    (dit / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def _peak_rss() -> tuple[int, int]:
    peak = rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return peak, rss


def _pss() -> int | None:
    """This process's proportional set size: pages shared with other processes count a share
    each (summed over the ranks of a host, a shared host copy counts once, where RSS would
    count it once per rank)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (read on the host, one tensor at a time)."""
    data = t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
    return hashlib.sha256(data.numpy()).hexdigest()


def _weights_digest(module: torch.nn.Module, read: Mapping[str, str] | None = None) -> str:
    """Digest of ``module``'s state dict: every tensor's name, dtype, shape and bytes, in name
    order; ``read`` gives the bytes' digests already taken (a streamed block's, while it ran)."""
    read = read or {}
    whole = hashlib.sha256()
    for name, t in sorted(module.state_dict(keep_vars=True).items()):
        digest = read.get(name) or _tensor_digest(t)
        whole.update(f"{name}\t{t.dtype}\t{tuple(t.shape)}\t{digest}\n".encode())
    return whole.hexdigest()[:16]


@torch.no_grad()
def _digests(transformer: Any, device: torch.device, blocks: Sequence[torch.nn.Module] = ()) -> tuple[str, str]:
    """(forward, weights): digests of one small forward of the DiT and of its weights
    (:func:`_weights_digest`). ``blocks``: the streamed blocks, whose tensors hold their values
    only while they run (under allgather a rank holds a shard of each between forwards): each is
    read as its forward starts, after the ring's own hook put it on the device, whole. Equal
    weights digests mean bitwise equal weights; the forward's may differ on the CPU between
    loads of equal weights (matmul results depend on the tensors' memory alignment there)."""
    names = {id(m): n for n, m in transformer.named_modules()}
    read: dict[str, str] = {}

    def take(module: torch.nn.Module, _args: Any) -> None:
        prefix = names[id(module)] + "."
        read.update((name, _tensor_digest(t)) for name, t in module.state_dict(prefix=prefix, keep_vars=True).items())

    hooks = [b.register_forward_pre_hook(take) for b in blocks]  # after the ring's: registered later
    try:
        x = wan_transformer_inputs(transformer, batch=1, num_frames=1, height=8, width=8)
        x = {k: v.to(device) if torch.is_tensor(v) else v for k, v in x.items()}
        out = transformer(**x)[0]
    finally:
        for h in hooks:
            h.remove()
    forward = hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()[:16]
    return forward, _weights_digest(transformer, read)


def _load(args: argparse.Namespace) -> dict[str, Any]:
    device = resolve_device(None)
    dtype = _DTYPES[args.run_dtype]
    config = {"mode": "layer", "components": ["dit"],
              "layer_options": {"dit": {"weight_transfer": args.transfer}}}
    start = time.perf_counter()
    row: dict[str, Any] = {"mode": args.mode, "transfer": args.transfer}
    if args.mode in ("cold", "ordinary"):
        loaded = load_and_place(str(args.folder), OffloadConfig.parse(config), device=device, dtype=dtype,
                                cold_start=args.mode == "cold")
        if device.type == "cuda":
            torch.cuda.synchronize()
        row["ready_s"] = time.perf_counter() - start
        (ring,) = loaded.handle.summary_rows()
        row.update(load_s=loaded.load_s, place_s=loaded.place_s, dit_fill_s=ring.setup_s,
                   dit_bytes=ring.block_bytes, host_bytes=ring.host_bytes,
                   shared_host_bytes=ring.shared_host_bytes, weight_transfer=ring.weight_transfer,
                   cold_start=loaded.cold_start)
        transformer = loaded.pipeline.transformer
        rings = loaded.handle.rings if loaded.handle is not None else []
        blocks = [layout.module for ring in rings for layout in ring.layouts]
    else:
        pipe = DiffusionPipeline.from_pretrained(str(args.folder), **{dtype_kwarg(): dtype})
        loaded = time.perf_counter()
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module) and name != "transformer":
                module.to(device)
        transformer = pipe.transformer
        block_bytes = module_bytes(transformer.blocks)
        blocks = []  # group offloading keeps every block's weights on the host between uses
        begin = time.perf_counter()
        transformer.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                         offload_type="block_level", num_blocks_per_group=1,
                                         use_stream=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize()
        row.update(load_s=loaded - start, dit_fill_s=time.perf_counter() - begin, dit_bytes=block_bytes,
                   ready_s=time.perf_counter() - start)
    row["dit_fill_gbps"] = row["dit_bytes"] / row["dit_fill_s"] / 1e9
    if args.mode != "peer":  # this project's host buffers: transparent huge pages asked for or not
        row["huge_pages"] = huge_pages_wanted()
    row["peak_rss_gib"], row["rss_gib"] = (v / 2**30 for v in _peak_rss())
    pss = _pss()
    row["pss_gib"] = pss / 2**30 if pss is not None else None
    # "digest" (the forward's) keeps the key of earlier rows.
    row["digest"], row["weights_digest"] = _digests(transformer, device, blocks)
    return row


def _share_gpus() -> DistContext:
    """Join the job over gloo on ``cuda:LOCAL_RANK % GPUs``: more ranks than GPUs, sharing them
    (NCCL refuses two ranks on one GPU; allgather cannot run so, rank-local and shared can)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=local, backend="gloo", device=device)


PROG = "python -m omni_dist_offload.tools.startup"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write a Wan-14B-size pipeline folder with random weights")
    w.add_argument("folder", type=Path)
    w.add_argument("--blocks", type=positive_int, default=40)
    w.add_argument("--preset", default="wan-14b", choices=["wan-14b", "wan-1.3b", "tiny-wan"],
                   help="block size, from the benchmark presets")
    w.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="checkpoint dtype")
    ld = sub.add_parser("load", help="load it one way and report time and memory")
    ld.add_argument("folder", type=Path)
    ld.add_argument("--mode", required=True, choices=["cold", "ordinary", "peer"])
    ld.add_argument("--transfer", default="rank-local", choices=["rank-local", "shared", "allgather"])
    ld.add_argument("--run-dtype", default="bf16", choices=sorted(_DTYPES))
    ld.add_argument("--json", type=Path, default=None, help="append this rank's row here")
    ld.add_argument("--share-gpus", action="store_true",
                    help="under torchrun with more ranks than GPUs: ranks share them (gloo), for the "
                    "host-side figures (fill, page-locking, memory) of rank-local and shared")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """0 when done; 2 for bad flags or a folder that is not there (one line on stderr, before
    anything loads), 1 when the folder does not load (one line, as ``omni-offload generate``)."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "write":  # a file in the way would fail only after the pipeline is built
            output_dir_check("folder", args.folder)
        if args.command == "load":
            if not args.folder.is_dir():
                raise UsageError(f"{str(args.folder)!r}: no such folder; give a pipeline folder "
                                 f"({PROG} write FOLDER makes one)")
            if args.json is not None:
                output_file("--json", args.json)  # every rank appends its row
            if args.share_gpus and not torch.cuda.is_available():
                raise UsageError("--share-gpus places ranks on the GPUs, and none is visible: leave it out "
                                 "on a machine without one")
    except UsageError as exc:
        return report_usage_error(PROG, exc, show=current_rank() == 0)
    if args.command == "write":
        if int(os.environ.get("RANK", "0")) == 0:
            start = time.perf_counter()
            total = write_folder(args.folder, args.blocks, _DTYPES[args.dtype], args.preset)
            print(json.dumps({"wrote": str(args.folder), "dit_bytes": total,
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
        return 0
    ctx = _share_gpus() if args.share_gpus else maybe_init_dist()
    try:
        row = {"rank": ctx.rank, "world": ctx.world_size, **_load(args)}
    except (ModelLoadError, CheckpointError) as exc:
        error_line(f"{rank_prefix()}{PROG} load: error: {exc}")
        return 1
    finally:
        destroy_dist(ctx)
    line = json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    print(line, flush=True)
    if args.json is not None:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    exit_with(main)
