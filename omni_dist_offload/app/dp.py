"""Data-parallel generation under torchrun: one process per device, prompts split across ranks.

Every rank runs the same number of pipeline calls with the same sizes and steps, in lockstep:
prompts go out in waves of ``world_size``, and the last wave is padded with repeats whose
outputs are discarded. The ``allgather`` weight transfer needs this, since each block's
all-gather is a collective that every rank of the group must enter. Prompt ``k`` is generated
with seed ``base_seed + k`` and written as ``<k>.<ext>``, whatever the number of ranks.

With one process (``runtime.dist.maybe_init_dist`` does nothing) the same loop runs alone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime.dist import DistContext
from .api import Omni, SamplingOptions
from .outputs import VideoFormat

__all__ = ["PromptJob", "RunReport", "plan_jobs", "run_jobs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptJob:
    """One pipeline call of one rank."""

    index: int
    """Global prompt index: names the output and sets the seed. For padding, past the end."""
    prompt: str
    seed: int
    wave: int
    padding: bool = False
    """A repeat that keeps this rank in lockstep with the others; its output is discarded."""


def plan_jobs(prompts: Sequence[str], base_seed: int, rank: int, world_size: int) -> list[PromptJob]:
    """This rank's jobs: prompt ``wave * world_size + rank`` in each wave, padded in the last.

    Every rank gets ``ceil(len(prompts) / world_size)`` jobs."""
    if not prompts:
        raise ValueError("no prompts to generate: give --prompt or a non-empty --prompts-file.")
    waves = math.ceil(len(prompts) / world_size)
    jobs = []
    for wave in range(waves):
        index = wave * world_size + rank
        padding = index >= len(prompts)
        # A padding job repeats a real prompt so its pipeline call does the same work.
        prompt = prompts[index % len(prompts)]
        jobs.append(PromptJob(index=index, prompt=prompt, seed=base_seed + index, wave=wave,
                              padding=padding))
    return jobs


@dataclass(slots=True)
class RunReport:
    """What one rank did, and the totals over all ranks (filled in on every rank)."""

    written: list[Path] = field(default_factory=list)
    """This rank's media files."""
    local_count: int = 0
    total_count: int = 0
    kind: str = "image"
    elapsed_s: float = 0.0
    """Wall time of the generation loop, the slowest rank's."""
    compile_s: float = 0.0
    """Of which torch.compile's own time on this rank (``Omni(compile=...)``)."""

    @property
    def per_minute(self) -> float:
        return 60.0 * self.total_count / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self, world_size: int, setup_s: float) -> str:
        """The final report: outputs per minute over the generation loop (setup excluded)."""
        noun = self.kind if self.total_count == 1 else f"{self.kind}s"
        ranks = "rank" if world_size == 1 else "ranks"
        compiling = f", of which {self.compile_s:.1f} s compiling" if self.compile_s else ""
        return (f"generated {self.total_count} {noun} in {self.elapsed_s:.1f} s on {world_size} "
                f"{ranks}{compiling}: {self.per_minute:.2f} {self.kind}s/min (setup {setup_s:.1f} s, not counted)")


def run_jobs(
    omni: Omni,
    jobs: Sequence[PromptJob],
    ctx: DistContext,
    *,
    sampling: SamplingOptions,
    output_dir: Path,
    video_format: VideoFormat = "auto",
    fps: int | None = None,
) -> RunReport:
    """Generate this rank's jobs in order, write real outputs, discard padding, and total up."""
    report = RunReport()
    options = sampling.to_kwargs()
    start = time.perf_counter()
    for job in jobs:
        job_start = time.perf_counter()
        result = omni.generate(job.prompt, seed=job.seed, name=f"{job.index:05d}", fps=fps, **options)
        report.kind = result.kind
        report.compile_s += result.metadata["timings"].get("compile_s") or 0.0
        if job.padding:
            logger.info("wave %d/%d: padding call done (%.1f s), output discarded",
                        job.wave + 1, len(jobs), time.perf_counter() - job_start)
            continue
        result.metadata.update(index=job.index, rank=ctx.rank, world_size=ctx.world_size)
        saved = result.save(output_dir, video_format=video_format)
        report.written.append(saved.media)
        report.local_count += 1
        logger.info("wave %d/%d: prompt %d %r -> %s (%.1f s)", job.wave + 1,
                    len(jobs), job.index, job.prompt, saved.media, time.perf_counter() - job_start)
    report.elapsed_s = time.perf_counter() - start
    report.total_count, report.elapsed_s = _reduce_totals(report.local_count, report.elapsed_s, ctx)
    return report


def _reduce_totals(count: int, elapsed_s: float, ctx: DistContext) -> tuple[int, float]:
    """Sum of outputs and the slowest rank's time; also a barrier, so rank 0's final line
    comes after every rank has written."""
    if ctx.backend is None:
        return count, elapsed_s
    nccl = ctx.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    totals = torch.tensor([float(count), elapsed_s], dtype=torch.float64, device=device)
    counts, times = totals[:1].clone(), totals[1:].clone()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return int(counts.item()), float(times.item())
