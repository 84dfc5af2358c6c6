"""Side-by-side benchmark: resident, diffusers group offloading and this project's streaming.

Models are real diffusers classes built from config at real block sizes with random weights
(nothing is downloaded), cast the way ``from_pretrained(torch_dtype=bf16)`` casts them. A case is
one preset at one block count and one input shape; per case, in one process, these variants run:

* ``resident``: the whole model on the device;
* ``peer``: diffusers group offloading, ``enable_group_offload(offload_type="block_level",
  num_blocks_per_group=1, use_stream=True)`` (``use_stream=False`` without CUDA, which diffusers
  requires; the output says so), undone after each pass;
* ``rank-local``: ``apply_offload`` streaming every DiT block over this rank's own link;
* ``shared`` (only when asked for, world size > 1): rank-local copies from one host copy the
  ranks of a host share (``weight_transfer: "shared"``);
* ``allgather``: the same with per-rank host shards all-gathered block by block (world size > 1),
  with the default gather (the copy engines where the GPUs can map each other's memory);
* ``allgather-nccl`` (only when asked for): allgather with NCCL's all-gather kernels;
* ``compiled`` and ``compiled-streamed`` (only when asked for): the DiT's blocks compiled with
  regional ``torch.compile`` (``loading.compiling``), resident and streamed rank-local (compiled
  after offloading, as ``Omni(compile=True)`` does); both are compared bitwise with the compiled
  resident model, and ``compiled-streamed`` also as a ratio to ``compiled``. With ``--budget``,
  ``compiled-streamed`` runs once per budget;
* ``fp8-resident``, ``fp8-streamed``, ``fp8-allgather``, ``fp8-layer`` and ``fp8-allgather-layer``
  (only when asked for): weights stored in float8_e4m3fn and computed in the model's dtype.
  ``fp8-resident`` is the baseline, diffusers' ``enable_layerwise_casting`` on the resident model
  (undone after each pass); ``fp8-streamed`` streams rank-local with ``storage_dtype`` (once per
  budget with ``--budget``), ``fp8-allgather`` with allgather; the ``-layer`` variants the same with
  ``upcast: "layer"``. All are compared bitwise with ``fp8-resident`` and reported as a ratio to it.

**Context parallelism.** ``--ulysses-degree N`` / ``--ring-degree N`` (under torchrun) split
each forward's sequence across groups of ``N`` ranks with diffusers' own context parallelism
(:mod:`omni_dist_offload.loading.parallel`), for the resident model and every streamed variant
alike: ratios are to the context-parallel resident model, with each rank's peak device memory
and host memory beside it. The peer and ``--stagger`` do not run so (every rank of a group
must run the same input). Attention heads ``--ulysses-degree`` does not divide, and a case
whose token count (or the preset's text length, where the DiT splits the text) ``ulysses x
ring`` does not divide, are usage errors before any model is built (read from the preset's DiT
on the meta device); a split refused later, at a case's first forward, ends the run with exit
status 2 on every rank, one line, and the cases measured before it in ``--json``
(``meta["stopped"]``).

**Denoising loops.** ``--steps N`` times N steps of a plain Euler loop (the latents move by
the model's output, the timestep falls) instead of one forward; ``--cache SPEC`` (as
``omni-offload --cache``, e.g. ``first-block:0.1``) enables a step cache on the DiT, resets its
state every loop, and reports how many steps ran the last block (``computed_steps``); the floor
of a loop is the resident loop.

**Drift.** Variants run in a mirrored order, each streamed pass applying its offload once and
removing it after::

    resident, peer, rank-local, allgather, allgather, rank-local, peer, resident

Every variant runs twice, once in each half, so its two passes sit at the same mean position in
the run: a linear drift (clocks settling, the GPU warming, the host page cache filling) adds the
same to every variant's pooled timings instead of favouring whichever ran first. Each pass runs
``--warmup`` untimed forwards (the first forward after applying an offload starts cold) and then
``--repeats`` timed ones; a variant's figure is the median of its pooled timed forwards, CUDA
events on a GPU, the wall clock elsewhere. Under torchrun every rank runs the same schedule in
lockstep and each figure is the slowest rank's median: the JSON keeps every rank's raw timings,
``timings_ms_per_rank`` (in rank order) beside ``timings_ms`` (rank 0's), ``forward_ms`` is the
largest of their medians and ``overhead`` that over the resident row's ``forward_ms`` (both
slowest-rank medians, which may come from different ranks); ``meta["figures"]`` in the file
says how each figure derives from them. ``--stagger`` gives rank ``r`` the
``(k + r)``-th shape in the case where rank 0 runs the ``k``-th (``--frames 81 17``: one rank at 81
frames while the other runs 17, then the other way round), and reports every rank's own figures,
one row each: transfers that let ranks run different work (rank-local, shared) measured as a
data-parallel job runs them (on one rank there is nothing to stagger: a note says so).

**Interleaved.** ``--interleave`` holds every variant at once instead, each as its own copy of
the model (offloaded once, removed at the end), and runs ``--repeats`` rounds of one timed
forward of each, in an order that turns every round, after ``--warmup`` forwards of each (the
device idles between two variants, so one variant's copies never run beside another's compute).
Each timed forward follows an untimed one of the same variant, back to back, as in a pass: the
copies a ring issues at the end of a forward for the next one (its first blocks) are waited for
by the timed forward, as they are by every forward of a generation. A
variant's overhead is then the median over rounds of its forward over the resident forward of
the same round (under torchrun, the largest such median over the ranks, each from its own
``timings_ms_per_rank``): where the forward is bound by the host launching kernels (Flux at 512 px), the
host's speed changes from one second to the next, and passes measure when they ran more than
what ran. It needs device memory for the copies' non-block weights and host memory for each
streamed copy; peak device memory is each variant's own (its weights on the device and its
forward's activations) beside what every variant shares (inputs, references). With
``--stagger`` each rank alternates the variants on its own shape. Not with context
parallelism, ``--cache`` or ``--memory-fraction``.

**Floor.** Per block, a streamed forward cannot beat ``max(compute, block bytes / bandwidth)``,
with the block's resident compute time measured by timing each block of the resident model, and
the pinned host-to-device bandwidth measured at start (allgather: each rank moves 1/N of the
bytes over its link). The floor of a variant is the resident forward with every block's compute
replaced by that maximum; on the CPU (no bandwidth) it is the resident time.

Reported per variant: forward time, overhead (/ resident), floor, forward / floor, peak device
memory and host bytes per rank (rank 0's in the table; under torchrun every rank's in the JSON),
setup time, and whether the output is bitwise equal to resident (the peer's equality is
reported, not required; the exit status is 1 if a variant of this project differs). Output: a table on stdout, ``--json``, ``--png`` (overhead per case and
variant) and ``--timeline`` (one traced forward of the first case, compute and copy lanes per
block). Only rank 0 prints and writes; the folders of these paths are made, and the paths
checked, before any model is built.

    omni-offload bench --preset wan-14b --blocks 8 --frames 81 17 --json wan14b.json --png wan14b.png
    omni-offload bench --preset flux-12b --blocks 19 --px 1024 512 --timeline flux-timeline.png
    NGPU=2 launch/bench.sh --preset flux-12b --blocks 19 --px 1024     # torchrun, allgather too
    NGPU=2 launch/bench.sh --preset wan-14b --blocks 8 --frames 81 --height 720 --width 1280 \
        --ulysses-degree 2 --variants rank-local allgather           # context parallel, both split
    omni-offload bench --preset tiny-wan --frames 5 --height 32 --width 32 --png out.png  # CPU
    omni-offload bench --preset wan-14b --blocks 8 --frames 81 --steps 10 --cache first-block:0.1 \
        --variants rank-local                                            # a step cache

``python -m omni_dist_offload.tools.bench`` is the same command.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import diffusers
import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry
from diffusers.hooks.group_offloading import _is_group_offload_enabled
from torch import nn

from ..apply import apply_offload
from ..budget import MEASURED_FORWARD
from ..config import OffloadConfig
from ..hostmem import HostBuffer
from ..layout import layout_block
from ..loading.adapters import AdapterError, CacheSpec, enable_cache
from ..loading.compiling import compile_dits, compile_seconds, uncompile
from ..loading.parallel import (
    ContextParallel,
    ContextParallelError,
    PlannedSplit,
    check_attention_backend,
    check_cache,
    check_ranks,
    disable_context_parallel,
    enable_context_parallel,
    planned_splits,
)
from ..models import PRESETS, Preset, build_model, case_inputs
from ..plan import discover, module_bytes
from ..residency import format_bytes, image_slot_bytes, min_budget, parse_bytes
from ..runtime.dist import destroy_dist, maybe_init_dist
from ..runtime.flags import (
    OneLineParser,
    UsageError,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
    report_usage_error,
    user_path,
)
from ..runtime.logs import current_rank, error_line, rank_prefix
from ..runtime.proc import exit_with
from ..storage import cast_tensors, unhook_layerwise_casting
from ..transfer import RankLocalTransfer, TransferStreams, gather_transfer
from ..transfer.groups import ComponentFacts, GroupSession
from ..transfer.sharding import plan_shards
from .timeline import draw_budget_sweep, draw_overhead, draw_timeline, image_formats

__all__ = ["VARIANTS", "BenchOptions", "CaseResult", "PeerOffload", "floor_ms", "main", "run_case", "schedule"]

#: Streamed variants, in the order of the first half of the schedule.
VARIANTS = ("peer", "rank-local", "shared", "allgather", "allgather-nccl", "compiled", "compiled-streamed",
            "fp8-resident", "fp8-streamed", "fp8-allgather", "fp8-layer", "fp8-allgather-layer")
#: Variants with the DiT's blocks compiled (regional ``torch.compile``): resident, and streamed
#: rank-local; compared bitwise with the compiled resident model.
_COMPILED = ("compiled", "compiled-streamed")
#: Variants storing the weights in 8 bits; compared bitwise with ``fp8-resident``.
_FP8 = ("fp8-resident", "fp8-streamed", "fp8-allgather", "fp8-layer", "fp8-allgather-layer")
#: The streamed ones among them.
_FP8_STREAMED = _FP8[1:]
#: The 8-bit format of the fp8 variants.
FP8_STORAGE = "float8_e4m3fn"
#: Variants that exist only under torchrun with several ranks.
_MULTI_RANK = ("shared", "allgather", "allgather-nccl", "fp8-allgather", "fp8-allgather-layer")
DEFAULT_VARIANTS = ("peer", "rank-local", "allgather")
DEFAULT_CHUNK_MIB = (16, 32, 64, 128, 0)
"""``--transfer-mib``'s allgather chunk sizes when ``--chunk-mib`` is not given (0: whole block)."""
#: Variants that hold no device budget: with ``--budget`` they run once, as without it.
_NO_BUDGET = ("peer", "compiled", "fp8-resident")
#: The shape flags' defaults, filled in by :func:`_check_args`: the parser's are None so that a
#: flag given for the other kind of preset is seen (and refused) instead of silently unused.
_SHAPE_DEFAULTS = {"frames": (81, 17), "height": 480, "width": 832, "px": (1024,)}
#: The flags that size a case, for each kind of preset.
_VIDEO_SHAPE, _IMAGE_SHAPE = ("frames", "height", "width"), ("px",)
RESIDENT = "resident"
#: The flags that name output files (written by rank 0).
_OUTPUTS = ("json", "png", "timeline")


