"""The HTTP front-end of ``omni-offload serve`` (rank 0): FastAPI under uvicorn.

Needs the ``serve`` extra (``pip install -e ".[serve]"``); the CLI imports it (through
``run.py``) only once the service starts. Handlers check a request, queue its slots and await
their futures; rank 0's main thread generates (see [Note: waves] in ``service.py``).

Errors are JSON, in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``;
``param`` names the offending field and ``code`` is a string (or null). 400: the body is not
JSON, a field is unknown, of the wrong type or out of range, or the model makes the other kind
of output; 401: a missing or wrong API key; 404: no such route or model; 413: the body is larger
than ``--max-body``; 429 (with ``Retry-After``): the queue is full; 503: shutting down; 500: the
pipeline raised while generating (the body names the request; the reason is in the log only).
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import gc
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import resource
except ImportError:  # Windows: no open-file limit to raise
    resource = None  # type: ignore[assignment]

from ...runtime.proc import rss_mib
from ..api import DEFAULT_FPS
from .jobs import StoreFull, VideoStore
from .metrics import ServeMetrics
from .service import (
    GenerationFailed,
    ModelLimits,
    QueueFull,
    ServeOptions,
    Service,
    ServiceUnavailable,
    Slot,
    prompt_tokens,
)

__all__ = ["HttpServer", "ImageRequest", "RequestError", "VideoJobRequest", "VideoRequest", "build_app"]

_PATHS = {"image": "/v1/images/generations", "video": "/v1/videos/generations"}
#: OpenAI's video job API: POST creates a job, GET polls and lists, .../content downloads.
_JOBS = "/v1/videos"
_SIZE = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)$")
# Seconds a graceful stop waits for open connections before closing them: answers in flight are
# written by then (the running wave finished before the stop), and a stalled upload must not hold
# the shutdown up.
_GRACEFUL_S = 2
# Seconds an idle keep-alive connection stays open.
_KEEP_ALIVE_S = 5
# What a client told the queue is full should wait before it retries, in seconds.
_RETRY_AFTER_S = 1
# How often a waiting request checks whether its client is still there, in seconds.
_DISCONNECT_POLL_S = 0.25
# The status of a request whose client went away (nginx's "client closed request"): never sent,
# it keeps such requests out of the answered counts.
_ABANDONED = 499
#: Largest seed: output i of a request uses seed + i, which must stay below 2**63.
SEED_LIMIT = 2**63
#: Formats a response may take; OpenAI's "url" is not served.
RESPONSE_FORMATS = ("b64_json", "path")

logger = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the model cannot take; ``param`` names the field."""

    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


# -- request bodies --------------------------------------------------------------------------
class _GenerationRequest(BaseModel):
    # Unknown fields are refused (a typo must not be silently ignored); JSON types are strict.
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1)
    n: int = Field(1, ge=1)
    size: str | None = None
    """``WIDTHxHEIGHT`` (OpenAI's order); default: the model's own size."""
    response_format: str = "b64_json"
    """``b64_json`` or ``path``; OpenAI's ``url`` gets a 400 naming these."""
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    """Seed of output 0; output i uses seed + i. Default: a random one (returned)."""
    num_inference_steps: int | None = Field(None, ge=1)
    negative_prompt: str | None = None
    model: str | None = None
    """If given, must be the served model."""
    # Fields OpenAI clients send. Accepted so such clients work; they have no meaning for these
    # models and are ignored (documented in docs/serving.md).
    user: str | None = None
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    output_format: str | None = None
    """If given, must be the format this service writes (``png`` for images)."""


class ImageRequest(_GenerationRequest):
    """``POST /v1/images/generations``."""


class VideoRequest(_GenerationRequest):
    """``POST /v1/videos/generations``."""

    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1, le=240)


