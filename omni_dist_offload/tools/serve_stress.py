"""Load and abuse check for ``omni-offload serve``: many concurrent requests, then thousands of
stalled uploads while normal requests keep coming; and, on its own, a throughput measurement
with mixed image sizes.

The tool starts the server itself (``python -m omni_dist_offload serve --model tiny-flux --port 0``:
on a free loopback port it picks and logs, its output in a log file of a temporary folder; with
``--ranks N`` under ``torchrun --standalone --nproc_per_node N``), or drives one already running
(``--url``). It only ever sends to 127.0.0.1.

* load: ``--requests`` image requests from ``--in-flight`` concurrent clients. Every answer must
  be a 200 carrying the seed that was sent; the server's RSS at the end may be at most
  ``--rss-tolerance`` above its RSS once the first ``--in-flight`` were answered; the
  ``/metrics`` counters must have risen by exactly what was sent.
* abuse: the p95 latency of 20 requests one at a time (unloaded); then ``--stalled`` connections
  that send the headers of an image request and the first bytes of its body, then nothing, held
  open for ``--hold`` seconds while a probe request goes out every ``--probe-interval`` seconds.
  Every probe must be a 200, their p95 at most ``--p95-factor`` times the unloaded one; the
  server's log may grow less than ``--max-log-bytes``; its RSS ``--settle`` seconds after the
  stalled connections closed may be at most ``--rss-tolerance`` above its RSS before.
* throughput (``--phase throughput``, not part of ``both``): ``--warmup`` unmeasured requests
  (default 2 per rank), then ``--requests`` requests from ``--in-flight`` concurrent clients.
  Request i asks for the size ``--sizes[i % len(sizes)]`` with seed i, so two runs send the same
  requests in the same order. Every answer must be a 200 carrying its seed and size. It reports
  the wall time, images per minute, p50/p95 latency per size, and from ``/metrics`` the waves,
  padded slots and ``omni_serve_lockstep``: free ranks against lockstep waves on the same
  requests (see "Several GPUs" in docs/serving.md).

A server the tool started must then stop on SIGTERM with status 0 within 30 s (under torchrun the
SIGTERM goes to rank 0, which stops the others). The last line is ``serve_stress PASS`` or
``serve_stress FAIL`` with the checks that failed and the figures; the exit status is 1 on FAIL.

    python -m omni_dist_offload.tools.serve_stress                                  # both phases
    python -m omni_dist_offload.tools.serve_stress --requests 200 --in-flight 20 --stalled 2000 --hold 10
    python -m omni_dist_offload.tools.serve_stress --phase abuse -- --max-connections 20000
    python -m omni_dist_offload.tools.serve_stress --serve-flag=--read-timeout=5 --json stress.json
    python -m omni_dist_offload.tools.serve_stress --url http://127.0.0.1:8000 --pid 4242 --log serve.log

Free ranks (``shared`` weights) against allgather's padded waves, two ranks, the same requests::

    python -m omni_dist_offload.tools.serve_stress --phase throughput --ranks 2 --requests 48 \
        --in-flight 8 --steps 4 --sizes 64x64,128x128 --json free.json -- --diffusion-offload-config \
        '{"mode":"layer","components":["dit"],"layer_options":{"dit":{"weight_transfer":"shared"}}}'
    python -m omni_dist_offload.tools.serve_stress --phase throughput --ranks 2 --requests 48 \
        --in-flight 8 --steps 4 --sizes 64x64,128x128 --json waves.json -- --diffusion-offload-config \
        '{"mode":"layer","components":["dit"],"layer_options":{"dit":{"weight_transfer":"allgather"}}}'

Flags after ``--`` (or each ``--serve-flag=...``) go to ``omni-offload serve`` after the tool's own,
so they may also replace ``--diffusion-offload-config``. The server gets ``OMP_NUM_THREADS=1``
unless the environment sets it: the tiny presets are dominated by thread-pool overhead otherwise.
With ``--ranks`` above 1 it also gets ``OMNI_OFFLOAD_ALLOW_GLOO=1`` unless set (allgather over
gloo, for CPU runs; without effect on GPUs), and the RSS figures are rank 0's.
With ``--url`` the RSS checks need ``--pid`` and the log check needs ``--log``; without them they
are skipped, and other clients of that server make the metrics check fail.
"""

from __future__ import annotations

import argparse
import errno
import http.client
import itertools
import json
import math
import os
import re
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

from ..runtime.proc import exit_with, rss_mib
from ..runtime.flags import (
    OneLineParser,
    UsageError,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_int,
    report_usage_error,
)

__all__ = ["SERVING_LINE", "AbuseFigures", "LoadFigures", "SizeFigures", "StressOptions", "StressResult", "ThroughputFigures",
           "main", "run_stress"]

IMAGES = "/v1/images/generations"
DEFAULT_OFFLOAD_CONFIG = '{"mode":"layer","components":["dit","text_encoder"]}'
_PROMPT = "a red fox in the snow"
# ``transfer.groups.ALLOW_GLOO_ENV``, spelled out: importing it would import torch into the tool.
_ALLOW_GLOO_ENV = "OMNI_OFFLOAD_ALLOW_GLOO"
_MIB = 2**20
_HEALTH_TIMEOUT_S = 300.0
_STOP_TIMEOUT_S = 30.0
# Opening the stalled connections gives up after this long: a listener that stops accepting
# must not hang the tool (the connections still pending are counted as not connected).
_OPEN_TIMEOUT_S = 10.0
_RSS_SAMPLE_S = 0.1
_UNLOADED_REQUESTS = 20
_STALLED_LENGTH = 100_000
# Probe seeds stay clear of the load phase's 0..requests-1, so a swapped answer cannot match.
_PROBE_SEED = 1 << 40
# Warm-up seeds of the throughput phase, clear of both.
_WARMUP_SEED = 1 << 41
_NOT_OK_SHOWN = 10


