"""How ``omni-offload serve`` holds up against clients that misbehave: the API key and answer
counts (:class:`Front`), bodies read whole within their limits before the framework sees them
(:class:`Buffered`), uvicorn's h11 protocol with a connection cap and a header deadline
(:func:`http_protocol`), memory handed back after a flood of connections, and log floods cut to
a line a second. ``http.py`` puts them together; docs/serving.md's Security section says what
each bounds."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import hmac
import ipaddress
import json
import logging
import os
import threading
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from ...runtime.proc import rss_mib
from .errors import error_response, internal_error_response
from .metrics import ServeMetrics

try:
    import resource
except ImportError:  # Windows: no open-file limit to raise
    resource = None  # type: ignore[assignment]

__all__ = ["ABANDONED", "Buffered", "Front", "connection_cap", "http_protocol", "is_loopback", "throttle_server_logs"]

logger = logging.getLogger(__name__)

# The status of a request whose client went away (nginx's "client closed request"): never sent,
# it keeps such requests out of the answered counts.
ABANDONED = 499


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: A body over the limit is read on and dropped up to this many more bytes before the 413.
_DRAIN_BYTES = 16 << 20
#: ...until no more of it arrives for this long.
_DRAIN_PAUSE_S = 0.5


class Buffered:
    """ASGI wrapper outside the framework: reads a request's whole body before the app sees the
    request, as a reverse proxy's request buffering does. A body over ``limit`` bytes gets 413,
    whether it declares its length or streams in chunks (nothing past the limit is read); a body
    that has not fully arrived ``deadline_s`` after the request started gets 408. Either answer
    closes the connection (the rest of the body may still come).

    A stalled upload so holds only this small coroutine, not the framework's stack of
    middlewares and handlers (some 16 KiB a request): 10,000 of them cost a third as much.

    A stop cancels a body still arriving once the graceful wait is over (uvicorn's
    ``timeout_graceful_shutdown``): that request is answered 503 ``shutting_down`` and the
    connection closed, quietly. The cancellation is a normal end of the upload, not an error, and
    raised on it would reach uvicorn, which logs any exception out of the app as "Exception in ASGI
    application" with its traceback."""

    def __init__(self, app: Any, limit: int, deadline_s: float) -> None:
        self.app, self.limit, self.deadline_s = app, limit, deadline_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        deadline = time.monotonic() + self.deadline_s
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send, deadline)
        chunks, seen = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                response = error_response(408, f"the request body did not arrive within {self.deadline_s:g} s "
                                  "(--read-timeout).", code="request_timeout", headers={"Connection": "close"})
                return await response(scope, receive, send)
            except asyncio.CancelledError:
                # The server is stopping (see above). Nothing waits on this task's outcome: once it
                # has answered, it ends as any answered request does.
                response = error_response(503, "the service stopped before the request body arrived: retry "
                                          "on a running service.", code="shutting_down",
                                          headers={"Connection": "close"})
                return await response(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client left before its body arrived: no one to answer
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                return await self._refuse(scope, receive, send, deadline,
                                          more=message.get("more_body", False), continued=True)
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

    async def _refuse(self, scope: dict, receive: Any, send: Any, deadline: float, more: bool = True,
                      continued: bool = False) -> None:
        """413, once the rest of the body (``more``: some may still come) has been read and
        dropped while it keeps coming: up to :data:`_DRAIN_BYTES`, within the request's deadline,
        until a pause of :data:`_DRAIN_PAUSE_S`. A client that sends its whole body before it
        reads the answer (Python's http.client, requests) would otherwise meet a reset as the
        connection closes with its body unread, and lose the answer (the kernel drops what it
        had received). A client still waiting for ``100 Continue`` is answered at once (reading
        would ask it for the body); ``continued``: the body was read from already, which sent it
        the ``100 Continue``, so it is sending."""
        headers = dict(scope.get("headers") or [])
        drained = 0
        if not continued and headers.get(b"expect", b"").lower() == b"100-continue":
            more = False
        while more and drained <= _DRAIN_BYTES:
            wait = min(_DRAIN_PAUSE_S, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                message = await asyncio.wait_for(receive(), wait)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                break
            if message["type"] != "http.request":
                return  # the client left: no one to answer
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)
        response = error_response(413, f"the request body is larger than this service takes (--max-body "
                          f"{self.limit} bytes).", code="request_too_large", headers={"Connection": "close"})
        await response(scope, receive, send)


def _authorised(headers: dict[bytes, bytes], key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time."""
    scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


class Front:
    """ASGI middleware: the API key (every path but ``/health``), then the answered-requests
    metrics of the generation endpoints' POSTs (not for requests whose client went away).

    It is also the last stop of an exception no handler caught: logged here, once, with its
    traceback (uvicorn's own log of it is cut to a line a second, see :func:`throttle_server_logs`),
    and answered 500 ``internal_error`` if no answer had started (the app's own handler answers
    those raised inside the framework, see ``http.build_app``), so it is counted like any other
    error. An answer already started is left as it is (uvicorn closes a connection whose answer
    was cut short).

    A request a stop cancels (uvicorn's ``timeout_graceful_shutdown`` over) before its answer
    started is answered 503 ``shutting_down`` and its connection closed, quietly, as
    :class:`Buffered` answers an upload still arriving then."""

    def __init__(self, app: Any, metrics: ServeMetrics, key: str | None, endpoints: set[str]) -> None:
        self.app, self.metrics, self.key, self.endpoints = app, metrics, key, endpoints

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, path = time.perf_counter(), scope["path"]
        status: list[int] = []
        if self.key is not None and path != "/health" and not _authorised(dict(scope.get("headers") or []), self.key):
            response = error_response(401, "a valid API key is required: send 'Authorization: Bearer <key>'.",
                              code="invalid_api_key")
            await response(scope, receive, send)
            status.append(401)
        else:
            async def sent(message: dict) -> None:
                if message["type"] == "http.response.start":
                    status.append(message["status"])
                await send(message)

            try:
                await self.app(scope, receive, sent)
            except asyncio.CancelledError:
                if status:  # cut short: uvicorn closes the connection (see above)
                    raise
                # uvicorn cancels the requests still running once a stop's graceful wait is over
                # (a prompt check, a generation waiting its turn): answered as Buffered answers
                # an upload then, and ended as a normal end of the request rather than raised on
                # to uvicorn, which would answer a plain-text 500 and log a traceback.
                response = error_response(503, "the service stopped before this request was answered: retry on "
                                          "a running service.", code="shutting_down",
                                          headers={"Connection": "close"})
                await response(scope, receive, sent)
            except Exception:
                logger.exception("unexpected error answering %s %r (%s)", scope["method"], path,
                                 f"status {status[0]} sent" if status else "answered 500 internal_error")
                if not status:
                    await internal_error_response()(scope, receive, sent)
        if scope["method"] == "POST" and path in self.endpoints and status and status[0] != ABANDONED:
            self.metrics.answered(path, status[0], time.perf_counter() - start)


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


def http_protocol(cap: int, header_timeout_s: float, max_pipelined: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with three guards its settings lack: a connection past ``cap`` is
    answered 503 and closed as it opens (so a flood of idle connections cannot take every
    descriptor); a request's headers must arrive within ``header_timeout_s`` of the
    connection opening or of the previous answer (a slow trickle of header bytes holds nothing);
    and a connection whose client sends more than ``max_pipelined`` bytes after the body of a
    request still being answered is closed, which the request sees as its client leaving.
    The body has its own deadline (:class:`Buffered`); idle keep-alive has uvicorn's.

    The last bounds pipelining. h11 keeps what arrives after a request's body (the next
    request, pipelined) until the answer is sent, and uvicorn reads on whenever the app waits
    for a message, which the handlers do every 0.25 s to learn whether their client left: a
    client could so push a megabyte a second, for as long as its request waited, into memory
    that nothing bounded. ``max_pipelined`` leaves room for one whole request of the largest
    body behind the one waiting; the count starts again with each answer."""
    refusal = json.dumps({"error": {"message": f"this service has {cap} connections open (--max-connections): "
                                    "retry later.", "type": "service_unavailable_error", "param": None,
                                    "code": "too_many_connections"}}).encode()
    answer = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
              b"retry-after: 1\r\nconnection: close\r\ncontent-length: " + str(len(refusal)).encode()
              + b"\r\n\r\n" + refusal)

    flood = _Flood()

    class Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _pipelined = 0
        """Bytes that came after the body of the request being answered."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            flood.opened(self.connections, self.tasks)
            if len(self.connections) > cap:
                transport.write(answer)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                self._pipelined += len(data)
                if self._pipelined > max_pipelined:
                    # Closed as a client that left: its request is dropped (connection_lost tells
                    # it), and what h11 had kept goes with the connection.
                    self.logger.warning("a client sent more than %d bytes after a request still being answered "
                                        "(pipelined requests); its connection was closed", max_pipelined)
                    self.transport.close()
                    return
            super().data_received(data)
            self._disarm_once_headers_came()

        def on_response_complete(self) -> None:
            self._pipelined = 0  # before the pipelined requests kept so far are taken up
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
    # The multipart parser logs each malformed upload (a line per request, its text carrying
    # offsets, so no two are alike); the client is answered 400 saying what is wrong.
    logging.getLogger("python_multipart").setLevel(logging.ERROR)
    logging.getLogger("multipart").setLevel(logging.ERROR)
