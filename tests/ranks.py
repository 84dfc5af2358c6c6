"""Run a test's worker function on several ranks, as torchrun would start them.

``run_ranks(worker, world=2)`` starts ``world`` processes with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``PORT`` of
a rendezvous store this process holds, as torchrun's agent does, ``OMP_NUM_THREADS=1``,
``OMNI_OFFLOAD_ALLOW_GLOO=1``), initialises the process group on
each (gloo on the CPU; NCCL with one GPU per rank, ``cuda:LOCAL_RANK``, on CUDA; gloo with ranks
sharing GPUs where a host has fewer GPUs than ranks), calls
``worker(rank, *args)`` there and returns what each rank's call returned, in rank order.

The worker is a module-level function of the test file, so it travels by reference (the rank
imports its module); ``rank`` is a :class:`Rank`. What it returns goes back as JSON (tuples
come back as lists, anything else JSON cannot hold as its ``str``). A rank that raises fails the
test with its traceback and the tail of its output; so does one that writes nothing, or that is
still running after ``timeout`` seconds (the others are stopped).

On the CPU the ranks are forked from a server process (multiprocessing's forkserver) that has
already imported torch, diffusers and the package: a rank starts in a fraction of a second
instead of the several seconds those imports take. On CUDA they are spawned (CUDA cannot be
used in a forked child). Each rank's environment is this process's at the call (plus the above
and ``env``), as for a subprocess.

``start_ranks`` starts the ranks and returns at once (a server the test then calls); its
``RankJob.wait`` is the rest of ``run_ranks``. ``start_forked`` runs one command-like function
in a process forked the same way (a one-rank server, the CLI's exit status), and ``preloaded``
is the context for a process pool.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.distributed as dist

__all__ = ["RankJob", "Rank", "preloaded", "proc_status", "run_ranks", "start_forked", "start_ranks"]

#: Imported once by the forkserver, before it forks any rank.
PRELOAD = ["torch", "torch.distributed", "omni_dist_offload", "omni_dist_offload.loading.coldstart",
           "omni_dist_offload.tools.soak", "diffusers", "transformers", "tiny_models", "toys", "faults"]
#: After a rank has failed, how long the others get to finish before they are stopped.
GRACE_S = 10.0
LOG_TAIL = 3000


@dataclasses.dataclass(frozen=True)
class Rank:
    """Where the worker runs: its rank, the job's shape, and its device."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device
    """``cpu``, or this rank's ``cuda:LOCAL_RANK`` (the current device)."""
    result_path: str

    def report(self, result: Any) -> None:
        """Publish this rank's result now: for a rank about to end itself on purpose
        (``os._exit``), which returns nothing. A later return replaces it."""
        _write(self.result_path, {"result": result})


def run_ranks(worker: Callable[..., Any], world: int = 2, *, local_world: int | None = None,
              args: tuple = (), env: dict[str, str | None] | None = None, device: str = "cpu",
              timeout: float = 180.0, broken_group: bool = False) -> list[Any]:
    """Run ``worker(rank, *args)`` on ``world`` ranks, ``local_world`` per host (default: all on
    one host), and return each rank's result.

    ``env`` adds variables to the ranks' environment, or removes them (value ``None``); e.g.
    ``{"OMNI_OFFLOAD_ALLOW_GLOO": None}``. ``broken_group``: the worker breaks the process group
    on purpose (a rank that diverges or dies), so the ranks end without its teardown."""
    job = start_ranks(worker, world, local_world=local_world, args=args, env=env, device=device,
                      broken_group=broken_group)
    return job.wait(timeout)


