"""The HTTP front-end of ``omni-offload serve`` (rank 0): FastAPI under uvicorn.

Needs the ``serve`` extra (``pip install -e ".[serve]"``); the CLI imports it (through
``run.py``) only once the service starts. Handlers check a request, queue its slots and await
their futures; rank 0's main thread generates (see [Note: waves] in ``service.py``). What guards
the server against misbehaving clients is in ``guards.py``; the error shape in ``errors.py``.

Errors are JSON, in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``;
``param`` names the offending field and ``code`` is a string (or null). 400: the body is not
JSON, a field is unknown, of the wrong type or out of range, or the model makes the other kind
of output; 401: a missing or wrong API key; 404: no such route or model; 405 (with ``Allow``):
a method the route does not take; 413: the body is larger than ``--max-body``; 429 (with
``Retry-After``): the queue is full, or as many requests wait for their prompt check; 503:
shutting down; 500: the pipeline raised while generating (the body names the request), or a
handler raised unexpectedly (``internal_error``); either way the reason is in the log only.
Every GET route answers HEAD too.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
import reprlib
import secrets
import sys
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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ..api import DEFAULT_FPS
from .errors import RequestError, error_response, internal_error_response
from .guards import (
    ABANDONED,
    Buffered,
    Front,
    connection_cap,
    http_protocol,
    is_loopback,
    throttle_server_logs,
)
from .jobs import StoreFull, VideoStore, write_whole
from .metrics import ServeMetrics
from .service import (
    GenerationFailed,
    ModelLimits,
    QueueFull,
    ServeOptions,
    Service,
    ServiceUnavailable,
    Slot,
)

__all__ = ["HttpServer", "ImageRequest", "RequestError", "VideoJobRequest", "VideoRequest", "build_app"]

_PATHS = {"image": "/v1/images/generations", "video": "/v1/videos/generations"}
#: OpenAI's video job API: POST creates a job, GET polls and lists, .../content downloads.
_JOBS = "/v1/videos"
_SIZE = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)")
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
#: Bytes a client may send past ``--max-body`` after the body of a request still being answered
#: (its next requests, pipelined) before its connection is closed: room for the headers of one.
PIPELINED_HEADROOM = 64 << 10
#: Characters a prompt may hold for each token of the text encoders' window: a longer one is
#: refused without being tokenized (tokenizing a megabyte took over a second of CPU). English runs
#: at some 4 characters a token; only text of long runs of spaces or of one character, which
#: tokenizers fold, could fit the window past it.
PROMPT_CHARS_PER_TOKEN = 32
#: Largest seed: output i of a request uses seed + i, which must stay below 2**63.
SEED_LIMIT = 2**63
#: Formats a response may take; OpenAI's "url" is not served.
RESPONSE_FORMATS = ("b64_json", "path")

logger = logging.getLogger(__name__)


# -- request bodies --------------------------------------------------------------------------
class _OpenAIBody(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI's clients send ``null`` for optional fields left unset (openai-python's
        ``n=None``), and OpenAI's API takes it as the default: so does this one. A required
        field stays required."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}

    @field_validator("*", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        """A string must be text. JSON can carry a lone UTF-16 surrogate (``"\\udfff"``), which is
        not: the tokenizer raises on it (a 500, where the field is to blame) and no answer holding
        it could be encoded. Refused here, naming the field, whichever field it is."""
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise PydanticCustomError(
                    "string_unicode", "holds a lone UTF-16 surrogate ({char} at character {index}), which is "
                    "not text: send UTF-8 text (a surrogate pair, one character, is fine)",
                    {"char": f"U+{ord(value[exc.start]):04X}", "index": exc.start}) from None
        return value


class _GenerationRequest(_OpenAIBody):
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


class VideoJobRequest(_OpenAIBody):
    """``POST /v1/videos``: OpenAI's video job fields, then this service's own.

    OpenAI's client sends it as a multipart form (every value a string), so types are converted
    the way form data needs ("7" is 7); a JSON boolean is still no number, and unknown fields are
    still refused."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    seconds: float | None = Field(None, gt=0, allow_inf_nan=False)
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

    @field_validator("seconds", "seed", "num_frames", "fps", "num_inference_steps", mode="before")
    @classmethod
    def _no_booleans(cls, value: Any) -> Any:
        """A form's strings convert ("7" is 7), but a JSON ``true`` is no number: the lax types
        would take it as 1, where the synchronous endpoints (strict) refuse it."""
        if isinstance(value, bool):
            raise PydanticCustomError("int_type", "Input should be a number, not a boolean")
        return value


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
        steps = body.seconds * fps / step
        if not math.isfinite(steps):  # 1e308 seconds at 16 fps: no integer count of frames
            raise RequestError(f"seconds={body.seconds:g} is longer than any video this service makes: "
                               "ask for a few seconds.", "seconds")
        num_frames = max(1, round(steps)) * step + 1
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
    if body.response_format == "path" and options.output_dir is None:
        raise RequestError("response_format 'path': this server has no folder it can write outputs to (its "
                           "default, outputs/, was not writable at start): ask for b64_json, or have it "
                           "started with --output-dir.", "response_format")
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
    if body.n > options.max_queue:  # the CLI refuses --max-queue below --max-n; ServeOptions may not
        raise RequestError(f"n={body.n} is more than this service ever queues (--max-queue "
                           f"{options.max_queue}): send several requests.", "n")
    if body.num_inference_steps is not None and body.num_inference_steps > options.max_steps:
        raise RequestError(f"num_inference_steps={body.num_inference_steps} is more than this "
                           f"service allows (--max-steps {options.max_steps}).", "num_inference_steps")
    num_frames = getattr(body, "num_frames", None)
    # A field left out runs the model's default, which the server's limits bound as well.
    over = defaults_over_limits(limits, options)
    for name, given in (("num_inference_steps", body.num_inference_steps), ("size", body.size),
                        ("num_frames", num_frames)):
        if given is None and name in over:
            why, hint = over[name]
            raise RequestError(f"{name} left out: {why}; give {name}, {hint}.", name)
    width, height = _parse_size(body.size, limits, options)
    if num_frames is not None:
        _check_frames(num_frames, limits, options)
    _check_cost(body.n, width, height, num_frames, limits, options)
    seed = secrets.randbelow(2**31) if body.seed is None else body.seed
    return [Slot(kind=limits.kind, prompt=body.prompt, seed=seed + i, name=f"{request_id}-{i}",
                 num_inference_steps=body.num_inference_steps, height=height, width=width,
                 num_frames=num_frames, negative_prompt=body.negative_prompt,
                 fps=getattr(body, "fps", None)) for i in range(body.n)]


