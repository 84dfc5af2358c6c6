"""Data-parallel generation under torchrun: one process per device, prompts split across ranks.

Prompt ``k`` is generated with seed ``base_seed + k`` and written as ``<k>.<ext>`` (its sidecar
names the rank that ran it), whatever the number of ranks and whichever rank runs it, so the
outputs are those of one process. :func:`run_prompts` picks how the prompts are shared:

- **Free** (``Omni.lockstep`` is False: every ring streams without a collective): each rank takes
  the next prompt index as soon as it is free, from an atomic counter in the process group's
  c10d store (``store.add`` on a key unique to the run, named by a nonce rank 0 broadcasts). No
  rank waits for another and nothing is padded: a rank that finishes early takes more. Without a store (a process group started without one) the split is static, prompt
  ``k`` to rank ``k % world_size``, still without padding.
- **Lockstep** (``Omni.lockstep`` is True: an ``allgather`` ring rebuilds each block with a
  collective that every rank of its weight group must enter): every rank runs the same number
  of pipeline calls with the same sizes and steps, together. Prompts go out in waves of
  ``world_size`` (:func:`plan_jobs`), and the last wave is padded with repeats whose outputs
  are discarded.

Either way the run ends with the totals over all ranks (outputs, the slowest rank's time), which
is also a barrier, reached through the store (:class:`_Alive`) rather than a bare collective: a
rank that stopped is named instead of waited for. A lockstep rank that fails says why in the store
before it exits (the ranks of its weight group are stuck in a collective with it, and those of
other hosts would run their waves on): between waves each rank reads that (one store read per
wave), and one whose collective failed because that rank left names it. With one process
(``runtime.dist.maybe_init_dist`` does nothing) the same loop runs alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..runtime.dist import DistContext, default_store
from ..runtime.flags import UsageError
from .api import Omni, SamplingOptions
from .outputs import VideoFormat, numbered_files

__all__ = ["PeerStopped", "PromptJob", "RunReport", "check_same_run", "claim_indices", "plan_jobs", "run_free",
           "run_jobs", "run_prompts", "share_usage_error", "static_indices"]

logger = logging.getLogger(__name__)

# Prefix of the store keys whose counters hand out prompt indices (one key per run).
_CLAIM_KEY = "omni_offload/dp"
#: How often a rank that has run out of prompts looks whether the others have too (_Alive).
_ARRIVAL_POLL_S = 0.2
#: How often a rank running its prompts shows it is alive, and a waiting rank looks.
_BEAT_S = 2.0
#: A rank that has shown no sign of life this long before the end is named as stopped.
_SILENT_S = 120.0
#: Once every prompt is taken, each rank is on its last one: one that has not finished it within
#: this many times its own longest generation so far (and at least _SILENT_S) is named as hung,
#: alive or not (a GPU that stopped, a write that never returns).
_HANG_FACTOR = 3.0
#: A rank still on its first prompt has no time of its own to go by (and a first generation may
#: compile, or run on a slower host than the others'): it is named only past this long, and
#: _HANG_FACTOR times the longest generation of any rank.
_FIRST_HANG_S = 1800.0


@dataclass(frozen=True, slots=True)
class PromptJob:
    """One pipeline call of one rank."""

    index: int
    """Global prompt index: names the output and sets the seed. For padding, past the end."""
    prompt: str
    seed: int
    wave: int | None = None
    """Lockstep: the wave it runs in; None when ranks take prompts as they are free."""
    padding: bool = False
    """A repeat that keeps this rank in lockstep with the others; its output is discarded."""


def plan_jobs(prompts: Sequence[str], base_seed: int, rank: int, world_size: int) -> list[PromptJob]:
    """This rank's jobs in lockstep: prompt ``wave * world_size + rank`` in each wave, padded in
    the last. Every rank gets ``ceil(len(prompts) / world_size)`` jobs."""
    _check_prompts(prompts)
    waves = math.ceil(len(prompts) / world_size)
    jobs = []
    for wave in range(waves):
        index = wave * world_size + rank
        padding = index >= len(prompts)
        # A padding job repeats a real prompt, and its seed, so its pipeline call does the same work.
        repeated = index % len(prompts)
        jobs.append(PromptJob(index=index, prompt=prompts[repeated], seed=base_seed + repeated, wave=wave,
                              padding=padding))
    return jobs


def static_indices(total: int, rank: int, world_size: int) -> range:
    """The prompts of ``rank`` when no store hands them out: ``k % world_size == rank``, no padding."""
    return range(rank, total, world_size)


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


@dataclass(frozen=True, slots=True)
class _Output:
    """Where and how a run writes its outputs."""

    sampling: SamplingOptions
    output_dir: Path
    video_format: VideoFormat
    fps: int | None


def check_same_run(prompts: Sequence[str], base_seed: int, sampling: SamplingOptions | None, fps: int | None,
                   ctx: DistContext, *, setup: Mapping[str, Any] | None = None) -> None:
    """Every rank must be given the same prompts, seed, sampling flags and setup (``setup``: the
    model, dtype, offload config, adapters, context parallelism, ... by flag): output k is prompt
    k, so a rank that read another prompts file (each host its own copy) would drop prompts past
    its own count or write its prompts under rank 0's numbers; a rank with another model would
    mix its outputs with rank 0's; a rank with other steps, sizes or a ring of another kind would
    leave the collectives out of step (a hang). Raises :class:`UsageError` on every rank, naming
    what differs from rank 0, or the rank whose flags were refused (:func:`share_usage_error`).
    Collective (every rank calls it, before the model loads); compares digests, not the prompts."""
    if ctx.backend is None or ctx.world_size < 2:
        return
    text = json.dumps(list(prompts), ensure_ascii=True).encode("ascii")
    mine = (None, len(prompts), hashlib.sha256(text).hexdigest(), base_seed,
            json.dumps(sampling.to_kwargs() if sampling is not None else None, sort_keys=True, default=repr), fps,
            json.dumps(dict(setup or {}), sort_keys=True, default=repr))
    everyone: list[tuple | None] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    _raise_if_refused(everyone)
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == first:
            continue
        if theirs[1] != first[1]:
            what = f"{theirs[1]} prompt(s), where rank 0 has {first[1]}"
        elif theirs[2] != first[2]:
            what = f"other prompts than rank 0 (the same count, {first[1]})"
        elif theirs[3] != first[3]:
            what = f"--seed {theirs[3]}, where rank 0 has {first[3]}"
        elif theirs[4] != first[4]:
            what = f"the sampling flags {theirs[4]}, where rank 0 has {first[4]}"
        elif theirs[5] != first[5]:
            what = f"--fps {theirs[5]}, where rank 0 has {first[5]}"
        else:
            ours, other = json.loads(first[6]), json.loads(theirs[6])
            flag = next(k for k in sorted({*ours, *other}) if ours.get(k) != other.get(k))
            what = f"{flag} {other.get(flag)!r}, where rank 0 has {ours.get(flag)!r}"
        raise UsageError(f"rank {rank} has {what}: every rank must be given the same flags (one prompts "
                         "file, the same on every host; the same model, offload config, --seed and sampling "
                         "flags).")


def share_usage_error(error: str, ctx: DistContext) -> None:
    """The refused rank's side of :func:`check_same_run`: a rank whose flags were refused still
    joins the job and says so, and every other rank stops with it (exit status 2) instead of
    waiting, on another host, for a rank that never comes. Collective."""
    if ctx.backend is None or ctx.world_size < 2:
        return
    everyone: list[tuple | None] = [None] * ctx.world_size
    dist.all_gather_object(everyone, (error,))


def _raise_if_refused(everyone: Sequence[tuple | None]) -> None:
    for rank, theirs in enumerate(everyone):
        if theirs is not None and theirs[0] is not None:
            raise UsageError(f"rank {rank} refused its flags ({theirs[0]}); the job stops on every rank: "
                             "fix that rank's command line.")


def run_prompts(
    omni: Omni,
    prompts: Sequence[str],
    base_seed: int,
    ctx: DistContext,
    *,
    sampling: SamplingOptions,
    output_dir: Path,
    video_format: VideoFormat = "auto",
    fps: int | None = None,
) -> RunReport:
    """Generate every prompt once over the ranks: free when no ring needs lockstep
    (:func:`run_free`), else in padded waves (:func:`plan_jobs`, :func:`run_jobs`). Output k
    replaces the one of an earlier run in ``output_dir``, in whatever media format it was."""
    _check_prompts(prompts)
    earlier = _warn_earlier_outputs(output_dir, len(prompts), ctx)
    groups = omni.parallel
    if ctx.world_size > 1 and not omni.lockstep:
        report = run_free(omni, prompts, base_seed, ctx, sampling=sampling, output_dir=output_dir,
                          video_format=video_format, fps=fps)
    elif groups is not None:  # one prompt per group of ranks: data parallel across, context within
        jobs = plan_jobs(prompts, base_seed, groups.dp_rank, groups.dp_size)
        logger.info("%d prompt(s) on %d group(s) of %d ranks, each splitting its sample (context parallel): "
                    "%d wave(s), this group runs prompts %s", len(prompts), groups.dp_size, groups.cp_size,
                    len(jobs), [j.index for j in jobs if not j.padding])
        report = run_jobs(omni, jobs, ctx, sampling=sampling, output_dir=output_dir, video_format=video_format,
                          fps=fps, writes=groups.writes)
    else:
        jobs = plan_jobs(prompts, base_seed, ctx.rank, ctx.world_size)
        if ctx.world_size > 1:
            logger.info("%d prompt(s) on %d ranks in lockstep (a ring gathers its weights across ranks): "
                        "%d wave(s), this rank runs prompts %s", len(prompts), ctx.world_size, len(jobs),
                        [j.index for j in jobs if not j.padding])
        report = run_jobs(omni, jobs, ctx, sampling=sampling, output_dir=output_dir, video_format=video_format,
                          fps=fps)
    _remove_unreplaced(earlier, output_dir)
    return report


def run_jobs(
    omni: Omni,
    jobs: Sequence[PromptJob],
    ctx: DistContext,
    *,
    sampling: SamplingOptions,
    output_dir: Path,
    video_format: VideoFormat = "auto",
    fps: int | None = None,
    writes: bool = True,
) -> RunReport:
    """Lockstep: generate this rank's jobs in order, write real outputs, discard padding, and
    total up. ``writes=False``: this rank shares its group's samples (context parallel) and the
    group's first rank writes them."""
    out = _Output(sampling, output_dir, video_format, fps)
    report = RunReport(kind=_output_kind(omni))
    key = _run_key(ctx)
    start = _started(ctx)
    # No hang deadline: nothing is claimed, and another host may be waves behind this one.
    alive = _Alive(ctx, key, len(jobs), hangs=False)
    left: str | None = None  # why this rank leaves the run early, for the others
    try:
        for number, job in enumerate(jobs, 1):
            where = f"wave {number}/{len(jobs)}"
            if number > 1:  # between waves: stop here if a rank has left (one store read)
                alive.raise_if_departed(f"stops before {where}")
            try:
                _generate(omni, job if writes else dataclasses.replace(job, padding=True), ctx, out, report,
                          f"{where}: " if job.wave is not None else "")
            except RuntimeError as exc:
                # A collective that failed because a rank it gathers with left (gloo: "Connection
                # closed by peer"): that rank wrote why before it exited. Other errors (a file
                # that cannot be written, an option refused) are this rank's own.
                alive.raise_if_departed(f"stops: their collective failed in {where}", cause=exc)
                raise
        report.elapsed_s = time.perf_counter() - start
        report.total_count, report.elapsed_s = _finish(report.local_count, report.elapsed_s, None, ctx, key, alive)
    except PeerStopped:
        left = "stopped with another rank"
        raise
    except BaseException as exc:
        # This rank's own error (its output that cannot be written, an interrupt): told to the
        # others before it exits, which they read between waves, at the end, or when their
        # collective with this rank fails.
        left = _why(exc)
        alive.depart(left)
        raise
    finally:
        alive.stop(left)
    return report