class VideoJobRequest(BaseModel):
    """``POST /v1/videos``: OpenAI's video job fields, then this service's own.

    OpenAI's client sends it as a multipart form (every value a string), so types are converted
    the way form data needs ("7" is 7); unknown fields are still refused."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    seconds: float | None = Field(None, gt=0)
    """Length of the clip: ``num_frames`` becomes the nearest count the model takes at ``fps``."""
    size: str | None = None
    input_reference: Any = None
    """Refused: these models make videos from text only."""
    user: str | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1, le=240)
    num_inference_steps: int | None = Field(None, ge=1)
    negative_prompt: str | None = None


def plan_job(body: VideoJobRequest, limits: ModelLimits) -> VideoRequest:
    """The synchronous request a video job runs; :class:`RequestError` for what it cannot be."""
    if body.input_reference is not None:
        raise RequestError("input_reference: the models served here make videos from text only; "
                           "leave it out.", "input_reference", code="unsupported_parameter")
    num_frames = body.num_frames
    if body.seconds is not None:
        if num_frames is not None:
            raise RequestError("give seconds or num_frames, not both.", "seconds")
        step, fps = max(limits.frame_step, 1), body.fps or DEFAULT_FPS
        num_frames = max(1, round(body.seconds * fps / step)) * step + 1
    return VideoRequest(prompt=body.prompt, model=body.model, size=body.size, seed=body.seed,
                        num_frames=num_frames, fps=body.fps, num_inference_steps=body.num_inference_steps,
                        negative_prompt=body.negative_prompt, user=body.user)


def plan_slots(body: _GenerationRequest, kind: str, limits: ModelLimits, options: ServeOptions,
               request_id: str) -> list[Slot]:
    """The request's slots, after the checks that depend on the model and the server's limits."""
    if body.model is not None and body.model != limits.model:
        raise RequestError(f"model {body.model!r} is not served here; this service serves "
                           f"{limits.model!r} (or leave 'model' out).", "model", code="model_not_found")
    if kind != limits.kind:
        raise RequestError(f"{limits.model} makes {limits.kind}s: POST {_PATHS[limits.kind]}.",
                           None, code="wrong_endpoint")
    if body.response_format not in RESPONSE_FORMATS:
        raise RequestError(f"response_format {body.response_format!r} is not served here: use "
                           f"{' or '.join(RESPONSE_FORMATS)} (the media inline, or a path on the server).",
                           "response_format")
    if body.output_format is not None and (kind != "image" or body.output_format.lower() != "png"):
        raise RequestError(f"output_format {body.output_format!r}: this service writes "
                           f"{'png images' if kind == 'image' else 'videos as --video-format says'}; "
                           "leave output_format out.", "output_format")
    if body.seed is not None and body.seed + body.n - 1 >= SEED_LIMIT:
        raise RequestError(f"seed {body.seed} with n={body.n}: output i uses seed + i, which must "
                           f"stay below 2**63; give a seed below {SEED_LIMIT - body.n + 1}.", "seed")
    if body.n > options.max_n:
        raise RequestError(f"n={body.n} is more than this service allows (--max-n "
                           f"{options.max_n}): send several requests.", "n")
    if body.num_inference_steps is not None and body.num_inference_steps > options.max_steps:
        raise RequestError(f"num_inference_steps={body.num_inference_steps} is more than this "
                           f"service allows (--max-steps {options.max_steps}).", "num_inference_steps")
    width, height = _parse_size(body.size, limits, options)
    num_frames = getattr(body, "num_frames", None)
    if num_frames is not None:
        _check_frames(num_frames, limits, options)
    _check_cost(body.n, width, height, num_frames, limits, options)
    seed = secrets.randbelow(2**31) if body.seed is None else body.seed
    return [Slot(kind=limits.kind, prompt=body.prompt, seed=seed + i, name=f"{request_id}-{i}",
                 num_inference_steps=body.num_inference_steps, height=height, width=width,
                 num_frames=num_frames, negative_prompt=body.negative_prompt,
                 fps=getattr(body, "fps", None)) for i in range(body.n)]


def _parse_size(size: str | None, limits: ModelLimits,
                options: ServeOptions) -> tuple[int | None, int | None]:
    if size is None:
        return None, None
    match = _SIZE.match(size)
    if match is None:
        raise RequestError(f"size {size!r} is not WIDTHxHEIGHT (for example '1024x768').", "size")
    width, height = int(match[1]), int(match[2])
    m = limits.size_multiple
    if width % m or height % m:
        raise RequestError(f"size {size!r}: {limits.model} needs width and height that are "
                           f"multiples of {m}; for example '{_round_up(width, m)}x{_round_up(height, m)}'.",
                           "size")
    if max(width, height) > options.max_size:
        raise RequestError(f"size {size!r} is larger than this service allows (--max-size "
                           f"{options.max_size} pixels a side).", "size")
    if max(width, height) > options.max_aspect * min(width, height):
        raise RequestError(f"size {size!r} is more than {options.max_aspect:g} times as long as it is wide "
                           "(--max-aspect).", "size")
    return width, height


#: ``--max-pixels`` when not given: 4 images of 2048x2048; one 1280x720 video of 121 frames.
DEFAULT_MAX_PIXELS = {"image": 4 * 2048 * 2048, "video": 1280 * 720 * 121}
#: ``--max-wave-pixels`` when not given: one image of 2048x2048; one 1280x720 video of 121 frames.
DEFAULT_MAX_WAVE_PIXELS = {"image": 2048 * 2048, "video": 1280 * 720 * 121}


def _check_cost(n: int, width: int | None, height: int | None, num_frames: int | None,
                limits: ModelLimits, options: ServeOptions) -> None:
    """One output's ``width x height x frames`` within ``--max-wave-pixels`` (the work of one
    wave on each rank), all ``n`` of them within ``--max-pixels``. A size or frame count left to
    the model's default counts as that default (where the pipeline fixes one)."""
    if width is None or height is None:
        width, height = limits.default_size or (None, None)
    if width is None or height is None:
        return
    frames = num_frames or (limits.default_frames if limits.kind == "video" else None) or 1
    shown = " x num_frames" if limits.kind == "video" else ""
    wave = width * height * frames
    wave_budget = options.max_wave_pixels or DEFAULT_MAX_WAVE_PIXELS[limits.kind]
    if wave > wave_budget:
        raise RequestError(f"size{shown} is {wave} pixels for one output, more than this service allows "
                           f"(--max-wave-pixels {wave_budget}): ask for less.", "size")
    budget = options.max_pixels or DEFAULT_MAX_PIXELS[limits.kind]
    if n * wave > budget:
        raise RequestError(f"n x size{shown} is {n * wave} pixels, more than this service allows per "
                           f"request (--max-pixels {budget}): ask for less.", "n" if n > 1 else "size")


