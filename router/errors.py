"""Errors the router returns, each with its HTTP status, OpenAI error type and gRPC status."""

from __future__ import annotations

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


class Overloaded(RouterError):
    http_status = 429
    error_type = "RateLimitError"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RouterError):
    http_status = 503
    error_type = "ServiceUnavailableError"
    grpc_code = grpc.StatusCode.UNAVAILABLE


_BY_CODE_NAME: dict[str, type[RouterError]] = {
    "INVALID_ARGUMENT": BadRequest, "OUT_OF_RANGE": BadRequest, "FAILED_PRECONDITION": BadRequest,
    "NOT_FOUND": ModelNotFound, "RESOURCE_EXHAUSTED": Overloaded, "UNAVAILABLE": Unavailable,
    "UNAUTHENTICATED": Unauthorized, "DEADLINE_EXCEEDED": Unavailable,
}


def from_code_name(code: str, message: str) -> RouterError:
    return _BY_CODE_NAME.get(code.upper(), RouterError)(message)
