"""``omni-offload serve``: keep an offloaded pipeline warm and answer generation requests over HTTP.

    omni-offload serve --model tiny-flux --port 8000
    torchrun --nproc_per_node 8 -m omni_dist_offload serve --model Wan-AI/Wan2.2-T2V-A14B-Diffusers \\
        --diffusion-offload-config '{"mode":"layer","components":["dit"]}'

Set-up (loading, consolidating, pinning) is paid once. Rank 0 runs the HTTP front-end (FastAPI
under uvicorn, in a thread of its own: ``http.py``) and every rank generates; ``run.py`` starts
them.

[Note: waves]
Requests become *slots*, one pipeline call each (a request with ``n`` images is ``n`` slots with
seeds ``seed .. seed + n - 1``). On rank 0 only the main thread generates (the pipeline is not
thread-safe). How slots reach the other ranks depends on ``Omni.lockstep``, the same on every
rank, and ``run.py`` creates the gloo groups (beside the pipeline's own) that mode needs:

- **Free** (lockstep False: every ring streams rank-local, or by any transfer that never waits
  for another rank), several ranks: no waves, no padding. Rank 0's main thread takes the oldest
  queued slot, of any shape, runs it and answers it. For each other rank ``r`` a dispatcher
  thread of rank 0 does the same for ``r``, over a two-rank gloo group of its own (``RankLink``;
  distinct groups may be used from different threads): it sends the slot, relays the step
  progress ``r`` sends back (videos only, one message a step, so ``Job.progress`` moves for
  every rank's videos), and answers the ``SlotResult``. A rank takes the next slot the moment it
  is free, so a long video on one rank does not hold up short images on the others. If a link
  fails (its rank died), that slot gets :class:`GenerationFailed` (500), rank 0 logs an error,
  and its dispatcher ends: the others serve on (``omni_serve_ranks_serving`` drops).
- **Lockstep** (lockstep True: some ring gathers its weights with a collective, which every rank
  of its weight group must enter, so every rank must run the same forwards at the same shapes
  together), or one rank: waves. Rank 0's main thread takes the oldest queued slot and every
  queued slot with the same shape key (kind, size, frames, steps, negative prompt or not), up to
  one per rank, waiting up to ``--wave-wait`` for a partly filled wave to fill, then pads it with
  repeats whose outputs are dropped. It broadcasts the wave over a gloo group of every rank,
  each rank runs its slot and encodes the media, and ``gather_object`` brings the bytes back to
  rank 0, which answers. ``Job.progress`` follows rank 0's slot, which runs the same steps.

A slot whose client went away (its future was cancelled) leaves the queue at once and is not
run, in either mode.

On SIGTERM (or SIGINT) rank 0 stops taking requests (503) at once, whatever its main thread is
doing (``run.py``: [Note: signals while generating]), lets the running slots finish (the
wave; free: every rank's running slot), answers the slots still queued with 503, tells every
other rank to stop (a wave of ``None``; free: ``None`` over each live link) and closes the
server; all ranks exit 0. Other ranks ignore the signal and wait for rank 0's stop message.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import inspect
import io
import logging
import math
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import torch.distributed as dist
from PIL import Image

from ...runtime.dist import DistContext
from ...runtime.flags import UsageError, output_dir_check, port, positive_int
from ..api import Omni
from ..outputs import VIDEO_FORMATS, resolve_video_format

__all__ = [
    "GenerationFailed",
    "ModelLimits",
    "PromptCounter",
    "QueueFull",
    "RankLink",
    "ServeOptions",
    "Service",
    "ServiceUnavailable",
    "Slot",
    "SlotResult",
    "WaveObserver",
    "WaveQueue",
    "add_serve_flags",
    "serve_options",
]

logger = logging.getLogger(__name__)

_SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "python_multipart")
# The wave group waits for the next wave for as long as the service is idle; the default
# collective timeout (30 min) would end an idle service.
_WAVE_GROUP_TIMEOUT = timedelta(days=365)
# How often rank 0's generation loop looks for a stop request while the queue is empty.
_POLL_S = 0.1


class ServiceUnavailable(RuntimeError):
    """The service is shutting down (HTTP 503)."""


class QueueFull(ServiceUnavailable):
    """More slots are queued than ``--max-queue`` allows (HTTP 429 with ``Retry-After``)."""


class GenerationFailed(RuntimeError):
    """The pipeline raised while generating a slot (HTTP 500); the message is the reason."""


# -- flags -----------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class ServeOptions:
    """``omni-offload serve`` flags other than the model's."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_n: int = 4
    """Largest ``n`` of one request."""
    max_frames: int = 121
    """Largest ``num_frames`` of a video request."""
    max_size: int = 2048
    """Largest height or width, in pixels."""
    max_steps: int = 100
    """Largest ``num_inference_steps``."""
    max_aspect: float = 16.0
    """Largest ratio of the longer side to the shorter one (extreme shapes break some VAEs)."""
    max_pixels: int | None = None
    """Largest ``n x width x height x frames`` of one request (its cost); None: 4 images of
    2048x2048 for an image model, one 1280x720 video of 121 frames for a video model."""
    max_wave_pixels: int | None = None
    """Largest ``width x height x frames`` of one output: the work each rank does in one wave,
    so how long the generation thread is held. None: 2048x2048 for an image model, 1280x720 x
    121 frames for a video model."""
    max_queue: int = 256
    """Slots waiting at most; beyond it requests get 429 (``queue_full``, with ``Retry-After``).
    Also how many requests may wait for their prompt check at once. At least ``max_n`` (the CLI
    refuses less): a request of more outputs than it could never be queued."""
    wave_wait_s: float = 0.1
    """How long a wave that is not full waits for more slots of its shape (several ranks in
    lockstep only: free ranks take slots as they come)."""
    output_dir: Path | None = Path("outputs")
    """Where ``"response_format": "path"`` outputs and their JSON sidecars are written; None:
    nowhere (the default folder cannot be written), and such requests get 400."""
    video_format: Literal["mp4", "gif"] = "gif"
    """Resolved from ``--video-format``: MP4 with the ``video`` extra, else GIF."""
    api_key: str | None = None
    """Bearer token every endpoint but ``/health`` requires (``--api-key`` or
    ``OMNI_OFFLOAD_API_KEY``); None: no authentication."""
    max_body_bytes: int = 1 << 20
    """Largest request body; beyond it 413."""
    read_timeout_s: float = 30.0
    """Seconds a request's body may take to arrive; beyond it 408 (a stalled upload)."""
    max_connections: int | None = None
    """Open connections at most; a connection past it gets 503 and is closed at once, so it
    holds no descriptor. None: what the open-file limit leaves (see ``http.connection_cap``)."""
    max_video_jobs: int = 256
    """Video jobs kept (``/v1/videos``): a new one evicts the oldest finished one."""
    video_ttl_s: float = 3600.0
    """Seconds a finished video job, and its file, is kept."""


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The serve subcommand's own flags (the model flags come from the CLI)."""
    d = ServeOptions()
    parser.add_argument("--host", default=d.host, help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port, default=d.port,
                        help="TCP port; 0: a free one, named in the 'serving ... on' log line (default: %(default)s)")
    parser.add_argument("--max-n", type=positive_int, default=d.max_n, metavar="N",
                        help="largest n of one request (default: %(default)s)")
    parser.add_argument("--max-frames", type=positive_int, default=d.max_frames, metavar="N",
                        help="largest num_frames of a video request (default: %(default)s)")
    parser.add_argument("--max-size", type=positive_int, default=d.max_size, metavar="PX",
                        help="largest height or width (default: %(default)s)")
    parser.add_argument("--max-steps", type=positive_int, default=d.max_steps, metavar="N",
                        help="largest num_inference_steps (default: %(default)s)")
    parser.add_argument("--max-aspect", type=float, default=d.max_aspect, metavar="R",
                        help="largest longer-side / shorter-side ratio of a size (default: %(default)s)")
    parser.add_argument("--max-pixels", type=positive_int, default=None, metavar="N",
                        help="largest n x width x height x frames of one request (default: 4 x 2048x2048 "
                        "for images, 1280x720 x 121 frames for videos, for a model of 16 pixels a latent "
                        "token side; scaled to the same tokens for others)")
    parser.add_argument("--max-wave-pixels", type=positive_int, default=None, metavar="N",
                        help="largest width x height x frames of one output, the work of one wave on each "
                        "rank (default: 2048x2048 for images, 1280x720 x 121 frames for videos, for a model "
                        "of 16 pixels a latent token side; scaled to the same tokens for others)")
    parser.add_argument("--max-queue", type=positive_int, default=d.max_queue, metavar="N",
                        help="queued images or videos at most, then 429 (default: %(default)s)")
    parser.add_argument("--wave-wait", type=float, default=d.wave_wait_s, metavar="S",
                        help="seconds a wave that is not full waits for more requests of its "
                        "shape before it starts padded (several ranks in lockstep, i.e. allgather weights; "
                        "default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help=f"where response_format=path outputs go (default: {d.output_dir}; given, it must "
                        "be writable at start; the default, unwritable, only refuses such requests)")
    parser.add_argument("--video-format", default="auto", choices=VIDEO_FORMATS,
                        help="auto: MP4 when imageio-ffmpeg is installed, else GIF")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $OMNI_OFFLOAD_API_KEY, else none)")
    parser.add_argument("--max-body", type=positive_int, default=d.max_body_bytes, metavar="BYTES",
                        help="largest request body in bytes, then 413 (default: %(default)s)")
    parser.add_argument("--read-timeout", type=float, default=d.read_timeout_s, metavar="S",
                        help="seconds a request body may take to arrive, then 408 (default: %(default)s)")
    parser.add_argument("--max-connections", type=positive_int, default=d.max_connections, metavar="N",
                        help="open connections at most; more are answered 503 and closed (default: "
                        "what the open-file limit leaves, once raised to its hard limit)")
    parser.add_argument("--max-video-jobs", type=positive_int, default=d.max_video_jobs, metavar="N",
                        help="video jobs (/v1/videos) kept; a new one evicts the oldest finished one "
                        "(default: %(default)s)")
    parser.add_argument("--video-ttl", type=float, default=d.video_ttl_s, metavar="S",
                        help="seconds a finished video job and its file are kept (default: %(default)s)")