@dataclasses.dataclass
class CaseResult:
    """One variant of one case. Times in ms, memory in MiB (``2**20`` bytes)."""

    preset: str
    blocks: int
    shape: str
    variant: str
    forward_ms: float
    overhead: float
    """forward_ms / the resident forward_ms of the same case."""
    floor_ms: float
    peak_device_mib: float
    host_mib: float
    """Host memory this rank holds for the variant's offloaded weights."""
    setup_s: float
    bitwise_equal: bool
    floor_overhead: float = 1.0
    """floor_ms / the resident forward_ms."""
    to_floor: float = 1.0
    """forward_ms / floor_ms: 1.0 is as fast as the link and compute allow."""
    weight_transfer: str = RESIDENT
    """What actually ran: resident, group-offload, rank-local or allgather (after any fallback)."""
    note: str = ""
    timings_ms: list[float] = dataclasses.field(default_factory=list)
    """The timed forwards of rank 0 (``--stagger``: of ``rank``), both passes pooled."""
    timings_ms_per_rank: list[list[float]] | None = None
    """Every rank's ``timings_ms``, in rank order (one list with one rank; None with
    ``--stagger``, where each row is one rank's own): ``forward_ms`` is the largest of their
    medians, and ``overhead`` is ``forward_ms`` over the resident row's (``--interleave``: the
    largest over ranks of the median per-round ratio to the resident timings of the same rank).
    The JSON's ``meta["figures"]`` says the same."""
    block_compute_ms: list[float] = dataclasses.field(default_factory=list)
    """The case's blocks' compute in the resident model, per block (median of up to 3
    forwards, marks around each block; zeros with ``--steps`` above 1): with ``block_bytes``,
    what ``floor_ms`` is made of (``meta["figures"]["floor_ms"]``)."""
    block_bytes: list[int] = dataclasses.field(default_factory=list)
    """The case's blocks' bytes as streamed (the compute dtype's), per block."""
    predicted_ratio: float | None = None
    """Budget variants: the residency plan's predicted forward / its resident forward (both
    from the ring's own measurements)."""
    predicted_ms: float | None = None
    """Budget variants: the plan's predicted forward, to compare with ``forward_ms``."""
    device_budget: int | None = None
    """Budget variants: the budget in bytes (after ``auto`` and the two-slot minimum)."""
    resident_blocks: int = 0
    kept_blocks: int = 0
    """Budget variants: streamed blocks keeping their first tensors on the device."""
    slots: int = 0
    """Device slots of the ring (budget variants: as planned)."""
    streamed_mib: float = 0.0
    """Block bytes each forward copies into slots (what a budget leaves off the device); what
    the copies cost the model's own kernels is ``tools/contention.py --mib`` this."""
    compile_s: float = 0.0
    """Compiled variants: torch's compile time in the variant's first pass (warm-up)."""
    vs_compiled: float | None = None
    """Compiled-streamed variants: forward_ms / the ``compiled`` (resident) variant's."""
    vs_fp8: float | None = None
    """The streamed fp8 variants: forward_ms / the ``fp8-resident`` variant's."""
    computed_steps: int | None = None
    """``--steps`` loops: how many steps of the resident reference loop ran the last block (all
    of them without ``--cache``); every variant's output is compared bitwise with that loop's."""
    rank: int | None = None
    """``--stagger``: the rank whose figures these are; None: the slowest rank's."""
    peak_device_mib_ranks: list[float] | None = None
    """Under torchrun (not ``--stagger``): every rank's ``peak_device_mib``, by rank (the table's
    column is rank 0's)."""
    host_mib_ranks: list[float] | None = None
    """Under torchrun (not ``--stagger``): every rank's ``host_mib``, by rank."""
    bitwise_equal_ranks: list[bool] | None = None
    """Under torchrun (not ``--stagger``): every rank's own bitwise check, by rank
    (``bitwise_equal`` is true only where every rank's is)."""
    block_mib: float | None = None
    """The case's block bytes as the ring lays them out (alignment included): what a
    ``--budget`` percent is of."""
    plans: list[dict[str, Any]] | None = None
    """Budget variants: each pass's residency plan (resident_blocks, kept_blocks, slots,
    predicted_ms, predicted_ratio), in pass order. The row's resident_blocks, kept_blocks and
    slots are the first pass's; forward_ms pools every pass's timings, whichever plan ran."""
    plans_differ: bool = False
    """Budget variants: the passes ran different plans (a planner's measured forward differed),
    so the pooled forward_ms mixes them."""
    fell_back: bool = False
    """The variant asked for a transfer that did not run (allgather fell back to rank-local):
    the row's figures are ``weight_transfer``'s, not the variant's."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """One ``--budget`` value: a share of the case's block bytes, a size, or ``auto``."""

    label: str
    percent: float | None = None
    nbytes: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Budget":
        if text.strip().lower() == "auto":
            return cls("auto")
        number = text.removesuffix("%")
        try:
            percent = float(number)
        except ValueError:
            try:
                return cls(text, nbytes=parse_bytes(text, "--budget"))
            except ValueError:
                raise BenchUsageError(f"--budget {text!r}: give a percentage of the block bytes (60, 60%), "
                                      "a size (24GiB) or auto") from None
        if not 0 <= percent <= 100:
            raise BenchUsageError(f"--budget {text!r}: a percentage is from 0 to 100")
        return cls(f"{percent:g}%", percent=percent)

    def config_value(self, block_nbytes: Sequence[int], least: int | None = None) -> tuple[int | str, str]:
        """The ``device_budget`` for a case with these block sizes, and a note when the
        two-slot minimum (``least``: the ring's own, default two of the largest block) raised it."""
        if self.percent is None and self.nbytes is None:
            return "auto", ""
        want = self.nbytes if self.nbytes is not None else int(self.percent / 100 * sum(block_nbytes))
        least = least if least is not None else min_budget(block_nbytes, block_nbytes)
        if want < least:
            return least, f"{self.label} is below two slots of the largest block: ran at {format_bytes(least)}"
        return want, ""


@dataclasses.dataclass(kw_only=True)
class BenchOptions:
    """How to run every case."""

    device: torch.device
    dtype: torch.dtype
    warmup: int = 2
    """Untimed forwards at the start of every pass."""
    repeats: int = 5
    """Timed forwards per pass (each variant runs two passes)."""
    bandwidth: float | None = None
    """Pinned host-to-device bytes/s; None on the CPU (the floor is then the resident time)."""
    world: int = 1
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    trace_variant: str | None = None
    """Run one more, traced, forward of this variant for ``--timeline``."""
    budgets: tuple[Budget, ...] = ()
    """Run each of our variants once per budget (``rank-local@60%``) instead of streaming every block."""
    stagger: bool = False
    """Each rank its own shape of the case at a time, and its own figures (``--stagger``)."""
    memory_fraction: float | None = None
    """Cap the allocator at this fraction of the device while budget variants run (what
    ``device_budget: "auto"`` sees); resident and the peer run uncapped."""
    lora: int | None = None
    """Add a LoRA of this rank (random weights) on every attention projection of the DiT before
    any variant runs; resident and streamed variants then all run with it."""
    lora_fused: bool = False
    """With ``lora``: fuse it into the base weights (``fuse_lora``) before any variant runs."""
    steps: int = 1
    """Time a denoising loop of this many steps instead of one forward (:func:`denoising_loop`)."""
    cache: CacheSpec | None = None
    """A step cache on the DiT for every variant (with ``steps``)."""
    computed_steps: int | None = None
    """Set by the run: steps of the resident reference loop that ran the last block."""
    context_parallel: ContextParallel | None = None
    """Split every forward across groups of ranks (diffusers' context parallelism), for
    resident and streamed variants alike."""
    interleave: bool = False
    """Hold every variant at once (a copy of the model each) and alternate their forwards round
    by round (``--interleave``, :func:`_interleaved`)."""


#: The attention projections a ``--lora`` adapter targets (diffusers' names, Wan and Flux).
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def add_lora(model: nn.Module, rank: int, fused: bool, seed: int = 0) -> None:
    """A rank-``rank`` LoRA with random (seeded) A and B on every attention projection; fused
    into the base weights when ``fused``. Needs peft."""
    from peft import LoraConfig  # optional (the lora extra): main() checked it is installed
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(LORA_TARGETS),
                                     init_lora_weights=False))
    if fused:
        model.fuse_lora()


def _last_child(blocks: Sequence[nn.Module]) -> nn.Module:
    """A module inside the last block that runs only when the block's own forward does."""
    for child in blocks[-1].children():
        if any(True for _ in child.parameters()):
            return child
    return blocks[-1]


def denoising_loop(model: nn.Module, inputs: Mapping[str, Any], steps: int,
                   ran: list[int] | None = None) -> Callable[[], torch.Tensor]:
    """``steps`` Euler steps from ``inputs``: the latents move by ``output / steps``, the
    timestep falls linearly to ``1 / steps`` of its start. A step cache on ``model`` gets a
    ``cache_context`` per step and a fresh state per loop, as a pipeline gives it."""
    cached = callable(getattr(model, "cache_context", None)) and getattr(model, "is_cache_enabled", False)
    start = inputs["timestep"]

    def loop() -> torch.Tensor:
        x = inputs["hidden_states"]
        for k in range(steps):
            t = start * ((steps - k) / steps)
            kwargs = {**inputs, "hidden_states": x, "timestep": t}
            if cached:
                with model.cache_context("cond"):
                    out = model(**kwargs)[0]
            else:
                out = model(**kwargs)[0]
            x = x - out / steps
        if cached:
            model._reset_stateful_cache()
        return x

    return loop


@dataclasses.dataclass
class _Pass:
    """What one pass of one variant measured."""

    times: list[float]
    equal: bool
    peak_mib: float
    setup_s: float = 0.0
    host_bytes: int = 0
    transfer: str = RESIDENT
    note: str = ""
    outside_allocator_bytes: int = 0
    """Device memory the variant holds outside PyTorch's allocator (added to ``peak_mib``)."""
    predicted_ratio: float | None = None
    predicted_ms: float | None = None
    device_budget: int | None = None
    resident_blocks: int = 0
    kept_blocks: int = 0
    slots: int = 0
    streamed_bytes: int = 0
    compile_s: float = 0.0
    fell_back: bool = False
    """The ring ran another transfer than the variant asked for (``transfer`` is what ran)."""