def _check_frames(num_frames: int, limits: ModelLimits, options: ServeOptions) -> None:
    step = limits.frame_step
    if num_frames > options.max_frames:
        raise RequestError(f"num_frames={num_frames} is more than this service allows "
                           f"(--max-frames {options.max_frames}).", "num_frames")
    if step > 1 and num_frames % step != 1:
        lower = num_frames - (num_frames - 1) % step
        raise RequestError(f"num_frames={num_frames}: {limits.model} needs {step}k+1 frames, for "
                           f"example {lower} or {lower + step}.", "num_frames")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# -- the app ---------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error",
                413: "invalid_request_error",
                429: "rate_limit_error",
                503: "service_unavailable_error"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in OpenAI's shape; ``code`` is a string or null, as OpenAI's clients expect."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _validation_error(exc: RequestValidationError | ValidationError) -> JSONResponse:
    """The first problem, as one message naming the field: 400 for a body that is not JSON."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "missing", "loc": ("body",), "msg": "missing"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    if first["type"] == "json_invalid":
        return _error(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])}).",
                      code="invalid_json")
    if param is None:
        return _error(400, "the body must be a JSON object with at least 'prompt', sent with "
                      "Content-Type: application/json.", code="invalid_body")
    if first["type"] == "extra_forbidden":
        return _error(400, f"unknown field {param!r}: drop it; see docs/serving.md for the fields.",
                      param, code="unknown_parameter")
    if first["type"] == "missing":
        return _error(400, f"{param} is required.", param, code="missing_required_parameter")
    shown = first.get("input")
    shown = f"{shown[:40]!r}..." if isinstance(shown, str) and len(shown) > 40 else repr(shown)
    return _error(400, f"{param}: {first['msg']} (got {shown}).", param, code="invalid_value")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Buffered:
    """ASGI wrapper outside the framework: reads a request's whole body before the app sees the
    request, as a reverse proxy's request buffering does. A body over ``limit`` bytes gets 413,
    whether it declares its length or streams in chunks (nothing past the limit is read); a body
    that has not fully arrived ``deadline_s`` after the request started gets 408. Either answer
    closes the connection (the rest of the body may still come).

    A stalled upload so holds only this small coroutine, not the framework's stack of
    middlewares and handlers (some 16 KiB a request): 10,000 of them cost a third as much."""

    def __init__(self, app: Any, limit: int, deadline_s: float) -> None:
        self.app, self.limit, self.deadline_s = app, limit, deadline_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, seen = [], 0
        deadline = time.monotonic() + self.deadline_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                response = _error(408, f"the request body did not arrive within {self.deadline_s:g} s "
                                  "(--read-timeout).", code="request_timeout", headers={"Connection": "close"})
                return await response(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client left before its body arrived: no one to answer
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                return await self._refuse(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> dict:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: the disconnect, whenever it comes

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        response = _error(413, f"the request body is larger than this service takes (--max-body "
                          f"{self.limit} bytes).", code="request_too_large", headers={"Connection": "close"})
        await response(scope, receive, send)


def build_app(service: Service, store: VideoStore | None = None) -> Any:
    """The ASGI app: the API key and answer counts (:class:`_Front`), then the whole body read
    within its limits (:class:`_Buffered`), then FastAPI's app with the generation endpoints,
    video jobs, health, models and metrics. Both wrappers are plain ASGI, outside the framework
    (its decorator middlewares would hide a client's disconnect from the handlers, which watch
    for it)."""
    app = FastAPI(title="omni_dist_offload", docs_url=None, redoc_url=None, openapi_url=None)
    metrics: ServeMetrics = service.metrics  # type: ignore[assignment]
    endpoints = {*_PATHS.values(), _JOBS}

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.post(_PATHS["image"])
    async def images(body: ImageRequest, request: Request) -> Response:
        return await _generate(service, "image", body, request)

    @app.post(_PATHS["video"])
    async def videos(body: VideoRequest, request: Request) -> Response:
        return await _generate(service, "video", body, request)

    if store is not None:
        _video_job_routes(app, service, store)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "stopping" if service.draining else "ok", "model": service.omni.model,
                "kind": service.limits.kind, "world_size": service.ctx.world_size,
                "queue_depth": service.queue.depth()}
        return JSONResponse(body, status_code=503 if service.draining else 200)

    def model_card() -> dict[str, Any]:
        omni = service.omni
        return {"id": omni.model, "object": "model", "created": int(service.started),
                "owned_by": "omni_dist_offload", "kind": service.limits.kind,
                "world_size": service.ctx.world_size,
                "offload_config": omni.config.to_dict() if omni.config else None}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != service.omni.model:
            return _error(404, f"model {model_id!r} is not served here; this service serves "
                          f"{service.omni.model!r}.", "model", code="model_not_found")
        return JSONResponse(model_card())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    buffered = _Buffered(app, limit=service.options.max_body_bytes, deadline_s=service.options.read_timeout_s)
    return _Front(buffered, metrics=metrics, key=service.options.api_key, endpoints=endpoints)


def _authorised(headers: dict[bytes, bytes], key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time."""
    scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


