"""Per-request sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest
from engine.structured.grammar import StructuredOutputsParams

GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default --max-logprobs)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_BAD_WORDS = 128  # bounds per-step host work: each word is matched against its row's output at every step
MAX_BAD_WORD_CHARS = 256
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


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
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before penalties and sampling
    allowed_token_ids: list[int] | None = None  # only these token ids may be sampled
    bad_words: list[str] | None = None  # words never generated (a multi-token word: its last token is banned after the rest)
    # Guided decoding (vLLM's name; `guided_decoding=` is accepted as its older spelling).
    structured_outputs: StructuredOutputsParams | None = None
    # Fields the user set explicitly; generation_config defaults fill only the others.
    _explicit: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    # `bad_words` as token id sequences, set by the engine's input processor (it holds the tokenizer).
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __init__(self, **kwargs: Any) -> None:
        if "guided_decoding" in kwargs:  # vLLM before 0.10.2
            if kwargs.get("structured_outputs") is not None:
                raise InvalidRequest("give structured_outputs or guided_decoding, not both", "guided_decoding")
            kwargs = {**kwargs, "structured_outputs": kwargs["guided_decoding"]}
            del kwargs["guided_decoding"]
        names = {f.name for f in dataclasses.fields(self) if not f.name.startswith("_")}
        unknown = set(kwargs) - names
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        for f in dataclasses.fields(self):
            if f.name != "_explicit":
                default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                setattr(self, f.name, kwargs.get(f.name, default))
        self._explicit = frozenset(kwargs)
        if isinstance(self.allowed_token_ids, (tuple, set)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = self.bad_words or None  # [] bans nothing
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = self.logit_bias or None  # {} biases nothing
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def guided_decoding(self) -> StructuredOutputsParams | None:
        return self.structured_outputs

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """`bad_words` tokenized (empty until the engine's input processor tokenized them)."""
        return self._bad_words_token_ids or []

    @property
    def masks_tokens(self) -> bool:
        """Some token ids are masked out on the host (allowed_token_ids, bad_words): no on-device argmax shortcut."""
        return self.allowed_token_ids is not None or bool(self._bad_words_token_ids)

    @property
    def needs_output_history(self) -> bool:
        """Its logit processing reads the tokens generated so far (penalties count them; bad words match them)."""
        return self.needs_penalties or bool(self._bad_words_token_ids)

    def validate(self) -> None:
        """Raises InvalidRequest naming the first bad field (its `param`)."""

        def fail(name: str, message: str) -> None:
            raise InvalidRequest(message, name)

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"n must be an integer >= 1, got {self.n!r}")
        for name in _FLOAT_FIELDS:  # NaN passes every range check below, and inf is no temperature
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                fail(name, f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            fail("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            fail("top_k", f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            fail("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            fail("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0 or value > MAX_LOGPROBS):
                fail(name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):  # type: ignore[union-attr]
            fail("stop", "stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            fail("stop_token_ids", "stop_token_ids must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "logit_bias must map token ids to biases")
            for token, bias in self.logit_bias.items():  # type: ignore[union-attr]
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    fail("logit_bias", f"logit_bias keys must be non-negative token ids, got {token!r}")
                if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias) \
                        or abs(bias) > MAX_LOGIT_BIAS:
                    fail("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids:
                fail("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):  # type: ignore[union-attr]
                fail("allowed_token_ids", "allowed_token_ids must be non-negative integers")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip()
                                                           for w in self.bad_words):
                fail("bad_words", "bad_words must be a list of non-empty strings")
            if len(self.bad_words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
                fail("bad_words", f"bad_words may hold at most {MAX_BAD_WORDS} words of at most "
                                  f"{MAX_BAD_WORD_CHARS} characters each")

    def with_defaults(self, defaults: dict[str, Any]) -> SamplingParams:
        """A copy where fields the user did not set take the model's generation_config defaults."""
        chosen = {k: v for k, v in defaults.items() if k not in self._explicit}
        if not chosen:
            return self
        merged = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in self._explicit}
        merged.update(chosen)
        out = SamplingParams(**merged)
        out._explicit = self._explicit
        out._bad_words_token_ids = self._bad_words_token_ids
        return out

    def child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n samples: one sequence each, distinct seeds when seeded."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in self._explicit}
        fields["n"] = 1
        if self.seed is not None:
            fields["seed"] = self.seed + index
        out = SamplingParams(**fields)
        out._explicit = self._explicit
        out._bad_words_token_ids = self._bad_words_token_ids
        return out