# -- timing --------------------------------------------------------------------------------
def _timed(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int,
           reference: torch.Tensor | None = None) -> tuple[list[float], bool]:
    """Milliseconds per timed call (CUDA events on the GPU, wall clock after the call elsewhere),
    and whether every call's result, warm-up calls included, equals ``reference`` bitwise (not
    only the last: a copy race, a cold first forward or the forwards up to a residency re-plan
    would show in some forwards only; True without a reference). Each comparison runs after
    its call's end was waited for, outside the timed span, and holds no output past it (a kept
    output would add to the peak device memory the bench reports). Warm-up calls run in the
    same loop as timed ones: each waits for its own end on the compute stream, not for the whole
    device (copies already issued for the next call go on, as they do between timed calls), so a
    forward the residency planner measures during warm-up sees the gap between forwards that the
    timed ones see."""
    equal = True
    times = []
    for k in range(warmup + repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            out = fn()
            ms = (time.perf_counter() - t0) * 1e3
        if k >= warmup:
            times.append(ms)
        if reference is not None:
            equal = bool(torch.equal(out, reference)) and equal
        del out
    return times, equal


def _time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> list[float]:
    return _timed(fn, device, warmup, repeats)[0]


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Measured pinned host-to-device bandwidth in bytes/s (None on the CPU)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = statistics.median(_time(lambda: dst.copy_(src, non_blocking=True), device, 2, 5))
    return nbytes / (ms / 1e3)


def _block_compute_ms(blocks: Sequence[nn.Module], forward: Callable[[], Any], device: torch.device,
                      runs: int) -> list[float]:
    """Each block's compute time in the resident model, median over ``runs`` forwards. Marks
    are taken around every block's forward (events on the GPU, read after the forward)."""
    cuda = device.type == "cuda"
    marks: list[list[Any]] = [[] for _ in blocks]

    def mark(i: int, *_):
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks[i].append(event)
        else:
            marks[i].append(time.perf_counter())

    hooks = [h for i, b in enumerate(blocks) for h in (
        b.register_forward_pre_hook(lambda *a, i=i: mark(i)), b.register_forward_hook(lambda *a, i=i: mark(i)))]
    try:
        for _ in range(runs):
            forward()
    finally:
        for h in hooks:
            h.remove()
    _sync(device)
    per_block = []
    for m in marks:
        pairs = zip(m[0::2], m[1::2])
        per_block.append(statistics.median(a.elapsed_time(b) if cuda else (b - a) * 1e3 for a, b in pairs))
    return per_block


def floor_ms(resident_ms: float, compute_ms: Sequence[float], block_bytes: Sequence[int],
             bandwidth: float | None, share: int = 1) -> float:
    """The resident forward with each block's compute replaced by max(compute, bytes / bandwidth);
    ``share`` ranks split each block's bytes (allgather)."""
    if not bandwidth:
        return resident_ms
    link = [b / share / bandwidth * 1e3 for b in block_bytes]
    return resident_ms + sum(max(c, l) - c for c, l in zip(compute_ms, link, strict=True))


# -- the variants ----------------------------------------------------------------------------
def schedule(variants: Sequence[str], world: int = 1, budgets: Sequence[Budget] = ()) -> list[str]:
    """Mirrored order: resident, the streamed variants, the same reversed, resident again (see
    the module docstring: each variant's two passes share a mean position, so drift cancels).
    With budgets, each of our variants runs once per budget: ``rank-local@60%``."""
    streamed = [v for v in VARIANTS if v in variants and (v not in _MULTI_RANK or world > 1)]
    if budgets:
        streamed = [f"{v}@{b.label}" if v not in _NO_BUDGET else v for v in streamed
                    for b in (budgets if v not in _NO_BUDGET else budgets[:1])]
    return [RESIDENT, *streamed, *reversed(streamed), RESIDENT]


def _offload_config(variant: str, device_budget: int | str | None = None) -> dict[str, Any]:
    transfer = variant.split("@")[0]
    dit: dict[str, Any] = {"mode": "layer", "components": ["dit"]}
    if transfer in ("allgather", "shared"):
        dit["layer_options"] = {"dit": {"weight_transfer": transfer}}
    elif transfer == "allgather-nccl":
        dit["layer_options"] = {"dit": {"weight_transfer": "allgather", "gather": "nccl"}}
    elif transfer == "fp8-streamed":
        dit["layer_options"] = {"dit": {"storage_dtype": FP8_STORAGE}}
    elif transfer == "fp8-allgather":
        dit["layer_options"] = {"dit": {"weight_transfer": "allgather", "storage_dtype": FP8_STORAGE}}
    elif transfer == "fp8-layer":
        dit["layer_options"] = {"dit": {"storage_dtype": FP8_STORAGE, "upcast": "layer"}}
    elif transfer == "fp8-allgather-layer":
        dit["layer_options"] = {"dit": {"weight_transfer": "allgather", "storage_dtype": FP8_STORAGE, "upcast": "layer"}}
    if device_budget is not None:
        dit["device_budget"] = device_budget
    return dit


def _apply_ours(model: nn.Module, variant: str, device: torch.device, trace: bool = False,
                device_budget: int | str | None = None):
    # trace=False beats OMNI_OFFLOAD_TRACE: timed passes never carry trace marks.
    return apply_offload(model, _offload_config(variant, device_budget), device=device, trace=trace)


def layerwise_casting(model: nn.Module) -> Callable[[], None]:
    """diffusers' ``enable_layerwise_casting`` at :data:`FP8_STORAGE`, computing in the model's
    dtype; returns the undo (diffusers has none: its hooks come off and the original tensors go
    back, so the next pass starts from the same model)."""
    originals = [(t, t.data) for t in (*model.parameters(), *model.buffers())]
    model.enable_layerwise_casting(storage_dtype=getattr(torch, FP8_STORAGE), compute_dtype=model.dtype)

    def undo() -> None:
        for module in model.modules():
            unhook_layerwise_casting(module)
        for t, data in originals:
            t.data = data

    return undo


class PeerOffload:
    """diffusers group offloading as the peer: applied with ``enable_group_offload``, undone by
    removing its hooks (diffusers has no public remover) and moving the model back."""

    # The hooks that enable_group_offload installs (diffusers.hooks.group_offloading).
    _HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        # use_stream needs CUDA (diffusers raises for a CPU onload device).
        self.use_stream = device.type == "cuda"
        model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1,
                                   use_stream=self.use_stream)

    @property
    def note(self) -> str:
        return "" if self.use_stream else "use_stream=False (diffusers needs CUDA for streams)"

    def host_bytes(self) -> int:
        """Bytes of the host copies the peer keeps (every offloaded group's tensors)."""
        seen: dict[int, torch.Tensor] = {}
        for group in self._groups():
            tensors = list(group.cpu_param_dict.values()) or [
                *[t for m in group.modules for t in (*m.parameters(), *m.buffers())],
                *group.parameters, *group.buffers]
            seen.update((id(t), t) for t in tensors)
        return sum(t.numel() * t.element_size() for t in seen.values())

    def remove(self) -> None:
        registry = HookRegistry.check_if_exists_or_initialize(self.model)
        for name in self._HOOKS:
            registry.remove_hook(name, recurse=True)
        if _is_group_offload_enabled(self.model):
            raise RuntimeError(
                f"diffusers group offloading is still enabled on {type(self.model).__name__} after "
                f"removing its hooks {self._HOOKS}: this diffusers version names them otherwise; "
                "update PeerOffload._HOOKS from diffusers/hooks/group_offloading.py.")
        self.model.to(self.device)
        left = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
                if t.device.type != self.device.type]
        if left:
            raise RuntimeError(f"after undoing group offloading, {left[0]} is on the wrong device "
                               f"(and {len(left) - 1} more): expected {self.device}.")
        if self.use_stream:
            # The peer's pinned copies (Tensor.pin_memory) go back to torch's host allocator,
            # which keeps them cached; give them back so later passes start from the same host.
            gc.collect()
            getattr(torch._C, "_host_emptyCache", lambda: None)()

    def _groups(self) -> list[Any]:
        groups: dict[int, Any] = {}
        for module in self.model.modules():
            registry = getattr(module, "_diffusers_hook", None)
            hook = registry.get_hook(self._HOOKS[0]) if registry is not None else None
            if hook is not None:
                groups[id(hook.group)] = hook.group
        return list(groups.values())


def _run_pass(variant: str, model: nn.Module, forward: Callable[[], Any], reference: torch.Tensor,
              opts: BenchOptions, budgets: Mapping[str, tuple[int | str, str]] | None = None) -> _Pass:
    """Apply the variant (timed as setup), run warm-up and timed forwards, undo it. A budget
    variant warms up past its measured forward, so the timed forwards run the final plan."""
    label = variant.split("@")[1] if "@" in variant else None
    device_budget, budget_note = (budgets or {}).get(label, (None, ""))
    compiling = compile_seconds()
    capped = label is not None and opts.memory_fraction is not None
    if capped:  # the model leaves the device first, so the cap holds only what the variant puts there
        model.cpu()
        _empty(opts.device)
        torch.cuda.set_per_process_memory_fraction(opts.memory_fraction, opts.device)
    t0 = time.perf_counter()
    try:
        undo, info, handle = _apply_variant(variant, model, opts.device, device_budget)
    except BaseException:
        if capped:
            torch.cuda.set_per_process_memory_fraction(1.0, opts.device)
            model.to(opts.device)
        raise
    _sync(opts.device)
    setup_s = time.perf_counter() - t0 if variant != RESIDENT else 0.0
    try:
        _reset_peak(opts.device)
        warmup = opts.warmup + (MEASURED_FORWARD if label is not None else 0)
        times, equal = _timed(forward, opts.device, warmup, opts.repeats, reference)
        if handle is not None:
            info = {**info, **_plan_info(handle)}
        if opts.world > 1:
            # Every rank has read what it holds before any undoes its pass (a shared copy's
            # share grows as the other ranks leave it), and the ranks' passes stay side by side.
            dist.barrier()
        after = compile_seconds()
        if compiling is not None and after is not None:
            info["compile_s"] = after - compiling
        peak = _peak(opts.device) + info.get("outside_allocator_bytes", 0) / 2**20
    finally:
        if capped:  # remove() brings the blocks back to the device: lift the cap first
            torch.cuda.set_per_process_memory_fraction(1.0, opts.device)
        undo()
    _empty(opts.device)
    if budget_note:
        info["note"] = "; ".join(n for n in (info.get("note"), budget_note) if n)
    return _Pass(times=times, equal=equal, peak_mib=peak, setup_s=setup_s, **info)


def _plan_info(handle) -> dict[str, Any]:
    """What the ring holds once its plan is final."""
    (row,) = handle.summary_rows()
    # The copy-engine gather's slots are CUDA symmetric memory, allocated outside PyTorch's
    # caching allocator, whose peak the table reports: count them on top.
    outside = row.device_slot_bytes if row.gather == "copy-engine" else 0
    ring = handle.rings[0]
    measured = ring.plan is not None and ring.plan.measured
    return {"host_bytes": row.host_bytes, "outside_allocator_bytes": outside,
            "predicted_ratio": row.predicted_ratio, "device_budget": row.device_budget,
            "predicted_ms": ring.plan.predicted_ms if measured else None,
            "resident_blocks": len(row.resident_blocks), "kept_blocks": len(row.kept_blocks),
            "slots": handle.rings[0].num_slots,
            "streamed_bytes": row.block_bytes}


