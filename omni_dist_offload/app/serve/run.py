"""Starting ``omni-offload serve``: join the ranks, build the pipeline, run the HTTP front-end on
rank 0 and the wave loop on every rank, stop on SIGTERM. See [Note: waves] in ``service.py``."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import torch.distributed as dist

from ...runtime.dist import DistContext, destroy_dist, maybe_init_dist
from ..api import Omni
from .http import HttpServer
from .metrics import ServeMetrics
from .service import _WAVE_GROUP_TIMEOUT, ServeOptions, Service, redact_prompts_in_logs

__all__ = ["run_serve"]

logger = logging.getLogger(__name__)


def run_serve(omni_factory: Callable[[], Omni], device: str | None, options: ServeOptions) -> int:
    """Join the ranks, build the pipeline with ``omni_factory()``, serve until SIGTERM."""
    ctx = maybe_init_dist(device)
    try:
        omni = omni_factory()
        redact_prompts_in_logs()  # every rank generates, so every rank's pipeline may log a prompt
        try:
            # Every rank creates the group, in the same order, after the pipeline's own groups.
            group = (dist.new_group(backend="gloo", timeout=_WAVE_GROUP_TIMEOUT)
                     if ctx.world_size > 1 else None)
            if ctx.rank != 0:
                signal.signal(signal.SIGTERM, _ignore_signal)
                signal.signal(signal.SIGINT, _ignore_signal)
                Service(omni, ctx, options, group).follow()
                return 0
            return _serve_rank0(omni, ctx, options, group)
        finally:
            omni.close()
    finally:
        destroy_dist(ctx)


def _serve_rank0(omni: Omni, ctx: DistContext, options: ServeOptions,
                 group: dist.ProcessGroup | None) -> int:
    service = Service(omni, ctx, options, group)
    service.metrics = ServeMetrics(service)
    server = HttpServer(service)
    signal.signal(signal.SIGTERM, service.request_stop)
    signal.signal(signal.SIGINT, service.request_stop)
    try:
        if not server.start():
            logger.error("could not listen on %s:%d (see the error above); stopping",
                         options.host, options.port)
            service.request_stop()
            service.run()  # sends the stop wave
            return 1
        logger.info("serving %s (%ss) on http://%s:%d with %d rank(s)", omni.model,
                    service.limits.kind, options.host, options.port, ctx.world_size)
        service.run()
    finally:
        server.stop()
    logger.info("stopped")
    return 0


def _ignore_signal(signum: int, _frame: object) -> None:
    logger.info("%s: waiting for rank 0's stop wave", signal.Signals(signum).name)