def defaults_over_limits(limits: ModelLimits, options: ServeOptions) -> dict[str, tuple[str, str]]:
    """The fields whose model default (what a request that leaves them out runs with) is over the
    server's limit: field -> (why, what to give). Such requests are refused rather than run past
    the limit, or cut to it (another output than the model's default, without saying so). A
    default the pipeline works out only when called (FLUX.1's size, from its transformer) is not
    known here, and not checked."""
    over = {}
    steps, frames = limits.default_steps, limits.default_frames
    if steps is not None and steps > options.max_steps:
        over["num_inference_steps"] = (f"{limits.model}'s default of {steps} steps is more than this service allows "
                                       f"(--max-steps {options.max_steps})", f"at most {options.max_steps}")
    if limits.default_size is not None and max(limits.default_size) > options.max_size:
        width, height = limits.default_size
        over["size"] = (f"{limits.model}'s default size of {width}x{height} is more than this service allows "
                        f"(--max-size {options.max_size} pixels a side)",
                        f"at most {options.max_size} pixels a side")
    if limits.kind == "video" and frames is not None and frames > options.max_frames:
        step = max(limits.frame_step, 1)
        over["num_frames"] = (f"{limits.model}'s default of {frames} frames is more than this service allows "
                              f"(--max-frames {options.max_frames})",
                              f"at most {options.max_frames - (options.max_frames - 1) % step}")
    return over