class _Front:
    """ASGI middleware: the API key (every path but ``/health``), then the answered-requests
    metrics of the generation endpoints' POSTs (not for requests whose client went away)."""

    def __init__(self, app: Any, metrics: ServeMetrics, key: str | None, endpoints: set[str]) -> None:
        self.app, self.metrics, self.key, self.endpoints = app, metrics, key, endpoints

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, path = time.perf_counter(), scope["path"]
        status: list[int] = []
        if self.key is not None and path != "/health" and not _authorised(dict(scope.get("headers") or []), self.key):
            response = _error(401, "a valid API key is required: send 'Authorization: Bearer <key>'.",
                              code="invalid_api_key")
            await response(scope, receive, send)
            status.append(401)
        else:
            async def sent(message: dict) -> None:
                if message["type"] == "http.response.start":
                    status.append(message["status"])
                await send(message)

            await self.app(scope, receive, sent)
        if scope["method"] == "POST" and path in self.endpoints and status and status[0] != _ABANDONED:
            self.metrics.answered(path, status[0], time.perf_counter() - start)


def _check_prompts(service: Service, body: _GenerationRequest) -> None:
    """A prompt longer than the text encoders read is refused rather than cut: the cut part would
    be lost, and diffusers would log it."""
    limit = service.limits.max_prompt_tokens
    if limit is None:
        return
    for field in ("prompt", "negative_prompt"):
        text = getattr(body, field)
        if text:
            count = prompt_tokens(service.omni.pipeline, text)
            if count > limit:
                raise RequestError(f"{field} is {count} tokens; {service.limits.model} reads at most {limit}: "
                                   "shorten it.", field, code="prompt_too_long")


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed the connection."""
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


async def _generate(service: Service, kind: str, body: _GenerationRequest, request: Request) -> Response:
    request_id = f"req-{uuid.uuid4().hex[:12]}"
    try:
        slots = plan_slots(body, kind, service.limits, service.options, request_id)
        # Tokenising a long prompt takes a while: off the event loop.
        await asyncio.to_thread(_check_prompts, service, body)
        futures = [job.future for job in service.submit(slots)]
    except RequestError as exc:
        return _error(exc.status, str(exc), exc.param, code=exc.code)
    except QueueFull as exc:
        return _error(429, str(exc), code="queue_full", headers={"Retry-After": str(_RETRY_AFTER_S)})
    except ServiceUnavailable as exc:
        return _error(503, str(exc), code="shutting_down")
    # Wait for the outputs or for the client to leave, whichever comes first. A client that left
    # cancels its queued slots (the generation loop skips cancelled ones, so they never run; with
    # several ranks rank 0 leaves them out of the wave it sends, so the ranks agree); slots
    # already running finish and are discarded, counted apart from answered requests.
    gathered = asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
    gone = asyncio.ensure_future(_client_gone(request))
    await asyncio.wait({gathered, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not gathered.done():
        queued = sum(f.cancel() for f in futures)
        if service.metrics is not None:
            service.metrics.abandoned_slots(_PATHS[kind], queued, len(futures) - queued)  # type: ignore[attr-defined]
        logger.info("request %s: the client went away; %d queued output(s) dropped, %d running "
                    "discarded", request_id, queued, len(futures) - queued)
        return Response(status_code=_ABANDONED)  # no one to deliver it to
    gone.cancel()
    outcomes = gathered.result()
    try:
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        results = outcomes
    except GenerationFailed:
        # The reason (an exception's text) stays in the server's log: it may hold internals.
        return _error(500, f"generation failed for request {request_id}; the server's log has the reason.",
                      code="generation_failed")
    except ServiceUnavailable as exc:
        return _error(503, str(exc), code="shutting_down")
    data = []
    for slot, result in zip(slots, results, strict=True):
        meta = result.metadata
        item: dict[str, Any] = {"seed": slot.seed, "format": result.suffix.lstrip("."),
                                "size": f"{meta['width']}x{meta['height']}"}
        if kind == "video":
            item.update(num_frames=meta["num_frames"], fps=meta["fps"])
        if body.response_format == "path":
            item["path"] = str(_write(service.options.output_dir, slot.name, result))
        else:
            item["b64_json"] = base64.b64encode(result.media).decode("ascii")
        data.append(item)
    return JSONResponse({"id": request_id, "created": int(time.time()), "model": service.omni.model,
                         "data": data})


# -- video jobs ------------------------------------------------------------------------------
_MEDIA_TYPES = {".mp4": "video/mp4", ".gif": "image/gif", ".png": "image/png"}
#: Largest page of ``GET /v1/videos``.
_MAX_PAGE = 100


async def _job_fields(request: Request) -> dict[str, Any]:
    """A job request's fields, from a multipart or URL-encoded form (OpenAI's client) or JSON."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        async with request.form(max_files=1, max_fields=64) as form:
            fields: dict[str, Any] = {}
            for key, value in form.multi_items():
                if key in fields:
                    raise RequestError(f"{key} is given twice.", key)
                # A file (input_reference) is refused by plan_job; its bytes are not kept.
                fields[key] = value if isinstance(value, str) else "<file>"
            return fields
    try:
        fields = await request.json()
    except ValueError as exc:
        raise RequestError(f"the body is not valid JSON ({exc}).", None, code="invalid_json") from None
    if not isinstance(fields, dict):
        raise RequestError("the body must be a JSON object with at least 'prompt'.", None, code="invalid_body")
    return fields


