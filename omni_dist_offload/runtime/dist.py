"""Process-group start-up for torchrun jobs: the one way every entry point joins (or skips) it.

With one process :func:`maybe_init_dist` does nothing but pick the device, so the same code
runs alone and under torchrun (``maybe_init_dist`` in gpt-fast's sense).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["DistContext", "PeerFailed", "agree_on_step", "build_on_every_rank", "default_store", "destroy_dist",
           "maybe_init_dist"]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DistContext:
    """Where this process sits in the torchrun job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    """``nccl``, ``gloo``, or ``None`` when no process group was created (one process)."""
    device: torch.device = torch.device("cpu")
    """This rank's device: ``cuda:LOCAL_RANK`` (current) on a GPU host, else the CPU."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def maybe_init_dist(device: str | torch.device | None = None) -> DistContext:
    """Join the torchrun process group when there is more than one process; else do nothing.

    On CUDA the rank's device is ``cuda:LOCAL_RANK`` (set as current) and the backend NCCL;
    on the CPU (or with ``device="cpu"``) the backend is gloo."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    dev = torch.device("cpu")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} has no GPU: this host has {torch.cuda.device_count()}; "
                "start at most that many processes per node (torchrun --nproc_per_node)."
            )
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    if world_size == 1:
        return DistContext(rank=rank, world_size=1, local_rank=local_rank, device=dev)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=dev if use_cuda else None)
    logger.info("joined %d ranks (%s)", world_size, backend)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device=dev)


def destroy_dist(ctx: DistContext) -> None:
    """Leave the process group that :func:`maybe_init_dist` joined, if any."""
    if ctx.backend is not None and dist.is_initialized():
        dist.destroy_process_group()


def default_store() -> dist.Store | None:
    """The default process group's store, where this torch has one to give (a private helper
    of torch's, so its absence is not an error)."""
    get_store = getattr(distributed_c10d, "_get_default_store", None)
    if get_store is None:
        return None
    try:
        return get_store()
    except (RuntimeError, ValueError):
        return None


class PeerFailed(RuntimeError):
    """Another rank could not finish a step every rank takes together (loading the model): this
    rank stops with it rather than wait in a collective that rank never reaches."""


# Numbers each agreement of this process; every rank takes the same steps, so the same number
# names the same step on every rank.
_AGREEMENTS = itertools.count()


def agree_on_step(step: str, error: BaseException | None, timeout_s: float | None = None) -> None:
    """Every rank of the default group says whether it got through ``step`` (``error`` None) or
    why not, and waits until all have said (at most ``timeout_s``; None: the store's timeout).
    A rank that got through raises :class:`PeerFailed` naming the first rank that did not; a
    rank that failed returns (it raises its own error).

    Through the group's store, not a collective: a rank that failed before its device or
    backend was ready can still take part, and a wait for a rank that never comes ends at the
    store's timeout naming it. Does nothing with one rank, or without a store (then a failed
    rank's peers learn of it from the next collective, as before)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    store = default_store()
    if store is None:
        return
    me, world = dist.get_rank(), dist.get_world_size()
    prefix = f"omni_offload/agree/{next(_AGREEMENTS)}"
    why = "" if error is None else f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    store.set(f"{prefix}/{me}", "ok" if error is None else f"failed {why}")
    keys = [f"{prefix}/{rank}" for rank in range(world)]
    try:
        if timeout_s is None:
            store.wait(keys)
        else:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - the timeout (or a store gone): name who is missing
        if error is not None:
            return
        missing = [rank for rank, key in enumerate(keys) if not _check(store, key)]
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else getattr(store, "timeout", None)
        within = f" within {timeout.total_seconds():g} s" if isinstance(timeout, datetime.timedelta) else ""
        raise PeerFailed(f"rank(s) {', '.join(map(str, missing)) or '?'} did not {step}{within} (a process that "
                         "died, or a host far slower than the others); every rank stops: see their logs.") from None
    if error is not None:
        return
    for rank, key in enumerate(keys):
        said = store.get(key).decode()
        if said != "ok":
            raise PeerFailed(f"rank {rank} could not {step} ({said.removeprefix('failed ')}); every rank stops: "
                             "see that rank's log.")


def _check(store: dist.Store, key: str) -> bool:
    with contextlib.suppress(Exception):
        return store.check([key])
    return False


def build_on_every_rank(step: str, build: Callable[[], _T]) -> _T:
    """``build()`` on every rank, then :func:`agree_on_step`: a rank whose build raised tells
    the others, which close what they built (its ``close()``, if any) and raise
    :class:`PeerFailed`, instead of waiting for that rank in their first collective."""
    try:
        built = build()
    except Exception as exc:
        with contextlib.suppress(Exception):  # the agreement failing too must not hide why this rank failed
            agree_on_step(step, exc)
        raise
    try:
        agree_on_step(step, None)
    except BaseException:
        close = getattr(built, "close", None)
        if close is not None:
            close()
        raise
    return built