def serve_options(ns: argparse.Namespace) -> ServeOptions:
    """Check the serve flags and that the HTTP stack is installed; ``ValueError`` names the flag."""
    missing = [name for name in _SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"serving needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                         "not installed: pip install -e \".[serve]\" (or pip install "
                         "'omni_dist_offload[serve]').")
    for flag, value in (("--wave-wait", ns.wave_wait), ("--max-aspect", ns.max_aspect),
                        ("--read-timeout", ns.read_timeout), ("--video-ttl", ns.video_ttl)):
        # inf would overflow the waits and the expiry times (a video's expires_at is a whole
        # number of seconds), nan pass every comparison below.
        if not math.isfinite(value):
            raise ValueError(f"{flag} {value}: give a finite number.")
    if ns.wave_wait < 0:
        raise ValueError(f"--wave-wait {ns.wave_wait}: give 0 or more seconds.")
    if not ns.max_aspect >= 1:
        raise ValueError(f"--max-aspect {ns.max_aspect}: give a ratio of 1 or more.")
    if not ns.read_timeout > 0:
        raise ValueError(f"--read-timeout {ns.read_timeout}: give a positive number of seconds.")
    if not ns.video_ttl > 0:
        raise ValueError(f"--video-ttl {ns.video_ttl}: give a positive number of seconds.")
    if ns.max_queue < ns.max_n:
        # A request of n outputs queues all n or none: past --max-queue it would get 429 "retry
        # later" for ever, even on an idle server.
        raise ValueError(f"--max-queue {ns.max_queue} is below --max-n {ns.max_n}: a request of more outputs "
                         f"than --max-queue could never be queued; give --max-queue {ns.max_n} or more, or a "
                         "lower --max-n.")
    # response_format=path writes there: found now, not at the first such request. Only a
    # folder asked for stops the start: the default is not needed by b64_json clients.
    output_dir = ns.output_dir if ns.output_dir is not None else ServeOptions().output_dir
    try:
        output_dir_check("--output-dir", output_dir)
    except UsageError as exc:
        if ns.output_dir is not None:
            raise ValueError(str(exc)) from None
        logger.warning("%s response_format=path requests are refused (400) until the server is started with an "
                       "--output-dir it can write.", exc)
        output_dir = None
    try:
        video_format = resolve_video_format(ns.video_format)
    except ValueError as exc:
        raise ValueError(f"--video-format: {exc}") from None
    api_key = ns.api_key if ns.api_key is not None else os.environ.get("OMNI_OFFLOAD_API_KEY") or None
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the flag out.")
    if api_key is not None and not all("!" <= c <= "~" for c in api_key):
        # A header carries Latin-1 at most; clients send UTF-8 bytes or refuse (OpenAI's client
        # raises before sending), and spaces around it are dropped: no client could match it.
        raise ValueError("--api-key (or OMNI_OFFLOAD_API_KEY) holds a character other than visible ASCII "
                         "(a letter outside ASCII, a space or a control character), which no client can "
                         "send in an Authorization header as given: use letters, digits and punctuation, "
                         "e.g. the output of `openssl rand -hex 32`.")
    return ServeOptions(host=ns.host, port=ns.port, max_n=ns.max_n, max_frames=ns.max_frames,
                        max_size=ns.max_size, max_steps=ns.max_steps, max_aspect=ns.max_aspect,
                        max_pixels=ns.max_pixels, max_wave_pixels=ns.max_wave_pixels, max_queue=ns.max_queue,
                        wave_wait_s=ns.wave_wait, output_dir=output_dir, video_format=video_format,
                        api_key=api_key, max_body_bytes=ns.max_body, read_timeout_s=ns.read_timeout,
                        max_connections=ns.max_connections, max_video_jobs=ns.max_video_jobs,
                        video_ttl_s=ns.video_ttl)


