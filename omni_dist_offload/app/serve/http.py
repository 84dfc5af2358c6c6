"""The HTTP front-end of ``omni-offload serve`` (rank 0): FastAPI under uvicorn.

Needs the ``serve`` extra (``pip install -e ".[serve]"``); the CLI imports it (through
``run.py``) only once the service starts. Handlers check a request, queue its slots and await
their futures; rank 0's main thread generates (see [Note: waves] in ``service.py``).

Errors are JSON, in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``;
``param`` names the offending field. 400: the body is not JSON, or the model makes the other
kind of output; 422: a field is unknown, of the wrong type or out of range; 503: shutting down
or queue full; 500: the pipeline raised while generating.
"""

from __future__ import annotations

import asyncio
import base64
import re
import secrets
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import ServeMetrics
from .service import (
    GenerationFailed,
    ModelLimits,
    ServeOptions,
    Service,
    ServiceUnavailable,
    Slot,
)

__all__ = ["HttpServer", "ImageRequest", "RequestError", "VideoRequest", "build_app"]

_PATHS = {"image": "/v1/images/generations", "video": "/v1/videos/generations"}
_SIZE = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)$")
# Seconds a graceful stop waits for open connections before closing them.
_GRACEFUL_S = 30


class RequestError(Exception):
    """A request the model cannot take; ``param`` names the field."""

    def __init__(self, message: str, param: str | None, status: int = 422) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


# -- request bodies --------------------------------------------------------------------------
class _GenerationRequest(BaseModel):
    # Unknown fields are refused (a typo must not be silently ignored); JSON types are strict.
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1)
    n: int = Field(1, ge=1)
    size: str | None = None
    """``WIDTHxHEIGHT`` (OpenAI's order); default: the model's own size."""
    response_format: Literal["b64_json", "path"] = "b64_json"
    seed: int | None = Field(None, ge=0, lt=2**63)
    """Seed of output 0; output i uses seed + i. Default: a random one (returned)."""
    num_inference_steps: int | None = Field(None, ge=1)
    negative_prompt: str | None = None
    model: str | None = None
    """If given, must be the served model."""


class ImageRequest(_GenerationRequest):
    """``POST /v1/images/generations``."""


class VideoRequest(_GenerationRequest):
    """``POST /v1/videos/generations``."""

    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1, le=240)


def plan_slots(body: _GenerationRequest, kind: str, limits: ModelLimits, options: ServeOptions,
               request_id: str) -> list[Slot]:
    """The request's slots, after the checks that depend on the model and the server's limits."""
    if body.model is not None and body.model != limits.model:
        raise RequestError(f"model {body.model!r} is not served here; this service serves "
                           f"{limits.model!r} (or leave 'model' out).", "model")
    if kind != limits.kind:
        raise RequestError(f"{limits.model} makes {limits.kind}s: POST {_PATHS[limits.kind]}.",
                           None, status=400)
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
    return width, height


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
def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found", 405: "invalid_request_error",
            422: "invalid_request_error", 503: "unavailable"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """The first problem, as one message naming the field: 400 for a body that is not JSON."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "missing", "loc": ("body",), "msg": "missing"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    if first["type"] == "json_invalid":
        return _error(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])}).")
    if param is None:
        return _error(400, "the body must be a JSON object with at least 'prompt', sent with "
                      "Content-Type: application/json.")
    if first["type"] == "extra_forbidden":
        return _error(422, f"unknown field {param!r}: drop it; see docs/serving.md for the fields.",
                      param)
    if first["type"] == "missing":
        return _error(422, f"{param} is required.", param)
    return _error(422, f"{param}: {first['msg']} (got {first.get('input')!r}).", param)


def build_app(service: Service) -> FastAPI:
    """The FastAPI app: generation endpoints, health, models, metrics."""
    app = FastAPI(title="omni_dist_offload", docs_url=None, redoc_url=None, openapi_url=None)
    metrics: ServeMetrics = service.metrics  # type: ignore[assignment]
    endpoints = set(_PATHS.values())

    @app.middleware("http")
    async def _observe(request: Request, call_next: Any) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        if request.url.path in endpoints:
            metrics.answered(request.url.path, response.status_code, time.perf_counter() - start)
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.post(_PATHS["image"])
    async def images(body: ImageRequest) -> JSONResponse:
        return await _generate(service, "image", body)

    @app.post(_PATHS["video"])
    async def videos(body: VideoRequest) -> JSONResponse:
        return await _generate(service, "video", body)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "stopping" if service.draining else "ok", "model": service.omni.model,
                "kind": service.limits.kind, "world_size": service.ctx.world_size,
                "queue_depth": service.queue.depth()}
        return JSONResponse(body, status_code=503 if service.draining else 200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        omni = service.omni
        return JSONResponse({"object": "list", "data": [{
            "id": omni.model, "object": "model", "created": int(service.started),
            "owned_by": "omni_dist_offload", "kind": service.limits.kind,
            "world_size": service.ctx.world_size,
            "offload_config": omni.config.to_dict() if omni.config else None}]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _generate(service: Service, kind: str, body: _GenerationRequest) -> JSONResponse:
    request_id = f"req-{uuid.uuid4().hex[:12]}"
    try:
        slots = plan_slots(body, kind, service.limits, service.options, request_id)
        futures = service.submit(slots)
    except RequestError as exc:
        return _error(exc.status, str(exc), exc.param)
    except ServiceUnavailable as exc:
        return _error(503, str(exc))
    try:
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    except GenerationFailed as exc:
        return _error(500, f"generation failed: {exc}")
    except ServiceUnavailable as exc:
        return _error(503, str(exc))
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


def _write(output_dir: Path, name: str, result: Any) -> Path:
    """The media and its sidecar, as ``omni-offload generate`` writes them; returns the media."""
    output_dir.mkdir(parents=True, exist_ok=True)
    media = (output_dir / name).with_suffix(result.suffix)
    media.write_bytes(result.media)
    media.with_suffix(".json").write_bytes(result.sidecar)
    return media.resolve()


class HttpServer:
    """uvicorn in a thread of its own, so rank 0's main thread keeps generating and handling
    signals (uvicorn installs no signal handlers off the main thread)."""

    def __init__(self, service: Service) -> None:
        opts = service.options
        config = uvicorn.Config(build_app(service), host=opts.host, port=opts.port, lifespan="off",
                                log_level="warning", access_log=False,
                                timeout_graceful_shutdown=_GRACEFUL_S)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="omni-serve-http", daemon=True)

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