def _video_job_routes(app: FastAPI, service: Service, store: VideoStore) -> None:
    """``/v1/videos``: create, poll, list, download and delete video jobs (see ``jobs.py``)."""
    metrics: ServeMetrics | None = service.metrics  # type: ignore[assignment]

    def missing(video_id: str) -> JSONResponse:
        return _error(404, f"no video job {video_id!r}: it never existed, expired (--video-ttl "
                      f"{service.options.video_ttl_s:g} s) or was deleted.", "video_id", code="video_not_found")

    @app.post(_JOBS)
    async def create(request: Request) -> Response:
        try:
            try:
                body = VideoJobRequest.model_validate(await _job_fields(request))
            except ValidationError as exc:
                return _validation_error(exc)
            if service.limits.kind != "video":
                raise RequestError(f"{service.limits.model} makes images: POST {_PATHS['image']}.",
                                   None, code="wrong_endpoint")
            request_id = f"req-{uuid.uuid4().hex[:12]}"
            plain = plan_job(body, service.limits)
            try:
                (slot,) = plan_slots(plain, "video", service.limits, service.options, request_id)
            except RequestError as exc:
                if body.seconds is None or exc.param != "num_frames":
                    raise
                raise RequestError(f"seconds={body.seconds:g} is {plain.num_frames} frames at "
                                   f"{plain.fps or DEFAULT_FPS} fps: {exc}", "seconds") from None
            await asyncio.to_thread(_check_prompts, service, plain)
            if not store.has_room():
                raise StoreFull(f"{len(store)} video jobs are waiting or running (--max-video-jobs "
                                f"{store.max_jobs}): retry later.")
            (job,) = service.submit([slot])
        except RequestError as exc:
            return _error(exc.status, str(exc), exc.param, code=exc.code)
        except (QueueFull, StoreFull) as exc:
            code = "queue_full" if isinstance(exc, QueueFull) else "too_many_jobs"
            return _error(429, str(exc), code=code, headers={"Retry-After": str(_RETRY_AFTER_S)})
        except ServiceUnavailable as exc:
            return _error(503, str(exc), code="shutting_down")
        width, height = (slot.width, slot.height) if slot.width else service.limits.default_size or (0, 0)
        frames = slot.num_frames or service.limits.default_frames
        fps = slot.fps or DEFAULT_FPS
        try:
            video = store.add(job, model=service.omni.model, prompt=slot.prompt,
                              size=f"{width}x{height}" if width else "default",
                              seconds=f"{(frames - 1) / fps:g}" if frames else "default")
        except StoreFull as exc:
            job.future.cancel()  # not kept, so not run
            return _error(429, str(exc), code="too_many_jobs", headers={"Retry-After": str(_RETRY_AFTER_S)})
        return JSONResponse(video.card())

    @app.get(_JOBS)
    async def listing(after: str | None = None, limit: int = 20, order: str = "desc") -> JSONResponse:
        if not 1 <= limit <= _MAX_PAGE:
            return _error(400, f"limit={limit}: give 1 to {_MAX_PAGE}.", "limit", code="invalid_value")
        if order not in ("asc", "desc"):
            return _error(400, f"order={order!r}: give 'asc' or 'desc'.", "order", code="invalid_value")
        try:
            jobs, more = store.page(after, limit, order)
        except KeyError:
            return _error(400, f"after={after!r} is not a video job kept here.", "after", code="invalid_value")
        data = [video.card() for video in jobs]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": more})

    @app.get(_JOBS + "/{video_id}")
    async def retrieve(video_id: str) -> JSONResponse:
        video = store.get(video_id)
        return missing(video_id) if video is None else JSONResponse(video.card())

    @app.get(_JOBS + "/{video_id}/content")
    async def content(video_id: str, variant: str = "video") -> Response:
        video = store.get(video_id)
        if video is None:
            return missing(video_id)
        if variant not in ("video", "thumbnail"):
            return _error(400, f"variant={variant!r} is not served here: give 'video' or 'thumbnail'.",
                          "variant", code="invalid_value")
        if video.status != "completed":
            return _error(409, f"video job {video_id} has status {video.status!r}: content comes with "
                          "'completed' (poll GET /v1/videos/{id}).", "video_id", code="video_not_ready")
        path = video.media if variant == "video" else video.thumbnail
        if path is None or not path.is_file():
            return missing(video_id)
        return FileResponse(path, media_type=_MEDIA_TYPES.get(path.suffix, "application/octet-stream"),
                            filename=f"{video_id}{path.suffix}")

    @app.delete(_JOBS + "/{video_id}")
    async def delete(video_id: str) -> JSONResponse:
        outcome = store.delete(video_id)
        if outcome is None:
            return missing(video_id)
        # A queued job's slot is dropped here; a running one finishes and is discarded, counted
        # then by the store's on_discarded.
        if outcome == "dropped" and metrics is not None:
            metrics.abandoned_slots(_JOBS, 1, 0)
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})


