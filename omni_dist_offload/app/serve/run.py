"""Starting ``omni-offload serve``: join the ranks, build the pipeline, run the HTTP front-end on
rank 0 and the generation loop on every rank, stop on SIGTERM. See [Note: waves] in
``service.py``."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed as dist

from ...runtime.dist import DistContext, build_on_every_rank, destroy_dist, maybe_init_dist
from ..api import Omni
from ..dp import check_same_run
from .http import HttpServer
from .metrics import ServeMetrics
from .service import _WAVE_GROUP_TIMEOUT, OutOfStep, RankLink, ServeOptions, Service, redact_prompts_in_logs

__all__ = ["run_serve"]

logger = logging.getLogger(__name__)


def run_serve(omni_factory: Callable[[], Omni], device: str | None, options: ServeOptions,
              setup: Mapping[str, Any] | None = None) -> int:
    """Join the ranks, check that they were given the same ``setup`` (``check_same_run``),
    build the pipeline with ``omni_factory()``, serve until SIGTERM."""
    ctx = maybe_init_dist(device)
    try:
        check_same_run((), 0, None, None, ctx, setup=setup)
        omni = build_on_every_rank("load the model", omni_factory)  # one rank failing stops them all
        redact_prompts_in_logs()  # every rank generates, so every rank's pipeline may log a prompt
        try:
            group, links = _service_groups(omni, ctx)
            if ctx.rank != 0:
                signal.signal(signal.SIGTERM, _ignore_signal)
                signal.signal(signal.SIGINT, _ignore_signal)
                Service(omni, ctx, options, group, links=links).follow()
                return 0
            return _serve_rank0(Service(omni, ctx, options, group, links=links))
        finally:
            omni.close()
    finally:
        destroy_dist(ctx)


def _service_groups(omni: Omni, ctx: DistContext) -> tuple[dist.ProcessGroup | None, list[RankLink]]:
    """The gloo groups the service talks over, beside the pipeline's own: in lockstep one group
    of every rank for the waves; free, a two-rank group between rank 0 and each other rank (this
    rank's ends of them). ``new_group`` is collective, so every rank creates every group, in the
    same order, after the pipeline's (``omni.lockstep`` is the same on every rank)."""
    if ctx.world_size == 1:
        return None, []
    if omni.lockstep:
        return dist.new_group(backend="gloo", timeout=_WAVE_GROUP_TIMEOUT), []
    links = []
    for peer in range(1, ctx.world_size):
        group = dist.new_group([0, peer], backend="gloo", timeout=_WAVE_GROUP_TIMEOUT)
        if ctx.rank == 0:
            links.append(RankLink(group, 0, peer))
        elif ctx.rank == peer:
            links.append(RankLink(group, peer, 0))
    return None, links


def _serve_rank0(service: Service) -> int:
    omni, options = service.omni, service.options
    service.metrics = ServeMetrics(service)
    server = HttpServer(service)
    with _stop_on_signals(service.request_stop):
        try:
            if not server.start():
                logger.error("could not listen on %s:%d (see the error above); stopping",
                             options.host, options.port)
                service.request_stop()
                service.run()  # tells the other ranks to stop
                return 1
            how = ("" if service.ctx.world_size == 1 else
                   ", in padded waves (a ring gathers its weights: lockstep)" if service.lockstep else
                   ", each taking the next request when free")
            # Tools and tests read the port from this line (tools/serve_stress.py: SERVING_LINE).
            logger.info("serving %s (%ss) on http://%s:%d with %d rank(s)%s", omni.model,
                        service.limits.kind, options.host, server.port, service.ctx.world_size, how)
            try:
                service.run()
            except OutOfStep:  # logged where found; the other ranks were told to stop
                return 1
        finally:
            server.stop()
    logger.info("stopped")
    return 0


# [Note: signals while generating]
# Python runs a signal's handler on the main thread, between two bytecodes; rank 0's main thread
# generates, and one torch op on the CPU (a large attention, a VAE decode) can run for minutes
# without a bytecode in between. A handler on the main thread would so leave /health "ok" and
# new requests queued for that long after SIGTERM. Instead, the C-level handler Python installs
# writes the signal's number to a wakeup socket (signal.set_wakeup_fd) from whichever thread the
# signal interrupted, at once, and a thread of its own reads it and requests the stop (the main
# thread's Python-level handler, run whenever that thread gets to it, does nothing more). The
# generation loop, the stop message to the other ranks and the HTTP server's shutdown stay as
# they were: the main thread sees the stop flag once its running wave ends.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _stop_on_signals(request_stop: Callable[[], None]) -> Iterator[None]:
    """Calls ``request_stop`` the moment SIGTERM or SIGINT arrives, whatever the main thread is
    doing (see [Note: signals while generating]). Main thread only (``set_wakeup_fd``)."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # the C handler must never block on it

    def watch() -> None:
        while data := reader.recv(64):  # empty once the writer is closed, below
            if any(signum in _STOP_SIGNALS for signum in data):
                request_stop()

    # The handlers must be Python's (not SIG_DFL / SIG_IGN) for its C handler to write the socket.
    previous = {signum: signal.signal(signum, _noted) for signum in _STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="serve-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        writer.close()
        watcher.join(timeout=5)
        reader.close()


def _noted(_signum: int, _frame: object) -> None:
    """The main thread's handler of SIGTERM / SIGINT on rank 0: the watcher thread has acted on the
    signal already (see [Note: signals while generating])."""


def _ignore_signal(signum: int, _frame: object) -> None:
    logger.info("%s: waiting for rank 0's stop message", signal.Signals(signum).name)
