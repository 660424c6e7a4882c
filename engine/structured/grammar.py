"""Structured output (guided decoding) through xgrammar: request parameters, grammar compilation, token bitmasks.

`StructuredOutputsParams` is vLLM's request-side form (also importable as `GuidedDecodingParams`, its older name):
exactly one of `json` (a JSON schema), `regex`, `choice`, `grammar` (EBNF) or `json_object` (any JSON object).

`StructuredOutputManager` belongs to one engine: it compiles each distinct constraint once (its own bounded cache,
keyed by the constraint's canonical text), on its compile threads, within the size limits and the time budget of
engine/structured/limits.py, under the engine's `StructuredOutputsConfig` (engine/structured/config.py; its
`disable_any_whitespace` applies to every request), hands the runner one
`GrammarMatcher` per constrained request, and fills one bitmask tensor per batch in which only constrained rows are
written (the sampler masks only those rows). A matcher advances on every accepted token; once its grammar is
complete it allows only the end-of-sequence token, so the request stops as any other request does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.errors import InvalidRequest
from engine.structured.config import StructuredOutputsConfig
from engine.structured.limits import DEFAULT_LIMITS, StructuredOutputLimits, check_constraint

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
    """One per engine: compiled grammars (cached per distinct constraint), matchers, and the batch bitmask.

    Grammars compile on the manager's own threads (xgrammar releases the GIL while it compiles), never on the
    engine loop: a server awaits `submit`'s future before it admits the request, so the loop keeps stepping
    everyone else meanwhile. Each constraint passes the size limits (engine/structured/limits.py) first and has
    `limits.timeout_s` to compile; one that waited that long for a free thread is dropped unstarted. A compile
    that has started cannot be interrupted (xgrammar has no cancel): it runs to its end on its thread, and an
    identical constraint sent meanwhile waits for that same compile instead of starting another.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, max_threads: int = 2,
                 tokenizer_info: Any = None, config: StructuredOutputsConfig | None = None,
                 limits: StructuredOutputLimits = DEFAULT_LIMITS, compile_threads: int = 2) -> None:
        """`tokenizer_info`: an xgrammar TokenizerInfo to use instead of one read from `tokenizer` (a benchmark
        on a random-weight model without a tokenizer). `config`: the engine's (default: vLLM's defaults).
        `max_threads`: xgrammar's own threads per compile; `compile_threads`: compiles running at once."""
        self.tokenizer = tokenizer
        self.config = config if config is not None else StructuredOutputsConfig()
        self.limits = limits
        self.tokenizer_info = tokenizer_info
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_threads = max_threads
        self._compiler: Any = None  # built on first use: TokenizerInfo reads the whole vocabulary (~0.5 s)
        self._compiler_lock = threading.Lock()
        self._lock = threading.Lock()  # the cache and the threads: servers submit from their event loop
        self._compiled: OrderedDict[str, Future] = OrderedDict()  # done (grammar or refusal) or in flight
        self._jobs: queue.SimpleQueue[tuple[str, StructuredOutputsParams, Future, float]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._num_threads = compile_threads
        self._bitmask: torch.Tensor | None = None
        self.num_compiled = 0  # compilations done (cache misses)

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._new_compiler()
            return self._compiler

    def _new_compiler(self) -> Any:
        import xgrammar as xgr

        info = self.tokenizer_info
        if info is None:
            if self.tokenizer is None:
                raise InvalidRequest("structured output needs the model's tokenizer, and this model has none", PARAM)
            stop = [self.eos_token_id] if self.eos_token_id is not None else None
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=stop)
        return xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)

    def _normalized(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        if self.config.disable_any_whitespace and not params.disable_any_whitespace:  # the engine-wide setting
            return dataclasses.replace(params, disable_any_whitespace=True)
        return params

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The future of the constraint's compiled grammar (done at once on a cache hit); thread-safe. Raises
        InvalidRequest, naming the field, for a constraint over the size limits; the future holds the
        InvalidRequest of one that does not compile (or not in time)."""
        params = self._normalized(params)
        check_constraint(params, PARAM, self.limits)
        key = params.cache_key()
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
                return future
            future = Future()
            self._compiled[key] = future
            self._evict()
            self._jobs.put((key, params, future, time.monotonic() + self.limits.timeout_s))
            self._start_threads()
        return future

    def _evict(self) -> None:
        """Drop the least recently used finished entries past MAX_CACHED_GRAMMARS (in-flight ones stay)."""
        excess = len(self._compiled) - MAX_CACHED_GRAMMARS
        for key in [k for k, f in self._compiled.items() if f.done()][:max(excess, 0)]:
            del self._compiled[key]

    def _start_threads(self) -> None:
        while len(self._threads) < self._num_threads:  # daemon threads: a long compile never holds up exit
            thread = threading.Thread(target=self._work, name=f"grammar-compile-{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while True:
            key, params, future, deadline = self._jobs.get()
            if time.monotonic() > deadline:  # its callers have given up: don't spend a thread on it
                self._forget(key, future)  # not a verdict on the constraint: a later request compiles it
                future.set_exception(self.timeout_error(params))
                continue
            try:
                future.set_result(self._compile_now(params))
            except InvalidRequest as exc:
                future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - a compiler bug fails this request, not the thread
                logger.exception("grammar compilation failed")
                future.set_exception(InvalidRequest(f"the {params.kind} constraint failed to compile: {exc}", PARAM))

    def _forget(self, key: str, future: Future) -> None:
        with self._lock:
            if self._compiled.get(key) is future:
                del self._compiled[key]

    def timeout_error(self, params: StructuredOutputsParams) -> InvalidRequest:
        return InvalidRequest(f"'{PARAM}': the {params.kind} constraint did not compile within "
                              f"{self.limits.timeout_s:g} s (--structured-outputs-timeout-s); simplify it", PARAM)

    def result(self, future: Future, params: StructuredOutputsParams, timeout: float | None = None) -> Any:
        """The compiled grammar, waiting up to `timeout` (default: the budget); raises InvalidRequest."""
        try:
            return future.result(self.limits.timeout_s if timeout is None else timeout)
        except FutureTimeout:
            raise self.timeout_error(params) from None

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (once per distinct constraint), waiting for it within the budget; raises
        InvalidRequest for a bad one. Blocks its caller: servers await `submit`'s future first, so that the
        engine loop only ever finds it ready."""
        return self.result(self.submit(params), params)

    def _compile_now(self, params: StructuredOutputsParams) -> Any:
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
        with self._lock:
            self.num_compiled += 1
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