def _write(output_dir: Path, name: str, result: Any) -> Path:
    """The media and its sidecar, as ``omni-offload generate`` writes them; returns the media."""
    output_dir.mkdir(parents=True, exist_ok=True)
    media = (output_dir / name).with_suffix(result.suffix)
    media.write_bytes(result.media)
    media.with_suffix(".json").write_bytes(result.sidecar)
    return media.resolve()


# -- connections -----------------------------------------------------------------------------
# Descriptors kept for everything but connections (the pipeline's files, NCCL, logs, the store).
_FD_RESERVE = 256
# Once a second at most: how often a log record of one kind (out of descriptors, a malformed
# request) is written while a flood of them lasts.
_LOG_EVERY_S = 1.0


def connection_cap(requested: int | None) -> int:
    """The connection cap: ``requested``, else what the open-file limit leaves. Raises the soft
    open-file limit to the hard one first (a server holds a descriptor per connection) and warns
    when ``requested`` is more than the descriptors left, which would then run out first."""
    if resource is None:  # not a POSIX host: no limit to read
        return requested or 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    left = max(16, soft - in_use - _FD_RESERVE)
    if requested is None:
        return left
    if requested > left:
        logger.warning("--max-connections %d is more than the %d descriptors the open-file limit (%d) "
                       "leaves: past %d, connections fail instead of getting 503. Raise the limit "
                       "(ulimit -n) or lower --max-connections.", requested, left, soft, left)
    return requested