def start_ranks(worker: Callable[..., Any], world: int = 2, *, local_world: int | None = None,
                args: tuple = (), env: dict[str, str | None] | None = None, device: str = "cpu",
                broken_group: bool = False) -> "RankJob":
    """:func:`run_ranks` without the wait: the ranks run while the test talks to them (a server);
    :meth:`RankJob.wait` collects their results, as ``run_ranks`` does."""
    assert "<locals>" not in worker.__qualname__, f"{worker.__qualname__}: the worker must be a module-level function"
    local_world = local_world or world
    assert world % local_world == 0, (world, local_world)
    device = torch.device(device)
    context = _context(device)
    # The rendezvous store is this process's, on a port it holds until the ranks are done (as
    # torchrun's agent does): a port picked and released here could be taken, or picked by
    # another job's ranks too, before rank 0 bound it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world), "OMP_NUM_THREADS": "1", "OMNI_OFFLOAD_ALLOW_GLOO": "1",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for key, value in (env or {}).items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    job = RankJob(worker.__name__, store, Path(tempfile.mkdtemp(prefix="ranks-")), world)
    try:
        for rank, (result, log) in enumerate(job.files):
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank % local_world),
                        "GROUP_RANK": str(rank // local_world)}
            info = Rank(rank, world, rank % local_world, local_world, device, str(result))
            target = (worker.__module__, worker.__qualname__)  # imported by the rank, into its log
            proc = context.Process(target=_rank_main, args=(target, args, rank_env, info, str(log), broken_group),
                                   name=f"{worker.__name__}-rank{rank}")
            proc.start()
            job.procs.append(proc)
    except BaseException:
        job.stop()
        raise
    return job


class RankJob:
    """Ranks started by :func:`start_ranks`: their processes and logs, until :meth:`wait`."""

    def __init__(self, name: str, store: dist.TCPStore, tmp: Path, world: int) -> None:
        self.name, self.store, self.tmp = name, store, tmp
        self.files = [(tmp / f"rank{r}.json", tmp / f"rank{r}.log") for r in range(world)]
        self.procs: list = []
        self.outputs: list[str] | None = None

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def output(self, rank: int) -> str:
        """What the rank printed so far (all of it, once stopped)."""
        if self.outputs is not None:
            return self.outputs[rank]
        log = self.files[rank][1]
        return log.read_text(errors="replace") if log.exists() else ""

    def stop(self) -> None:
        """Kill the ranks still running and remove their files, keeping what they printed."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        if self.outputs is None:
            self.outputs = [self.output(rank) for rank in range(len(self.files))]
        shutil.rmtree(self.tmp, ignore_errors=True)

    def wait(self, timeout: float = 180.0) -> list[Any]:
        """Each rank's result, or the test fails naming the ranks that did not give one."""
        world = len(self.files)
        try:
            running, first_failure = _wait(self.procs, [result for result, _ in self.files], timeout)
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
            outcomes = [_read(result) for result, _ in self.files]
            problems = []
            for rank, (proc, outcome) in enumerate(zip(self.procs, outcomes)):
                if outcome is not None and "error" in outcome:
                    why = f"failed:\n{outcome['error']}"
                elif rank in running and first_failure is not None:
                    why = f"was still running {GRACE_S:.0f} s after rank {first_failure} failed, and was stopped"
                elif rank in running:
                    why = f"was still running after {timeout:.0f} s, and was stopped"
                elif outcome is None:
                    why = f"ended without a result (exit code {proc.exitcode})"
                else:
                    continue
                problem = (f"rank {rank} of {world} ({self.name}) {why}\n--- its output, last "
                           f"{LOG_TAIL} characters ---\n{self.output(rank)[-LOG_TAIL:]}")
                problems.insert(0 if rank == first_failure else len(problems), problem)  # the first failure first
        finally:
            self.stop()
        if problems:
            pytest.fail("\n\n".join(problems), pytrace=False)
        return [outcome["result"] for outcome in outcomes]


def start_forked(target: Callable[..., int], args: tuple, *, env: dict[str, str], log: Path, cwd: Path,
                 max_files: int | None = None) -> "Forked":
    """``target(*args)`` in a process of its own, forked from the preloaded server as ranks are
    (a command that would import torch and diffusers afresh starts in a fraction of a second),
    with ``env`` as its whole environment, ``cwd``, stdout and stderr to ``log``, and at most
    ``max_files`` open files. What ``target`` returns is the exit status, as a command's."""
    assert "<locals>" not in target.__qualname__, f"{target.__qualname__}: the target must be a module-level function"
    proc = _context(torch.device("cpu")).Process(
        target=_forked_main, args=((target.__module__, target.__qualname__), args, env, str(log), str(cwd), max_files),
        name=target.__name__)
    proc.start()
    return Forked(proc)


class Forked:
    """A process of :func:`start_forked`, with the ``subprocess.Popen`` calls a test makes."""

    def __init__(self, proc) -> None:
        self._proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise TimeoutError(f"process {self.pid} still running after {timeout} s")
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()
        self._proc.join()


def _start_as_told(log: str, mode: int, env: dict[str, str]) -> None:
    """A forked process's start: stdout and stderr to ``log`` (``mode``: ``os.O_APPEND`` or
    ``os.O_TRUNC``), line-buffered so that it can be read while the process runs (a server), and
    ``env`` as its whole environment."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | mode, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):  # read by OpenMP when the server imported torch: set it here
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _function(target: tuple[str, str]) -> Callable[..., Any]:
    """A module-level function by (module, qualified name), imported here (into the log)."""
    function = importlib.import_module(target[0])
    for name in target[1].split("."):
        function = getattr(function, name)
    return function


def _forked_main(target: tuple[str, str], args: tuple, env: dict[str, str], log: str, cwd: str,
                 max_files: int | None) -> None:
    _start_as_told(log, os.O_APPEND, env)
    os.chdir(cwd)
    if max_files is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))
    code = 1
    try:
        code = _function(target)(*args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # as at a command's exit (a forked child skips them)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def shared_copy_mappings(ignore: Sequence[int] = ()) -> list[str]:
    """This process's descriptors (but ``ignore``) and mappings of shared host copies: empty once
    every shared copy it held is released."""
    gc.collect()
    found = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if int(fd) not in ignore
             and os.path.exists(f"/proc/self/fd/{fd}") and "omni-offload" in os.readlink(f"/proc/self/fd/{fd}")]
    found += [line for line in Path("/proc/self/maps").read_text().splitlines() if "omni-offload" in line]
    return found


def proc_status(field: str) -> int:
    """A memory figure of this process's /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def preloaded() -> multiprocessing.context.BaseContext:
    """The forkserver context ranks start from, for a process pool: its processes start with
    torch, diffusers and the package imported."""
    return _context(torch.device("cpu"))


def _context(device: torch.device) -> multiprocessing.context.BaseContext:
    if device.type == "cuda":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first call)
    return context