def run_free(
    omni: Omni,
    prompts: Sequence[str],
    base_seed: int,
    ctx: DistContext,
    *,
    sampling: SamplingOptions,
    output_dir: Path,
    video_format: VideoFormat = "auto",
    fps: int | None = None,
) -> RunReport:
    """Each rank takes the next prompt as soon as it is free (:func:`claim_indices`); no
    padding, no waiting. Collective at the start (the run's key) and at the end (the totals)."""
    _check_prompts(prompts)
    out = _Output(sampling, output_dir, video_format, fps)
    report = RunReport(kind=_output_kind(omni))
    logger.info("%d prompt(s) on %d rank(s), each rank taking the next prompt when it is free "
                "(no ring gathers its weights, so no lockstep)", len(prompts), ctx.world_size)
    ran = []
    key = _run_key(ctx)
    start = _started(ctx)
    alive = _Alive(ctx, key, len(prompts))
    try:
        try:
            for index in claim_indices(len(prompts), ctx, key):
                job = PromptJob(index=index, prompt=prompts[index], seed=base_seed + index)
                began = time.perf_counter()
                _generate(omni, job, ctx, out, report, "")
                alive.took(time.perf_counter() - began)
                ran.append(index)
        except Exception as exc:
            # The others go on with the prompts left (none waits on this rank until the end), then
            # learn why this rank stopped, instead of a lost connection when its process exits.
            if ctx.backend is not None and ctx.world_size > 1:
                try:
                    _finish(report.local_count, time.perf_counter() - start, _why(exc), ctx, key, alive)
                except Exception:  # noqa: BLE001 - the group is gone too: the original error says more
                    pass
            raise
        report.elapsed_s = time.perf_counter() - start
        report.total_count, report.elapsed_s = _finish(report.local_count, report.elapsed_s, None, ctx, key, alive)
    finally:
        alive.stop()  # an interrupt: the others are told at once that this rank will not come
    _log_by_rank(ran, ctx)
    return report