# -- what the model accepts ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request may ask of this model, read from the pipeline once."""

    model: str
    kind: Literal["image", "video"]
    size_multiple: int
    """Height and width must be multiples of it: the VAE's spatial factor times the 2x2
    patching (Flux packs latents 2x2, Wan's and SD3's DiTs patch 2x2)."""
    frame_step: int
    """Videos: ``num_frames - 1`` must be a multiple of it (the VAE's temporal factor)."""
    max_prompt_tokens: int | None = None
    """The longest prompt, in tokens, the pipeline's text encoders read (the longest window of
    its tokenizers); None if it has no tokenizer."""
    default_size: tuple[int, int] | None = None
    """``(width, height)`` of a request that names no size, where the pipeline fixes it."""
    default_frames: int | None = None
    """Frames of a video request that names none, where the pipeline fixes it."""
    default_steps: int | None = None
    """``num_inference_steps`` of a request that names none, where the pipeline fixes it."""
    max_side: int | None = None
    """The largest width or height the DiT's positions cover (Wan's precomputed rotary table:
    ``rope_max_seq_len`` patches a side); None: no such bound."""
    max_frames: int | None = None
    """Videos: the most frames the DiT's positions cover (the same table); None: no bound."""

    @classmethod
    def of(cls, omni: Omni) -> ModelLimits:
        pipe = omni.pipeline
        params = inspect.signature(pipe.__call__).parameters
        spatial = int(getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", 8))
        temporal = int(getattr(pipe, "vae_scale_factor_temporal", 1) or 1)
        defaults = call_defaults(omni)
        found = prompt_tokenizer(pipe, defaults.get("max_sequence_length"))
        width, height = defaults.get("width"), defaults.get("height")
        max_side, max_frames = _position_bounds(pipe, spatial, temporal)
        return cls(model=omni.model, kind="video" if "num_frames" in params else "image",
                   size_multiple=spatial * 2, frame_step=temporal,
                   max_prompt_tokens=found[1] if found is not None else None,
                   default_size=(width, height) if isinstance(width, int) and isinstance(height, int) else None,
                   default_frames=defaults.get("num_frames") if isinstance(defaults.get("num_frames"), int) else None,
                   default_steps=steps if isinstance(steps := defaults.get("num_inference_steps"), int) else None,
                   max_side=max_side, max_frames=max_frames)


def call_defaults(omni: Omni) -> dict[str, Any]:
    """The integer options a request that names none runs with: the pipeline's own defaults,
    then the project's for built-in models."""
    params = inspect.signature(omni.pipeline.__call__).parameters
    defaults = {name: p.default for name, p in params.items() if isinstance(p.default, int)}
    defaults.update(omni.call_kwargs())
    return defaults


def _position_bounds(pipe: Any, spatial: int, temporal: int) -> tuple[int | None, int | None]:
    """Largest side and frame count a DiT with a precomputed rotary table (Wan's
    ``rope_max_seq_len`` positions an axis, over ``patch_size`` patches) can place; past them
    its forward fails on a shape. ``(None, None)`` for DiTs that compute positions as needed."""
    config = getattr(getattr(pipe, "transformer", None), "config", None)
    positions = getattr(config, "rope_max_seq_len", None)
    patch = getattr(config, "patch_size", None)
    if not isinstance(positions, int) or not isinstance(patch, (tuple, list)) or len(patch) != 3:
        return None, None
    max_side = positions * int(min(patch[1], patch[2])) * spatial
    return max_side, (positions * int(patch[0]) - 1) * temporal + 1


def prompt_tokenizer(pipe: Any, max_sequence_length: int | None = None) -> tuple[Any, int] | None:
    """The pipeline's tokenizer with the longest window, and that window in tokens: its
    ``model_max_length``, or, for a tokenizer whose text encoder is not a CLIP (diffusers
    pipelines call CLIP at its own window), the pipeline's ``max_sequence_length`` where that is
    shorter (the built-ins read 16 or 32 tokens)."""
    best = None
    for suffix in ("", "_2", "_3"):
        tokenizer = getattr(pipe, f"tokenizer{suffix}", None)
        window = getattr(tokenizer, "model_max_length", None)
        if tokenizer is None or not isinstance(window, int) or window > 1_000_000:  # "no limit" sentinels
            continue
        encoder = type(getattr(pipe, f"text_encoder{suffix}", None)).__name__
        if isinstance(max_sequence_length, int) and not encoder.startswith("CLIP"):
            window = min(window, max_sequence_length)
        if best is None or window > best[1]:
            best = (tokenizer, window)
    return best


class PromptCounter:
    """Counts a prompt's tokens for the HTTP side with a copy of the pipeline's tokenizer (the one
    :func:`prompt_tokenizer` picks) of its own, made before serving starts.

    The pipeline's own tokenizer is not for other threads: a fast tokenizer sets truncation and
    padding on its backend at every call, so a count (no truncation, no padding) on an HTTP
    thread while the generation thread encodes a prompt (padded and cut to the window) could
    unpad that prompt, and the output would change (a serve test saw it, rarely: an image off
    by a few levels), or the backend refuse a call ("Already borrowed"). The copy is used by
    one HTTP thread at a time."""

    def __init__(self, pipe: Any, max_sequence_length: int | None = None) -> None:
        found = prompt_tokenizer(pipe, max_sequence_length)
        self._tokenizer = copy.deepcopy(found[0]) if found is not None else None
        self._lock = threading.Lock()

    def count(self, text: str) -> int:
        """How many tokens ``text`` is; 0 without a tokenizer."""
        if self._tokenizer is None:
            return 0
        with self._lock:
            return len(self._tokenizer(text, truncation=False, verbose=False)["input_ids"])


class RedactPromptText(logging.Filter):
    """Keeps prompts out of the log: diffusers' pipelines log the part of a prompt their text
    encoder cut off (which can be most of a long prompt); the record keeps only that it happened."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("The following part of your input was truncated"):
            record.msg, record.args = "a prompt was longer than a text encoder's window and was cut (text not logged)", ()
        return True


def redact_prompts_in_logs() -> None:
    """Install :class:`RedactPromptText` on the handlers diffusers' and transformers' records reach."""
    for name in ("diffusers", "transformers", ""):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactPromptText) for f in handler.filters):
                handler.addFilter(RedactPromptText())


# -- slots and waves -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Slot:
    """One pipeline call on one rank; sent to the ranks, so plain and picklable."""

    kind: Literal["image", "video"]
    prompt: str
    seed: int
    name: str
    """Output stem: ``<request id>-<i>``."""
    num_inference_steps: int | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    negative_prompt: str | None = None
    fps: int | None = None
    padding: bool = False
    """A repeat that keeps a rank in lockstep; its output is dropped."""

    @property
    def shape_key(self) -> tuple[Any, ...]:
        """Slots of one wave share it, so every rank runs the same forwards (see [Note: waves])."""
        return (self.kind, self.height, self.width, self.num_frames, self.num_inference_steps,
                self.negative_prompt is not None)

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``Omni.generate``; ``None`` keeps the pipeline's default."""
        return {"num_inference_steps": self.num_inference_steps, "height": self.height,
                "width": self.width, "num_frames": self.num_frames,
                "negative_prompt": self.negative_prompt}


@dataclass(frozen=True, slots=True)
class SlotResult:
    """What a rank sends back for its slot: the encoded media and its sidecar, or the error."""

    media: bytes = b""
    suffix: str = ""
    """``.png``, ``.mp4`` or ``.gif``."""
    sidecar: bytes = b""
    """The JSON sidecar ``GenerationResult.save`` wrote."""
    metadata: dict[str, Any] = field(default_factory=dict)
    thumbnail: bytes = b""
    """Videos: the first frame as a PNG (``GET /v1/videos/{id}/content?variant=thumbnail``)."""
    error: str | None = None
    in_step: tuple[int, str | None] | None = None
    """Lockstep waves: the rank's ``OffloadHandle.lockstep_status()`` after its slot."""


@dataclass(slots=True, eq=False)
class Job:
    """A queued slot on rank 0 and the future its HTTP request awaits (compared by identity)."""

    slot: Slot
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    progress: float = 0.0
    """Fraction of the denoising steps done while the job runs: written by rank 0's generation
    loop (in lockstep for the whole wave, whose slots all run the same steps), or, free, by the
    dispatcher of the rank that runs it, from that rank's step messages (videos)."""


class WaveQueue:
    """Queued jobs in arrival order; ``next_wave`` takes up to one per rank of one shape.

    A job whose future is cancelled (its client went away, its video job was deleted) leaves the
    queue at once: left in until a wave took it, it would count against ``--max-queue`` and the
    queue depth for as long as the running wave lasts, and clients that queue work and leave
    could keep every other client out (429)."""

    def __init__(self, max_jobs: int) -> None:
        self._jobs: deque[Job] = deque()
        self._max_jobs = max_jobs
        self._closed = False
        self._cond = threading.Condition()

    def depth(self) -> int:
        return len(self._jobs)

    def put(self, jobs: Sequence[Job]) -> None:
        """Queue all of ``jobs`` or none: raises :class:`QueueFull` or :class:`ServiceUnavailable`."""
        with self._cond:
            if self._closed:
                raise ServiceUnavailable("the service is shutting down: no new work is taken.")
            if len(self._jobs) + len(jobs) > self._max_jobs:
                raise QueueFull(f"{len(self._jobs)} images or videos are queued (--max-queue "
                                f"{self._max_jobs}): retry later.")
            self._jobs.extend(jobs)
            self._cond.notify_all()
        # Outside the lock: a future cancelled already calls back at once.
        for job in jobs:
            job.future.add_done_callback(functools.partial(self._forget, job))

    def next_wave(self, size: int, fill_wait_s: float, timeout_s: float) -> list[Job]:
        """The oldest job and up to ``size - 1`` more of its shape, in arrival order.

        Waits up to ``timeout_s`` for a first job (empty list if none came), then up to
        ``fill_wait_s`` for the wave to fill."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._jobs or self._closed, timeout=timeout_s):
                return []
            if not self._jobs:
                return []
            key = self._jobs[0].slot.shape_key
            deadline = time.monotonic() + fill_wait_s
            while not self._closed and self._count(key) < size:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(timeout=left):
                    break
            wave = [job for job in self._jobs if job.slot.shape_key == key][:size]
            for job in wave:
                self._jobs.remove(job)
            return wave

    def close(self) -> list[Job]:
        """Take no more jobs; returns those still queued."""
        with self._cond:
            self._closed = True
            left, self._jobs = list(self._jobs), deque()
            self._cond.notify_all()
            return left

    def _forget(self, job: Job, future: concurrent.futures.Future) -> None:
        """A job's future is done: if it was cancelled, the job leaves the queue. (In the thread
        that cancelled it; a job a wave took already is skipped by the generation loop.)"""
        if future.cancelled():
            with self._cond:
                with contextlib.suppress(ValueError):  # not queued: a wave took it, or a stop
                    self._jobs.remove(job)

    def _count(self, key: tuple[Any, ...]) -> int:
        return sum(1 for job in self._jobs if job.slot.shape_key == key)


# -- the service -----------------------------------------------------------------------------
class WaveObserver(Protocol):
    """What the generation loop reports to after each wave (the HTTP front-end's metrics).
    Called from several threads of rank 0 when ranks are free (one per follower, besides the
    main thread), so an observer must be thread-safe."""

    def wave_done(self, kind: str, done: int, padded: int, seconds: float, omni: Omni | None) -> None: ...


class RankLink:
    """One end of a two-rank gloo group between rank 0 and one other rank (free ranks, see
    [Note: waves]): objects go one way at a time, by a broadcast from the sending end."""

    def __init__(self, group: dist.ProcessGroup, rank: int, peer: int) -> None:
        self.group = group
        self.rank = rank
        self.peer = peer
        """The rank at the other end."""

    def send(self, message: Any) -> None:
        dist.broadcast_object_list([message], src=self.rank, group=self.group)

    def recv(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.peer, group=self.group)
        return box[0]


class Service:
    """The warm pipeline, the queue and the loop that feeds the ranks, in waves or free."""

    def __init__(self, omni: Omni, ctx: DistContext, options: ServeOptions,
                 group: dist.ProcessGroup | None, metrics: WaveObserver | None = None, *,
                 links: Sequence[RankLink] = ()) -> None:
        """``group``: the gloo group of every rank that carries waves (lockstep only).
        ``links``: free ranks only: on rank 0 one per other rank, on another rank the one to
        rank 0."""
        self.omni = omni
        self.ctx = ctx
        self.options = options
        self.limits = ModelLimits.of(omni)
        # The window ModelLimits counts against: the same max_sequence_length.
        self.prompts = PromptCounter(omni.pipeline, call_defaults(omni).get("max_sequence_length"))
        """Prompt lengths for the HTTP side (never the pipeline's own tokenizer)."""
        self.queue = WaveQueue(options.max_queue)
        self.metrics = metrics
        self.started = time.time()
        self.lockstep = omni.lockstep
        """Whether the ranks run in padded waves ([Note: waves]); the same on every rank."""
        self._group = group
        self._links = list(links)
        self._lost: set[int] = set()
        """Ranks that failed while generating (free ranks): they get no more work."""
        self._stop = threading.Event()

    @property
    def free(self) -> bool:
        """Several ranks, each taking the next slot when it is free (no waves, no padding)."""
        return self.ctx.world_size > 1 and not self.lockstep

    def ranks_serving(self) -> int:
        """Ranks that take work: all of them, less those lost (free ranks only lose any)."""
        return self.ctx.world_size - len(self._lost)

    # -- front-end side (any thread) ---------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._stop.is_set()

    def submit(self, slots: Sequence[Slot]) -> list[Job]:
        """Queue the slots of one request; each job's future resolves to a :class:`SlotResult`
        or raises :class:`GenerationFailed` / :class:`ServiceUnavailable`."""
        if self.draining:
            raise ServiceUnavailable("the service is shutting down: no new work is taken.")
        jobs = [Job(slot) for slot in slots]
        self.queue.put(jobs)
        return jobs

    def request_stop(self, *_: object) -> None:
        """Stop after the running slots (on rank 0, from the thread that watches for SIGTERM and
        SIGINT: ``run.py``, [Note: signals while generating]). The queued slots are answered 503
        at once, not after the running ones: a launcher that kills the ranks a while after its own
        SIGTERM (torchrun's shutdown timeout) must not cut them off unanswered."""
        if not self._stop.is_set():
            logger.info("stopping: finishing the running %s, refusing new work",
                        "slots" if self.free else "wave")
            # A thread: the caller returns at once, whoever holds the queue's lock.
            threading.Thread(target=self._refuse_queued, name="serve-stop", daemon=True).start()
        self._stop.set()

    def _refuse_queued(self) -> None:
        for job in self.queue.close():
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(ServiceUnavailable(
                    "the service shut down before this request ran: retry on a running service."))

    # -- rank 0 ------------------------------------------------------------------------
    def run(self) -> None:
        """Rank 0's generation loop until a stop is requested: waves, or (free ranks) its own
        slots while a thread per other rank hands that rank its slots. Then every rank is told
        to stop."""
        dispatchers = [threading.Thread(target=self._dispatch, args=(link,), name=f"serve-rank{link.peer}")
                       for link in (self._links if self.free else [])]
        for thread in dispatchers:
            thread.start()
        try:
            while not self._stop.is_set():
                if self.free:
                    job = self._take()
                    if job is not None:
                        self._run_own(job)
                    continue
                wave = self.queue.next_wave(self.ctx.world_size, self.options.wave_wait_s, _POLL_S)
                if wave:
                    self._run_wave(wave)
        finally:
            self._stop.set()  # the dispatchers end too, should this loop have raised
            self._refuse_queued()
            for thread in dispatchers:  # each finishes its rank's running slot, then sends the stop
                thread.join()
            if self.ctx.world_size > 1 and not self.free:
                dist.broadcast_object_list([None], src=0, group=self._group)

    def _take(self) -> Job | None:
        """The oldest queued slot, of any shape, marked running; None if none came within the
        poll interval or its client went away (its future was cancelled)."""
        jobs = self.queue.next_wave(1, 0.0, _POLL_S)
        return jobs[0] if jobs and jobs[0].future.set_running_or_notify_cancel() else None

    def _run_wave(self, wave: list[Job]) -> None:
        # A request whose client went away has cancelled its futures: its slots are not run.
        wave = [job for job in wave if job.future.set_running_or_notify_cancel()]
        if not wave:
            return
        start = time.perf_counter()
        padding = [dataclasses.replace(wave[0].slot, padding=True)] * (self.ctx.world_size - len(wave))
        def on_step(fraction: float) -> None:
            for job in wave:
                job.progress = fraction

        try:
            results = self._exchange([job.slot for job in wave] + padding, on_step)
        except BaseException as exc:  # a collective failed: answer, then end the loop
            for job in wave:
                job.future.set_exception(GenerationFailed(f"the wave failed: {type(exc).__name__}: {exc}"))
            raise
        first = wave[0].slot
        self._answer(wave, results, len(padding), time.perf_counter() - start,
                     f"wave of {len(wave)} {first.kind}(s) + {len(padding)} padding", own=True)
        _check_in_step(results)

    def _exchange(self, slots: list[Slot], on_step: Callable[[float], None]) -> list[SlotResult]:
        """Send the wave to the ranks, run rank 0's slot, gather every rank's result."""
        if self.ctx.world_size == 1:
            return [run_slot(self.omni, slots[0], self.ctx, self.options.video_format, on_step)]
        dist.broadcast_object_list([slots], src=0, group=self._group)
        own = run_slot(self.omni, slots[0], self.ctx, self.options.video_format, on_step)
        own = dataclasses.replace(own, in_step=_lockstep_status(self.omni))
        results: list[Any] = [None] * self.ctx.world_size
        dist.gather_object(own, results, dst=0, group=self._group)
        return results

    def _run_own(self, job: Job) -> None:
        """Free ranks: rank 0 runs one slot itself."""
        start = time.perf_counter()
        result = run_slot(self.omni, job.slot, self.ctx, self.options.video_format,
                          lambda fraction: setattr(job, "progress", fraction))
        self._answer([job], [result], 0, time.perf_counter() - start, f"{job.slot.kind} on rank 0", own=True)

    def _dispatch(self, link: RankLink) -> None:
        """Free ranks: rank 0's thread for the rank at the other end of ``link``: hands it the
        next queued slot as soon as it is free, relays its progress, answers its result. A
        rank that fails fails its slot (500) and gets no more work; the others serve on."""
        while not self._stop.is_set():
            job = self._take()
            if job is None:
                continue
            start = time.perf_counter()
            try:
                link.send(job.slot)
                while isinstance(message := link.recv(), float):  # step progress, then the result
                    job.progress = message
            except Exception as exc:
                self._lost.add(link.peer)
                logger.error("rank %d failed (%s: %s): it takes no more work; serving on with %d rank(s)",
                             link.peer, type(exc).__name__, exc, self.ranks_serving())
                job.future.set_exception(GenerationFailed(
                    f"rank {link.peer} failed while generating: {type(exc).__name__}: {exc}"))
                return
            self._answer([job], [message], 0, time.perf_counter() - start,
                         f"{job.slot.kind} on rank {link.peer}", own=False)
        try:
            link.send(None)  # the stop message
        except Exception as exc:
            logger.warning("rank %d did not take the stop message (%s: %s)", link.peer, type(exc).__name__, exc)

    def _answer(self, jobs: list[Job], results: list[SlotResult], padded: int, elapsed: float,
                what: str, *, own: bool) -> None:
        """Count, log and answer the jobs of one wave (free ranks: one slot). ``own``: rank 0
        ran it, so its offload trace (if any) describes it."""
        # Metrics first, so that a client reading /metrics after its answer sees its outputs.
        if self.metrics is not None:
            done = sum(1 for r in results[:len(jobs)] if r.error is None)
            self.metrics.wave_done(self.limits.kind, done, padded, elapsed, self.omni if own else None)
        first = jobs[0].slot
        size = f"{first.width}x{first.height}" if first.width else "default size"
        logger.info("%s (%s, steps %s) in %.2f s", what, size, first.num_inference_steps or "default", elapsed)
        for job, result in zip(jobs, results, strict=False):
            if result.error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(GenerationFailed(result.error))

    # -- other ranks -------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks other than 0: run the slots rank 0 sends (this rank's slot of each wave, or,
        free, each slot it is handed) until the stop message."""
        if not self.free:
            self._follow_waves()
            return
        (link,) = self._links
        while (slot := link.recv()) is not None:
            start = time.perf_counter()
            # Step progress goes back for videos, the only outputs whose progress is asked for.
            report = link.send if slot.kind == "video" else None
            result = run_slot(self.omni, slot, self.ctx, self.options.video_format, report)
            link.send(result)
            logger.info("%s %s done in %.2f s", slot.kind, slot.name, time.perf_counter() - start)
        logger.info("stopped")

    def _follow_waves(self) -> None:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self._group)
            if box[0] is None:
                logger.info("stopped")
                return
            result = run_slot(self.omni, box[0][self.ctx.rank], self.ctx, self.options.video_format)
            result = dataclasses.replace(result, in_step=_lockstep_status(self.omni))
            dist.gather_object(result, None, dst=0, group=self._group)


def _lockstep_status(omni: Omni) -> tuple[int, str | None] | None:
    return omni.handle.lockstep_status() if omni.handle is not None else None


class OutOfStep(RuntimeError):
    """The ranks' weight gathers no longer pair (a slot failed on some ranks part way through
    its forwards): the service stops rather than serve on."""


def _check_in_step(results: Sequence[SlotResult]) -> None:
    """After a lockstep wave (answered already): every rank's allgather rings must have made the
    same number of fills, and none may have failed. A slot that fails on one rank part way
    through its forwards leaves that rank's fills behind the others' (the ranks meet again only
    once the others' fills time out, ``collective_timeout_s``); served on, every later wave
    would stall the same way or fail. The service stops, so whatever restarts it starts clean."""
    statuses = [r.in_step for r in results if r.in_step is not None]
    broken = next((why for _, why in statuses if why), None)
    if broken is None and len({fills for fills, _ in statuses}) <= 1:
        return
    counts = ", ".join(f"rank {r}: {s[0] if s else '?'}" for r, s in enumerate(r.in_step for r in results))
    message = (f"the ranks' weight gathers are out of step after this wave (fills made: {counts})"
               + (f"; {broken}" if broken else "") + ": stopping the service. A slot failed on some ranks "
               "part way through its denoising steps (see the warnings above); restart the service.")
    logger.error("%s", message)
    raise OutOfStep(message)


class _StepReport:
    """A diffusers ``callback_on_step_end`` that reports progress and changes nothing: it hands
    back no tensors, so the pipeline keeps its own latents (the output stays bitwise the same)."""

    def __init__(self, on_step: Callable[[float], None]) -> None:
        self.on_step = on_step

    def __call__(self, pipe: Any, step: int, _timestep: Any, _tensors: dict[str, Any]) -> dict[str, Any]:
        total = getattr(pipe, "_num_timesteps", None) or getattr(pipe, "num_timesteps", None)
        if isinstance(total, int) and total > 0:
            self.on_step(min(1.0, (step + 1) / total))
        return {}


def run_slot(omni: Omni, slot: Slot, ctx: DistContext, video_format: str,
             on_step: Callable[[float], None] | None = None) -> SlotResult:
    """Generate one slot with ``Omni.generate`` (so it equals ``omni-offload generate`` for the
    same prompt and seed) and encode it the way ``GenerationResult.save`` writes files.
    ``on_step`` is told the fraction of denoising steps done, where the pipeline reports steps."""
    try:
        extra = {}
        if on_step is not None and "callback_on_step_end" in inspect.signature(omni.pipeline.__call__).parameters:
            extra["callback_on_step_end"] = _StepReport(on_step)
        result = omni.generate(slot.prompt, seed=slot.seed, name=slot.name, fps=slot.fps,
                               **slot.options(), **extra)
        if slot.padding:
            return SlotResult()
        result.metadata.update(rank=ctx.rank, world_size=ctx.world_size)
        thumbnail = b""
        with tempfile.TemporaryDirectory(prefix="omni-serve-") as tmp:
            saved = result.save(tmp, video_format=video_format)  # type: ignore[arg-type]
            if result.kind == "video":
                buffer = io.BytesIO()
                Image.fromarray(result.frames[0]).save(buffer, format="PNG")
                thumbnail = buffer.getvalue()
            return SlotResult(media=saved.media.read_bytes(), suffix=saved.media.suffix,
                              sidecar=saved.sidecar.read_bytes(), metadata=result.metadata,
                              thumbnail=thumbnail)
    except Exception as exc:
        logger.warning("slot %s (seed %d) failed: %s: %s", slot.name, slot.seed,
                       type(exc).__name__, exc, exc_info=True)
        return SlotResult(error=f"{type(exc).__name__}: {exc}")
