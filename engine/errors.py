"""Errors that cross the engine's public surface."""


class InvalidRequest(ValueError):
    """A request the engine refuses, with the reason; the engine keeps serving everything else.

    Transports map it to HTTP 400 / gRPC INVALID_ARGUMENT.
    """


class ModelNotAvailable(RuntimeError):
    """The named model cannot be loaded here (missing package, file or unknown preset)."""
