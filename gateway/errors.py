"""Typed gateway errors and their OpenAI wire form.

Why one exception family: every failure a client can see (bad input, auth, limits, overload, a dead
worker) must leave as ``{"error": {"message", "type", "param", "code"}}`` with the right status, the shape
the official ``openai`` client turns into ``BadRequestError``/``RateLimitError``/...; raising a typed error
deep in the router and rendering it in one handler keeps that uniform.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class GatewayError(Exception):
    """Base: an error with an HTTP status and an OpenAI error ``type``."""

    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.status in (408, 413):  # the body was not read to its end: the connection cannot be reused
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class PromptTooLong(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class BodyTimeout(GatewayError):
    """The client did not send its whole request body in time (a stalled or deliberately slow upload)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class Overloaded(GatewayError):
    """Too many requests in flight, or the estimated TTFT is past the SLO (admission control)."""

    status = 429
    type = "rate_limit_error"
    code = "overloaded"


class BackendUnavailable(GatewayError):
    """No healthy worker of a role, or a worker failed in a way retrying elsewhere could not fix."""

    status = 503
    type = "service_unavailable"
    code = "backend_unavailable"


class BackendTimeout(GatewayError):
    status = 504
    type = "timeout"
    code = "backend_timeout"
