"""Errors the router returns, each with its HTTP status, OpenAI error type and gRPC status.

Every error leaves the router as OpenAI error JSON, `{"error": {"message", "type", "param", "code"}}`; a
`BadRequest` about one field names it in `param` (body-level problems, such as a body that is not JSON, have none).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from grpc import StatusCode


class RouterError(Exception):
    """A failure the router reports. Each kind declares its HTTP status, OpenAI error type and gRPC status in its
    class line; a kind that declares none keeps its parent's (the base: an internal error)."""

    http_status = 500
    error_type = "InternalServerError"
    grpc_code = StatusCode.INTERNAL

    def __init_subclass__(cls, *, http_status: int = 0, error_type: str = "", grpc_code: StatusCode | None = None,
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if http_status:  # the three together: a kind is one status on each surface
            cls.http_status, cls.error_type, cls.grpc_code = http_status, error_type, grpc_code

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


class BadRequest(RouterError, http_status=400, error_type="BadRequestError", grpc_code=StatusCode.INVALID_ARGUMENT):
    """The request is refused as it is; `param` names the field at fault, when one is."""


class Unauthorized(RouterError, http_status=401, error_type="AuthenticationError",
                   grpc_code=StatusCode.UNAUTHENTICATED):
    """No API key, or not the router's."""


class ModelNotFound(RouterError, http_status=404, error_type="NotFoundError", grpc_code=StatusCode.NOT_FOUND):
    """The request names a model the router does not serve (and a worker's NOT_FOUND)."""


class RequestTimeout(RouterError, http_status=408, error_type="RequestTimeoutError",
                     grpc_code=StatusCode.DEADLINE_EXCEEDED):
    """The request body did not arrive within --request-body-timeout."""


class PayloadTooLarge(RouterError, http_status=413, error_type="RequestEntityTooLargeError",
                      grpc_code=StatusCode.RESOURCE_EXHAUSTED):
    """The request body is larger than --max-request-body-bytes."""


class Overloaded(RouterError, http_status=429, error_type="RateLimitError", grpc_code=StatusCode.RESOURCE_EXHAUSTED):
    """A worker's RESOURCE_EXHAUSTED: it has no room for the request now."""


class Unavailable(RouterError, http_status=503, error_type="ServiceUnavailableError",
                  grpc_code=StatusCode.UNAVAILABLE):
    """No worker can take the request now: none answered yet, none is healthy, or those tried failed."""


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
