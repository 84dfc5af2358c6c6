"""Errors of ``omni-offload serve`` in OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}``, ``param`` naming the offending field and ``code`` a string or null, as OpenAI's
clients expect."""

from __future__ import annotations

from fastapi.responses import JSONResponse

__all__ = ["RequestError", "error_response", "internal_error_response"]


class RequestError(Exception):
    """A request the model cannot take; ``param`` names the field."""

    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error",
                413: "invalid_request_error",
                429: "rate_limit_error",
                503: "service_unavailable_error"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in OpenAI's shape; ``code`` is a string or null, as OpenAI's clients expect.
    Text that UTF-8 cannot hold (a lone surrogate from a JSON key the client sent, named as the
    ``param``) is escaped: the answer to a bad request must not fail itself."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return JSONResponse({"error": {"message": _encodable(message), "type": kind, "param": _encodable(param),
                                   "code": code}},
                        status_code=status, headers=headers)


def _encodable(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def internal_error_response() -> JSONResponse:
    """500 for an exception no handler expected. The body holds no traceback or exception text
    (they may hold internals); the server logs them."""
    return error_response(500, "the server failed unexpectedly while answering this request; its log has the reason.",
                          code="internal_error")