def _parse_size(size: str | None, limits: ModelLimits,
                options: ServeOptions) -> tuple[int | None, int | None]:
    if size is None:
        return None, None
    match = _SIZE.fullmatch(size)
    if match is None:
        raise RequestError(f"size {_shown(size)} is not WIDTHxHEIGHT (for example '1024x768').", "size")
    # A side with more digits than --max-size is larger than it; int() would refuse thousands.
    if max(len(match[1]), len(match[2])) > len(str(options.max_size)):
        raise RequestError(f"size {_shown(size)} is larger than this service allows (--max-size "
                           f"{options.max_size} pixels a side).", "size")
    width, height = int(match[1]), int(match[2])
    m = limits.size_multiple
    if width % m or height % m:
        raise RequestError(f"size {size!r}: {limits.model} needs width and height that are "
                           f"multiples of {m}; for example '{_round_up(width, m)}x{_round_up(height, m)}'.",
                           "size")
    if max(width, height) > options.max_size:
        raise RequestError(f"size {size!r} is larger than this service allows (--max-size "
                           f"{options.max_size} pixels a side).", "size")
    if limits.max_side is not None and max(width, height) > limits.max_side:
        raise RequestError(f"size {size!r}: {limits.model} places at most {limits.max_side} pixels a side "
                           "(its DiT's position table); ask for a smaller size.", "size")
    if max(width, height) > options.max_aspect * min(width, height):
        raise RequestError(f"size {size!r} is more than {options.max_aspect:g} times as long as it is wide "
                           "(--max-aspect).", "size")
    return width, height


#: ``--max-pixels`` when not given: 4 images of 2048x2048; one 1280x720 video of 121 frames
#: (for a model of 16 pixels a latent token side: :func:`default_budget`).
DEFAULT_MAX_PIXELS = {"image": 4 * 2048 * 2048, "video": 1280 * 720 * 121}
#: ``--max-wave-pixels`` when not given: one image of 2048x2048; one 1280x720 video of 121 frames
#: (likewise).
DEFAULT_MAX_WAVE_PIXELS = {"image": 2048 * 2048, "video": 1280 * 720 * 121}
#: The ``size_multiple`` the default budgets are given for (FLUX.1, Wan, SD3: an 8x VAE, 2x2 patches).
BUDGET_SIZE_MULTIPLE = 16


