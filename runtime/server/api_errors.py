"""Errors answered in OpenAI's shape: APIError, and the two kinds the request bodies and the serving code raise.

Its own module so that the body models' helpers (structured_fields.py, tools.py) raise them without importing
protocol.py, which imports them.
"""
from __future__ import annotations


class APIError(Exception):
    """An error answered in OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        # What a client sent may reach a message; a lone surrogate in it would make the error body unencodable.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(request_id: str, what: str = "internal server error") -> APIError:
    """A 500 that names the request and nothing of its cause: exception text may hold paths or data of the
    server, so the cause goes to the server's log under `request_id` (the caller logs it)."""
    return APIError(f"{what} in request {request_id}; the server's log has the cause under this id", status=500,
                    type="internal_server_error")


def bad_param(param: str, message: str) -> APIError:
    """Raised from a body's validators: pydantic passes exceptions other than ValueError through, so the
    app's APIError handler answers it with `param` set (a ValueError would lose the field's name)."""
    return APIError(message, param=param, code="invalid_value")
