"""Speculative decoding configuration, in vLLM's form.

`speculative_config` is a dict (or its JSON text on the command line):
  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
  {"model": "smollm2", "num_speculative_tokens": 3}                  # a draft model (method "draft_model")
  {"model": "smollm2", "num_speculative_tokens": 3, "draft_num_layers": 12}   # kvflow: a layer-truncated draft
plus "disable_by_batch_size" (speculation is skipped in steps with more running requests than that). Unlike
vLLM, it defaults to DEFAULT_DISABLE_BY_BATCH_SIZE rather than "never": a verify step costs 2-3x a decode step
on a GPU at batch 8-64 (bench/results/spec_gpu_h100.json), so speculation that is always on made concurrency-64
throughput 0.57x; JSON null keeps it on at every batch size.
vLLM's older flags (--speculative-model, --num-speculative-tokens, --ngram-prompt-lookup-max/min,
--speculative-disable-by-batch-size) map onto the same thing (`from_legacy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import json_object_argument

SpecMethod = Literal["ngram", "draft_model"]
SPEC_METHODS: tuple[str, ...] = ("ngram", "draft_model")
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")  # vLLM's older --speculative-model spelling of prompt lookup
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither bound is given
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
_DEFAULT = "default"  # build()'s marker for "disable_by_batch_size not given" (None means: never disable)
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "draft_num_layers")


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"speculative_config.{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class SpecConfig:
    method: SpecMethod
    num_speculative_tokens: int
    model: str | None = None  # the draft (path or preset) for method "draft_model"
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE  # None: speculate at every batch size
    draft_num_layers: int | None = None  # keep only the first N layers of the draft (self-speculation)

    @classmethod
    def parse(cls, value: SpecConfig | dict[str, Any] | str | None) -> SpecConfig | None:
        """A dict, its JSON text, a SpecConfig or None (speculation off)."""
        if value is None or isinstance(value, SpecConfig):
            return value
        return cls.build(**json_object_argument(value, "speculative_config", _KEYS))

    @classmethod
    def build(cls, method: str | None = None, model: str | None = None, num_speculative_tokens: Any = None,
              prompt_lookup_max: Any = None, prompt_lookup_min: Any = None, disable_by_batch_size: Any = _DEFAULT,
              draft_num_layers: Any = None) -> SpecConfig:
        if model in NGRAM_MODEL_NAMES and method in (None, "ngram"):
            method, model = "ngram", None
        if method is None:
            if model is None:
                raise ValueError("speculative_config needs a 'method' (ngram) or a draft 'model'")
            method = "draft_model"
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
        if num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        k = _positive_int("num_speculative_tokens", num_speculative_tokens)
        if isinstance(disable_by_batch_size, str) and disable_by_batch_size == _DEFAULT:
            disable_by_batch_size = DEFAULT_DISABLE_BY_BATCH_SIZE
        elif disable_by_batch_size is not None:
            disable_by_batch_size = _positive_int("disable_by_batch_size", disable_by_batch_size)
        if method == "ngram":
            if model is not None:
                raise ValueError(f"speculative_config.model={model!r} does not go with method 'ngram'")
            if draft_num_layers is not None:
                raise ValueError("speculative_config.draft_num_layers needs a draft model, not method 'ngram'")
            if prompt_lookup_max is None and prompt_lookup_min is None:
                prompt_lookup_max = prompt_lookup_min = DEFAULT_PROMPT_LOOKUP
            elif prompt_lookup_min is None:
                prompt_lookup_min = prompt_lookup_max
            elif prompt_lookup_max is None:
                prompt_lookup_max = prompt_lookup_min
            lo = _positive_int("prompt_lookup_min", prompt_lookup_min)
            hi = _positive_int("prompt_lookup_max", prompt_lookup_max)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            return cls("ngram", k, None, hi, lo, disable_by_batch_size, None)
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model (the draft's path or preset) is required for 'draft_model'")
        if prompt_lookup_max is not None or prompt_lookup_min is not None:
            raise ValueError("speculative_config.prompt_lookup_max/min apply to method 'ngram' only")
        if draft_num_layers is not None:
            draft_num_layers = _positive_int("draft_num_layers", draft_num_layers)
        return cls("draft_model", k, model, DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP, disable_by_batch_size,
                   draft_num_layers)

    @classmethod
    def from_legacy(cls, speculative_model: str | None, num_speculative_tokens: int | None,
                    ngram_prompt_lookup_max: int | None, ngram_prompt_lookup_min: int | None,
                    disable_by_batch_size: int | None) -> SpecConfig | None:
        """vLLM's older flags; None when none of them is set."""
        given = [num_speculative_tokens, ngram_prompt_lookup_max, ngram_prompt_lookup_min, disable_by_batch_size]
        if speculative_model is None:
            if any(v is not None for v in given):
                raise ValueError("--num-speculative-tokens / --ngram-prompt-lookup-* / "
                                 "--speculative-disable-by-batch-size need --speculative-model")
            return None
        is_ngram = speculative_model in NGRAM_MODEL_NAMES
        return cls.build("ngram" if is_ngram else "draft_model", None if is_ngram else speculative_model,
                         num_speculative_tokens, ngram_prompt_lookup_max, ngram_prompt_lookup_min,
                         _DEFAULT if disable_by_batch_size is None else disable_by_batch_size)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out.update(prompt_lookup_max=self.prompt_lookup_max, prompt_lookup_min=self.prompt_lookup_min)
        else:
            out["model"] = self.model
            if self.draft_num_layers is not None:
                out["draft_num_layers"] = self.draft_num_layers
        out["disable_by_batch_size"] = self.disable_by_batch_size  # null (never disable) must survive a round trip
        return out

    def enabled_for(self, batch_size: int) -> bool:
        return self.disable_by_batch_size is None or batch_size <= self.disable_by_batch_size
