"""Per-request sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest

GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Fields the user set explicitly; generation_config defaults fill only the others.
    _explicit: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __init__(self, **kwargs: Any) -> None:
        names = {f.name for f in dataclasses.fields(self)} - {"_explicit"}
        unknown = set(kwargs) - names
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        for f in dataclasses.fields(self):
            if f.name != "_explicit":
                default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                setattr(self, f.name, kwargs.get(f.name, default))
        self._explicit = frozenset(kwargs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequest(message)

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            fail(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            fail(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0 or value > 20):
                fail(f"{name} must be an integer in [0, 20], got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):  # type: ignore[union-attr]
            fail("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            fail("stop_token_ids must be non-negative integers")

    def with_defaults(self, defaults: dict[str, Any]) -> SamplingParams:
        """A copy where fields the user did not set take the model's generation_config defaults."""
        chosen = {k: v for k, v in defaults.items() if k not in self._explicit}
        if not chosen:
            return self
        merged = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in self._explicit}
        merged.update(chosen)
        out = SamplingParams(**merged)
        out._explicit = self._explicit
        return out

    def child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n samples: one sequence each, distinct seeds when seeded."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in self._explicit}
        fields["n"] = 1
        if self.seed is not None:
            fields["seed"] = self.seed + index
        out = SamplingParams(**fields)
        out._explicit = self._explicit
        return out
