"""The engine loop: validate and enqueue requests, then `step()` = schedule -> run model -> update -> outputs."""

from __future__ import annotations

import copy
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from engine.arg_utils import EngineArgs
from engine.config import EngineConfig
from engine.core.block_hash import BlockHasher
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.swap_space import SwapSpace
from engine.errors import InvalidRequest
from engine.kv_port import KVPort
from engine.metrics.stats import EngineStats, FinishedRequestTiming
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.parallel.executor import create_runner
from engine.processing.detokenizer import IncrementalDetokenizer, decode_all
from engine.processing.generation_config import cap_max_tokens, resolve_generation_defaults
from engine.processing.tokenizer import load_tokenizer
from engine.runner.sampler import seeded_generator_state
from engine.sampling_params import SamplingParams
from engine.spec.proposer import DraftModelProposer, build_proposer
from engine.structured.grammar import StructuredOutputManager

logger = logging.getLogger(__name__)

OutputKind = Literal["cumulative", "delta", "final"]
PromptInput = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int  # queued plus waiting for remote KV
    queued_prefill_tokens: int  # prompt tokens admitted or waiting but not yet computed
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_blocks: int
    num_preemptions: int


@dataclass(frozen=True)
class RemoteSlot:
    """Blocks reserved on the decode side for a prompt whose KV comes from a prefill worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # after generation-config defaults: what the prefill worker must sample with
    block_ids: list[int]  # the whole prompt's block table
    num_cached_blocks: int  # leading blocks already in this worker's prefix cache: not transferred


@dataclass
class _Sample:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    sent_tokens: int = 0
    sent_chars: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind
    samples: list[_Sample]
    prompt_logprobs: list[PositionLogprobs | None] | None
    arrival: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


class LLMEngine:
    def __init__(self, config: EngineConfig, enable_kv_events: bool = False) -> None:
        self.config = config
        self.runner = create_runner(config)  # tensor parallelism: rank 0's runner, the other ranks started
        # Speculative decoding (engine/spec/proposer.py); a draft model is loaded before the memory profile.
        self.proposer = build_proposer(config)
        num_blocks = self.runner.determine_num_blocks()
        if isinstance(self.proposer, DraftModelProposer):
            # Same block count for target and draft (the same block tables' lengths): split the KV budget.
            if config.cache.num_gpu_blocks_override is None:
                own = self.runner.block_bytes
                num_blocks = max(2, num_blocks * own // (own + self.proposer.block_bytes))
            self.proposer.initialize(num_blocks)
        capacity = (num_blocks - 1) * config.cache.block_size
        if config.model.max_model_len > capacity:
            raise ValueError(
                f"The model's max seq len ({config.model.max_model_len}) is larger than the maximum number of tokens "
                f"that can be stored in KV cache ({capacity}). Try increasing kv_cache_memory_bytes / "
                "gpu_memory_utilization or decreasing max_model_len."
            )
        num_swap = 0
        if config.scheduler.preemption_mode == "swap":
            num_swap = config.cache.swap_space_bytes // self.runner.block_bytes
        self.runner.initialize_kv_cache(num_blocks, num_swap)
        self.num_gpu_blocks = num_blocks
        # what KV transports may touch
        self.kv_port = KVPort(self.runner.kv_caches, self.runner.kv_dtype_name, self.runner.kv_scales)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), max concurrency %.1fx at %d tokens/request",
                    num_blocks, config.cache.block_size, capacity, capacity / config.model.max_model_len,
                    config.model.max_model_len)
        self.hasher = BlockHasher.for_model(config.model.model_id, config.cache.block_size)
        self.kv_manager = KVCacheManager(num_blocks, config.cache.block_size, self.hasher,
                                         config.cache.enable_prefix_caching, enable_kv_events)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, SwapSpace(num_swap) if num_swap else None)
        self.tokenizer = load_tokenizer(config.model.tokenizer_path)
        self.eos_token_id = self._eos_token_id()
        self.structured_output = StructuredOutputManager(self.tokenizer, config.model.arch.vocab_size,
                                                         self.eos_token_id, config=config.structured_outputs)
        self.runner.structured_output = self.structured_output
        self.generation_defaults: dict[str, Any] = resolve_generation_defaults(
            config.model.generation_config, config.model.model_path, config.model.override_generation_config)
        if self.generation_defaults:
            logger.info("Default sampling parameters have been overridden by the generation config: %s (use "
                        "generation_config='vllm' to ignore the model's)", self.generation_defaults)
        self.stats = EngineStats(num_gpu_blocks=num_blocks)
        self.finished_timings: list[FinishedRequestTiming] = []
        self._states: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._ids = itertools.count()
        self.num_lease_expired_blocks = 0  # P/D prefill side: held blocks freed because no transfer finished

    @classmethod
    def from_engine_args(cls, args: EngineArgs, enable_kv_events: bool = False) -> LLMEngine:
        return cls(args.create_engine_config(), enable_kv_events)

    def _eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        eos = getattr(self.config.model.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, list) else eos

    # ---- requests ----------------------------------------------------------------------------------------
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

    def add_request(self, request_id: str | None, prompt: PromptInput, params: SamplingParams | None = None,
                    output_kind: OutputKind = "cumulative", extra_keys: tuple[str, ...] = (),
                    kv_lease_s: float | None = None, resume_output_token_ids: list[int] | None = None) -> str:
        """Validate and enqueue; raises InvalidRequest (nothing is enqueued) for bad input.

        `kv_lease_s` (prefill side of P/D): keep the finished request's blocks until `release_kv` or the lease.
        `resume_output_token_ids` (migration): the tokens another engine already generated for this request; they
        count as output (max_tokens, penalties, stop rules) and are not returned again, and a seeded request's
        generator continues after them. Single-sample requests only.
        """
        state = self._new_state(request_id, prompt, params, output_kind, extra_keys, kv_lease_s,
                                resume_output_token_ids or [])
        for sample in state.samples:
            self.scheduler.add_request(sample.request)
        return state.request_id

    def add_remote_prefill_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                                   output_kind: OutputKind = "cumulative", extra_keys: tuple[str, ...] = (),
                                   min_uncached_tokens: int = 0) -> RemoteSlot | None:
        """Decode side of P/D: admit a request whose prompt KV a prefill worker computes.

        Blocks for the whole prompt are reserved now; the request is not scheduled until `finish_remote_prefill`
        (or `fail_remote_prefill`, which recomputes locally). Returns None, with nothing enqueued, when the prompt
        has fewer than `min_uncached_tokens` uncached tokens or the pool has no room: prefill locally then.
        Raises InvalidRequest for bad input, and for n > 1 or prompt_logprobs (those always prefill locally).
        """
        if params.n != 1 or params.prompt_logprobs is not None:
            raise InvalidRequest("remote prefill serves single-sample requests without prompt_logprobs")
        state = self._new_state(request_id, prompt, params, output_kind, extra_keys, None)
        request = state.samples[0].request
        if not self.scheduler.admit_remote(request, min_uncached_tokens):
            self._states.pop(state.request_id)
            self._child_to_parent.pop(request.request_id)
            return None
        num_cached_blocks = request.num_computed_tokens // self.config.cache.block_size
        return RemoteSlot(state.request_id, list(request.prompt_token_ids), request.sampling_params,
                          self.kv_manager.block_ids(request.request_id), num_cached_blocks)

    def finish_remote_prefill(self, request_id: str, first_token: int, logprobs: PositionLogprobs | None,
                              sampler_state: bytes = b"") -> None:
        """The prompt's KV was written into the reserved blocks (the writes have completed): decode on from the
        remotely sampled token.

        `sampler_state` is the prefill side's seeded generator after that token (`sampler_state()`), so seeded
        sampling continues exactly as a unified engine would. Both reach the runner through `NewRequestData`.
        """
        state = self._states.get(request_id)
        if state is None:
            return  # aborted meanwhile
        sample = state.samples[0]
        taken_early = sample.request.num_output_tokens > 0
        self.scheduler.resume_remote(sample.request, first_token, sampler_state)
        if taken_early:
            return  # absorbed and delivered by `take_remote_first_token`
        self._absorb(state, sample, None if logprobs is None else [logprobs], None)
        if state.finished:
            self._pending_outputs.append(self._finish_state(state))
        elif state.output_kind != "final":
            self._pending_outputs.append(self._make_output(state, finished=False))

    def take_remote_first_token(self, request_id: str, first_token: int, logprobs: PositionLogprobs | None,
                                sampler_state: bytes = b"") -> bool:
        """The prefill worker sampled the first token; its KV is still on the way. Deliver the token now (TTFT is
        then the prefill worker's, not prefill + transfer) and keep waiting for the KV before decoding on.

        Declined (False) when the token would end the request or the request has stop strings (either ends it,
        which must wait until no transfer writes into its blocks): `finish_remote_prefill` then takes the token.
        Taken, it stays taken whatever the transfer does: `fail_remote_prefill` recomputes the prompt and this
        token, and sampling continues from the prefill side's generator state."""
        state = self._states.get(request_id)
        if state is None:
            return False
        sample = state.samples[0]
        request = sample.request
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KV or request.num_output_tokens \
                or request.sampling_params.stop:
            return False
        if not self.scheduler.take_remote_first_token(request, first_token, sampler_state):
            return False
        self._absorb(state, sample, None if logprobs is None else [logprobs], None)
        if state.output_kind != "final":
            self._pending_outputs.append(self._make_output(state, finished=False))
        return True

    def sampler_state(self, request_id: str) -> bytes:
        """Prefill side: the request's seeded generator state (empty if unseeded); read it right after the step
        that sampled, before the runner drops the request."""
        return self.runner.generator_state(request_id)

    def fail_remote_prefill(self, request_id: str) -> None:
        """The prefill worker failed: recompute the prompt here (its reserved blocks are dropped), with the first
        token if `take_remote_first_token` took it."""
        state = self._states.get(request_id)
        if state is not None and state.samples[0].request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            self.scheduler.requeue_remote(state.samples[0].request)

    # ---- what the worker runtime and KV transports may ask (no reaching into scheduler or runner) -----------
    def computed_prompt_blocks(self, request_id: str) -> int | None:
        """Full prompt blocks whose KV is computed so far (None: no such request)."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        return min(request.num_computed_tokens, request.num_prompt_tokens) // self.config.cache.block_size

    def kv_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (also while its finished blocks are held for a transfer)."""
        return self.kv_manager.block_ids(request_id)

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced between steps (a remote prefill's first token, aborts): deliver them now rather
        than after the next step's compute."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def load(self) -> EngineLoad:
        sched = self.scheduler
        pending = [*sched.waiting, *sched.running]
        queued = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in pending)
        pool = self.kv_manager.pool
        return EngineLoad(sched.num_running, sched.num_waiting + len(sched.remote_waiting), queued,
                          pool.usage, pool.num_usable_blocks, pool.num_free_blocks, sched.num_preemptions)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def bind_thread(self) -> None:
        """Make the engine's GPU the calling thread's current device (CUDA's current device is per thread)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def check_ranks(self) -> None:
        """Raise if a tensor-parallel rank is gone (health probes)."""
        self.runner.check_ranks()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        self.runner.shutdown()

    def expire_kv_leases(self) -> None:
        self.num_lease_expired_blocks += self.kv_manager.release_expired(time.monotonic())

    def abort_all(self) -> None:
        self.abort_request(list(self._states))

    def release_kv(self, request_id: str) -> int:
        """Prefill side of P/D: the KV was shipped (or the transfer cancelled): free the held blocks."""
        return self.kv_manager.release_held(request_id)

    def _new_state(self, request_id: str | None, prompt: PromptInput, params: SamplingParams | None,
                   output_kind: OutputKind, extra_keys: tuple[str, ...], kv_lease_s: float | None,
                   resumed: list[int] | None = None) -> _RequestState:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._states:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        params = params if params is not None else SamplingParams()
        params.validate()
        vocab = self.config.model.arch.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:  # an index past the logits would crash the step
            raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        params = params.with_defaults(self.generation_defaults)
        if params.structured_outputs is not None:  # compiled once per distinct constraint; a bad one is a 400
            if self.config.device.tensor_parallel_size > 1:  # the other ranks' samplers hold no grammar matchers
                raise InvalidRequest("structured outputs are not supported with tensor_parallel_size > 1 yet",
                                     "structured_outputs")
            self.structured_output.compile(params.structured_outputs)
        capped = cap_max_tokens(self.generation_defaults, params.max_tokens)
        if capped != params.max_tokens:  # max_new_tokens caps what a request asks for (a copy: callers share)
            params = copy.copy(params)
            params.max_tokens = capped
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        resumed = list(resumed or [])
        if resumed:
            self._validate_resume(token_ids, resumed, params)
        max_len = self.config.model.max_model_len
        samples = []
        first: Request | None = None
        for index in range(params.n):
            # A copy even for n = 1: the caller may share one params object across prompts (LLM.generate does).
            child_params = params.child(index) if params.n > 1 else copy.copy(params)
            if child_params.max_tokens is None:
                child_params.max_tokens = max_len - len(token_ids)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(child_id, token_ids, child_params, self.eos_token_id, wait_for=first,
                              extra_keys=extra_keys, kv_lease_s=kv_lease_s)
            if resumed:
                request.resume_from(resumed)
                if child_params.seed is not None and not child_params.is_greedy:
                    request.remote_sampler_state = seeded_generator_state(child_params.seed, len(resumed),
                                                                          self.device)
            first = first or request
            need_detok = output_kind != "final" or bool(child_params.stop)
            detok = IncrementalDetokenizer(self.tokenizer, [*token_ids, *resumed], child_params.skip_special_tokens,
                                           child_params.stop, child_params.include_stop_str_in_output) \
                if need_detok and self.tokenizer is not None else None
            wants_lp = child_params.logprobs is not None
            samples.append(_Sample(request, detok, [] if wants_lp else None, 0.0 if wants_lp else None,
                                   sent_tokens=len(resumed)))
            self._child_to_parent[child_id] = request_id
        state = _RequestState(request_id, text, token_ids, params, output_kind, samples,
                              [] if params.prompt_logprobs is not None else None)
        self._states[request_id] = state
        return state

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

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for request_id in ids:
            state = self._states.get(request_id)
            if state is None:
                continue
            self.scheduler.finish_requests([s.request.request_id for s in state.samples],
                                           RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(self._finish_state(state))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    # ---- the loop ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.expire_kv_leases()
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        if self.proposer is not None:
            self.stats.count_spec(scheduler_output, runner_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.stats.num_steps += 1
        touched: dict[str, _RequestState] = {}
        for request in updated:
            parent = self._states.get(self._child_to_parent.get(request.request_id, ""))
            if parent is None:
                continue
            sample = next(s for s in parent.samples if s.request is request)
            self._absorb(parent, sample, runner_output.logprobs_for(request.request_id),
                         runner_output.prompt_logprobs.get(request.request_id))
            touched[parent.request_id] = parent
        self.stats.prompt_tokens += sum(
            len(c.token_ids) for c in scheduler_output.chunks if c.start_position < self._prompt_len(c.request_id))
        outputs, self._pending_outputs = self._pending_outputs, []
        for state in touched.values():
            if state.finished:
                outputs.append(self._finish_state(state))
            elif state.output_kind != "final":
                outputs.append(self._make_output(state, finished=False))
        self._refresh_gauges()
        return outputs

    def _prompt_len(self, child_id: str) -> int:
        request = self.scheduler.requests.get(child_id)
        return request.num_prompt_tokens if request is not None else 0

    def _absorb(self, state: _RequestState, sample: _Sample, logprobs: list[PositionLogprobs] | None,
                prompt_logprobs: list[PositionLogprobs | None] | None) -> None:
        """Take a sample's new tokens (several after a speculative step), one logprobs entry per token."""
        request = sample.request
        if prompt_logprobs and state.prompt_logprobs is not None and sample is state.samples[0]:
            room = len(state.prompt_token_ids) - len(state.prompt_logprobs)
            state.prompt_logprobs.extend(prompt_logprobs[:room])
        new_tokens = request.output_token_ids[sample.sent_tokens :]
        if not new_tokens:
            return
        stop = None
        if sample.detokenizer is not None:
            # Token by token: a stop string ends the output at its token. An ending EOS / stop id is no text.
            visible = new_tokens[:-1] if _stop_token_ended(request) else new_tokens
            for i, token in enumerate(visible):
                stop = sample.detokenizer.update([token])
                if stop is not None:
                    if i + 1 < len(new_tokens):  # accepted speculative tokens after it are dropped
                        request.truncate_output(sample.sent_tokens + i + 1)
                        new_tokens = new_tokens[: i + 1]
                    break
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        self.stats.generation_tokens += len(new_tokens)
        if logprobs is not None and sample.logprobs is not None:
            for entry, token in zip(logprobs, new_tokens, strict=False):  # tokens cut at a stop have no entry
                sample.logprobs.append(entry)
                chosen = entry.get(token)
                if chosen is not None and sample.cumulative_logprob is not None:
                    sample.cumulative_logprob += chosen.logprob
        sample.sent_tokens = request.num_output_tokens
        if stop is not None and not request.is_finished:
            request.stop_reason = stop
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def _completion(self, state: _RequestState, index: int, finished: bool) -> CompletionOutput:
        sample = state.samples[index]
        request = sample.request
        params = request.sampling_params
        if sample.detokenizer is not None:
            text = sample.detokenizer.visible_text(finished)
        elif finished:
            shown = request.output_token_ids[:-1] if _stop_token_ended(request) else request.output_token_ids
            text = decode_all(self.tokenizer, shown, params.skip_special_tokens)
        else:
            text = ""
        token_ids = list(request.output_token_ids)
        logprobs = sample.logprobs
        if state.output_kind == "delta":
            text, sample.sent_chars = text[sample.sent_chars :], len(text)
        return CompletionOutput(index, text, token_ids, sample.cumulative_logprob, logprobs,
                                request.status.finish_reason if finished else None, request.stop_reason)

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        first = state.samples[0].request
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=[self._completion(state, i, finished) for i in range(len(state.samples))],
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
        )

    def _finish_state(self, state: _RequestState) -> RequestOutput:
        output = self._make_output(state, finished=True)
        now = time.monotonic()
        for sample in state.samples:
            request = sample.request
            reason = request.status.finish_reason or "abort"
            self.stats.request_success[reason] = self.stats.request_success.get(reason, 0) + 1
            ttft = request.first_token_time - request.arrival_time if request.first_token_time else None
            tpot = None
            if request.first_token_time and request.num_output_tokens > 1:
                tpot = (now - request.first_token_time) / (request.num_output_tokens - 1)
            scheduled = request.first_scheduled_time or now
            self.finished_timings.append(FinishedRequestTiming(
                request.request_id, reason, request.num_prompt_tokens, request.num_output_tokens,
                scheduled - request.arrival_time, ttft, now - request.arrival_time, tpot))
            self._child_to_parent.pop(request.request_id, None)
            self.scheduler.forget(request.request_id)
        self._states.pop(state.request_id, None)
        output.metrics = {"arrival_time": state.arrival}
        return output

    def _refresh_gauges(self) -> None:
        s = self.stats
        s.num_requests_running = self.scheduler.num_running
        s.num_requests_waiting = self.scheduler.num_waiting
        s.num_requests_swapped = self.scheduler.num_swapped if self.scheduler.swap_space is not None else 0
        s.kv_cache_usage = self.kv_manager.usage
        s.prefix_cache_queries = self.kv_manager.stats.queries
        s.prefix_cache_hits = self.kv_manager.stats.hits
        s.num_preemptions = self.scheduler.num_preemptions

    def take_finished_timings(self) -> list[FinishedRequestTiming]:
        timings, self.finished_timings = self.finished_timings, []
        return timings


def _stop_token_ended(request: Request) -> bool:
    """The request ended on EOS or one of its stop_token_ids: as vLLM, that token's text is not part of the output
    unless include_stop_str_in_output (its id stays in token_ids)."""
    return (request.status is RequestStatus.FINISHED_STOPPED and not isinstance(request.stop_reason, str)
            and not request.sampling_params.include_stop_str_in_output and request.num_output_tokens > 0)