class PeerStopped(RuntimeError):
    """Another rank's generation raised: this rank ran its own prompts (free), or stopped with it
    (lockstep), and the job fails."""


def _why(exc: BaseException) -> str:
    """One line saying why a rank stopped: ``interrupted``, or the error's type and first line."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first.rstrip('.')}"  # it goes in parentheses mid-sentence


def _finish(count: int, elapsed_s: float, error: str | None, ctx: DistContext,
            key: str | None, alive: _Alive) -> tuple[int, float]:
    """A run's end, free or lockstep: the sum of outputs and the slowest rank's time, and whether
    a rank stopped on an error (:class:`PeerStopped` on the others, naming it). Also a barrier, so
    rank 0's final line comes after every rank has written; the collective runs once every rank
    has arrived (:meth:`_Alive.arrive`), so none waits in it for a rank that left."""
    if ctx.backend is None:
        return count, elapsed_s
    alive.arrive()
    everyone: list[tuple | None] = [None] * ctx.world_size
    dist.all_gather_object(everyone, (count, elapsed_s, error))
    if error is None:
        failed = [(rank, theirs[2]) for rank, theirs in enumerate(everyone) if theirs[2] is not None]
        if failed:
            rank, why = failed[0]
            raise PeerStopped(f"rank {rank} stopped on an error ({why}); this rank ran its own prompts. "
                              "See that rank's log; the outputs written stay.")
    return int(sum(t[0] for t in everyone)), max(t[1] for t in everyone)


def _started(ctx: DistContext) -> float:
    """When the generation loop starts on every rank: after all have set up (a rank that loaded
    sooner would otherwise count its wait for the slowest as generation time)."""
    if ctx.backend is not None and ctx.world_size > 1:
        dist.barrier()
    return time.perf_counter()


def _run_key(ctx: DistContext) -> str | None:
    """A key of this run's own in the default store, whatever it held (collective: rank 0
    names it); None without a process group."""
    if ctx.backend is None:
        return None
    box = [f"{_CLAIM_KEY}/{secrets.token_hex(8)}" if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _Alive:
    """Free mode's end without a collective that times out. A rank that runs out of prompts waits
    for the others' last generations, which may take longer than the default group's collective
    timeout (10 minutes on NCCL, 30 on gloo: a 720p video, or the prompts the others finish after
    one rank failed): it polls the store instead (:meth:`arrive`). While it runs its prompts, a
    daemon thread adds to a counter of its own every :data:`_BEAT_S`, so a rank that dies (no
    launcher to stop the others: several hosts, srun, mpirun) is named once it has shown no
    sign of life for :data:`_SILENT_S`; one that leaves the run without arriving (an interrupt)
    says so, and is named at once. A rank that lives but hangs beats on: each rank publishes the
    longest generation it has run, and once every prompt is taken (each rank is then on its last)
    one that has not arrived within :data:`_HANG_FACTOR` times its own longest is named (one on its
    first prompt, past :data:`_FIRST_HANG_S`).

    Lockstep runs end the same way (``hangs=False``: nothing is claimed, and another host may be
    waves behind). A lockstep rank that fails does not arrive: it records why (:meth:`depart`)
    and exits, and the others name it (:meth:`raise_if_departed`) between waves, when their
    collective with it fails, or while they wait here."""

    def __init__(self, ctx: DistContext, key: str | None, total: int, *, hangs: bool = True) -> None:
        self.ctx, self.key, self.total, self.hangs = ctx, key, total, hangs
        self.store = default_store() if key is not None and ctx.world_size > 1 else None
        self._arrived = False
        self._longest = 0.0
        self._stop = threading.Event()
        if self.store is not None:
            threading.Thread(target=self._beat, args=(f"{key}/alive/{ctx.rank}",), daemon=True,
                             name="omni-offload-alive").start()

    def _beat(self, name: str) -> None:
        while True:
            with contextlib.suppress(Exception):  # a store that failed once may answer the next time
                self.store.add(name, 1)
            if self._stop.wait(_BEAT_S):
                return

    def took(self, seconds: float) -> None:
        """This rank ran a generation in ``seconds``: published when it is its longest yet."""
        if self.store is not None and seconds > self._longest:
            self._longest = seconds
            with contextlib.suppress(Exception):  # only a hang's deadline depends on it
                self.store.set(f"{self.key}/took/{self.ctx.rank}", f"{seconds:.3f}")

    def _longest_by_rank(self, world: int) -> dict[int, float]:
        """The longest generation each rank has published (ranks that have finished none: absent)."""
        found = {self.ctx.rank: self._longest} if self._longest > 0 else {}
        for rank in range(world):
            took = f"{self.key}/took/{rank}"
            if rank != self.ctx.rank and self.store.check([took]):
                found[rank] = float(self.store.get(took))
        return found

    def _hang_deadline(self, rank: int, took: dict[int, float]) -> float | None:
        """How long after every prompt was taken ``rank`` is named as hung (None: not yet known)."""
        if rank in took:
            return max(_SILENT_S, _HANG_FACTOR * took[rank])
        if not took:
            return None  # no rank has finished a generation: nothing to measure by
        return max(_FIRST_HANG_S, _HANG_FACTOR * max(took.values()))

    def stop(self, why: str | None = None) -> None:
        """This rank leaves the run: no more beats; unless it arrived, the others are told
        (``why``: the reason they give; default ``interrupted``)."""
        self._stop.set()
        if self.store is not None and not self._arrived:
            with contextlib.suppress(Exception):
                self.store.set(f"{self.key}/left/{self.ctx.rank}", why or "interrupted")

    def depart(self, why: str) -> None:
        """Lockstep: this rank stops on its own error (``why``) and exits without arriving. The
        first rank to do so is recorded as the run's cause, which :meth:`raise_if_departed` and
        :meth:`arrive` name on the others (a rank that stops only because it left does not count)."""
        if self.store is None:
            return
        with contextlib.suppress(Exception):  # the job is going down; this rank's own line says why
            self.store.set(f"{self.key}/left/{self.ctx.rank}", why)
            if self.store.add(f"{self.key}/departed", 1) == 1:
                self.store.set(f"{self.key}/first", f"{self.ctx.rank}\t{why}")

    def departed(self) -> tuple[int, str] | None:
        """The first rank that stopped on its own error (:meth:`depart`), and why; None if none
        has, or it is this rank. One store read when none has. Raises :class:`PeerStopped` when
        the store cannot be reached (its holder, the launcher or rank 0, stopped)."""
        if self.store is None:
            return None
        first = f"{self.key}/first"
        try:
            if not self.store.check([first]):
                return None
            rank, _, why = self.store.get(first).decode().partition("\t")
        except Exception:  # noqa: BLE001 - whatever the store raises, its holder is gone
            raise PeerStopped("the job's store became unreachable (the rank or launcher holding it stopped); this "
                              "rank stops: see the other ranks' logs. The outputs written stay.") from None
        return None if int(rank) == self.ctx.rank else (int(rank), why)

    def raise_if_departed(self, what: str, cause: BaseException | None = None) -> None:
        """:class:`PeerStopped` naming the rank that stopped (:meth:`departed`), if one has;
        ``what`` says what this rank does (``stops before wave 2/3``). ``cause``: this rank's own
        error, which is raised instead if the store cannot be read."""
        try:
            found = self.departed()
        except PeerStopped:
            if cause is None:
                raise
            found = None  # a failure of this rank's own: its error says more than a lost store
        if found is not None:
            rank, why = found
            raise PeerStopped(f"rank {rank} stopped on an error ({why}); this rank, in lockstep with it, {what}. "
                              "See that rank's log; the outputs written stay.") from None

    def arrive(self) -> None:
        """Wait until every rank has reached the end of its prompts; :class:`PeerStopped` naming
        a rank that left the run without arriving, has shown no sign of life for
        :data:`_SILENT_S`, or hangs on its last prompt (see the class)."""
        if self.store is None:
            return  # the collective that follows is the barrier
        store, key, me, world = self.store, self.key, self.ctx.rank, self.ctx.world_size
        store.set(f"{key}/arrived/{me}", "1")
        self._arrived = True
        self._stop.set()
        arrived = f"{key}/arrived"
        store.add(arrived, 1)
        beats: dict[int, tuple[int, float]] = {}
        emptied: float | None = None  # when this rank first saw every prompt taken
        check = time.monotonic() + _BEAT_S
        while store.add(arrived, 0) < world:
            time.sleep(_ARRIVAL_POLL_S)
            # Lockstep: a rank that stopped on its error (one read while none has).
            self.raise_if_departed("ran its waves and stops at the end")
            now = time.monotonic()
            if now < check:
                continue
            check = now + _BEAT_S
            if self.hangs and emptied is None and store.add(key, 0) >= self.total:  # the claim counter
                emptied = now
            late = []
            for rank in range(world):
                if rank == me or store.check([f"{key}/arrived/{rank}"]):
                    continue
                if store.check([f"{key}/left/{rank}"]):
                    why = store.get(f"{key}/left/{rank}").decode()
                    raise PeerStopped(f"rank {rank} left the run before the end of its prompts ({why}); "
                                      "this rank ran its own prompts. The outputs written stay.")
                count = store.add(f"{key}/alive/{rank}", 0)
                seen = beats.get(rank)
                if seen is None or seen[0] != count:
                    beats[rank] = (count, now)
                elif now - seen[1] > _SILENT_S:
                    raise PeerStopped(f"rank {rank} has shown no sign of life for {_SILENT_S:g} s before the end "
                                      "of its prompts (its process died, or its host is unreachable); this rank "
                                      "ran its own prompts. See that rank's log; the outputs written stay.")
                late.append(rank)
            if emptied is None or not late:
                continue
            took = self._longest_by_rank(world)
            for rank in late:
                deadline = self._hang_deadline(rank, took)
                if deadline is not None and now - emptied > deadline:
                    measure = (f"{_HANG_FACTOR:g} times its own longest generation ({took[rank]:.1f} s)" if rank in took
                               else f"{deadline:g} s, on its first prompt")
                    raise PeerStopped(
                        f"rank {rank} still runs its last prompt {now - emptied:.0f} s after every prompt was taken, "
                        f"over {measure}: it hangs (a GPU that stopped, a write that never returns) though its "
                        "process lives; this rank ran its own prompts. See its log; the outputs written stay.")


def claim_indices(total: int, ctx: DistContext, key: str | None = None) -> Iterator[int]:
    """The prompt indices this rank runs, each claimed when the rank is ready for it: every
    index in ``range(total)`` goes to exactly one rank. Collective when it starts unless
    ``key`` (from :func:`_run_key`) is given (all ranks must call it): rank 0 names the run's
    counter."""
    store = None
    if ctx.backend is not None:
        store = default_store()
        key = key if key is not None else _run_key(ctx)
    if store is None:
        if ctx.world_size > 1:
            logger.warning("no c10d store to share prompts through: prompt k goes to rank k %% %d, "
                           "no padding", ctx.world_size)
        yield from static_indices(total, ctx.rank, ctx.world_size)
        return
    while (index := store.add(key, 1) - 1) < total:
        yield index


def _generate(omni: Omni, job: PromptJob, ctx: DistContext, out: _Output, report: RunReport,
              where: str) -> None:
    """Run one job; write its output unless it is padding; count it in ``report``. ``where``
    starts its log line (the wave, in lockstep)."""
    start = time.perf_counter()
    result = omni.generate(job.prompt, seed=job.seed, name=f"{job.index:05d}", fps=out.fps,
                           **out.sampling.to_kwargs())
    report.kind = result.kind
    report.compile_s += result.metadata["timings"].get("compile_s") or 0.0
    if job.padding:
        logger.info("%spadding call, or a share of a sample another rank of the group writes, done (%.1f s)",
                    where, time.perf_counter() - start)
        return
    result.metadata.update(index=job.index, rank=ctx.rank, world_size=ctx.world_size)
    # replace: an earlier run's 00000.gif beside this run's 00000.png would have no sidecar.
    saved = result.save(out.output_dir, video_format=out.video_format, replace=True)
    report.written.append(saved.media)
    report.local_count += 1
    logger.info("%sprompt %d %r -> %s (%.1f s)", where, job.index, job.prompt, saved.media,
                time.perf_counter() - start)


def _warn_earlier_outputs(output_dir: Path, count: int, ctx: DistContext) -> dict[Path, tuple[int, int]]:
    """One warning line when ``output_dir`` already holds numbered outputs: those of this run's
    numbers are replaced as it writes them, the others stay beside them. Logged by each host's
    first rank (a host writes its own folder), before any rank writes (the loop starts after a
    barrier). Returns the files of the earlier outputs this run's numbers replace, each with its
    inode and modification time, for :func:`_remove_unreplaced` (on the other ranks: none)."""
    if ctx.local_rank != 0:
        return {}
    files = numbered_files(output_dir)
    found = sorted(set(files.values()))
    if not found:
        return {}
    replaced = [k for k in found if k < count]
    kept = [k for k in found if k >= count]
    parts = []
    if replaced:
        parts.append(f"{_span(replaced)} will be replaced (with its media in any other format)")
    if kept:
        parts.append(f"{_span(kept)} past this run's {count} prompt(s) will stay as they are")
    logger.warning("--output-dir %s already holds outputs of an earlier run: %s", output_dir, "; ".join(parts))
    earlier = {}
    for path, k in files.items():
        if k < count:
            with contextlib.suppress(OSError):  # gone already: nothing to replace
                stat = path.stat()
                earlier[path] = (stat.st_ino, stat.st_mtime_ns)
    return earlier


def _remove_unreplaced(earlier: Mapping[Path, tuple[int, int]], output_dir: Path) -> None:
    """After a run that ended well (every rank has written: its end is a barrier): the earlier
    outputs of this run's numbers that are still there as they were. On one host there are none,
    as every output replaced its own. On several, each host writes its own folder, and which
    prompts a host runs changes from run to run (the next free rank takes the next prompt), so
    a host's folder would keep an earlier output k that another host wrote this time, beside the
    outputs of this run: the same number twice, with other seeds, once the folders are merged. A
    file written anew is another inode (each is renamed into place), so on a folder the hosts
    share, the files the other hosts wrote this run stay."""
    removed = []
    for path, (inode, mtime) in earlier.items():
        with contextlib.suppress(OSError):  # gone, or replaced by another host's rank meanwhile
            stat = path.stat()
            if (stat.st_ino, stat.st_mtime_ns) == (inode, mtime):
                path.unlink()
                removed.append(path.name)
    if removed:
        logger.info("removed %d file(s) of an earlier run from --output-dir %s, whose prompts other hosts wrote "
                    "this time (in their own --output-dir): %s", len(removed), output_dir, ", ".join(sorted(removed)))


def _span(indices: list[int]) -> str:
    """``3 (00000 to 00002)``, ``1 (00004)``: how many, and the first and last."""
    first, last = indices[0], indices[-1]
    return f"{len(indices)} ({first:05d})" if first == last else f"{len(indices)} ({first:05d} to {last:05d})"


def _log_by_rank(ran: list[int], ctx: DistContext) -> None:
    """Rank 0 logs which prompts each rank ran (a collective: every rank calls it)."""
    if ctx.backend is None:
        return
    everyone: list[list[int] | None] = [None] * ctx.world_size
    dist.all_gather_object(everyone, ran)
    logger.info("prompts by rank: %s", "; ".join(f"rank {r} {indices}" for r, indices in enumerate(everyone)))


def _output_kind(omni: Omni) -> str:
    """``video`` or ``image``, before anything is generated (a rank may generate nothing)."""
    return "video" if "num_frames" in inspect.signature(omni.pipeline.__call__).parameters else "image"


def _check_prompts(prompts: Sequence[str]) -> None:
    if not prompts:
        raise ValueError("no prompts to generate: give --prompt or a non-empty --prompts-file.")
