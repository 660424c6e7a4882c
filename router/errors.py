"""Errors the router returns, each with its HTTP status, OpenAI error type and gRPC status.

Every error leaves the router as OpenAI error JSON, `{"error": {"message", "type", "param", "code"}}`; a
`BadRequest` about one field names it in `param` (body-level problems, such as a body that is not JSON, have none).
"""

from __future__ import annotations

import json
from http import HTTPStatus

import grpc


class RouterError(Exception):
    http_status = 500
    error_type = "InternalServerError"
    grpc_code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.http_status}}

    def to_json(self) -> str:
        """ASCII-escaped: a message quoting the caller's input (a lone surrogate, say) always serializes."""
        return json.dumps(self.to_openai(), ensure_ascii=True)


class BadRequest(RouterError):
    http_status = 400
    error_type = "BadRequestError"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthorized(RouterError):
    http_status = 401
    error_type = "AuthenticationError"
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class ModelNotFound(RouterError):
    http_status = 404
    error_type = "NotFoundError"
    grpc_code = grpc.StatusCode.NOT_FOUND


class RequestTimeout(RouterError):
    http_status = 408
    error_type = "RequestTimeoutError"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class PayloadTooLarge(RouterError):
    http_status = 413
    error_type = "RequestEntityTooLargeError"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Overloaded(RouterError):
    http_status = 429
    error_type = "RateLimitError"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RouterError):
    http_status = 503
    error_type = "ServiceUnavailableError"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class ShuttingDown(Unavailable):
    """The router is draining (SIGTERM): new requests are refused, and those still running at --drain-timeout are
    ended."""


class HTTPError(RouterError):
    """Any other HTTP status the web framework answers by itself (an unknown path: 404, a wrong method: 405)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = status
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        self.error_type = "".join(phrase.title().split()).removesuffix("Error") + "Error"


_BY_CODE_NAME: dict[str, type[RouterError]] = {
    "INVALID_ARGUMENT": BadRequest, "OUT_OF_RANGE": BadRequest, "FAILED_PRECONDITION": BadRequest,
    "NOT_FOUND": ModelNotFound, "RESOURCE_EXHAUSTED": Overloaded, "UNAVAILABLE": Unavailable,
    "UNAUTHENTICATED": Unauthorized, "DEADLINE_EXCEEDED": Unavailable,
}


def from_code_name(code: str, message: str) -> RouterError:
    return _BY_CODE_NAME.get(code.upper(), RouterError)(message)