@dataclass(kw_only=True, slots=True)
class StressOptions:
    """One run of the tool."""

    phase: Literal["load", "abuse", "both", "throughput"] = "both"
    model: str = "tiny-flux"
    """The model the started server serves (an image model)."""
    ranks: int = 1
    """Ranks of the started server: above 1 it runs under torchrun."""
    serve_flags: tuple[str, ...] = ()
    """More flags for ``omni-offload serve``, after the tool's own."""
    url: str | None = None
    """``http://127.0.0.1:PORT`` of a running server (None: start one)."""
    pid: int | None = None
    """With ``url``: the server's process, for its RSS."""
    log: Path | None = None
    """With ``url``: the server's log file, for its growth."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer`` on every request, the stalled ones too."""
    requests: int = 1000
    in_flight: int = 50
    steps: int = 1
    """``num_inference_steps`` of every generation request."""
    timeout_s: float = 300.0
    """Of one request."""
    rss_tolerance: float = 0.10
    """The server's RSS may grow by this fraction in either phase."""
    stalled: int = 10000
    hold_s: float = 30.0
    probe_interval_s: float = 0.2
    settle_s: float = 5.0
    p95_factor: float = 3.0
    max_log_bytes: int = 1 << 20
    sizes: tuple[str, ...] = ("64x64", "128x128")
    """Throughput: ``WIDTHxHEIGHT`` of the requests, in turn."""
    warmup: int | None = None
    """Throughput: unmeasured requests first (None: 2 per rank of the server)."""


@dataclass(slots=True)
class LoadFigures:
    """The load phase. Latencies in milliseconds, memory in MiB."""

    requests: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    """Answers by status; ``error``: no answer (connection failed, timed out)."""
    wrong_seed: int = 0
    """200s whose ``data[0].seed`` is not the seed sent (swapped or unreadable)."""
    seconds: float = 0.0
    requests_per_s: float = 0.0
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    rss_early_mib: float | None = None
    """Once the first ``in_flight`` requests were answered."""
    rss_end_mib: float | None = None
    requests_200_delta: float | None = None
    """Rise of ``omni_serve_requests_total{endpoint=images,code="200"}``."""
    image_outputs_delta: float | None = None
    """Rise of ``omni_serve_outputs_total{kind="image"}``."""
    first_error: str | None = None


@dataclass(slots=True)
class AbuseFigures:
    """The abuse phase. Latencies in milliseconds, memory in MiB."""

    unloaded_codes: dict[str, int] = field(default_factory=dict)
    unloaded_p50_ms: float | None = None
    unloaded_p95_ms: float | None = None
    stalled_connected: int = 0
    stalled_failed: int = 0
    open_seconds: float = 0.0
    open_error: str | None = None
    """The first reason a stalled connection could not be opened."""
    held_s: float = 0.0
    stalled_replies: dict[str, int] = field(default_factory=dict)
    """What the stalled connections had received by the end of the hold: a status the server
    answered with, ``closed`` (closed without an answer), ``reset``, or ``open`` (nothing yet)."""
    probes: int = 0
    probe_codes: dict[str, int] = field(default_factory=dict)
    probe_p50_ms: float | None = None
    probe_p95_ms: float | None = None
    probe_max_ms: float | None = None
    first_probe_error: str | None = None
    probes_not_ok_at_s: list[float] = field(default_factory=list)
    """When the first few probes that were not 200 went out, in seconds into the hold."""
    rss_before_mib: float | None = None
    rss_peak_mib: float | None = None
    rss_after_mib: float | None = None
    log_bytes_before: int | None = None
    log_bytes_after: int | None = None


@dataclass(slots=True)
class SizeFigures:
    """The throughput phase's requests of one size. Latencies in milliseconds."""

    requests: int = 0
    ok: int = 0
    """Answered 200 with the seed and size sent."""
    p50_ms: float | None = None
    p95_ms: float | None = None


@dataclass(slots=True)
class ThroughputFigures:
    """The throughput phase, its measured requests (not the warm-up). Latencies in milliseconds."""

    requests: int = 0
    warmup: int = 0
    warmup_codes: dict[str, int] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    """Answers by status; ``error``: no answer (connection failed, timed out)."""
    wrong_seed: int = 0
    """200s whose ``data[0].seed`` is not the seed sent."""
    wrong_size: int = 0
    """200s whose ``data[0].size`` is not the size sent."""
    seconds: float = 0.0
    images_per_min: float = 0.0
    """Of the 200s."""
    p50_ms: float | None = None
    p95_ms: float | None = None
    sizes: dict[str, SizeFigures] = field(default_factory=dict)
    """By size, in the order of ``--sizes``."""
    world_size: float | None = None
    """``omni_serve_world_size``: ranks that generate."""
    lockstep: float | None = None
    """``omni_serve_lockstep``: 1 padded waves, 0 free ranks."""
    waves_delta: float | None = None
    """Rise of ``omni_serve_waves_total`` (free ranks: one a slot)."""
    padded_slots_delta: float | None = None
    """Rise of ``omni_serve_padded_slots_total``."""
    requests_200_delta: float | None = None
    image_outputs_delta: float | None = None
    first_error: str | None = None
    host_load: tuple[float, float] | None = None
    """The host's 1-minute load average before and after the measured requests: other work on
    the host (a CPU run) shows here."""


@dataclass(slots=True)
class StressResult:
    options: StressOptions
    load: LoadFigures | None = None
    abuse: AbuseFigures | None = None
    throughput: ThroughputFigures | None = None
    server_exit: int | None = None
    """Exit status of the server the tool started, after SIGTERM (None: not started here, or
    killed because it did not stop)."""
    server_log: str | None = None
    server_allocator: str | None = None
    """``PYTHONMALLOC`` of the server's process once it was ready (``malloc``: it restarted on
    the C allocator, which its RSS after the abuse phase depends on; docs/serving.md); None where
    it could not be read (not Linux, another user's process) or was unset."""
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass(frozen=True, slots=True)
class _Target:
    """Where the requests go and what can be read of the server."""

    port: int
    pid: int | None
    log: Path | None
    api_key: str | None


class _Answer(NamedTuple):
    status: int
    """0: no answer."""
    seconds: float
    seed: int | None
    """``data[0].seed`` of a 200."""
    error: str | None
    size: str | None = None
    """``data[0].size`` of a 200."""


