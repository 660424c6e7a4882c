"""Errors that cross the engine's public surface."""


class InvalidRequest(ValueError):
    """A request the engine refuses, with the reason; the engine keeps serving everything else.

    `param` names the offending request field where there is one (the OpenAI front reports it). Transports map
    it to HTTP 400 / gRPC INVALID_ARGUMENT.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotAvailable(RuntimeError):
    """The named model cannot be loaded here (missing package, file or unknown preset)."""