def _protocol(cap: int, header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with two guards its settings lack: a connection past ``cap`` is
    answered 503 and closed as it opens (so a flood of idle connections cannot take every
    descriptor), and a request's headers must arrive within ``header_timeout_s`` of the
    connection opening or of the previous answer (a slow trickle of header bytes holds nothing).
    The body has its own deadline (:class:`_Buffered`); idle keep-alive has uvicorn's."""
    refusal = json.dumps({"error": {"message": f"this service has {cap} connections open (--max-connections): "
                                    "retry later.", "type": "service_unavailable_error", "param": None,
                                    "code": "too_many_connections"}}).encode()
    answer = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
              b"retry-after: 1\r\nconnection: close\r\ncontent-length: " + str(len(refusal)).encode()
              + b"\r\n\r\n" + refusal)

    flood = _Flood()

    class Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            flood.opened(self.connections, self.tasks)
            if len(self.connections) > cap:
                transport.write(answer)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._disarm_once_headers_came()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers (uvicorn's keep-alive covers idle time)
            self._disarm_once_headers_came()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)
            flood.closed(self.loop)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _disarm_once_headers_came(self) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return Protocol


class _Flood:
    """Gives the memory of a flood of connections back to the system once it has passed.

    Each open connection costs some 25 KiB (buffers, parser, task); freed, that memory stays in
    the allocators' heaps, so a server that once held 10,000 connections would keep ~250 MiB for
    good. Once the open connections and their tasks fall below a tenth of a peak of at least
    ``_FLOOD_CONNECTIONS``, a collection and ``malloc_trim`` run a second after the last close
    (glibc only; elsewhere the collection alone)."""

    def __init__(self) -> None:
        self.peak = 0
        self._timer: asyncio.TimerHandle | None = None
        self._open: tuple[set, set] = (set(), set())

    def opened(self, connections: set, tasks: set) -> None:
        self._open = (connections, tasks)
        self.peak = max(self.peak, len(connections))

    def closed(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.peak >= _FLOOD_CONNECTIONS and len(self._open[0]) * 10 < self.peak:
            if self._timer is not None:
                self._timer.cancel()  # the flood is still ebbing: wait for its last close
            self._timer = loop.call_later(1.0, self._release, loop)

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        connections, tasks = self._open
        if (len(connections) + len(tasks)) * 10 >= self.peak:  # requests still unwinding: later
            self._timer = loop.call_later(1.0, self._release, loop)
            return
        peak, before = self.peak, rss_mib() or 0.0
        self._timer, self.peak = None, 0
        gc.collect()
        if _LIBC is not None:
            _LIBC.malloc_trim(0)
        logger.info("a flood of %d connections has passed; memory given back: RSS %.0f -> %.0f MiB",
                    peak, before, rss_mib() or 0.0)


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc: no trim to ask for
        return None


_LIBC = _glibc()
# Open connections that make a flood worth giving memory back after.
_FLOOD_CONNECTIONS = 1000


class _OncePerSecond(logging.Filter):
    """Writes a record of one kind (its message template) once a second at most, with the
    count of those left out since; drops the traceback of running out of descriptors (the same
    one each time). Keeps a flood of failed accepts or malformed requests from filling the log."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = str(record.msg), time.monotonic()
        with self._lock:
            if now - self._last.get(key, -_LOG_EVERY_S) < _LOG_EVERY_S:
                self._skipped[key] = self._skipped.get(key, 0) + 1
                return False
            self._last[key] = now
            skipped = self._skipped.pop(key, 0)
        if "out of system resource" in key:
            record.msg = ("out of file descriptors: a connection could not be accepted; it waits until "
                          "connections close (--max-connections, ulimit -n)")
            record.args, record.exc_info, record.exc_text = (), None, None
        if skipped:
            record.msg = f"{record.getMessage()} [and {skipped} more like it since the last one written]"
            record.args = ()
        return True


def throttle_server_logs() -> None:
    """Install :class:`_OncePerSecond` on the loggers a flood of connections writes to."""
    for name in ("asyncio", "uvicorn.error"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _OncePerSecond) for f in log.filters):
            log.addFilter(_OncePerSecond())


class HttpServer:
    """uvicorn in a thread of its own, so rank 0's main thread keeps generating and handling
    signals (uvicorn installs no signal handlers off the main thread)."""

    def __init__(self, service: Service) -> None:
        opts = service.options
        metrics = service.metrics
        discarded = (lambda n: metrics.abandoned_slots(_JOBS, 0, n)) if metrics is not None else None  # type: ignore[attr-defined]
        self.store = VideoStore(opts.max_video_jobs, opts.video_ttl_s, on_discarded=discarded)
        self.max_connections = cap = connection_cap(opts.max_connections)
        throttle_server_logs()
        # uvicorn's own cap stays one above ours, so it only bounds tasks: ours closes a
        # connection past the cap as it opens, before it can hold a descriptor.
        config = uvicorn.Config(build_app(service, self.store), host=opts.host, port=opts.port, lifespan="off",
                                log_level="warning", access_log=False, http=_protocol(cap, opts.read_timeout_s),
                                timeout_graceful_shutdown=_GRACEFUL_S, timeout_keep_alive=_KEEP_ALIVE_S,
                                limit_concurrency=cap + 1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="omni-serve-http", daemon=True)
        if opts.api_key is None and not _is_loopback(opts.host):
            logger.warning("listening on %s, which is not a loopback address, without an API key: anyone "
                           "who can reach it can generate. Set --api-key (or OMNI_OFFLOAD_API_KEY).", opts.host)

    def start(self) -> bool:
        """Start listening; ``False`` if the server could not start (port taken, say)."""
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            time.sleep(0.02)
        return self._server.started

    def stop(self) -> None:
        """Close the listener and wait for answers in flight (all futures are resolved by now)."""
        self._server.should_exit = True
        self._thread.join(timeout=_GRACEFUL_S + 5)
        self.store.close()