def _interleaved(model: nn.Module, forward_of: Callable[[nn.Module], Callable[[], torch.Tensor]],
                 reference_of: Callable[[str], torch.Tensor],
                 budgets_of: Callable[[str], Mapping[str, tuple[int | str, str]]],
                 opts: BenchOptions) -> dict[str, list[_Pass]]:
    """Every variant at once, each on its own copy of ``model`` (resident: ``model`` itself),
    timed one forward each per round, in an order that turns every round and reverses every
    other one (see the module docstring). One :class:`_Pass` per variant."""
    dev = opts.device
    variants = list(dict.fromkeys(schedule(opts.variants, opts.world, opts.budgets)))
    allocated = (lambda: torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else (lambda: 0)
    # What every variant shares on the device (inputs, references): all but the model's own tensors.
    common = allocated() - sum(t.nbytes for t in (*model.parameters(), *model.buffers()) if t.device == dev)
    held: dict[str, int] = {}
    runs: dict[str, Callable[[], torch.Tensor]] = {}  # each holds its copy of the model
    undos: dict[str, Callable[[], None]] = {}
    infos: dict[str, dict] = {}
    handles: dict[str, Any] = {}
    # Every forward is compared with the reference, the untimed ones included: a variant wrong
    # only on its cold first forwards, or up to its residency re-plan, is not equal.
    equal: dict[str, bool] = dict.fromkeys(variants, True)

    def run_checked(variant: str, fn: Callable[[], torch.Tensor]) -> None:
        out = fn()
        equal[variant] = bool(torch.equal(out, reference_of(variant))) and equal[variant]

    undo_failures: dict[str, str] = {}
    try:
        for variant in variants:
            before = allocated()
            copy_ = model if variant == RESIDENT else copy.deepcopy(model)
            label = variant.split("@")[1] if "@" in variant else None
            device_budget, budget_note = budgets_of(variant).get(label, (None, "")) if label else (None, "")
            t0 = time.perf_counter()
            undo, info, handle = _apply_variant(variant, copy_, dev, device_budget, restore=False)
            undos[variant] = undo
            _sync(dev)
            info["setup_s"] = time.perf_counter() - t0 if variant != RESIDENT else 0.0
            if budget_note:
                info["note"] = "; ".join(n for n in (info.get("note"), budget_note) if n)
            fn = forward_of(copy_)
            for _ in range(opts.warmup + (MEASURED_FORWARD if label is not None else 0)):
                run_checked(variant, fn)
            _sync(dev)
            runs[variant], infos[variant], handles[variant] = fn, info, handle
            held[variant] = allocated() - before if variant != RESIDENT else allocated() - common
        times: dict[str, list[float]] = {v: [] for v in variants}
        activations: dict[str, float] = dict.fromkeys(variants, 0.0)
        for r in range(opts.repeats):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order if r % 2 == 0 else order[::-1]:
                _reset_peak(dev)
                base = allocated()
                # Two forwards back to back, the second timed: a ring's last blocks prefetch the
                # next forward's first on the copy stream, past the end event. In passes the next
                # forward waits for them; timed alone after an idle device, a copy-bound forward
                # would leave them out (up to a block's copy) and beat the link.
                run_checked(variant, runs[variant])
                (ms,), same = _timed(runs[variant], dev, 0, 1, reference_of(variant))
                times[variant].append(ms)
                equal[variant] = equal[variant] and same  # every round's forward, not only the last
                activations[variant] = max(activations[variant], _peak(dev) * 2**20 - base)
                # Every stream, not only the forward's: the copies a ring issues at the end of its
                # forward (the next forward's first blocks) finish before another copy of the model
                # runs, rather than beside its compute.
                _sync(dev)
        passes: dict[str, list[_Pass]] = {}
        for variant in variants:
            info = infos[variant]
            if handles[variant] is not None:
                info = {**info, **_plan_info(handles[variant])}
            outside = info.get("outside_allocator_bytes", 0)
            peak = (common + held[variant] + activations[variant] + outside) / 2**20 if dev.type == "cuda" else 0.0
            passes[variant] = [_Pass(times=times[variant], equal=equal[variant],
                                     peak_mib=peak, **info)]
        if opts.world > 1:
            dist.barrier()  # every rank has read what it holds before any undoes a variant
    finally:
        # Undo and let go of one copy at a time: an undo brings its copy's blocks back to the
        # device whole, so undoing every copy while all are still referenced would hold one
        # whole model per variant at the last undo (out of memory after every round was
        # measured). Each copy's every reference (its forward, handle and undo) is dropped and
        # the cache emptied before the next undo, so at most one restored copy (beside ``model``)
        # exists at a time. An undo that fails is reported, not raised: the figures were measured.
        copy_ = fn = undo = handle = None
        for variant in reversed(list(undos)):
            runs.pop(variant, None)
            handles.pop(variant, None)
            undo = undos.pop(variant)
            try:
                undo()
            except Exception as e:  # noqa: BLE001 - reported with the row, the others still undone
                undo_failures[variant] = f"{type(e).__name__}: {e}"
            undo = None
            gc.collect()
            _empty(dev)
    for variant, failure in undo_failures.items():
        note = f"undo failed after measuring ({failure}): the figures stand, the copy may hold device memory"
        error_line(f"bench: {variant}: {note}")
        pass_ = passes[variant][0]
        pass_.note = "; ".join(n for n in (pass_.note, note) if n)
    return passes


def _apply_variant(variant: str, model: nn.Module, device: torch.device,
                   device_budget: int | str | None = None, restore: bool = True) -> tuple[Callable[[], None], dict, Any]:
    """Apply one variant; returns how to undo it, what it holds (host bytes, what ran) and our
    offload handle (None for resident and the peer). ``restore=False``: the model is a copy
    that goes after the variant, so undoing need not bring back its original weights."""
    if variant == RESIDENT:
        return (lambda: None), {}, None
    if variant == "peer":
        peer = PeerOffload(model, device)
        return peer.remove, {"host_bytes": peer.host_bytes(), "transfer": "group-offload", "note": peer.note}, None
    if variant == "compiled":
        compile_dits(model, "regional")
        return (lambda: uncompile(model)), {"transfer": RESIDENT, "note": "regional torch.compile"}, None
    if variant == "fp8-resident":
        return layerwise_casting(model), {"transfer": RESIDENT, "note": f"diffusers layerwise casting ({FP8_STORAGE})"}, None
    saved = None
    if variant.startswith(_FP8_STREAMED) and restore:
        # remove() leaves 8-bit-stored weights at their 8-bit values (the offloaded model's
        # state): a host copy of the originals lets the next pass start from the same model.
        saved = [(t, t.detach().to("cpu", copy=True)) for t in (*model.parameters(), *model.buffers())]
    handle = _apply_ours(model, variant, device, device_budget=device_budget)
    if saved is not None:
        def undo() -> None:
            handle.remove()
            with torch.no_grad():
                for t, data in saved:
                    t.data.copy_(data)
    elif variant.startswith("compiled-streamed"):
        compile_dits(model, "regional")  # after offloading, as Omni(compile=True) does

        def undo() -> None:
            uncompile(model)
            handle.remove()
    else:
        undo = handle.remove
    (row,) = handle.summary_rows()
    note = f"fell back to {row.weight_transfer}: {row.fallback_reason}" if row.fallback_reason else ""
    if row.gather:
        note = f"gather: {row.gather}" + (f"; {note}" if note else "")
    return undo, {"transfer": row.weight_transfer, "note": note, "fell_back": bool(row.fallback_reason),
                  **_plan_info(handle)}, handle


# -- one case ------------------------------------------------------------------------------
@dataclasses.dataclass
class CaseRun:
    """A case's results and, when asked for, the traced forward for the timeline."""

    results: list[CaseResult]
    trace: list[dict[str, Any]] | None = None


def run_case(preset_name: str, blocks: int, shape: tuple[int, ...], *, device: torch.device,
             dtype: torch.dtype, warmup: int, repeats: int, bandwidth: float | None,
             world: int = 1, variants: tuple[str, ...] = DEFAULT_VARIANTS) -> list[CaseResult]:
    """All variants of one case in this process; ``shape`` is (frames, height, width) for video
    presets and (px,) for image presets."""
    opts = BenchOptions(device=device, dtype=dtype, warmup=warmup, repeats=repeats,
                        bandwidth=bandwidth, world=world, variants=tuple(variants))
    return measure_case(preset_name, blocks, shape, opts).results


def measure_case(preset_name: str, blocks: int, shape: tuple[int, ...], opts: BenchOptions) -> CaseRun:
    """Run the schedule of one case (and the traced forward if ``opts.trace_variant``)."""
    preset = PRESETS[preset_name]
    model = build_model(preset, blocks, opts.device, opts.dtype).eval()
    if opts.lora is not None:
        add_lora(model, opts.lora, opts.lora_fused)
    if opts.cache is not None:
        enable_cache(model, opts.cache)
    split = None
    if opts.context_parallel is not None:  # before any variant: streaming composes with it
        split = enable_context_parallel(model, opts.context_parallel, opts.device)
    inputs = case_inputs(preset, model, shape, opts.device, opts.dtype)
    (component,) = discover(model, OffloadConfig.parse(_offload_config("rank-local")))
    block_modules = [m for _, m in component.blocks]

    def forward_of(m: nn.Module) -> Callable[[], torch.Tensor]:
        if opts.steps > 1:
            return denoising_loop(m, inputs, opts.steps)
        return lambda: m(**inputs)[0]

    forward = forward_of(model)
    block_bytes = [module_bytes(m) for m in block_modules]
    block_nbytes = [layout_block(i, n, b).nbytes for i, (n, b) in enumerate(component.blocks)]
    budgets = {b.label: b.config_value(block_nbytes) for b in opts.budgets}
    if any(v in _FP8 for v in opts.variants):
        # A ring of 8-bit images needs more than two slots: two staging buffers beside them.
        cast = cast_tensors(model, torch.float8_e4m3fn)
        stored = [layout_block(i, n, b, cast=cast) for i, (n, b) in enumerate(component.blocks)]
        slots = image_slot_bytes([l.nbytes for l in stored], [l.image_nbytes for l in stored])
        least = min_budget([l.image_nbytes for l in stored], slots, max(l.nbytes for l in stored))
        fp8_budgets = {b.label: b.config_value(block_nbytes, least) for b in opts.budgets}
        # upcast "layer": two slots of the largest block in 8 bits.
        per_layer = [layout_block(i, n, b, cast=cast, per_layer=True).nbytes for i, (n, b) in enumerate(component.blocks)]
        least = min_budget(per_layer, per_layer)
        layer_budgets = {b.label: b.config_value(block_nbytes, least) for b in opts.budgets}
    passes: dict[str, list[_Pass]] = {}
    trace = None
    with torch.inference_mode():
        ran: list[int] = []
        counting = _last_child(block_modules).register_forward_pre_hook(lambda *_: ran.append(1))
        try:
            reference = forward()
        finally:
            counting.remove()
        if opts.steps > 1:
            opts.computed_steps = len(ran)
        references: dict[Any, torch.Tensor] = {False: reference}
        if any(v in _FP8 for v in opts.variants):  # 8-bit weights compute otherwise: own reference
            undo = layerwise_casting(model)
            try:
                references["fp8"] = forward()
            finally:
                undo()
        first_compile = 0.0
        if any(v in _COMPILED for v in opts.variants):  # compiled kernels round otherwise: own reference
            before = compile_seconds()
            compile_dits(model, "regional")
            references[True] = forward()
            uncompile(model)
            after = compile_seconds()
            first_compile = after - before if before is not None and after is not None else 0.0

        def reference_of(variant: str) -> torch.Tensor:
            base = variant.split("@")[0]
            return references["fp8" if base in _FP8 else base in _COMPILED]

        def budgets_of(variant: str) -> Mapping[str, tuple[int | str, str]]:
            base = variant.split("@")[0]
            if base in _FP8:
                return layer_budgets if base.endswith("-layer") else fp8_budgets
            return budgets

        if opts.interleave:
            passes = _interleaved(model, forward_of, reference_of, budgets_of, opts)
        else:
            for variant in schedule(opts.variants, opts.world, opts.budgets):
                passes.setdefault(variant, []).append(
                    _run_pass(variant, model, forward, reference_of(variant), opts, budgets_of(variant)))
        # A loop's floor is the resident loop (see _summarise): no per-block times needed.
        compute = (_block_compute_ms(block_modules, forward, opts.device, max(1, min(3, opts.repeats)))
                   if opts.steps == 1 else [0.0] * len(block_modules))
        if opts.trace_variant is not None:
            trace = _traced_forward(model, forward, opts)
    label = "x".join(map(str, shape))
    results = _summarise(passes, preset_name, blocks, label, compute, block_bytes, opts, sum(block_nbytes))
    for r in results:  # the compiled reference compiled the blocks first: that is their compile time
        if r.variant.split("@")[0] in _COMPILED:
            r.compile_s = max(r.compile_s, first_compile)
    if split is not None:  # the next case splits its own model: this one's process groups go
        disable_context_parallel(model, split)
    # Let go of the case's tensors before emptying the cache (the forward's closure holds the
    # model and inputs, so the names are cleared rather than deleted).
    model = inputs = reference = references = None
    _empty(opts.device)
    return CaseRun(results, trace)


def _traced_forward(model: nn.Module, forward: Callable[[], Any], opts: BenchOptions) -> list[dict[str, Any]]:
    """One forward of ``opts.trace_variant`` with per-block tracing, after a warm-up forward so
    block 0 was prefetched by the previous forward, as in a denoising loop."""
    handle = _apply_ours(model, opts.trace_variant, opts.device, trace=True)
    try:
        for _ in range(max(1, opts.warmup)):
            forward()
        forward()
        return handle.trace_report()
    finally:
        handle.remove()


def _summarise(passes: dict[str, list[_Pass]], preset: str, blocks: int, label: str,
               compute: list[float], block_bytes: list[int], opts: BenchOptions,
               budget_bytes: int) -> list[CaseResult]:
    pooled = {v: [t for p in ps for t in p.times] for v, ps in passes.items()}
    # Every rank's pooled timings, in rank order ([this rank's] with one rank): the raw figures
    # each figure below derives from, written to the JSON beside them. With --stagger each rank
    # reports its own rows, from its own timings.
    ranks = [pooled] if opts.stagger else (_every_rank(pooled, opts.world) or [pooled])
    medians = {v: _slowest_rank(statistics.median(r[v]) for r in ranks) for v in pooled}
    # Interleaved: a variant's ratio to a baseline is the median over rounds of its forward over
    # the baseline's forward of the same round (one pass each: times line up by round).
    paired: dict[str, dict[str, float]] = {}
    for base in (RESIDENT, "compiled", "fp8-resident") if opts.interleave else ():
        if base in pooled:
            paired[base] = {v: _slowest_rank(statistics.median(a / b for a, b in zip(r[v], r[base], strict=True))
                                             for r in ranks) for v in pooled}

    def ratio(variant: str, base: str) -> float:
        return paired[base][variant] if base in paired else medians[variant] / medians[base]

    # Peak and host memory per rank, and each rank's bitwise check (every rank compares its own
    # output: a shared copy's rank 1 reads bytes rank 0 wrote).
    memory = _every_rank({v: (max(p.peak_mib for p in ps), ps[0].host_bytes / 2**20, all(p.equal for p in ps))
                          for v, ps in passes.items()}, opts.world if not opts.stagger else 1)
    res_ms = medians[RESIDENT]
    compiled_ms = medians.get("compiled")
    fp8_ms = medians.get("fp8-resident")
    out = []
    for variant, ps in passes.items():
        transfer = ps[0].transfer
        share = opts.world if transfer == "allgather" else 1
        floor = res_ms if variant == RESIDENT else floor_ms(res_ms, compute, block_bytes, opts.bandwidth, share)
        base = compiled_ms if variant.startswith("compiled") and compiled_ms else res_ms
        if variant.startswith("fp8") and fp8_ms:
            base = fp8_ms
        if variant.startswith(("compiled", "fp8")):
            floor = base
        if ("@" in variant or variant.startswith(("compiled-streamed", *_FP8_STREAMED))) and opts.bandwidth:
            # The forward's floor: the compute, or copying the streamed bytes once a forward.
            floor = max(base, ps[0].streamed_bytes / share / opts.bandwidth * 1e3)
        if opts.steps > 1:  # a cache decides per step what to copy: the resident loop is the floor
            floor = base
        ms = medians[variant]
        # The prediction and its ratio come from the same passes: those whose planner measured.
        measured = [p for p in ps if p.predicted_ms]
        predicted_ms = statistics.median(p.predicted_ms for p in measured) if measured else None
        ratios = [p.predicted_ratio for p in (measured or ps) if p.predicted_ratio is not None]
        predicted_ratio = statistics.median(ratios) if ratios else None
        plans = [{"resident_blocks": p.resident_blocks, "kept_blocks": p.kept_blocks, "slots": p.slots,
                  "predicted_ms": p.predicted_ms, "predicted_ratio": p.predicted_ratio}
                 for p in ps] if ps[0].device_budget is not None else None
        out.append(CaseResult(
            preset=preset, blocks=blocks, shape=label, variant=variant, forward_ms=ms,
            overhead=ratio(variant, RESIDENT), floor_ms=floor, block_compute_ms=list(compute),
            block_bytes=list(block_bytes), peak_device_mib=max(p.peak_mib for p in ps),
            host_mib=ps[0].host_bytes / 2**20, setup_s=statistics.median(p.setup_s for p in ps),
            bitwise_equal=all(p.equal for p in ps) and all(m[variant][2] for m in memory or ()),
            # The floor as a ratio to resident in the overhead's own terms, so that the chart's
            # bar over its tick is to_floor (under --interleave the overhead is a median of
            # per-round ratios, not forward_ms / the resident forward_ms).
            floor_overhead=ratio(variant, RESIDENT) * floor / ms, to_floor=ms / floor,
            weight_transfer=transfer, note=ps[0].note, timings_ms=pooled[variant],
            timings_ms_per_rank=None if opts.stagger else [r[variant] for r in ranks],
            predicted_ratio=predicted_ratio, device_budget=ps[0].device_budget, predicted_ms=predicted_ms,
            plans=plans, plans_differ=plans is not None and len({_plan_key(p) for p in plans}) > 1,
            fell_back=any(p.fell_back for p in ps),
            resident_blocks=ps[0].resident_blocks, kept_blocks=ps[0].kept_blocks, slots=ps[0].slots,
            streamed_mib=ps[0].streamed_bytes / 2**20, compile_s=max(p.compile_s for p in ps),
            vs_compiled=ratio(variant, "compiled") if variant.startswith("compiled-streamed") and compiled_ms else None,
            vs_fp8=ratio(variant, "fp8-resident") if variant.startswith(_FP8_STREAMED) and fp8_ms else None,
            computed_steps=opts.computed_steps,
            peak_device_mib_ranks=[m[variant][0] for m in memory] if memory else None,
            host_mib_ranks=[m[variant][1] for m in memory] if memory else None,
            bitwise_equal_ranks=[m[variant][2] for m in memory] if memory else None,
            block_mib=budget_bytes / 2**20))
    return out


def _plan_key(plan: Mapping[str, Any]) -> tuple[int, int, int]:
    """What makes two residency plans different: where the blocks live and the ring's slots."""
    return plan["resident_blocks"], plan["kept_blocks"], plan["slots"]


def _every_rank(figures: dict[str, Any], world: int) -> list[dict[str, Any]] | None:
    """``figures`` from every rank, by rank; None with one rank."""
    if world == 1:
        return None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, figures)
    return gathered


