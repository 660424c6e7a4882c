"""Input processing: a caller's prompt and sampling parameters, checked and turned into the scheduler's requests.

Invariants:
- A refused request leaves no trace: every check runs before its first `Request` exists, and each refusal is an
  `InvalidRequest` (naming the field where there is one).
- Parameters take the model's generation-config defaults, then its max_new_tokens caps max_tokens. The caller's
  params object is never mutated: callers share one across prompts (`LLM.generate` does), so every sample gets
  its own copy.
- A prompt is 1 to max_model_len - 1 token ids, each in [0, vocab).
- n > 1 makes one request per sample, `{request_id}#{index}`, each after the first waiting for the first's prefill
  (then it hits the cached prompt blocks).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.request import Request
from engine.errors import InvalidRequest
from engine.processing.bad_words import tokenize_bad_words
from engine.processing.generation_config import cap_max_tokens
from engine.runner.sampler import seeded_generator_state
from engine.sampling_params import SamplingParams
from engine.structured.grammar import StructuredOutputManager

PromptInput = str | list[int] | dict[str, Any]


def eos_token_id(tokenizer: Any, hf_config: Any) -> int | None:
    """The tokenizer's EOS, else the model config's (its first, where it lists several)."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos


@dataclass(frozen=True)
class ProcessedRequest:
    """A checked request, ready to enqueue: one scheduler request per sample."""

    request_id: str
    prompt: str | None  # the text, when the caller sent one
    prompt_token_ids: list[int]
    params: SamplingParams  # with the defaults and caps applied
    samples: list[Request]
    resumed: list[int]  # output tokens another engine already generated (migration)


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any, eos_token_id: int | None,
                 generation_defaults: dict[str, Any], structured_output: StructuredOutputManager,
                 device: torch.device) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.generation_defaults = generation_defaults
        self.structured_output = structured_output
        self.device = device

    def process(self, request_id: str, prompt: PromptInput, params: SamplingParams | None,
                extra_keys: tuple[str, ...], kv_lease_s: float | None, resumed: list[int]) -> ProcessedRequest:
        params = self._checked_params(params if params is not None else SamplingParams())
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        if resumed:
            self._validate_resume(token_ids, resumed, params)
        samples = self._sample_requests(request_id, token_ids, params, extra_keys, kv_lease_s, resumed)
        return ProcessedRequest(request_id, text, token_ids, params, samples, resumed)

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; send prompt_token_ids")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise InvalidRequest(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.config.model.arch.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab for t in token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        max_len = self.config.model.max_model_len
        if len(token_ids) + 1 > max_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_len} tokens. However, the prompt has "
                f"{len(token_ids)} tokens, which leaves no room for output (prompt length + 1 > max_model_len)."
            )

    def _checked_params(self, params: SamplingParams) -> SamplingParams:
        params.validate()
        vocab = self.config.model.arch.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:  # an index past the logits would crash the step
            raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        allowed = params.allowed_token_ids
        if allowed is not None and (max(allowed) >= vocab or len(allowed) > vocab):
            raise InvalidRequest(f"allowed_token_ids must be at most {vocab} ids in [0, {vocab})", "allowed_token_ids")
        params = params.with_defaults(self.generation_defaults)
        if params.bad_words:  # a copy: the caller's object is shared across prompts
            params = copy.copy(params)
            params._bad_words_token_ids = tokenize_bad_words(self.tokenizer, params.bad_words, vocab)
        if params.structured_outputs is not None:  # compiled once per distinct constraint; a bad one is a 400
            if self.config.device.tensor_parallel_size > 1:  # the other ranks' samplers hold no grammar matchers
                raise InvalidRequest("structured outputs are not supported with tensor_parallel_size > 1 yet",
                                     "structured_outputs")
            self.structured_output.compile(params.structured_outputs)
        capped = cap_max_tokens(self.generation_defaults, params.max_tokens)
        if capped != params.max_tokens:  # max_new_tokens caps what a request asks for (a copy: callers share)
            params = copy.copy(params)
            params.max_tokens = capped
        return params

    def _validate_resume(self, prompt: list[int], resumed: list[int], params: SamplingParams) -> None:
        if params.n != 1:
            raise InvalidRequest("a resumed request must be single-sample (n = 1)", "n")
        if params.prompt_logprobs is not None:
            raise InvalidRequest("a resumed request cannot ask for prompt_logprobs again", "prompt_logprobs")
        vocab = self.config.model.arch.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab for t in resumed):
            raise InvalidRequest(f"resumed token ids must be integers in [0, {vocab})", "resume_token_ids")
        if params.max_tokens is not None and len(resumed) >= params.max_tokens:
            raise InvalidRequest(f"{len(resumed)} resumed tokens leave nothing of max_tokens={params.max_tokens}",
                                 "resume_token_ids")
        if len(prompt) + len(resumed) + 1 > self.config.model.max_model_len:
            raise InvalidRequest("the prompt and the resumed tokens leave no room for output", "resume_token_ids")

    def _sample_requests(self, request_id: str, token_ids: list[int], params: SamplingParams,
                         extra_keys: tuple[str, ...], kv_lease_s: float | None, resumed: list[int]) -> list[Request]:
        max_len = self.config.model.max_model_len
        samples: list[Request] = []
        for index in range(params.n):
            # A copy even for n = 1: the caller may share one params object across prompts (LLM.generate does).
            child_params = params.child(index) if params.n > 1 else copy.copy(params)
            if child_params.max_tokens is None:
                child_params.max_tokens = max_len - len(token_ids)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            first = samples[0] if samples else None
            request = Request(child_id, token_ids, child_params, self.eos_token_id, wait_for=first,
                              extra_keys=extra_keys, kv_lease_s=kv_lease_s)
            if resumed:
                request.resume_from(resumed)
                if child_params.seed is not None and not child_params.is_greedy:
                    request.remote_sampler_state = seeded_generator_state(child_params.seed, len(resumed),
                                                                          self.device)
            samples.append(request)
        return samples
