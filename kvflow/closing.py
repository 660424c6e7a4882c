"""`with` support for kvflow's handles that hold resources (the offline `LLM`'s engine, the SDK's blocking channel):
leaving the block closes the handle however the block ends. `close` stays callable on its own."""

from __future__ import annotations

import abc
from typing import TypeVar

_Handle = TypeVar("_Handle", bound="Closing")


class Closing(abc.ABC):
    @abc.abstractmethod
    def close(self) -> None:
        """Release what the handle holds."""

    def __enter__(self: _Handle) -> _Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
