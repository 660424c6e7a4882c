"""Structured output (guided decoding) through xgrammar: request parameters, grammar compilation, token bitmasks.

`StructuredOutputsParams` is vLLM's request-side form (also importable as `GuidedDecodingParams`, its older name):
exactly one of `json` (a JSON schema), `regex`, `choice`, `grammar` (EBNF) or `json_object` (any JSON object).

`StructuredOutputManager` belongs to one engine: it compiles each distinct constraint once (xgrammar's compiler
cache, keyed by the constraint's canonical text) under the engine's `StructuredOutputsConfig`
(engine/structured/config.py; its `disable_any_whitespace` applies to every request), hands the runner one
`GrammarMatcher` per constrained request, and fills one bitmask tensor per batch in which only constrained rows are
written (the sampler masks only those rows). A matcher advances on every accepted token; once its grammar is
complete it allows only the end-of-sequence token, so the request stops as any other request does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.errors import InvalidRequest
from engine.structured.config import StructuredOutputsConfig

logger = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar", "json_object")
ANY_OBJECT_SCHEMA = '{"type": "object"}'  # json_object without free whitespace (the built-in JSON grammar has it)
BACKENDS = (None, "auto", "xgrammar")  # what `backend` may name: kvflow has one backend
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per engine (least recently used dropped first)
PARAM = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams` / `GuidedDecodingParams`: one constraint on a request's output."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens (compact output)
    disable_fallback: bool = False  # kvflow never falls back to another backend: always honoured
    backend: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, value: Any, param: str = PARAM) -> StructuredOutputsParams:
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise InvalidRequest(f"{param} must be an object with one of {', '.join(KINDS)}", param)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequest(f"{param}: unsupported option(s) {', '.join(unknown)} (kvflow supports "
                                 f"{', '.join(sorted(known))})", param)
        try:
            return cls(**value)
        except InvalidRequest as exc:
            raise InvalidRequest(str(exc), param) from exc

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequest(f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                                 f"{', '.join(set_kinds) or 'none'}", PARAM)
        if self.backend not in BACKENDS:
            raise InvalidRequest(f"structured output backend {self.backend!r} is not supported by kvflow (it uses "
                                 "xgrammar)", PARAM)
        for name in ("disable_any_whitespace", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a boolean", PARAM)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequest("a JSON schema must be an object (or its JSON text)", PARAM)
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}", PARAM) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("a JSON schema must be an object", PARAM)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(f"{name} must be a non-empty string", PARAM)
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequest("choice must be a non-empty list of non-empty strings", PARAM)
        if self.json_object not in (None, True, False):
            raise InvalidRequest("json_object must be a boolean", PARAM)

    def schema_text(self) -> str:
        """The JSON schema as canonical JSON text (the compile-cache key, and what the wire carries)."""
        assert self.json is not None
        value = json.loads(self.json) if isinstance(self.json, str) else self.json
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    def cache_key(self) -> str:
        kind = self.kind
        if kind == "json":
            body = self.schema_text()
        elif kind == "choice":
            body = json.dumps(self.choice)
        elif kind == "json_object":
            body = ""
        else:
            body = getattr(self, kind)
        return f"{kind}:{int(self.disable_any_whitespace)}:{body}"


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.10.2


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of the strings (JSON string literals are valid EBNF literals in xgrammar)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_grammar_syntax(params: StructuredOutputsParams) -> None:
    """Checks what can be checked without a tokenizer (the router's early 400): raises InvalidRequest."""
    import xgrammar as xgr

    try:
        kind = params.kind
        if kind == "json":
            xgr.Grammar.from_json_schema(params.schema_text(), any_whitespace=not params.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(params.choice or []))
    except RuntimeError as exc:  # xgrammar reports a bad schema / regex / grammar as RuntimeError
        raise InvalidRequest(f"invalid {kind}: {_short(exc)}", PARAM) from None


def _short(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 2)[-1]
    return text.splitlines()[0] if text else type(exc).__name__


class StructuredOutputManager:
    """One per engine: compiled grammars (cached per distinct constraint), matchers, and the batch bitmask."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, max_threads: int = 2,
                 tokenizer_info: Any = None, config: StructuredOutputsConfig | None = None) -> None:
        """`tokenizer_info`: an xgrammar TokenizerInfo to use instead of one read from `tokenizer` (a benchmark
        on a random-weight model without a tokenizer). `config`: the engine's (default: vLLM's defaults)."""
        self.tokenizer = tokenizer
        self.config = config if config is not None else StructuredOutputsConfig()
        self.tokenizer_info = tokenizer_info
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_threads = max_threads
        self._compiler: Any = None  # built on first use: TokenizerInfo reads the whole vocabulary (~0.5 s)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._bitmask: torch.Tensor | None = None
        self.num_compiled = 0  # compilations done (cache misses)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = self.tokenizer_info
            if info is None:
                if self.tokenizer is None:
                    raise InvalidRequest("structured output needs the model's tokenizer, and this model has none",
                                         PARAM)
                stop = [self.eos_token_id] if self.eos_token_id is not None else None
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=stop)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (once per distinct constraint); raises InvalidRequest for a bad one."""
        if self.config.disable_any_whitespace and not params.disable_any_whitespace:  # the engine-wide setting
            params = dataclasses.replace(params, disable_any_whitespace=True)
        key = params.cache_key()
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        compiler = self._get_compiler()
        kind = params.kind
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(params.schema_text(),
                                                        any_whitespace=not params.disable_any_whitespace)
            elif kind == "json_object" and params.disable_any_whitespace:  # as vLLM's xgrammar backend does
                compiled = compiler.compile_json_schema(ANY_OBJECT_SCHEMA, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(params.choice or []))
            else:
                compiled = compiler.compile_grammar(params.grammar)
        except RuntimeError as exc:
            raise InvalidRequest(f"invalid {kind}: {_short(exc)}", PARAM) from None
        self.num_compiled += 1
        self._compiled[key] = compiled
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def new_matcher(self, params: StructuredOutputsParams, output_token_ids: list[int]) -> Any:
        """A matcher for one request, advanced over the tokens it already has (a remote prefill's first token,
        a migrated request's output)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(params))
        for token in output_token_ids:
            if not matcher.accept_token(token):
                logger.warning("a resumed request's token %d does not match its grammar; the rest of its output "
                               "is constrained from the grammar's state before it", token)
                break
        return matcher

    def fill_bitmask(self, num_rows: int, constrained: list[tuple[int, Any]]) -> torch.Tensor:
        """One int32 bitmask [num_rows, ceil(vocab / 32)] for the batch; only the constrained rows are written
        (the sampler masks only those). A finished grammar allows only end-of-sequence."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        bitmask = self._bitmask
        for row, matcher in constrained:
            if matcher.is_terminated():  # only end-of-sequence (if the model has none: nothing left to forbid)
                bitmask[row].fill_(0 if self.eos_token_id is not None else -1)
                if self.eos_token_id is not None:
                    bit = 1 << (self.eos_token_id % 32)
                    bitmask[row, self.eos_token_id // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32
            else:
                matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask[:num_rows]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of the listed rows to -inf, in place (xgrammar's kernel for the logits' device)."""
    import xgrammar as xgr

    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