def default_budget(table: dict[str, int], limits: ModelLimits) -> int:
    """A default pixel budget for this model: the same number of latent tokens (what a
    generation's cost grows with) as ``table`` allows a model of 16 pixels a token side. A model
    of 4 (tiny-flux) makes 16x the tokens of the same pixels: its default is 16x smaller."""
    return max(1, table[limits.kind] * limits.size_multiple ** 2 // BUDGET_SIZE_MULTIPLE ** 2)


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
    wave_budget = options.max_wave_pixels or default_budget(DEFAULT_MAX_WAVE_PIXELS, limits)
    if wave > wave_budget:
        raise RequestError(f"size{shown} is {wave} pixels for one output, more than this service allows "
                           f"(--max-wave-pixels {wave_budget}): ask for less.", "size")
    budget = options.max_pixels or default_budget(DEFAULT_MAX_PIXELS, limits)
    if n * wave > budget:
        raise RequestError(f"n x size{shown} is {n * wave} pixels, more than this service allows per "
                           f"request (--max-pixels {budget}): ask for less.", "n" if n > 1 else "size")


def _check_frames(num_frames: int, limits: ModelLimits, options: ServeOptions) -> None:
    step = limits.frame_step
    if num_frames > options.max_frames:
        raise RequestError(f"num_frames={num_frames} is more than this service allows "
                           f"(--max-frames {options.max_frames}).", "num_frames")
    if limits.max_frames is not None and num_frames > limits.max_frames:
        raise RequestError(f"num_frames={num_frames}: {limits.model} places at most {limits.max_frames} frames "
                           "(its DiT's position table).", "num_frames")
    if step > 1 and num_frames % step != 1:
        lower = num_frames - (num_frames - 1) % step
        raise RequestError(f"num_frames={num_frames}: {limits.model} needs {step}k+1 frames, for "
                           f"example {lower} or {lower + step}.", "num_frames")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _shown(value: Any, limit: int = 40) -> str:
    """``repr(value)`` for a message: a long string cut to its first ``limit`` characters, a
    list or object to a few items and levels (a deeply nested one would exhaust the stack)."""
    if isinstance(value, str):
        return f"{value[:limit]!r}..." if len(value) > limit else repr(value)
    return reprlib.repr(value)


class _LongInteger:
    """An integer literal of more digits than ``int()`` reads (``sys.get_int_max_str_digits()``)."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str) -> int | _LongInteger:
    limit = sys.get_int_max_str_digits()
    digits = len(text) - text.startswith("-")
    return _LongInteger(digits) if limit and digits > limit else int(text)


def _load_json(body: bytes) -> Any:
    """A request body as ``json.loads`` reads it, except for an integer too long for ``int()``:
    ``json.loads`` raises a ``ValueError`` whose text tells the client to raise Python's limit
    (``sys.set_int_max_str_digits``); here it is a :class:`RequestError` naming the top-level
    field that holds it, out of range for every field. Raises ``ValueError`` (``UnicodeDecodeError``
    among them) and ``RecursionError`` as ``json.loads`` does."""
    data = json.loads(body, parse_int=_parse_int)
    for key, value in data.items() if isinstance(data, dict) else [(None, data)]:
        digits = _long_integer_in(value)
        if digits is None:
            continue
        if key is None:
            raise RequestError(f"the body holds a number of {digits} digits, out of range for every field.", None)
        name = key if key.isidentifier() and len(key) <= 40 else _shown(key)
        hint = "give a seed below 2**63" if key == "seed" else "see docs/serving.md for its range"
        raise RequestError(f"{name}: a number of {digits} digits is out of range: {hint}.", key)
    return data


def _long_integer_in(value: Any) -> int | None:
    """The digits of the first :class:`_LongInteger` in ``value``, at any depth; None if none."""
    stack = [value]
    while stack:  # not recursive: a body may nest as deep as json.loads reads
        item = stack.pop()
        if isinstance(item, _LongInteger):
            return item.digits
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _unreadable_json(exc: BaseException) -> str:
    """Why a body could not be read as JSON, for a 400 ``invalid_json``."""
    if isinstance(exc, RecursionError):
        return "the body is nested too deeply to read as JSON: send a flat JSON object."
    if isinstance(exc, UnicodeDecodeError):
        return f"the body is not valid JSON: it is not UTF-8 text ({exc.reason} at byte {exc.start})."
    return f"the body is not valid JSON ({exc})."


# -- the app ---------------------------------------------------------------------------------
#: The first part of a FastAPI validation error's ``loc``: where the field was.
_LOCATIONS = ("body", "query", "path", "header", "cookie")
#: Methods of the routes that read: GET, and HEAD (the same answer without its body).
_READ = ["GET", "HEAD"]


def _validationerror_response(exc: RequestValidationError | ValidationError) -> JSONResponse:
    """The first problem, as one message naming the field: 400 for a body that is not JSON."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "missing", "loc": ("body",), "msg": "missing"}
    loc = list(first.get("loc", ()))
    if loc and loc[0] in _LOCATIONS:  # where FastAPI found it: the param is the name after
        loc = loc[1:]
    param = str(loc[0]) if loc else None
    if first["type"] == "json_invalid":
        return error_response(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])}).",
                      code="invalid_json")
    if param is None and first["type"] == "string_unicode" and isinstance(first.get("input"), str):
        # A key that is no text (a lone UTF-16 surrogate): pydantic refuses it before any field.
        key = first["input"]
        return error_response(400, f"unknown field {key!r}: a field name holding a lone UTF-16 surrogate is "
                              "not text; drop it and send UTF-8 text (see docs/serving.md for the fields).",
                              key, code="unknown_parameter")
    if param is None:
        return error_response(400, "the body must be a JSON object with at least 'prompt', sent with "
                      "Content-Type: application/json.", code="invalid_body")
    if first["type"] == "extra_forbidden":
        return error_response(400, f"unknown field {param!r}: drop it; see docs/serving.md for the fields.",
                      param, code="unknown_parameter")
    if first["type"] == "missing":
        return error_response(400, f"{param} is required.", param, code="missing_required_parameter")
    return error_response(400, f"{param}: {first['msg']} (got {_shown(first.get('input'))}).", param,
                          code="invalid_value")