def _wait(procs: list, results: list[Path], timeout: float) -> tuple[set[int], int | None]:
    """Wait for every rank, at most ``timeout`` s, or ``GRACE_S`` after a rank has failed (or
    ended without a result). Return the ranks still running then, and the rank that failed first."""
    deadline = time.monotonic() + timeout
    running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    first_failure = None
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for sentinel in multiprocessing.connection.wait(list(running), timeout=left):
            rank = running.pop(sentinel)
            outcome = _read(results[rank])
            if first_failure is None and (outcome is None or "error" in outcome):
                first_failure = rank
                deadline = min(deadline, time.monotonic() + GRACE_S)
    return set(running.values()), first_failure


def _write(path: str, outcome: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(outcome, f, default=str)
    os.replace(tmp, path)


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _rank_main(target: tuple[str, str], args: tuple, env: dict[str, str], info: Rank, log: str,
               broken_group: bool) -> None:
    """One rank: output to its log, torchrun's environment, the process group, the worker."""
    _start_as_told(log, os.O_TRUNC, env)
    code = 0
    try:
        worker = _function(target)
        if info.device.type == "cuda":
            # More ranks per host than GPUs: ranks share them, over gloo (NCCL refuses two
            # ranks on one GPU). Transfers that do not need NCCL (rank-local, shared) run so on
            # a one-GPU machine.
            count = torch.cuda.device_count()
            device = torch.device("cuda", info.local_rank % count)
            torch.cuda.set_device(device)
            info = dataclasses.replace(info, device=device)
            if info.local_world <= count:
                dist.init_process_group("nccl", device_id=device)
            else:
                dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo")
        _write(info.result_path, {"result": worker(info, *args)})
    except BaseException:
        _write(info.result_path, {"error": traceback.format_exc()})
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code or broken_group:
        os._exit(code)  # no teardown: the group is broken, on purpose or by the failure
    dist.destroy_process_group()
