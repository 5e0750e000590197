"""Errors a request meets, in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An HTTP status and one line for the client; param: the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"), "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_value")