def build_app(service: Service, store: VideoStore | None = None) -> Any:
    """The ASGI app: the API key and answer counts (:class:`_Front`), then the whole body read
    within its limits (:class:`_Buffered`), then FastAPI's app with the generation endpoints,
    video jobs, health, models and metrics. Both wrappers are plain ASGI, outside the framework
    (its decorator middlewares would hide a client's disconnect from the handlers, which watch
    for it)."""
    app = FastAPI(title="omni_dist_offload", docs_url=None, redoc_url=None, openapi_url=None)
    metrics: ServeMetrics = service.metrics  # type: ignore[assignment]
    endpoints = {*_PATHS.values(), _JOBS}
    prompts = PromptChecks(service)
    if metrics is not None:
        metrics.prompt_checks = prompts.waiting

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # A field unknown to the other kind's endpoint (a video request's num_frames sent to the
        # image endpoint of a video model): where to POST, not to drop it, which would not help.
        other = next((kind for kind, path in _PATHS.items() if path == request.url.path), service.limits.kind)
        unknown = any(error.get("type") == "extra_forbidden" for error in exc.errors())
        if other != service.limits.kind and unknown:
            return error_response(400, f"{service.limits.model} makes {service.limits.kind}s: POST "
                                  f"{_PATHS[service.limits.kind]}.", None, code="wrong_endpoint")
        return _validationerror_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, ValueError) and not isinstance(cause, UnicodeDecodeError):
            # A JSON body the framework could not read for an integer too long for int(): read
            # again (the body is kept) to name the field.
            try:
                _load_json(await request.body())
            except RequestError as err:
                return error_response(err.status, str(err), err.param, code=err.code)
            except (ValueError, RecursionError):
                pass
        return _http_error_response(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # The framework sends this answer, then raises on: Front logs the exception and counts it.
        return internal_error_response()

    @app.post(_PATHS["image"])
    async def images(body: ImageRequest, request: Request) -> Response:
        return await _generate(service, prompts, "image", body, request)

    @app.post(_PATHS["video"])
    async def videos(body: VideoRequest, request: Request) -> Response:
        return await _generate(service, prompts, "video", body, request)

    if store is not None:
        _video_job_routes(app, service, store, prompts)

    @app.api_route("/health", methods=_READ)
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

    @app.api_route("/v1/models", methods=_READ)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.api_route("/v1/models/{model_id:path}", methods=_READ)
    async def model(model_id: str) -> JSONResponse:
        if model_id != service.omni.model:
            return error_response(404, f"model {model_id!r} is not served here; this service serves "
                          f"{service.omni.model!r}.", "model", code="model_not_found")
        return JSONResponse(model_card())

    @app.api_route("/metrics", methods=_READ)
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    buffered = Buffered(app, limit=service.options.max_body_bytes, deadline_s=service.options.read_timeout_s)
    return Front(buffered, metrics=metrics, key=service.options.api_key, endpoints=endpoints)


def _http_error_response(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """The framework's own errors, in OpenAI's shape with their headers: 404 (no route), 405 (a
    method the route does not take; ``Allow`` lists those every route of the path takes), 400
    (a body it could not read)."""
    headers = dict(exc.headers or {})
    method, path = request.method, _shown(request.url.path, 100)
    if exc.status_code == 404:
        return error_response(404, f"no route {method} {path}: see docs/serving.md for the endpoints.",
                              code="not_found", headers=headers)
    if exc.status_code == 405:
        # The router answers from the first route of the path, which may not be the only one.
        allowed = {name for route in request.app.router.routes
                   if getattr(route, "methods", None) and route.matches(request.scope)[0] != Match.NONE
                   for name in route.methods}
        headers["Allow"] = ", ".join(sorted(allowed)) or headers.get("Allow", "")
        return error_response(405, f"{method} is not allowed on {path}: use {headers['Allow']}.",
                              code="method_not_allowed", headers=headers)
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, (ValueError, RecursionError)):
        # A JSON body FastAPI could not decode (not UTF-8, nested too deeply).
        return error_response(400, _unreadable_json(cause), code="invalid_json", headers=headers)
    if exc.status_code == 400:  # a form the multipart parser refused
        return error_response(400, str(exc.detail), code="invalid_body", headers=headers)
    return error_response(exc.status_code, str(exc.detail), headers=headers)


class PromptChecks:
    """A prompt longer than the text encoders read is refused rather than cut: the cut part would
    be lost, and diffusers would log it. Counting its tokens costs CPU time that grows with its
    length, on one tokenizer copy (``Service.prompts``), so the checks are bounded:

    * a prompt of more than :data:`PROMPT_CHARS_PER_TOKEN` characters for each token of the
      window is refused without being tokenized;
    * the counts run one at a time, off the event loop; a request whose client has left by its
      turn is not counted (``check`` returns False);
    * at most ``max_waiting`` requests (``--max-queue``) wait for a count, or run one: past that,
      :class:`QueueFull` (429 with ``Retry-After``), before the request holds anything more."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.max_waiting = service.options.max_queue
        self._waiting = 0
        self._turn: asyncio.Lock | None = None  # made on the server's event loop, at the first check

    def waiting(self) -> int:
        """Requests waiting for their check, or running it."""
        return self._waiting

    async def check(self, body: _GenerationRequest, request: Request) -> bool:
        """Raises :class:`RequestError` for a prompt too long, :class:`QueueFull` when too many
        checks wait; False if the client left before its turn."""
        limits = self.service.limits
        limit = limits.max_prompt_tokens
        if limit is None:
            return True
        texts = [(field, text) for field in ("prompt", "negative_prompt") if (text := getattr(body, field))]
        for field, text in texts:
            if len(text) > limit * PROMPT_CHARS_PER_TOKEN:
                raise RequestError(f"{field} is {len(text)} characters; {limits.model} reads at most {limit} tokens, "
                                   f"and a prompt of more than {limit * PROMPT_CHARS_PER_TOKEN} characters "
                                   f"({PROMPT_CHARS_PER_TOKEN} a token) is refused uncounted: shorten it.",
                                   field, code="prompt_too_long")
        if not texts:
            return True
        if self._waiting >= self.max_waiting:
            raise QueueFull(f"{self._waiting} requests are waiting for their prompts to be checked (as many as "
                            f"--max-queue {self.max_waiting}): retry later.")
        if self._turn is None:
            self._turn = asyncio.Lock()
        self._waiting += 1
        try:
            async with self._turn:
                if await request.is_disconnected():
                    return False
                counts = await asyncio.to_thread(lambda: [(f, self.service.prompts.count(t)) for f, t in texts])
        finally:
            self._waiting -= 1
        for field, count in counts:
            if count > limit:
                raise RequestError(f"{field} is {count} tokens; {limits.model} reads at most {limit}: shorten it.",
                                   field, code="prompt_too_long")
        return True


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed the connection."""
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


async def _generate(service: Service, prompts: PromptChecks, kind: str, body: _GenerationRequest,
                    request: Request) -> Response:
    request_id = f"req-{uuid.uuid4().hex[:12]}"
    try:
        slots = plan_slots(body, kind, service.limits, service.options, request_id)
        if not await prompts.check(body, request):
            return Response(status_code=ABANDONED)  # the client left while its check waited
        futures = [job.future for job in service.submit(slots)]
    except RequestError as exc:
        return error_response(exc.status, str(exc), exc.param, code=exc.code)
    except QueueFull as exc:
        return error_response(429, str(exc), code="queue_full", headers={"Retry-After": str(_RETRY_AFTER_S)})
    except ServiceUnavailable as exc:
        return error_response(503, str(exc), code="shutting_down")
    # Wait for the outputs or for the client to leave, whichever comes first. A client that left
    # cancels its queued slots: they leave the queue at once (so they stop counting against
    # --max-queue) and never run (a wave taken just before is skipped by the generation loop;
    # with several ranks rank 0 leaves them out of the wave it sends, so the ranks agree); slots
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
        return Response(status_code=ABANDONED)  # no one to deliver it to
    gone.cancel()
    outcomes = gathered.result()
    try:
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        results = outcomes
    except GenerationFailed:
        # The reason (an exception's text) stays in the server's log: it may hold internals.
        return error_response(500, f"generation failed for request {request_id}; the server's log has the reason.",
                      code="generation_failed")
    except ServiceUnavailable as exc:
        return error_response(503, str(exc), code="shutting_down")
    data = []
    for slot, result in zip(slots, results, strict=True):
        meta = result.metadata
        item: dict[str, Any] = {"seed": slot.seed, "format": result.suffix.lstrip("."),
                                "size": f"{meta['width']}x{meta['height']}"}
        if kind == "video":
            item.update(num_frames=meta["num_frames"], fps=meta["fps"])
        if body.response_format == "path":
            try:
                item["path"] = str(_write(service.options.output_dir, slot.name, result))
            except OSError as exc:  # a full disk, a folder removed since the start
                logger.error("request %s: writing %s under --output-dir %s failed: %s", request_id, slot.name,
                             service.options.output_dir, exc)
                return error_response(500, f"request {request_id}: writing its output on the server failed; the "
                                      "server's log has the reason.", code="output_write_failed")
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
    """A job request's fields, from a multipart or URL-encoded form (OpenAI's client) or JSON
    (``application/json`` or ``application/*+json``, as the other endpoints read it)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        async with request.form(max_files=1, max_fields=64) as form:
            fields: dict[str, Any] = {}
            for key, value in form.multi_items():
                if key in fields:
                    raise RequestError(f"{key} is given twice.", key)
                if not isinstance(value, str) and key != "input_reference" and key in VideoJobRequest.model_fields:
                    # Taken as some placeholder, the job would run on it (curl -F prompt=@p.txt
                    # generated from the prompt "<file>"). An unknown field is refused as unknown.
                    raise RequestError(f"{key} was sent as a file: send it as a form field, not a file (curl: "
                                       f"-F '{key}=<file.txt' reads a file into a field, -F {key}=@file.txt "
                                       "uploads it as a file).", key)
                # A file as input_reference is refused by plan_job; its bytes are not kept.
                fields[key] = value if isinstance(value, str) else "<file>"
            return fields
    if not (kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))):
        raise RequestError("the body must be a JSON object with at least 'prompt', sent with Content-Type: "
                           "application/json, or a form (multipart/form-data, as OpenAI's client sends it, or "
                           "application/x-www-form-urlencoded).", None, code="invalid_body")
    try:
        fields = _load_json(await request.body())
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise RequestError(_unreadable_json(exc), None, code="invalid_json") from None
    if not isinstance(fields, dict):
        raise RequestError("the body must be a JSON object with at least 'prompt'.", None, code="invalid_body")
    return fields


def _video_job_routes(app: FastAPI, service: Service, store: VideoStore, prompts: PromptChecks) -> None:
    """``/v1/videos``: create, poll, list, download and delete video jobs (see ``jobs.py``)."""
    metrics: ServeMetrics | None = service.metrics  # type: ignore[assignment]

    def missing(video_id: str) -> JSONResponse:
        return error_response(404, f"no video job {video_id!r}: it never existed, expired (--video-ttl "
                      f"{service.options.video_ttl_s:g} s) or was deleted.", "video_id", code="video_not_found")

    @app.post(_JOBS)
    async def create(request: Request) -> Response:
        try:
            try:
                body = VideoJobRequest.model_validate(await _job_fields(request))
            except ValidationError as exc:
                return _validationerror_response(exc)
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
            if not await prompts.check(plain, request):
                return Response(status_code=ABANDONED)  # the client left while its check waited
            if not store.has_room():
                raise StoreFull(f"{len(store)} video jobs are waiting or running (--max-video-jobs "
                                f"{store.max_jobs}): retry later.")
            (job,) = service.submit([slot])
        except RequestError as exc:
            return error_response(exc.status, str(exc), exc.param, code=exc.code)
        except (QueueFull, StoreFull) as exc:
            code = "queue_full" if isinstance(exc, QueueFull) else "too_many_jobs"
            return error_response(429, str(exc), code=code, headers={"Retry-After": str(_RETRY_AFTER_S)})
        except ServiceUnavailable as exc:
            return error_response(503, str(exc), code="shutting_down")
        width, height = (slot.width, slot.height) if slot.width else service.limits.default_size or (0, 0)
        frames = slot.num_frames or service.limits.default_frames
        fps = slot.fps or DEFAULT_FPS
        try:
            video = store.add(job, model=service.omni.model, prompt=slot.prompt,
                              size=f"{width}x{height}" if width else "default",
                              seconds=f"{(frames - 1) / fps:g}" if frames else "default")
        except StoreFull as exc:
            job.future.cancel()  # not kept, so not run
            return error_response(429, str(exc), code="too_many_jobs", headers={"Retry-After": str(_RETRY_AFTER_S)})
        return JSONResponse(video.card())

    @app.api_route(_JOBS, methods=_READ)
    async def listing(after: str | None = None, limit: int = 20, order: str = "desc") -> JSONResponse:
        if not 1 <= limit <= _MAX_PAGE:
            return error_response(400, f"limit={limit}: give 1 to {_MAX_PAGE}.", "limit", code="invalid_value")
        if order not in ("asc", "desc"):
            return error_response(400, f"order={order!r}: give 'asc' or 'desc'.", "order", code="invalid_value")
        try:
            jobs, more = store.page(after, limit, order)
        except KeyError:
            return error_response(400, f"after={after!r} is not a video job kept here.", "after", code="invalid_value")
        data = [video.card() for video in jobs]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": more})

    @app.api_route(_JOBS + "/{video_id}", methods=_READ)
    async def retrieve(video_id: str) -> JSONResponse:
        video = store.get(video_id)
        return missing(video_id) if video is None else JSONResponse(video.card())

    @app.api_route(_JOBS + "/{video_id}/content", methods=_READ)
    async def content(video_id: str, variant: str = "video") -> Response:
        video = store.get(video_id)
        if video is None:
            return missing(video_id)
        if variant not in ("video", "thumbnail"):
            return error_response(400, f"variant={variant!r} is not served here: give 'video' or 'thumbnail'.",
                          "variant", code="invalid_value")
        if video.status != "completed":
            return error_response(409, f"video job {video_id} has status {video.status!r}: content comes with "
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
    # Each whole under a temporary name, then renamed (jobs._write): a full disk leaves no
    # truncated file in the folder.
    write_whole(media, result.media)
    write_whole(media.with_suffix(".json"), result.sidecar)
    return media.resolve()


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
                                log_level="warning", access_log=False,
                                http=http_protocol(cap, opts.read_timeout_s, opts.max_body_bytes + PIPELINED_HEADROOM),
                                timeout_graceful_shutdown=_GRACEFUL_S, timeout_keep_alive=_KEEP_ALIVE_S,
                                limit_concurrency=cap + 1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="omni-serve-http", daemon=True)
        over = defaults_over_limits(service.limits, opts)
        if over:
            logger.warning("%s: requests that leave %s out are refused (400); raise the limit, or have "
                           "clients send the field.", "; ".join(why for why, _ in over.values()), " or ".join(over))
        if opts.api_key is None and not is_loopback(opts.host):
            logger.warning("listening on %s, which is not a loopback address, without an API key: anyone "
                           "who can reach it can generate. Set --api-key (or OMNI_OFFLOAD_API_KEY).", opts.host)

    def start(self) -> bool:
        """Start listening; ``False`` if the server could not start (port taken, say)."""
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            time.sleep(0.02)
        return self._server.started

    @property
    def port(self) -> int:
        """The port it listens on, once started: ``--port`` or, for ``--port 0``, the free one
        the system picked (the "serving ... on" line says it, for callers to read)."""
        for server in self._server.servers:
            for sock in server.sockets:
                return sock.getsockname()[1]
        raise RuntimeError("the HTTP server is not listening")

    def stop(self) -> None:
        """Close the listener and wait for answers in flight (all futures are resolved by now)."""
        self._server.should_exit = True
        self._thread.join(timeout=_GRACEFUL_S + 5)
        self.store.close()