def _slowest_rank(per_rank: Iterable[float]) -> float:
    """The slowest rank's figure (every rank's median, or median ratio, in). Ranks of a
    data-parallel job run side by side, and allgather ties them together: a job moves at its
    slowest GPU's pace, so that is the figure to compare, for resident and streamed alike (GPUs
    of one host differ by a few percent)."""
    return max(per_rank)


# -- moving one block ------------------------------------------------------------------------
def transfer_case(mib: float, chunks_mib: list[float], *, device: torch.device, warmup: int,
                  repeats: int) -> list[dict[str, Any]]:
    """Time moving one block of ``mib`` MiB into a device slot: rank-local full copy vs the
    allgather transfer (shard copy + all-gather, pipelined) at several chunk sizes."""
    nbytes = int(mib * 2**20) // 256 * 256
    streams = TransferStreams(copy=torch.cuda.Stream(device), comm=torch.cuda.Stream(device))
    full = HostBuffer(nbytes)
    full.tensor.random_(0, 255)
    full.pin()
    after, ready = torch.cuda.Event(), torch.cuda.Event()

    def timed(transfer) -> float:
        transfer.allocate_slots(transfer.device_nbytes(0), 1)  # collective for the copy engines
        dst = transfer.slots[0][: transfer.device_nbytes(0)]

        def once():
            transfer.fill(0, dst, after, ready)
            torch.cuda.current_stream(device).wait_event(ready)
        ms = statistics.median(_time(once, device, warmup, repeats))
        transfer.close()
        return ms

    results = [{"variant": "rank-local", "chunk_mib": None,
                "ms": timed(RankLocalTransfer([full], [nbytes], streams, device))}]
    facts = {"block": ComponentFacts("allgather", 0, "auto", ("block",), ("x",))}
    groups = GroupSession(600.0)
    group, reason = groups.resolve(facts, device, None)
    if group is None:
        results[0].update(allgather=f"not run: {reason}", ratio_to_rank_local=1.0)
        full.release()
        groups.close()
        return results
    gathers = ["nccl"] + (["copy-engine"] if group.peer_copy_reason is None else [])
    for chunk in chunks_mib:
        plan = plan_shards(nbytes, group.size, group.rank, int(chunk * 2**20) if chunk else nbytes)
        shard = HostBuffer(plan.shard_nbytes)
        shard.tensor.copy_(full.tensor[: plan.shard_nbytes])
        shard.pin()
        for gather in gathers:
            ms = timed(gather_transfer(gather, [shard], [plan], group, streams, device, 600.0))
            results.append({"variant": "allgather", "gather": gather, "chunk_mib": chunk or "whole block", "ms": ms})
        shard.release()
    full.release()
    torch.cuda.synchronize(device)
    groups.close()
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


# -- output ------------------------------------------------------------------------------------
def _shown_name(r: CaseResult) -> str:
    """The variant as the table names it: one that fell back says what ran instead."""
    return f"{r.variant} (fell back to {r.weight_transfer})" if r.fell_back else r.variant


