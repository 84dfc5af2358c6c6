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
import time
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
#: Set on an exception this rank has told the others of (or learnt from them, PeerFailed): an
#: agreement telling it again would be one the others never join.
_TOLD = "_omni_offload_told"
#: How often a rank waiting for the others' answers looks at the store.
_AGREE_POLL_S = 0.2


def tell_peers(agree: Callable[[BaseException | None], None] | None, error: BaseException) -> None:
    """Tell the other ranks, through ``agree`` (a step of :func:`agree_on_step`; None: alone), why
    this rank failed, before it raises ``error``. The telling failing too must not hide the
    reason: it is dropped, and ``error`` raised as it is."""
    if agree is not None:
        with contextlib.suppress(Exception):
            agree(error)


def agree_on_step(step: str, error: BaseException | None, timeout_s: float | None = None) -> None:
    """Every rank of the default group says whether it got through ``step`` (``error`` None) or
    why not. A rank that got through waits for every answer (at most ``timeout_s``; None: the
    store's timeout) and raises :class:`PeerFailed` naming the first rank that failed, as soon
    as one has said so. A rank that failed says why and returns at once (it raises its own
    error): the others read it when they get there. Only a failed rank 0 of a job that holds its
    own store (started without torchrun's agent store) waits for them, since its exit would take
    the answer with it.

    Through the group's store, not a collective: a rank that failed before its device or
    backend was ready can still take part, and a wait for a rank that never comes ends at the
    timeout naming it. Does nothing with one rank, without a store (then a failed rank's peers
    learn of it from the next collective), or for an error already told."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    if error is not None and getattr(error, _TOLD, False):
        return
    store = default_store()
    if store is None:
        return
    me, world = dist.get_rank(), dist.get_world_size()
    prefix = f"omni_offload/agree/{next(_AGREEMENTS)}"
    keys = [f"{prefix}/{rank}" for rank in range(world)]
    if timeout_s is None:
        timeout = getattr(store, "timeout", None)
        timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 1800.0
    if error is not None:
        interrupted = isinstance(error, KeyboardInterrupt)
        first = (str(error).strip().splitlines() or [""])[0]
        why = "interrupted" if interrupted else f"{type(error).__name__}: {first}"
        store.set(keys[me], f"failed {why}")
        with contextlib.suppress(Exception):
            setattr(error, _TOLD, True)
        if me == 0 and not interrupted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            logger.error("%s; waiting up to %g s for the other ranks to reach '%s' and read it (this rank "
                         "holds the job's store)", why, timeout_s, step)
            with contextlib.suppress(Exception):
                _answers(store, keys, step, timeout_s, stop_at_failure=False)
        return
    store.set(keys[me], "ok")
    _answers(store, keys, step, timeout_s, stop_at_failure=True)


def _answers(store: dist.Store, keys: list[str], step: str, timeout_s: float, stop_at_failure: bool) -> None:
    """Poll until every rank has answered (or, ``stop_at_failure``, one has failed: raised)."""
    deadline = time.monotonic() + timeout_s
    said: dict[int, str] = {}
    while True:
        try:
            for rank, key in enumerate(keys):
                if rank not in said and store.check([key]):
                    said[rank] = store.get(key).decode()
        except Exception:  # noqa: BLE001 - the store's host (rank 0, or torchrun's agent) is gone
            raise _told(PeerFailed(f"the job's store became unreachable while the ranks agreed to {step} (the "
                                   "rank or launcher holding it stopped); every rank stops: see the other ranks' "
                                   "logs.")) from None
        failed = sorted((rank, answer) for rank, answer in said.items() if answer != "ok")
        if failed and stop_at_failure:
            rank, answer = failed[0]
            raise _told(PeerFailed(f"rank {rank} could not {step} ({answer.removeprefix('failed ')}); every rank "
                                   "stops: see that rank's log."))
        if len(said) == len(keys):
            return
        if time.monotonic() > deadline:
            missing = ", ".join(str(r) for r in range(len(keys)) if r not in said)
            raise _told(PeerFailed(f"rank(s) {missing} did not {step} within {timeout_s:g} s (a process that died, "
                                   "or a host far slower than the others); every rank stops: see their logs."))
        time.sleep(_AGREE_POLL_S)


def _told(exc: PeerFailed) -> PeerFailed:
    setattr(exc, _TOLD, True)
    return exc


def build_on_every_rank(step: str, build: Callable[[], _T]) -> _T:
    """``build()`` on every rank, then :func:`agree_on_step`: a rank whose build raised tells
    the others, which close what they built (its ``close()``, if any) and raise
    :class:`PeerFailed`, instead of waiting for that rank in their first collective."""
    try:
        built = build()
    except BaseException as exc:  # an interrupt too: the others are told at once
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