# -- HTTP ------------------------------------------------------------------------------------
def _http(target: _Target, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
    """One request on a connection of its own (a kept-alive one may be closed by the server
    between requests, and a POST cannot safely be sent twice)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if target.api_key is not None:
        headers["Authorization"] = f"Bearer {target.api_key}"
    conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _generate(target: _Target, seed: int, opts: StressOptions, size: str | None = None) -> _Answer:
    """One image request; ``size`` None leaves the size to the model."""
    fields = {"prompt": _PROMPT, "seed": seed, "num_inference_steps": opts.steps}
    body = json.dumps(fields if size is None else {**fields, "size": size}).encode()
    start = time.perf_counter()
    try:
        status, raw = _http(target, "POST", IMAGES, body, opts.timeout_s)
    except (OSError, http.client.HTTPException) as exc:
        return _Answer(0, time.perf_counter() - start, None, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - start
    seed_back = size_back = None
    if status == 200:
        try:
            item = json.loads(raw)["data"][0]
            seed_back, size_back = item["seed"], item.get("size")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            pass
    return _Answer(status, seconds, seed_back, None if status else "no status", size_back)


def _metrics_text(target: _Target, opts: StressOptions) -> str:
    status, raw = _http(target, "GET", "/metrics", None, opts.timeout_s)
    if status != 200:
        raise RuntimeError(f"GET /metrics answered {status}: {raw[:200]!r}")
    return raw.decode()


def _metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text; 0 when absent (a counter not yet touched)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$", line)
        if match and match[1] == name and ",".join(sorted((match[2] or "").split(","))) == wanted:
            return float(match[3])
    return 0.0


# -- the server ------------------------------------------------------------------------------
#: The line a server logs once it listens (``app/serve/run.py``), with the port it took: with
#: ``--port 0`` it picks a free port and says which, where a port picked here and passed on could
#: be taken by another process before it binds.
SERVING_LINE = re.compile(r"serving \S+ \(\w+\) on http://\S+?:(\d+) ")


class _ServerProcess:
    """``omni-offload serve`` as a subprocess (several ranks: under torchrun), its output in
    ``workdir/serve.log``. It runs in a session of its own, so that a server that does not stop
    is killed with every rank."""

    def __init__(self, opts: StressOptions, workdir: Path) -> None:
        self.port: int | None = None
        """The port it listens on, read from its log once it says (``--port 0``)."""
        self.log = workdir / "serve.log"
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(opts.ranks)]
        self.command = [sys.executable, *(launcher if opts.ranks > 1 else []), "-m", "omni_dist_offload",
                        "serve", "--model", opts.model, "--port", "0",
                        "--diffusion-offload-config", DEFAULT_OFFLOAD_CONFIG, *opts.serve_flags]
        self.rank0_pid: int | None = None
        """Under torchrun: rank 0's process, which answers HTTP (found once it is ready)."""
        # The server runs the code this tool was imported from, installed or not.
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        env.setdefault("OMP_NUM_THREADS", "1")
        if opts.ranks > 1:  # allgather over gloo is refused unless allowed; CUDA ranks ignore it
            env.setdefault(_ALLOW_GLOO_ENV, "1")
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.command, cwd=workdir, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.ranks = opts.ranks

    @property
    def pid(self) -> int:
        """The process that serves HTTP, for its RSS: rank 0 under torchrun, once found."""
        return self.rank0_pid or self.proc.pid

    def wait_ready(self, timeout_s: float, api_key: str | None) -> _Target:
        """Where to send requests, once the server has said its port and ``GET /health``
        answers 200 there; ``RuntimeError`` if it never does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it "
                                   f"was ready; its log ends:\n{_tail(self.log)}")
            if self.port is None and (match := SERVING_LINE.search(self.log.read_text(errors="replace"))):
                self.port = int(match[1])
            try:
                if self.port is not None and _http(_Target(self.port, self.proc.pid, self.log, api_key),
                                                   "GET", "/health", None, 2.0)[0] == 200:
                    if self.ranks > 1:
                        self.rank0_pid = _rank0_pid(self.proc.pid)
                    return _Target(self.port, self.pid, self.log, api_key)
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready (its port said and GET /health answering 200) within "
                           f"{timeout_s:g} s; the log ends:\n{_tail(self.log)}")

    def stop(self) -> int | None:
        """SIGTERM (under torchrun to rank 0, which stops the other ranks: torchrun then exits 0,
        where a SIGTERM to torchrun itself makes it exit 1); the exit status, or None if it had
        to be killed."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:  # rank 0 gone already: torchrun ends the job itself
                pass
        try:
            return self.proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # every rank, not torchrun alone
            self.proc.wait()
            return None


def _environment(pid: int | None, name: str) -> str | None:
    """Variable ``name`` in the environment process ``pid`` started with (Linux); None where it
    is unset or cannot be read."""
    if pid is None:
        return None
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    return next((e[len(prefix):].decode(errors="replace") for e in entries if e.startswith(prefix)), None)


def _rank0_pid(launcher: int) -> int | None:
    """The child of torchrun whose environment says ``RANK=0`` (Linux); None if none is found."""
    try:
        children = [pid for task in Path(f"/proc/{launcher}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        for pid in children:
            if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return int(pid)
    except OSError:
        pass
    return None


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


def _rss_mib(pid: int | None) -> float | None:
    """The server's resident set size (Linux); None without a pid or once it is gone."""
    return rss_mib(pid) if pid is not None else None


def _log_bytes(path: Path | None) -> int | None:
    try:
        return path.stat().st_size if path is not None else None
    except OSError:
        return None


@contextmanager
def _more_descriptors() -> Iterator[int]:
    """The soft descriptor limit raised to the hard one (each stalled connection holds one),
    put back afterwards: a caller in process keeps its own limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit cannot be the soft one: the kernel caps descriptors at nr_open.
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError):
        wanted = soft
    try:
        yield wanted
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- load ------------------------------------------------------------------------------------
def run_load(target: _Target, opts: StressOptions) -> LoadFigures:
    """``opts.requests`` requests, ``opts.in_flight`` at a time; seed i for request i."""
    fig = LoadFigures(requests=opts.requests)
    before = _metrics_text(target, opts)
    answers: list[_Answer | None] = [None] * opts.requests
    lock = threading.Lock()
    answered = 0
    early = min(opts.in_flight, opts.requests)

    def one(seed: int) -> None:
        nonlocal answered
        answers[seed] = _generate(target, seed, opts)
        with lock:
            answered += 1
            if answered == early:
                fig.rss_early_mib = _rss_mib(target.pid)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=opts.in_flight, thread_name_prefix="load") as pool:
        list(pool.map(one, range(opts.requests)))
    fig.seconds = time.perf_counter() - start
    fig.rss_end_mib = _rss_mib(target.pid)
    after = _metrics_text(target, opts)
    done = [a for a in answers if a is not None]
    fig.codes = _codes(done)
    fig.wrong_seed = sum(a.status == 200 and a.seed != seed for seed, a in enumerate(answers) if a)
    fig.first_error = next((a.error for a in done if a.error), None)
    fig.requests_per_s = opts.requests / fig.seconds if fig.seconds else 0.0
    latencies = [a.seconds for a in done]
    fig.p50_ms, fig.p95_ms, fig.p99_ms = (_percentile_ms(latencies, q) for q in (0.50, 0.95, 0.99))
    ok = {"endpoint": IMAGES, "code": "200"}
    fig.requests_200_delta = _metric(after, "omni_serve_requests_total", **ok) - _metric(
        before, "omni_serve_requests_total", **ok)
    fig.image_outputs_delta = _metric(after, "omni_serve_outputs_total", kind="image") - _metric(
        before, "omni_serve_outputs_total", kind="image")
    return fig


def _codes(answers: Sequence[_Answer]) -> dict[str, int]:
    return dict(sorted(Counter(str(a.status) if a.status else "error" for a in answers).items()))


def _percentile_ms(seconds: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile, in milliseconds."""
    if not seconds:
        return None
    ordered = sorted(seconds)
    return 1e3 * ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# -- throughput ------------------------------------------------------------------------------
def run_throughput(target: _Target, opts: StressOptions) -> ThroughputFigures:
    """The warm-up, then ``opts.requests`` requests, ``opts.in_flight`` at a time: request i asks
    for ``opts.sizes[i % len(opts.sizes)]`` with seed i. The metrics are read after the warm-up."""
    warmup = opts.warmup if opts.warmup is not None else 2 * _world_size(target)
    fig = ThroughputFigures(requests=opts.requests, warmup=warmup)
    # The warm-up cycles through the sizes too, so each rank has run each shape once or so.
    fig.warmup_codes = _codes(_send(target, opts, [(_WARMUP_SEED + k, _size(opts, k)) for k in range(warmup)])[0])
    before, load_before = _metrics_text(target, opts), os.getloadavg()[0]
    plan = [(i, _size(opts, i)) for i in range(opts.requests)]
    answers, fig.seconds = _send(target, opts, plan)
    after, fig.host_load = _metrics_text(target, opts), (load_before, os.getloadavg()[0])
    fig.codes = _codes(answers)
    fig.wrong_seed = sum(a.status == 200 and a.seed != seed for (seed, _), a in zip(plan, answers))
    fig.wrong_size = sum(a.status == 200 and a.size != size for (_, size), a in zip(plan, answers))
    fig.first_error = next((a.error for a in answers if a.error), None)
    fig.images_per_min = 60 * fig.codes.get("200", 0) / fig.seconds if fig.seconds else 0.0
    fig.p50_ms, fig.p95_ms = (_percentile_ms([a.seconds for a in answers], q) for q in (0.50, 0.95))
    for size in opts.sizes:
        mine = [(seed, a) for (seed, want), a in zip(plan, answers) if want == size]
        latencies = [a.seconds for _, a in mine]
        fig.sizes[size] = SizeFigures(
            requests=len(mine), ok=sum(a.status == 200 and a.seed == seed and a.size == size for seed, a in mine),
            p50_ms=_percentile_ms(latencies, 0.50), p95_ms=_percentile_ms(latencies, 0.95))
    fig.world_size, fig.lockstep = _metric(after, "omni_serve_world_size"), _metric(after, "omni_serve_lockstep")

    def rise(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    fig.waves_delta, fig.padded_slots_delta = rise("omni_serve_waves_total"), rise("omni_serve_padded_slots_total")
    fig.requests_200_delta = rise("omni_serve_requests_total", endpoint=IMAGES, code="200")
    fig.image_outputs_delta = rise("omni_serve_outputs_total", kind="image")
    return fig


def _size(opts: StressOptions, i: int) -> str:
    return opts.sizes[i % len(opts.sizes)]


def _send(target: _Target, opts: StressOptions, plan: Sequence[tuple[int, str]]) -> tuple[list[_Answer], float]:
    """``(seed, size)`` requests, ``opts.in_flight`` at a time, taken in order: (the answers in
    that order, the wall seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=opts.in_flight, thread_name_prefix="throughput") as pool:
        answers = list(pool.map(lambda request: _generate(target, request[0], opts, request[1]), plan))
    return answers, time.perf_counter() - start


def _world_size(target: _Target) -> int:
    """Ranks of the server, from ``GET /health`` (1 if it does not say)."""
    status, raw = _http(target, "GET", "/health", None, 10.0)
    size = json.loads(raw).get("world_size") if status == 200 else None
    return size if isinstance(size, int) and size > 0 else 1


# -- abuse -----------------------------------------------------------------------------------
def run_abuse(target: _Target, opts: StressOptions) -> AbuseFigures:
    """Unloaded latency, then the stalled uploads held open under probes, then the settle."""
    fig = AbuseFigures()
    fig.log_bytes_before = _log_bytes(target.log)
    _generate(target, _PROBE_SEED, opts)  # untimed: a server's first forward is slower
    unloaded = [_generate(target, _PROBE_SEED + i, opts) for i in range(_UNLOADED_REQUESTS)]
    fig.unloaded_codes = _codes(unloaded)
    fig.unloaded_p50_ms = _percentile_ms([a.seconds for a in unloaded], 0.50)
    fig.unloaded_p95_ms = _percentile_ms([a.seconds for a in unloaded], 0.95)
    fig.rss_before_mib = _rss_mib(target.pid)
    start = time.perf_counter()
    stalled, fig.stalled_failed, fig.open_error = _open_stalled(target, opts.stalled)
    fig.open_seconds = time.perf_counter() - start
    fig.stalled_connected = len(stalled)
    try:
        timed, fig.rss_peak_mib, fig.held_s = _hold(target, opts)
        fig.stalled_replies = _stalled_replies(stalled)
    finally:
        for sock in stalled:
            sock.close()
    probes = [answer for _, answer in timed]
    fig.probes = len(probes)
    fig.probes_not_ok_at_s = [round(at, 2) for at, answer in timed if answer.status != 200][:_NOT_OK_SHOWN]
    fig.probe_codes = _codes(probes)
    fig.first_probe_error = next((a.error for a in probes if a.error), None)
    latencies = [a.seconds for a in probes]
    fig.probe_p50_ms, fig.probe_p95_ms, fig.probe_max_ms = (_percentile_ms(latencies, q) for q in (0.5, 0.95, 1.0))
    time.sleep(opts.settle_s)
    fig.rss_after_mib = _rss_mib(target.pid)
    fig.log_bytes_after = _log_bytes(target.log)
    return fig


def _stalled_head(target: _Target) -> bytes:
    """The headers of an image request announcing a body of ``_STALLED_LENGTH`` bytes, and the
    first bytes of that body: the rest never comes."""
    key = f"Authorization: Bearer {target.api_key}\r\n" if target.api_key is not None else ""
    return (f"POST {IMAGES} HTTP/1.1\r\nHost: 127.0.0.1:{target.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {_STALLED_LENGTH}\r\n{key}\r\n" + '{"prompt": "').encode()


def _open_stalled(target: _Target, count: int) -> tuple[list[socket.socket], int, str | None]:
    """Open ``count`` stalled uploads: (the sockets, how many failed, the first failure).

    Non-blocking connects, a few hundred in flight at a time, so opening thousands takes about as
    long as the server takes to accept them rather than one round trip each."""
    head, address = _stalled_head(target), ("127.0.0.1", target.port)
    selector = selectors.DefaultSelector()
    opened: list[socket.socket] = []
    failed, first_error = 0, None
    deadline = time.monotonic() + _OPEN_TIMEOUT_S

    def fail(sock: socket.socket | None, reason: str) -> None:
        nonlocal failed, first_error
        failed += 1
        first_error = first_error or reason
        if sock is not None:
            sock.close()

    def finish(sock: socket.socket) -> None:
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            return fail(sock, f"connect: {os.strerror(code)}")
        try:
            if sock.send(head) == len(head):
                return opened.append(sock)
            fail(sock, "send: partial")
        except OSError as exc:
            fail(sock, f"send: {exc}")

    def reap(timeout: float) -> None:
        for key, _ in selector.select(timeout):
            selector.unregister(key.fileobj)
            finish(key.fileobj)  # type: ignore[arg-type]

    for i in range(count):
        if time.monotonic() > deadline:
            fail(None, f"not opened within {_OPEN_TIMEOUT_S:g} s")
            failed += count - i - 1
            break
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:  # out of descriptors: the rest would fail alike
            fail(None, f"socket: {exc}")
            failed += count - i - 1
            break
        sock.setblocking(False)
        code = sock.connect_ex(address)
        if code == 0:
            finish(sock)
        elif code in (errno.EINPROGRESS, errno.EAGAIN):
            selector.register(sock, selectors.EVENT_WRITE)
        else:
            fail(sock, f"connect: {os.strerror(code)}")
        if len(selector.get_map()) >= 256:
            reap(0.05)
    while selector.get_map() and time.monotonic() < deadline:
        reap(min(0.1, max(0.0, deadline - time.monotonic())))
    for key in list(selector.get_map().values()):
        selector.unregister(key.fileobj)
        fail(key.fileobj, f"connect not finished within {_OPEN_TIMEOUT_S:g} s")  # type: ignore[arg-type]
    selector.close()
    return opened, failed, first_error


def _hold(target: _Target, opts: StressOptions) -> tuple[list[tuple[float, _Answer]], float | None, float]:
    """Probe one request at a time for ``opts.hold_s``, sampling RSS: (the probes with when they
    went out, in seconds into the hold; peak RSS; seconds held)."""
    probes: list[tuple[float, _Answer]] = []
    stop = threading.Event()

    def probe() -> None:
        due = time.monotonic()
        for i in itertools.count():
            sent = time.monotonic() - start
            probes.append((sent, _generate(target, _PROBE_SEED + _UNLOADED_REQUESTS + i, opts)))
            due += opts.probe_interval_s
            if stop.wait(max(0.0, due - time.monotonic())):
                return

    start = time.monotonic()
    prober = threading.Thread(target=probe, name="probe", daemon=True)
    peak = _rss_mib(target.pid)
    prober.start()
    while (left := start + opts.hold_s - time.monotonic()) > 0:
        time.sleep(min(_RSS_SAMPLE_S, left))
        rss = _rss_mib(target.pid)
        if rss is not None:
            peak = rss if peak is None else max(peak, rss)
    stop.set()
    prober.join()
    return probes, peak, time.monotonic() - start


def _stalled_replies(sockets: Sequence[socket.socket]) -> dict[str, int]:
    """What each stalled connection received, peeked without blocking."""
    seen: Counter[str] = Counter()
    for sock in sockets:
        try:
            head = sock.recv(16, socket.MSG_PEEK)
        except BlockingIOError:
            seen["open"] += 1
            continue
        except OSError:
            seen["reset"] += 1
            continue
        parts = head.split()
        seen[parts[1].decode(errors="replace") if len(parts) > 1 else ("closed" if not head else "other")] += 1
    return dict(sorted(seen.items()))


# -- verdict ---------------------------------------------------------------------------------
def _judge_load(opts: StressOptions, fig: LoadFigures) -> list[str]:
    failures = []
    not_ok = fig.requests - fig.codes.get("200", 0)
    if not_ok:
        failures.append(f"load: {not_ok} of {fig.requests} requests not 200 ({_fmt_codes(fig.codes)})")
    if fig.wrong_seed:
        failures.append(f"load: {fig.wrong_seed} answers with a seed other than the one sent")
    growth = _growth(fig.rss_early_mib, fig.rss_end_mib)
    if growth is not None and growth > opts.rss_tolerance:
        failures.append(f"load: server RSS grew {100 * growth:.1f}% (limit {100 * opts.rss_tolerance:g}%)")
    for what, delta in (("requests_total{code=200}", fig.requests_200_delta),
                        ("outputs_total{kind=image}", fig.image_outputs_delta)):
        if delta != fig.requests:
            failures.append(f"load: metric omni_serve_{what} rose by {delta:g}, not {fig.requests}")
    return failures


def _judge_abuse(opts: StressOptions, fig: AbuseFigures) -> list[str]:
    failures = []
    if fig.unloaded_codes != {"200": _UNLOADED_REQUESTS}:
        failures.append(f"abuse: unloaded requests not all 200 ({_fmt_codes(fig.unloaded_codes)})")
    not_ok = fig.probes - fig.probe_codes.get("200", 0)
    if not fig.probes:
        failures.append("abuse: no probe was answered during the hold")
    elif not_ok:
        failures.append(f"abuse: {not_ok} of {fig.probes} probes not 200 ({_fmt_codes(fig.probe_codes)})")
    if (fig.probe_p95_ms is not None and fig.unloaded_p95_ms is not None
            and fig.probe_p95_ms > opts.p95_factor * fig.unloaded_p95_ms):
        failures.append(f"abuse: probe p95 {fig.probe_p95_ms:.1f} ms > {opts.p95_factor:g} x unloaded "
                        f"p95 {fig.unloaded_p95_ms:.1f} ms")
    growth = _log_growth(fig)
    if growth is not None and growth >= opts.max_log_bytes:
        failures.append(f"abuse: server log grew {growth} bytes (limit {opts.max_log_bytes})")
    rss = _growth(fig.rss_before_mib, fig.rss_after_mib)
    if rss is not None and rss > opts.rss_tolerance:
        failures.append(f"abuse: server RSS after the settle {100 * rss:.1f}% above before "
                        f"(limit {100 * opts.rss_tolerance:g}%)")
    return failures


def _judge_throughput(opts: StressOptions, fig: ThroughputFigures) -> list[str]:
    failures = []
    if fig.warmup_codes.get("200", 0) != fig.warmup:
        failures.append(f"throughput: warm-up requests not all 200 ({_fmt_codes(fig.warmup_codes)})")
    not_ok = fig.requests - fig.codes.get("200", 0)
    if not_ok:
        failures.append(f"throughput: {not_ok} of {fig.requests} requests not 200 ({_fmt_codes(fig.codes)})")
    for what, wrong in (("seed", fig.wrong_seed), ("size", fig.wrong_size)):
        if wrong:
            failures.append(f"throughput: {wrong} answers with a {what} other than the one sent")
    for what, delta in (("requests_total{code=200}", fig.requests_200_delta),
                        ("outputs_total{kind=image}", fig.image_outputs_delta)):
        if delta != fig.requests:
            failures.append(f"throughput: metric omni_serve_{what} rose by {delta:g}, not {fig.requests}")
    if opts.url is None and fig.world_size != opts.ranks:
        failures.append(f"throughput: the server runs {fig.world_size:g} rank(s), not --ranks {opts.ranks}")
    return failures


def _growth(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None or before <= 0 else after / before - 1


def _log_growth(fig: AbuseFigures) -> int | None:
    if fig.log_bytes_before is None or fig.log_bytes_after is None:
        return None
    return fig.log_bytes_after - fig.log_bytes_before


def _fmt_codes(codes: dict[str, int]) -> str:
    return ", ".join(f"{code} x {n}" for code, n in codes.items()) or "none"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} MiB"


def load_lines(opts: StressOptions, fig: LoadFigures) -> list[str]:
    growth = _growth(fig.rss_early_mib, fig.rss_end_mib)
    rss_growth = f" ({100 * growth:+.1f}%)" if growth is not None else ""
    return [
        (f"load: {fig.requests} requests, {opts.in_flight} in flight, {opts.steps} step(s): "
         f"{_fmt_codes(fig.codes)}; wrong seed {fig.wrong_seed}; {fig.seconds:.1f} s, "
         f"{fig.requests_per_s:.1f} req/s"),
        f"load: latency p50 {_ms(fig.p50_ms)}, p95 {_ms(fig.p95_ms)}, p99 {_ms(fig.p99_ms)}",
        (f"load: server RSS {_mib(fig.rss_early_mib)} after the first {min(opts.in_flight, fig.requests)}, "
         f"{_mib(fig.rss_end_mib)} at the end{rss_growth}"),
        (f"load: metrics requests_total{{code=200}} +{fig.requests_200_delta:g}, "
         f"outputs_total{{kind=image}} +{fig.image_outputs_delta:g}"),
    ]


def abuse_lines(opts: StressOptions, fig: AbuseFigures) -> list[str]:
    growth = _log_growth(fig)
    open_error = f" (first failure: {fig.open_error})" if fig.open_error else ""
    probe_error = f" (first error: {fig.first_probe_error})" if fig.first_probe_error else ""
    not_ok_at = (f"; not 200 at {', '.join(f'{t:g}' for t in fig.probes_not_ok_at_s)} s into the hold"
                 if fig.probes_not_ok_at_s else "")
    return [
        (f"abuse: unloaded {_UNLOADED_REQUESTS} requests: {_fmt_codes(fig.unloaded_codes)}, "
         f"p50 {_ms(fig.unloaded_p50_ms)}, p95 {_ms(fig.unloaded_p95_ms)}"),
        (f"abuse: stalled uploads {fig.stalled_connected}/{opts.stalled} connected in "
         f"{fig.open_seconds:.1f} s{open_error}, held {fig.held_s:.1f} s; by then they had received: "
         f"{_fmt_codes(fig.stalled_replies)}"),
        (f"abuse: probes {fig.probes}: {_fmt_codes(fig.probe_codes)}, p50 {_ms(fig.probe_p50_ms)}, "
         f"p95 {_ms(fig.probe_p95_ms)}, max {_ms(fig.probe_max_ms)}{probe_error}{not_ok_at}"),
        (f"abuse: server RSS before {_mib(fig.rss_before_mib)}, peak {_mib(fig.rss_peak_mib)}, "
         f"after {_mib(fig.rss_after_mib)} ({opts.settle_s:g} s after closing)"),
        f"abuse: server log {'n/a' if growth is None else f'+{growth} bytes'} during the phase",
    ]


def throughput_lines(opts: StressOptions, fig: ThroughputFigures) -> list[str]:
    mode = "padded waves" if fig.lockstep == 1 else "free ranks" if fig.lockstep == 0 else f"lockstep {fig.lockstep}"
    return [
        (f"throughput: {fig.requests} requests (after {fig.warmup} warm-up), {opts.in_flight} in flight, "
         f"{opts.steps} step(s), sizes {','.join(opts.sizes)}, {fig.world_size:g} rank(s), {mode}: "
         f"{_fmt_codes(fig.codes)}; wrong seed {fig.wrong_seed}, wrong size {fig.wrong_size}; "
         f"{fig.seconds:.2f} s, {fig.images_per_min:.1f} images/min"),
        "throughput: latency " + "; ".join(
            f"{size} ({s.requests}) p50 {_ms(s.p50_ms)}, p95 {_ms(s.p95_ms)}" for size, s in fig.sizes.items())
        + f"; all p50 {_ms(fig.p50_ms)}, p95 {_ms(fig.p95_ms)}",
        (f"throughput: metrics waves +{fig.waves_delta:g}, padded slots +{fig.padded_slots_delta:g}, "
         f"lockstep {fig.lockstep:g}, requests_total{{code=200}} +{fig.requests_200_delta:g}, "
         f"outputs_total{{kind=image}} +{fig.image_outputs_delta:g}; host load {fig.host_load[0]:.2f} "
         f"before, {fig.host_load[1]:.2f} after"),
    ]


def verdict_line(result: StressResult) -> str:
    parts = []
    if result.load is not None:
        fig = result.load
        parts.append(f"load {fig.codes.get('200', 0)}/{fig.requests} x 200 at {fig.requests_per_s:.1f} req/s, "
                     f"p95 {_ms(fig.p95_ms)}")
    if result.abuse is not None:
        fig = result.abuse
        parts.append(f"abuse {fig.stalled_connected} stalled for {fig.held_s:.0f} s, probes "
                     f"{fig.probe_codes.get('200', 0)}/{fig.probes} x 200, p95 {_ms(fig.probe_p95_ms)} "
                     f"(unloaded {_ms(fig.unloaded_p95_ms)})")
    if result.throughput is not None:
        fig = result.throughput
        p95 = ", ".join(f"{size} {_ms(s.p95_ms)}" for size, s in fig.sizes.items())
        parts.append(f"throughput {fig.codes.get('200', 0)}/{fig.requests} x 200 in {fig.seconds:.2f} s, "
                     f"{fig.images_per_min:.1f} images/min, waves {fig.waves_delta:g}, padded slots "
                     f"{fig.padded_slots_delta:g}, lockstep {fig.lockstep:g}, p95 {p95}")
    if result.options.url is None:
        parts.append(f"server exit {result.server_exit}")
    figures = "; ".join(parts)
    if result.passed:
        return f"serve_stress PASS: {figures}"
    return f"serve_stress FAIL: {'; '.join(result.failures)}" + (f" | {figures}" if figures else "")


# -- running ---------------------------------------------------------------------------------
def run_stress(opts: StressOptions, say: Callable[[str], None] = lambda line: None) -> StressResult:
    """Start the server (unless ``opts.url``), run the phases, stop it, judge."""
    result = StressResult(options=opts)
    workdir = server = None
    try:
        if opts.url is None:
            workdir = Path(tempfile.mkdtemp(prefix="serve_stress-"))
            server = _ServerProcess(opts, workdir)
            say(f"starting: {' '.join(server.command)}")
            target = server.wait_ready(_HEALTH_TIMEOUT_S, opts.api_key)
        else:
            target = _Target(_loopback_port(opts.url), opts.pid, opts.log, opts.api_key)
        result.server_allocator = _environment(target.pid, "PYTHONMALLOC")
        _check_image_server(target, opts.url)
        # Raised only now: the server started above keeps the limit its caller gave it.
        with _more_descriptors() as limit:
            if opts.phase in ("abuse", "both") and limit < opts.stalled + 64:
                say(f"warning: {limit} file descriptors at most: some stalled connections cannot open")
            _run_phases(target, opts, result, say)
    except _Unreachable as exc:  # a FAIL that says what was not there
        result.failures.append(str(exc))
    except Exception as exc:  # noqa: BLE001 (a run that broke is a FAIL with its reason, not a traceback)
        result.failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        if server is not None:
            result.server_exit = server.stop()
            if result.server_exit != 0:
                result.failures.append(f"server exit status {result.server_exit} after SIGTERM (want 0)"
                                       if result.server_exit is not None else
                                       f"server did not stop within {_STOP_TIMEOUT_S:g} s of SIGTERM (killed)")
    if result.load is not None:
        result.failures.extend(_judge_load(opts, result.load))
    if result.abuse is not None:
        result.failures.extend(_judge_abuse(opts, result.abuse))
    if result.throughput is not None:
        result.failures.extend(_judge_throughput(opts, result.throughput))
    if workdir is not None:
        if result.passed:
            shutil.rmtree(workdir, ignore_errors=True)
        else:  # kept for a look at what the server said
            result.server_log = str(server.log)  # type: ignore[union-attr]
            say(f"server log kept: {server.log}")  # type: ignore[union-attr]
    return result


def _run_phases(target: _Target, opts: StressOptions, result: StressResult, say: Callable[[str], None]) -> None:
    if opts.phase in ("load", "both"):
        say(f"load: {opts.requests} requests, {opts.in_flight} in flight ...")
        result.load = run_load(target, opts)
        for line in load_lines(opts, result.load):
            say(line)
    if opts.phase in ("abuse", "both"):
        say(f"abuse: {opts.stalled} stalled uploads held {opts.hold_s:g} s, a probe every "
            f"{opts.probe_interval_s:g} s ...")
        result.abuse = run_abuse(target, opts)
        for line in abuse_lines(opts, result.abuse):
            say(line)
    if opts.phase == "throughput":
        say(f"throughput: {opts.requests} requests of sizes {','.join(opts.sizes)}, {opts.in_flight} in flight ...")
        result.throughput = run_throughput(target, opts)
        for line in throughput_lines(opts, result.throughput):
            say(line)


def _loopback_port(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = None
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost") or not port:
        raise ValueError(f"--url {url!r}: give http://127.0.0.1:PORT (this tool only sends to loopback).")
    return port


def _check_image_server(target: _Target, url: str | None = None) -> None:
    try:
        status, raw = _http(target, "GET", "/health", None, 10.0)
    except (OSError, http.client.HTTPException) as exc:
        if url is None:  # the server this tool started: what went wrong is in its log
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        raise _Unreachable(f"cannot reach the server at {url} (GET /health: {reason}); is it running?") from None
    if status != 200:
        raise RuntimeError(f"GET /health answered {status}: {raw[:200]!r}")
    health = json.loads(raw)
    if health.get("kind") != "image":
        raise RuntimeError(f"the server serves {health.get('model')!r}, which makes {health.get('kind')}s; "
                           f"this tool drives {IMAGES}: serve an image model (--model tiny-flux).")


class _Unreachable(RuntimeError):
    """The server given with ``--url`` does not answer: the run fails, saying so in one line."""


# -- command line ----------------------------------------------------------------------------
PROG = "python -m omni_dist_offload.tools.serve_stress"


def _seconds(text: str) -> float:
    """A finite number above 0 (infinity would overflow a socket's timeout, NaN turn a check off)."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of seconds")
    return value


def _sizes(text: str) -> tuple[str, ...]:
    sizes = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*([1-9][0-9]*)x([1-9][0-9]*)\s*", part)
        if match is None:
            raise argparse.ArgumentTypeError(f"{part!r} is not a size: give WIDTHxHEIGHT[,WIDTHxHEIGHT...], "
                                             f"e.g. 64x64,128x128")
        sizes.append(f"{int(match[1])}x{int(match[2])}")
    return tuple(sizes)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = StressOptions()
    p.add_argument("--phase", default=d.phase, choices=["load", "abuse", "both", "throughput"],
                   help="both: load then abuse; throughput runs alone (default: %(default)s)")
    p.add_argument("--model", default=d.model, help="image model the started server serves (default: %(default)s)")
    p.add_argument("--ranks", type=positive_int, default=d.ranks,
                   help="ranks of the started server; above 1 under torchrun (default: %(default)s)")
    p.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                   help="one more flag for omni-offload serve (repeat; write --serve-flag=--read-timeout=5)")
    p.add_argument("--url", default=None, help="drive a running server at http://127.0.0.1:PORT instead")
    p.add_argument("--pid", type=positive_int, default=None, help="with --url: the server's pid, for its RSS")
    p.add_argument("--log", type=Path, default=None, help="with --url: the server's log file, for its growth")
    p.add_argument("--api-key", default=os.environ.get("OMNI_OFFLOAD_API_KEY") or None,
                   help="Bearer key sent with every request (default: $OMNI_OFFLOAD_API_KEY)")
    p.add_argument("--requests", type=positive_int, default=d.requests)
    p.add_argument("--in-flight", type=positive_int, default=d.in_flight)
    p.add_argument("--steps", type=positive_int, default=d.steps, help="num_inference_steps of each request")
    p.add_argument("--timeout", type=_seconds, default=d.timeout_s, help="seconds one request may take")
    p.add_argument("--rss-tolerance", type=non_negative_float, default=d.rss_tolerance,
                   help="fraction the server's RSS may grow in a phase (default: %(default)s)")
    p.add_argument("--stalled", type=non_negative_int, default=d.stalled, help="stalled uploads to hold open")
    p.add_argument("--hold", type=_seconds, default=d.hold_s, help="seconds to hold them")
    p.add_argument("--probe-interval", type=_seconds, default=d.probe_interval_s,
                   help="seconds between probe requests during the hold")
    p.add_argument("--settle", type=non_negative_float, default=d.settle_s,
                   help="seconds after closing them before the last RSS reading")
    p.add_argument("--p95-factor", type=_seconds, default=d.p95_factor,
                   help="probe p95 may be this many times the unloaded p95")
    p.add_argument("--max-log-bytes", type=positive_int, default=d.max_log_bytes,
                   help="the server's log must grow less than this during the abuse phase")
    p.add_argument("--sizes", type=_sizes, default=d.sizes, metavar="WxH[,WxH...]",
                   help=f"throughput: the requests' sizes, in turn (default: {','.join(d.sizes)})")
    p.add_argument("--warmup", type=non_negative_int, default=d.warmup, metavar="K",
                   help="throughput: unmeasured requests first (default: 2 per rank of the server)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every figure here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    try:
        args = build_parser().parse_args(argv)
        if args.url is None and (args.pid is not None or args.log is not None):
            raise UsageError("--pid and --log describe a server given with --url; without --url the tool "
                             "starts its own and knows both.")
        if args.url is not None and args.ranks > 1:
            raise UsageError("--ranks says how many ranks to start the server with; a server given with --url "
                             "runs the ranks it was started with.")
        if args.url is not None:
            try:
                _loopback_port(args.url)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        if args.json is not None:
            output_file("--json", args.json)
    except UsageError as exc:
        return report_usage_error(PROG, exc)
    opts = StressOptions(phase=args.phase, model=args.model, ranks=args.ranks, sizes=args.sizes, warmup=args.warmup,
                         serve_flags=(*args.serve_flag, *extra),
                         url=args.url, pid=args.pid, log=args.log, api_key=args.api_key,
                         requests=args.requests, in_flight=args.in_flight, steps=args.steps,
                         timeout_s=args.timeout, rss_tolerance=args.rss_tolerance, stalled=args.stalled,
                         hold_s=args.hold, probe_interval_s=args.probe_interval, settle_s=args.settle,
                         p95_factor=args.p95_factor, max_log_bytes=args.max_log_bytes)
    result = run_stress(opts, say=lambda line: print(line, flush=True))
    line = verdict_line(result)
    print(line, flush=True)
    if args.json is not None:
        figures = {**asdict(result), "passed": result.passed, "verdict": line}
        figures["options"]["api_key"] = None if opts.api_key is None else "(set)"
        args.json.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0 if result.passed else 1


if __name__ == "__main__":
    exit_with(main)