def format_table(results: Sequence[CaseResult]) -> str:
    """A fixed-width table: one row per case and variant."""
    budgets = any(r.device_budget is not None for r in results)
    width = max([12] + [len(_shown_name(r)) + 2 for r in results])
    head = (f"{'case':<30}{'variant':<{width}}{'fwd ms':>10}{'x res':>8}{'floor ms':>10}{'x floor':>9}"
            f"{'peak MiB':>10}{'host MiB':>10}{'setup s':>9}{'equal':>7}")
    if budgets:
        head += f"{'budget MiB':>12}{'kept':>6}{'part':>6}{'slots':>6}{'pred x':>8}{'pred ms':>9}{'/ pred':>8}"
    lines = [head, "-" * len(head)]
    for r in results:
        case = f"{r.preset} {r.blocks}b {r.shape}" + (f" r{r.rank}" if r.rank is not None else "")
        line = (f"{case:<30}{_shown_name(r):<{width}}{r.forward_ms:>10.2f}{r.overhead:>8.3f}{r.floor_ms:>10.2f}"
                f"{r.to_floor:>9.3f}{r.peak_device_mib:>10.1f}{r.host_mib:>10.1f}{r.setup_s:>9.2f}"
                f"{'yes' if r.bitwise_equal else 'NO':>7}")
        if budgets and r.device_budget is not None:
            pred, pred_ms = r.predicted_ratio, r.predicted_ms
            line += (f"{r.device_budget / 2**20:>12.1f}{r.resident_blocks:>6}{r.kept_blocks:>6}{r.slots:>6}"
                     + (f"{pred:>8.3f}" if pred else f"{'-':>8}")
                     + (f"{pred_ms:>9.2f}{r.forward_ms / pred_ms:>8.3f}" if pred_ms else f"{'-':>9}{'-':>8}"))
        lines.append(line)
    notes = sorted({f"{r.variant}: {r.note}" for r in results if r.note})
    notes += [f"{r.variant}: its passes ran different residency plans ("
              + "; ".join(f"pass {i}: resident {p['resident_blocks']}, kept {p['kept_blocks']}, slots {p['slots']}"
                          for i, p in enumerate(r.plans or (), 1))
              + "): fwd ms pools them; the row's plan columns are pass 1's" for r in results if r.plans_differ]
    notes += [f"{r.variant}: {r.vs_compiled:.3f}x the compiled resident forward (compile {r.compile_s:.1f} s)"
              for r in results if r.vs_compiled is not None]
    notes += [f"{r.variant}: {r.vs_fp8:.3f}x the fp8-resident forward (diffusers layerwise casting), "
              f"host {r.host_mib:.0f} MiB" for r in results if r.vs_fp8 is not None]
    notes += sorted({f"{r.preset} {r.blocks}b {r.shape}: the loop ran the last block in {r.computed_steps} "
                     "step(s)" for r in results if r.computed_steps is not None})
    return "\n".join(lines + [f"note: {n}" for n in notes])


# -- command line ----------------------------------------------------------------------------
class BenchUsageError(UsageError):
    """A bad flag or flag value: one line on stderr, exit status 2."""


def build_parser(prog: str = "omni-offload bench") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="wan-14b", choices=sorted(PRESETS),
                   help="model, named after the real one (tiny-*: CPU smoke runs)")
    p.add_argument("--blocks", type=positive_int, nargs="+", default=None,
                   help="blocks in the model, one case per value (default: the preset's)")
    p.add_argument("--frames", type=positive_int, nargs="+", default=None,
                   help="video presets (default: 81 17)")
    p.add_argument("--height", type=positive_int, default=None, help="video presets (default: 480)")
    p.add_argument("--width", type=positive_int, default=None, help="video presets (default: 832)")
    p.add_argument("--px", type=positive_int, nargs="+", default=None,
                   help="image presets: square sizes (default: 1024)")
    p.add_argument("--transfer-mib", type=positive_float, default=None,
                   help="instead of model cases, time moving one block of this size (CUDA)")
    p.add_argument("--chunk-mib", type=non_negative_float, nargs="+", default=None,
                   help="with --transfer-mib: allgather chunk sizes to try (0: whole block; "
                        f"default: {' '.join(map(str, DEFAULT_CHUNK_MIB))})")
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                   help="offloaded variants beside resident (shared, allgather, allgather-nccl and the fp8 "
                   "allgather ones need torchrun with 2 or more ranks: refused in one process; default: "
                   f"{' '.join(DEFAULT_VARIANTS)}, allgather only under torchrun, without peer under context "
                   "parallelism)")
    p.add_argument("--budget", nargs="+", default=None, metavar="BUDGET",
                   help="run each of our variants once per device budget: a percentage of the block "
                   "bytes (0 25 50 60 75 100; below two slots of the largest block runs at that "
                   "minimum), a size (24GiB) or auto; prints measured and predicted ratios")
    p.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                   help="with --budget: cap the allocator at this fraction of the GPU while budget "
                   "variants run (what auto then sees); resident and the peer run uncapped")
    p.add_argument("--lora", type=positive_int, default=None, metavar="RANK",
                   help="add a LoRA of this rank (random weights) on every attention projection of the DiT, "
                        "for every variant (needs peft)")
    p.add_argument("--lora-fused", action="store_true", help="with --lora: fuse it into the base weights first")
    p.add_argument("--steps", type=positive_int, default=1, metavar="N",
                   help="time a denoising loop of N steps instead of one forward")
    p.add_argument("--cache", default=None, metavar="SPEC",
                   help="a step cache on the DiT, e.g. first-block:0.1 (needs --steps 2 or more)")
    p.add_argument("--stagger", action="store_true",
                   help="under torchrun: rank r runs the (k + r)-th shape while rank 0 runs the k-th, and every "
                   "rank's figures are reported (ranks running different work side by side)")
    p.add_argument("--ulysses-degree", type=positive_int, default=1, metavar="N",
                   help="under torchrun: split each forward over N ranks with Ulysses attention (diffusers' "
                   "context parallelism), resident and streamed alike")
    p.add_argument("--ring-degree", type=positive_int, default=1, metavar="N",
                   help="the same with ring attention (needs a flash, cuDNN or sage attention backend)")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="untimed forwards per pass (budget variants add the measured forward)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="timed forwards per pass; each variant runs two passes")
    p.add_argument("--interleave", action="store_true",
                   help="hold every variant at once (a copy of the model each) and time one forward of each "
                   "per round (after an untimed one), --repeats rounds; ratios are medians of per-round ratios "
                   "(for forwards bound by the host, whose speed varies)")
    # user_path: ~ expanded as the flag is parsed, so the path checked before the run is the one
    # written after it (the shell leaves --json=~/x alone).
    p.add_argument("--json", type=user_path, default=None, metavar="PATH", help="write the results here (rank 0)")
    p.add_argument("--png", type=user_path, default=None, metavar="PATH",
                   help="draw the overhead chart here (rank 0); the suffix picks the format (.png, .svg, .pdf, "
                   "...; none: PNG)")
    p.add_argument("--timeline", type=user_path, default=None, metavar="PATH",
                   help="draw one traced forward of the first case here (rank 0)")
    p.add_argument("--timeline-variant", default=None, choices=["rank-local", "allgather", "allgather-nccl"],
                   help="variant traced for --timeline (default: allgather under torchrun, else rank-local; "
                   "allgather and allgather-nccl need torchrun with 2 or more ranks)")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "omni-offload bench") -> int:
    """Run the benchmark; 0 when every variant of this project matched resident bitwise, 1 when
    one did not, 2 for bad flags, 130 when interrupted (Ctrl-C)."""
    try:
        args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
        _check_args(args)
    except UsageError as exc:
        return report_usage_error(prog, exc, show=_env_rank() == 0)
    if args.stagger and _env_world() == 1 and _env_rank() == 0:
        print(f"{prog}: note: --stagger gives each rank of a torchrun job its own shape; with one rank "
              "there is nothing to stagger, and the figures are this rank's", file=sys.stderr, flush=True)
    try:
        return _start(args, prog, argv)
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status for SIGINT, as cli.py's commands
        error_line(f"{rank_prefix()}{prog}: interrupted")
        return 130


def _start(args: argparse.Namespace, prog: str, argv: Sequence[str] | None) -> int:
    """The run, in the job's process group (one process: none), which it leaves as it ends."""
    ctx = maybe_init_dist()
    try:
        if args.context_parallel is not None:
            try:
                check_ranks(args.context_parallel)
            except ContextParallelError as exc:
                if ctx.rank == 0:
                    error_line(f"{prog}: error: {exc}")
                return 2
        if ctx.rank == 0:  # the run starts: the folders of its outputs are made (_check_args checked them)
            try:
                for flag in _OUTPUTS:
                    if getattr(args, flag) is not None:
                        output_file(f"--{flag}", getattr(args, flag))
            except UsageError as exc:
                return report_usage_error(prog, exc)
        return _run(args, ctx.device, ctx.world_size, ctx.rank, argv, prog)
    finally:
        destroy_dist(ctx)


