"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``, and the exception that carries it.

Every rejection names the field at fault (``param``), so a client learns what to fix. The server and the
router both answer with these bodies, and stream them as an ``error`` event (``sse.py``).
"""
from __future__ import annotations

# HTTP status -> OpenAI error "type"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "request_timeout",
    413: "request_too_large",
    414: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
    508: "loop_detected",
}


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, close_connection: bool = False):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}
        self.close_connection = close_connection     # answer, then close without reading the rest of the body

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


def bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' {why}", param)
