"""The service's Prometheus metrics (``GET /metrics``), in a registry of its own.

With free ranks (no lockstep, see [Note: waves] in ``service.py``) every slot counts as a wave
of one without padding: ``omni_serve_waves_total`` counts slots run, ``omni_serve_wave_seconds``
times each slot on the rank that ran it, ``omni_serve_padded_slots_total`` stays 0.
``omni_serve_lockstep`` says which mode runs; ``omni_serve_ranks_serving`` how many ranks take
work (fewer than ``omni_serve_world_size`` once a free rank has failed).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..api import Omni
from .service import Service

__all__ = ["ServeMetrics"]

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class ServeMetrics:
    """The service's Prometheus metrics, in a registry of its own."""

    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omni_serve_requests", "Generation requests answered, by code.",
                                ["endpoint", "code"], registry=r)
        self.errors = Counter("omni_serve_request_errors", "Generation requests answered with "
                              "an error (4xx, 5xx).", ["endpoint", "code"], registry=r)
        self.latency = Histogram("omni_serve_request_seconds", "Time from request to answer of "
                                 "successful generation requests.", ["endpoint"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.outputs = Counter("omni_serve_outputs", "Images or videos generated.",
                               ["kind"], registry=r)
        self.abandoned = Counter("omni_serve_abandoned", "Images or videos of requests whose client "
                                 "went away: dropped from the queue (stage=queued) or generated and "
                                 "discarded (stage=running).", ["endpoint", "stage"], registry=r)
        self.waves = Counter("omni_serve_waves", "Waves run (one slot per rank; free ranks: "
                             "one slot each).", registry=r)
        self.padded = Counter("omni_serve_padded_slots", "Padding slots run to fill waves.", registry=r)
        self.wave_seconds = Histogram("omni_serve_wave_seconds", "Time of one wave, broadcast to "
                                      "gather (free ranks: of one slot, sent to answered).",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        Gauge("omni_serve_queue_depth", "Images or videos queued, not yet in a wave.",
              registry=r).set_function(service.queue.depth)
        self.prompt_checks: Callable[[], int] = lambda: 0
        """How many requests wait for their prompt check or run one (the HTTP app sets it)."""
        Gauge("omni_serve_prompt_checks_waiting", "Requests waiting for their prompt's tokens to be "
              "counted, or being counted.", registry=r).set_function(lambda: self.prompt_checks())
        Gauge("omni_serve_world_size", "Ranks that generate.", registry=r).set(service.ctx.world_size)
        Gauge("omni_serve_lockstep", "1: the ranks run in padded waves (a ring gathers its "
              "weights); 0: each rank takes the next slot when free.", registry=r).set(int(service.lockstep))
        Gauge("omni_serve_ranks_serving", "Ranks taking work: the world size, less free ranks "
              "that failed.", registry=r).set_function(service.ranks_serving)
        self._offload_gauges(service)

    def _offload_gauges(self, service: Service) -> None:
        labels = ["component"]
        self.offload = {key: Gauge(f"omni_offload_{key}", f"Offload summary: {key} of each streamed "
                                   "ring (rank 0), as of the last wave.", labels, registry=self.registry)
                        for key in ("num_blocks", "block_bytes", "host_bytes", "device_slot_bytes")}
        self._set_offload(service.omni)
        self.trace_wait = Gauge("omni_offload_exposed_wait_seconds", "Trace (OMNI_OFFLOAD_TRACE=1): "
                                "compute standing still for weights in the last forward (rank 0).",
                                labels, registry=self.registry)
        self.trace_forward = Gauge("omni_offload_forward_seconds", "Trace (OMNI_OFFLOAD_TRACE=1): "
                                   "the last forward of each ring (rank 0).", labels, registry=self.registry)

    def _set_offload(self, omni: Omni) -> None:
        # A residency plan changes them after a measured forward (resident blocks and kept parts
        # leave the host, the slots shrink): read again after every wave this rank ran.
        for row in omni.summary_rows():
            for key, gauge in self.offload.items():
                gauge.labels(row.component).set(getattr(row, key))

    def wave_done(self, kind: str, done: int, padded: int, seconds: float, omni: Omni | None) -> None:
        """Called by rank 0 after each wave (free ranks: each slot), from its generation loop
        or, for a slot another rank ran, from that rank's dispatcher thread (``omni`` None).
        Thread-safe: prometheus_client's counters and histograms lock, and only the generation
        loop, which ran the slot on this rank, reads the offload summary and trace."""
        self.waves.inc()
        self.padded.inc(padded)
        self.outputs.labels(kind).inc(done)
        self.wave_seconds.observe(seconds)
        if omni is not None:
            self._set_offload(omni)
        handle = omni.handle if omni is not None else None
        if handle is not None and handle.rings and all(r.tracer is not None for r in handle.rings):
            for row in handle.trace_report():
                self.trace_wait.labels(row["component"]).set(row["exposed_wait_ms"] / 1e3)
                self.trace_forward.labels(row["component"]).set(row["forward_ms"] / 1e3)

    def abandoned_slots(self, endpoint: str, queued: int, running: int) -> None:
        """A request's client went away: ``queued`` slots were dropped, ``running`` ran in vain."""
        self.abandoned.labels(endpoint, "queued").inc(queued)
        self.abandoned.labels(endpoint, "running").inc(running)

    def answered(self, endpoint: str, code: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(code)).inc()
        if code >= 400:
            self.errors.labels(endpoint, str(code)).inc()
        else:
            self.latency.labels(endpoint).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