def _check_args(args: argparse.Namespace) -> None:
    """Problems found before any model is built (a GPU run should not fail after minutes)."""
    if (args.png or args.timeline) and not _has_matplotlib():
        raise BenchUsageError("--png and --timeline draw with matplotlib, which is not installed: "
                              "pip install -e '.[bench]'")
    for flag in ("png", "timeline"):  # matplotlib picks the format by the suffix (none: PNG)
        path = getattr(args, flag)
        suffix = os.path.splitext(path)[1][1:].lower() if path is not None else ""
        if suffix and suffix not in (formats := image_formats()):
            raise BenchUsageError(f"--{flag} {str(path)!r}: matplotlib cannot write a .{suffix} file; end the path "
                                  f"in one of {', '.join('.' + f for f in formats)}")
    named: dict[str, str] = {}  # each output its own file: a second write would replace the first, silently
    for flag in ("json", "png", "timeline"):
        path = getattr(args, flag)
        if path is None:
            continue
        where = os.path.realpath(os.path.expanduser(str(path)))
        if where in named:
            raise BenchUsageError(f"--{named[where]} and --{flag} name the same file ({str(path)!r}): the second "
                                  "would replace the first; give each its own path")
        named[where] = flag
    if args.transfer_mib is not None and not torch.cuda.is_available():
        raise BenchUsageError("--transfer-mib times host-to-device copies and needs a CUDA device; "
                              "none is visible")
    if args.timeline and args.transfer_mib is not None:
        raise BenchUsageError("--timeline draws a model forward; leave out --transfer-mib")
    if args.png and args.transfer_mib is not None:  # the transfer run draws nothing
        raise BenchUsageError("--png draws the overhead of model cases; leave out --transfer-mib")
    if args.transfer_mib is not None:  # it times one block's copy: nothing that shapes a model case applies
        unused = [f"--{flag}" for flag in ("blocks", "variants", "frames", "height", "width", "px")
                  if getattr(args, flag) is not None] + (["--stagger"] if args.stagger else [])
        if unused:
            named = ", ".join(unused[:-1]) + " and " + unused[-1] if len(unused) > 1 else unused[0]
            raise BenchUsageError(f"{named} shape{'' if len(unused) > 1 else 's'} model cases, which --transfer-mib "
                                  f"does not run; leave {'them' if len(unused) > 1 else 'it'} out")
    if args.chunk_mib is not None and args.transfer_mib is None:  # model cases take no chunk size
        raise BenchUsageError(f"--chunk-mib {' '.join(f'{c:g}' for c in args.chunk_mib)}: chunk sizes are for "
                              "--transfer-mib's copy timing, which this run does not do; add --transfer-mib MIB "
                              "or leave --chunk-mib out")
    if args.timeline_variant and not args.timeline:
        raise BenchUsageError("--timeline-variant needs --timeline PATH")
    # One process runs no multi-rank variant: asked for, it would be left out (or, traced, run
    # rank-local under its name).
    if _env_world() < 2:
        if args.timeline_variant in _MULTI_RANK:
            raise BenchUsageError(f"--timeline-variant {args.timeline_variant} needs torchrun with 2 or more ranks "
                                  f"(this run has {_env_world()}): leave it out to trace rank-local, or start the "
                                  "run with NGPU=2 launch/bench.sh")
        if multi := [v for v in args.variants or () if v in _MULTI_RANK]:
            raise BenchUsageError(f"--variants {' '.join(multi)}: {'needs' if len(multi) == 1 else 'need'} torchrun "
                                  f"with 2 or more ranks (this run has {_env_world()}): leave "
                                  f"{'it' if len(multi) == 1 else 'them'} out, or start the run with NGPU=2 "
                                  "launch/bench.sh")
    args.budgets = tuple(Budget.parse(b) for b in args.budget or ())
    if len({b.label for b in args.budgets}) != len(args.budgets):
        raise BenchUsageError(f"--budget {args.budget}: each budget once")
    if args.memory_fraction is not None and not (args.budgets and 0 < args.memory_fraction <= 1):
        raise BenchUsageError("--memory-fraction is a fraction in (0, 1] and needs --budget")
    if args.memory_fraction is not None and not torch.cuda.is_available():
        raise BenchUsageError("--memory-fraction caps a CUDA device; none is visible")
    if args.lora is not None and importlib.util.find_spec("peft") is None:
        raise BenchUsageError("--lora needs peft, which is not installed: pip install -e '.[lora]'")
    if args.lora_fused and args.lora is None:
        raise BenchUsageError("--lora-fused fuses the adapter --lora RANK adds: give --lora too")
    if args.lora is not None and args.transfer_mib is not None:
        raise BenchUsageError("--lora runs model cases; leave out --transfer-mib")
    try:
        args.cache_spec = CacheSpec.parse(args.cache) if args.cache is not None else None
    except AdapterError as exc:
        raise BenchUsageError(str(exc)) from None
    if args.cache_spec is not None and args.steps < 2:
        raise BenchUsageError("--cache skips steps of a loop: give --steps 2 or more")
    if args.cache_spec is not None and args.cache_spec.type == "pyramid-attention":
        raise BenchUsageError("--cache pyramid-attention follows a pipeline's timestep; the bench runs a bare model")
    if (args.steps > 1 or args.cache) and args.transfer_mib is not None:
        raise BenchUsageError("--steps and --cache run model cases; leave out --transfer-mib")
    if args.budgets and args.transfer_mib is not None:
        raise BenchUsageError("--budget runs model cases; leave out --transfer-mib")
    try:
        args.context_parallel = ContextParallel.parse({"ulysses_degree": args.ulysses_degree,
                                                       "ring_degree": args.ring_degree})
    except ContextParallelError as exc:
        raise BenchUsageError(str(exc)) from None
    if args.context_parallel is not None:
        try:
            check_cache(args.context_parallel, args.cache_spec, flags=True)
            check_attention_backend(args.context_parallel)  # DIFFUSERS_ATTN_BACKEND, before any model
        except ContextParallelError as exc:
            raise BenchUsageError(str(exc)) from None
    if args.variants is None:
        args.variants = [v for v in DEFAULT_VARIANTS if v != "peer" or args.context_parallel is None]
    if args.budgets and all(v in _NO_BUDGET for v in args.variants):  # it would run them as without it
        raise BenchUsageError(f"--budget {' '.join(args.budget)}: none of --variants {' '.join(args.variants)} "
                              f"holds a device budget ({', '.join(_NO_BUDGET)} hold none); add one that does, "
                              "e.g. rank-local, or leave out --budget")
    if args.context_parallel is not None:
        flag = "--ulysses-degree/--ring-degree"
        if args.transfer_mib is not None:
            raise BenchUsageError(f"{flag} split model cases; leave out --transfer-mib")
        if args.stagger:
            raise BenchUsageError(f"{flag} split one input across ranks, and --stagger gives each rank its "
                                  "own: leave out one of them")
        if "peer" in args.variants:
            raise BenchUsageError(f"{flag}: the peer (diffusers group offloading) does not run context "
                                  "parallel here; leave it out of --variants")
    if args.interleave:
        clash = [flag for flag, on in (("--transfer-mib", args.transfer_mib is not None),
                                        ("--memory-fraction", args.memory_fraction is not None),
                                        ("--cache", args.cache is not None),
                                        ("--ulysses-degree/--ring-degree", args.context_parallel is not None)) if on]
        if clash:
            raise BenchUsageError(f"--interleave holds every variant at once on copies of one model, which "
                                  f"{clash[0]} does not allow: leave out one of them")
    preset = PRESETS[args.preset]
    _check_shape_flags(args, preset.video)
    # The VAE takes 4k+1 frames ((frames - 1) // 4 + 1 latent frames): any other count would run
    # as the 4k+1 below it under a label that says otherwise.
    for frames in args.frames or () if preset.video else ():
        if (frames - 1) % 4:
            below = frames - (frames - 1) % 4
            raise BenchUsageError(f"--frames {frames}: {args.preset} takes 4k+1 frames (the VAE's 4x in time), "
                                  f"so {frames} would run as {below}; give {below} or {below + 4}")
    for blocks in args.blocks or ():
        if (built := preset.built_blocks(blocks)) != blocks:
            raise BenchUsageError(f"--blocks {blocks}: {args.preset} builds {built} blocks for it (a Flux model "
                                  f"has at least one dual-stream and one single-stream block); give {built} or more")
    if preset.video and any(d % 16 for d in (args.height, args.width)):
        raise BenchUsageError(f"--height {args.height} --width {args.width}: both must be multiples "
                              "of 16 (VAE 8x, then 2x2 patches)")
    if not preset.video and any(px % 16 for px in args.px):
        raise BenchUsageError(f"--px {args.px}: every size must be a multiple of 16")
    if args.context_parallel is not None:  # what the split would refuse at a case's first forward
        _check_splits(args, preset)
    # Last, once every flag passed: a run must not end and then fail to write what it measured.
    # Nothing is created yet (a run refused after this, outside torchrun, leaves no folder):
    # main() makes the folders as the run starts.
    if _env_rank() == 0:  # the rank that writes
        for flag in _OUTPUTS:
            if getattr(args, flag) is not None:
                output_file(f"--{flag}", getattr(args, flag), create=False)


def _check_splits(args: argparse.Namespace, preset: Preset) -> None:
    """Refuse, before any model is built, a split the first forward of a case would refuse
    (every rank with a traceback, the cases measured before lost): attention heads that
    ``--ulysses-degree`` does not divide, and a case whose token count (or the preset's text
    length, where the DiT splits the text too) the context-parallel size does not divide. Both
    are read from the preset's DiT as the run builds it, on the meta device (no memory, no
    compute): its config's heads, and the lengths its forward at each case's inputs reaches
    where diffusers' plan splits (:func:`~omni_dist_offload.loading.parallel.planned_splits`).
    A DiT that cannot run so is left to the run, whose refusal ends it with exit status 2 too."""
    spec = args.context_parallel
    try:
        model = _meta_dit(preset)
    except Exception:  # noqa: BLE001 - not buildable on the meta device: the split checks it at the run
        return
    what = f"{args.preset}'s DiT ({preset.cls_name})"
    heads = getattr(model.config, "num_attention_heads", None)
    if isinstance(heads, int) and not isinstance(heads, bool) and heads % spec.ulysses_degree:
        fits = [str(d) for d in range(1, heads + 1) if heads % d == 0]
        raise BenchUsageError(
            f"--ulysses-degree {spec.ulysses_degree}: {what} has {heads} attention heads, which "
            f"{spec.ulysses_degree} does not divide (Ulysses gives each rank whole heads): pick a --ulysses-degree "
            f"that divides {heads} ({_or(fits)}), and split further with --ring-degree if needed")
    shapes = [(f, args.height, args.width) for f in args.frames] if preset.video else [(px,) for px in args.px]
    for shape in shapes:
        uneven = _uneven_split(preset, shape, spec.size, model)
        if uneven is None:
            continue
        size = spec.size
        case = f"--frames {shape[0]} --height {shape[1]} --width {shape[2]}" if preset.video else f"--px {shape[0]}"
        if len(shapes) > 1:
            case += (f" (one case of --frames {' '.join(map(str, args.frames))})" if preset.video else
                     f" (one case of --px {' '.join(map(str, args.px))})")
        given = f"{case} with --ulysses-degree {spec.ulysses_degree} --ring-degree {spec.ring_degree}"
        degrees = f"--ulysses-degree/--ring-degree whose product divides {uneven.tokens}"
        if uneven.text:
            raise BenchUsageError(
                f"{given}: {what} also splits the prompt's text embedding across {size} ranks, and the preset's "
                f"has {uneven.tokens} tokens, which {size} does not divide (diffusers splits in equal parts only) "
                f"and no size flag changes: pick {degrees}")
        flags = "--frames/--height/--width" if preset.video else "--px"
        other = _even_shape(preset, shape, size, model)
        example = f" (e.g. {other})" if other else ""
        raise BenchUsageError(
            f"{given}: {what} splits its sequence across {size} ranks, and at this size it has {uneven.tokens} "
            f"tokens, which {size} does not divide (diffusers splits in equal parts only): pick {flags} whose "
            f"token count {size} divides{example}, or {degrees}")


def _meta_dit(preset: Preset, blocks: int = 1) -> nn.Module:
    """The preset's DiT as :func:`build_model` builds it, on the meta device: its config and
    shapes, no weights (the lengths a forward splits do not depend on the block count)."""
    with torch.device("meta"):
        return getattr(diffusers, preset.cls_name)(**preset.block_config(blocks))


def _uneven_split(preset: Preset, shape: tuple[int, ...], size: int,
                  model: nn.Module | None = None) -> PlannedSplit | None:
    """The split of a case at ``shape`` that a context-parallel group of ``size`` ranks would
    refuse (:class:`~omni_dist_offload.loading.parallel.UnevenSplitError`), as the run would meet
    it: the text first where the DiT splits the text too (checked before its forward), then the
    first in the forward's order; None when every length divides, or the DiT cannot run on the
    meta device (the run checks it then). ``model``: the preset's DiT from :func:`_meta_dit`."""
    try:
        model = _meta_dit(preset) if model is None else model
        inputs = case_inputs(preset, model, shape, torch.device("meta"), torch.float32)
        splits = planned_splits(model, inputs)
    except Exception:  # noqa: BLE001 - an op the meta device lacks, say: the split checks the real forward
        return None
    uneven = [s for s in splits if s.tokens % size]
    return next((s for s in uneven if s.text), uneven[0] if uneven else None)


def _even_shape(preset: Preset, shape: tuple[int, ...], size: int, model: nn.Module) -> str | None:
    """A size flag changed to the nearest value (in the steps the shape checks allow) at which
    ``size`` ranks split every length of the case: for the refusal to give an example."""
    axes = [("--height", 1), ("--width", 2)] if preset.video else [("--px", 0)]
    for flag, axis in axes:
        for step in range(1, min(2 * size, 8) + 1):
            for value in (shape[axis] + 16 * step, shape[axis] - 16 * step):
                if value <= 0:
                    continue
                candidate = tuple(value if i == axis else d for i, d in enumerate(shape))
                if _uneven_split(preset, candidate, size, model) is None:
                    return f"{flag} {value}"
    return None


def _or(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else items[0]


def _check_shape_flags(args: argparse.Namespace, video: bool) -> None:
    """Refuse the shape flags of the other kind of preset (the case would run at its own
    defaults, not the size asked for), then fill in the defaults of this kind's."""
    own, other = (_VIDEO_SHAPE, _IMAGE_SHAPE) if video else (_IMAGE_SHAPE, _VIDEO_SHAPE)
    if given := [f"--{flag}" for flag in other if getattr(args, flag) is not None]:
        kind, sized_by, others = (("a video", "--frames, --height and --width", "an image") if video else
                                  ("an image", "--px", "a video"))
        named = ", ".join(given[:-1]) + " and " + given[-1] if len(given) > 1 else given[0]
        raise BenchUsageError(f"{named}: {args.preset} is {kind} preset, sized by {sized_by}; leave "
                              f"{'them' if len(given) > 1 else 'it'} out, or pick {others} preset")
    for flag in own:
        if getattr(args, flag) is None:
            default = _SHAPE_DEFAULTS[flag]
            setattr(args, flag, list(default) if isinstance(default, tuple) else default)


def _run(args: argparse.Namespace, device: torch.device, world: int, rank: int,
         argv: Sequence[str] | None, prog: str = "omni-offload bench") -> int:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = h2d_bandwidth(device)
    meta = _meta(args, device, world, bandwidth, argv)
    if args.transfer_mib is not None:
        chunks = args.chunk_mib if args.chunk_mib is not None else list(DEFAULT_CHUNK_MIB)
        results: list[Any] = transfer_case(args.transfer_mib, chunks, device=device,
                                           warmup=args.warmup, repeats=args.repeats)
        text = "\n".join(f"{r['variant']:<12}{r.get('gather') or '':<13}chunk {str(r['chunk_mib']):<12}"
                         f"{r['ms']:>9.2f} ms{r['ratio_to_rank_local']:>8.3f}x" for r in results)
        if rank == 0:
            _emit(text, meta, results, None, args, bandwidth, world)
        return 0
    opts = BenchOptions(device=device, dtype=dtype, warmup=args.warmup, repeats=args.repeats,
                        bandwidth=bandwidth, world=world, variants=tuple(args.variants), budgets=args.budgets,
                        memory_fraction=args.memory_fraction, lora=args.lora, lora_fused=args.lora_fused,
                        steps=args.steps, cache=args.cache_spec, stagger=args.stagger and world > 1,
                        context_parallel=args.context_parallel, interleave=args.interleave)
    preset = PRESETS[args.preset]
    shapes = [(f, args.height, args.width) for f in args.frames] if preset.video else [(px,) for px in args.px]
    cases: list[CaseResult] = []
    trace = None
    for blocks in args.blocks or [preset.default_blocks]:
        for k in range(len(shapes)):
            shape = shapes[(k + rank) % len(shapes)] if opts.stagger else shapes[k]
            traced = args.timeline is not None and trace is None
            opts.trace_variant = (args.timeline_variant or ("allgather" if world > 1 else "rank-local")) if traced else None
            label = f"{args.preset} {blocks}b {'x'.join(map(str, shape))}"
            try:
                run = measure_case(args.preset, blocks, shape, opts)
            except ContextParallelError as exc:
                # A split refused at the run (what _check_splits could not foresee): raised on every
                # rank of the group alike, before the split's collectives, so every rank ends here.
                return _stopped(exc, label, cases, trace, meta, args, bandwidth, world, rank, prog)
            cases += run.results
            if traced:
                trace = {"case": label, "variant": opts.trace_variant, "rings": run.trace}
    if opts.stagger:  # every rank's rows, by case and rank
        for r in cases:
            r.rank = rank
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, cases)
        cases = sorted((r for g in gathered for r in g), key=lambda r: (r.blocks, r.shape, r.rank))
    if opts.steps > 1:  # the steps each case's loop computed are in its rows
        meta["steps"] = opts.steps
        meta["cache"] = opts.cache.to_dict() if opts.cache is not None else None
    if rank == 0:
        _emit(format_table(cases), meta, [dataclasses.asdict(r) for r in cases], trace, args, bandwidth, world)
        if args.png:
            draw = draw_budget_sweep if args.budgets else draw_overhead
            draw(cases, args.png, title=f"{meta['device']}, world size {world}")
    ours = [r for r in cases if r.variant not in ("peer", RESIDENT)]
    return 0 if all(r.bitwise_equal for r in ours) else 1


def _stopped(exc: ContextParallelError, label: str, cases: list[CaseResult], trace: dict | None, meta: dict,
             args: argparse.Namespace, bandwidth: float | None, world: int, rank: int, prog: str) -> int:
    """A case refused by the split: exit status 2 on every rank, one line from rank 0, and the
    cases measured before it kept (their table, and ``--json`` with ``meta["stopped"]``, the case
    and the error; no chart). Not under ``--stagger``, which context parallelism excludes: the
    rows are this rank's group's, as in a whole run."""
    if rank != 0:
        return 2
    kept = ""
    if cases:
        meta = {**meta, "stopped": {"case": label, "error": str(exc)}}
        _emit(format_table(cases), meta, [dataclasses.asdict(r) for r in cases], trace, args, bandwidth, world)
        if args.json:
            measured = len({(r.blocks, r.shape) for r in cases})
            kept = (f"; the {measured} case{'s' if measured > 1 else ''} measured before it "
                    f"{'are' if measured > 1 else 'is'} in {args.json}")
    elif args.json:
        kept = f"; nothing was measured before it, so {args.json} is not written"
    error_line(f"{prog}: error: {label}: {exc}{kept}")
    return 2


def _emit(text: str, meta: dict, results: list[Any], trace: dict | None, args: argparse.Namespace,
          bandwidth: float | None, world: int) -> None:
    """Rank 0: the table, then the JSON file and the timeline."""
    print(text)
    if bandwidth:
        print(f"pinned H2D: {bandwidth / 1e9:.1f} GB/s; world size {world}")
    if cp := meta.get("context_parallel"):
        print(f"context parallel: ulysses {cp['ulysses_degree']} x ring {cp['ring_degree']}, {cp['groups']} "
              "group(s); every ratio is to the context-parallel resident model")
    if args.json:
        payload: dict[str, Any] = {"meta": meta, "results": results}
        if trace is not None:
            payload["timeline"] = trace
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    if args.timeline and trace is not None:
        draw_timeline(trace["rings"], args.timeline,
                      title=f"{trace['case']}, {trace['variant']}, {meta['device']}")


def _meta(args: argparse.Namespace, device: torch.device, world: int, bandwidth: float | None,
          argv: Sequence[str] | None) -> dict[str, Any]:
    return {"date": time.strftime("%Y-%m-%d"), "world_size": world, "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "nccl_max_ctas": os.environ.get("OMNI_OFFLOAD_NCCL_MAX_CTAS"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "h2d_bytes_per_s": bandwidth,
            # --interleave runs no passes: every variant held at once, one forward of each per round.
            "schedule": None if args.interleave else schedule(args.variants, world, args.budgets),
            "interleave": args.interleave, "warmup_per_pass": args.warmup, "repeats_per_pass": args.repeats,
            # A budget variant warms up past its planner's measured forward (the plan is then in force).
            "extra_warmup_under_a_budget": MEASURED_FORWARD if args.budgets else 0,
            "context_parallel": None if args.context_parallel is None else {
                **args.context_parallel.to_dict(), "groups": world // args.context_parallel.size},
            "lora": None if args.lora is None else {"rank": args.lora, "fused": args.lora_fused,
                                                    "targets": list(LORA_TARGETS)},
            "peer": {"offload_type": "block_level", "num_blocks_per_group": 1,
                     "use_stream": device.type == "cuda"},
            "figures": _figures(args.interleave, args.stagger and world > 1),
            "argv": list(sys.argv[1:] if argv is None else argv)}


def _figures(interleave: bool, stagger: bool) -> dict[str, str]:
    """How each reported figure derives from the raw timings in the same file."""
    if stagger:
        per_rank = "null: with --stagger each row is one rank's own figures (its 'rank')"
        forward = "median(timings_ms)"
        ratio = ("median over rounds i of timings_ms[i] / the baseline row's timings_ms[i] (same rank)"
                 if interleave else "forward_ms / the baseline row's forward_ms (same rank)")
    else:
        per_rank = "every rank's timings_ms, in rank order (one list with one rank)"
        forward = "max over ranks r of median(timings_ms_per_rank[r]): the slowest rank's median"
        ratio = ("max over ranks r of the median over rounds i of timings_ms_per_rank[r][i] / the baseline "
                 "row's timings_ms_per_rank[r][i]" if interleave else
                 "forward_ms / the baseline row's forward_ms (each the slowest rank's median, possibly of "
                 "different ranks)")
    return {"timings_ms": "rank 0's timed forwards, both passes pooled (with --stagger: the row's rank's)",
            "timings_ms_per_rank": per_rank, "forward_ms": forward,
            "overhead": f"{ratio}; baseline: the resident row of the same case",
            "vs_compiled": "the same as overhead, with the compiled row as the baseline",
            "vs_fp8": "the same as overhead, with the fp8-resident row as the baseline",
            "floor_ms": "the resident row: its forward_ms. Every block streamed (peer, rank-local, shared, "
                        "allgather): the resident row's forward_ms + the sum over blocks i of max(c_i, l_i) - c_i, "
                        "c_i = block_compute_ms[i], l_i = block_bytes[i] / share / meta['h2d_bytes_per_s'] in ms "
                        "(share: the world size for allgather, else 1). Under a budget ('@'), compiled-streamed "
                        "and fp8 streamed variants: max(the baseline's forward_ms, streamed_mib * 2**20 / share / "
                        "meta['h2d_bytes_per_s'] in ms). compiled, fp8-resident, and any variant with --steps above "
                        "1: the baseline's forward_ms (baseline: the compiled, fp8-resident or resident row). "
                        "Without a measured link (the CPU), the baseline's forward_ms",
            "to_floor": "forward_ms / floor_ms",
            "floor_overhead": "overhead * floor_ms / forward_ms: the floor in the overhead's terms (overhead / "
                              "floor_overhead = to_floor)"}


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _env_rank() -> int:
    return current_rank()


def _env_world() -> int:
    """The job's world size before the process group starts (torchrun sets ``WORLD_SIZE``)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


if __name__ == "__main__":
    exit_with(main, prog="python -m omni_dist_offload.tools.bench")
