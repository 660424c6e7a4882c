"""Output processing: from the tokens each step adds to a request's samples to the `RequestOutput`s its caller
gets: incremental detokenization, stop strings, logprobs, and the per-request statistics.

Invariants:
- One `RequestState` per caller request id while it runs; each of its samples (one scheduler request per `n`)
  maps back to it by its own id until the request finishes.
- A sample's new tokens are taken once (`sent_tokens`). A stop string ends the output at its token: accepted
  speculative tokens after it are dropped, and the request is finished as stopped in the scheduler.
- As in vLLM, a request that ends on EOS or a stop token id keeps that id in token_ids but not its text (unless
  include_stop_str_in_output).
- A finished request's final output is built once; then its timings and finish reason are counted and its state
  and scheduler record are dropped.
- Outputs produced between steps (a remote prefill's first token, aborts) wait in `pending` and go out first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.metrics.stats import EngineStats, FinishedRequestTiming
from engine.outputs import (
    CompletionOutput,
    ModelRunnerOutput,
    PositionLogprobs,
    RequestOutput,
    SchedulerOutput,
)
from engine.processing.detokenizer import IncrementalDetokenizer, decode_all
from engine.processing.input_processor import ProcessedRequest
from engine.sampling_params import SamplingParams

OutputKind = Literal["cumulative", "delta", "final"]


@dataclass
class SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    sent_tokens: int = 0
    sent_chars: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind
    samples: list[SampleState]
    prompt_logprobs: list[PositionLogprobs | None] | None
    arrival: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


def stop_token_ended(request: Request) -> bool:
    """The request ended on EOS or one of its stop_token_ids: as vLLM, that token's text is not part of the output
    unless include_stop_str_in_output (its id stays in token_ids)."""
    return (request.status is RequestStatus.FINISHED_STOPPED and not isinstance(request.stop_reason, str)
            and not request.sampling_params.include_stop_str_in_output and request.num_output_tokens > 0)


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler, stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.stats = stats
        self.states: dict[str, RequestState] = {}
        self.pending: list[RequestOutput] = []
        self.finished_timings: list[FinishedRequestTiming] = []
        self._child_to_parent: dict[str, str] = {}

    # ---- requests ----------------------------------------------------------------------------------------
    def add(self, processed: ProcessedRequest, output_kind: OutputKind) -> RequestState:
        samples = [self._sample_state(request, output_kind, processed.resumed) for request in processed.samples]
        for request in processed.samples:
            self._child_to_parent[request.request_id] = processed.request_id
        state = RequestState(processed.request_id, processed.prompt, processed.prompt_token_ids, processed.params,
                             output_kind, samples, [] if processed.params.prompt_logprobs is not None else None)
        self.states[processed.request_id] = state
        return state

    def discard(self, state: RequestState) -> None:
        """Drop a request that was never enqueued."""
        self.states.pop(state.request_id)
        for sample in state.samples:
            self._child_to_parent.pop(sample.request.request_id)

    def _sample_state(self, request: Request, output_kind: OutputKind, resumed: list[int]) -> SampleState:
        params = request.sampling_params
        need_detok = output_kind != "final" or bool(params.stop)
        detok = IncrementalDetokenizer(self.tokenizer, [*request.prompt_token_ids, *resumed],
                                       params.skip_special_tokens, params.stop, params.include_stop_str_in_output) \
            if need_detok and self.tokenizer is not None else None
        wants_lp = params.logprobs is not None
        return SampleState(request, detok, [] if wants_lp else None, 0.0 if wants_lp else None,
                           sent_tokens=len(resumed))

    # ---- a step's new tokens -----------------------------------------------------------------------------
    def process(self, updated: list[Request], scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """The outputs of a step: the pending ones first, then each touched request's."""
        touched: dict[str, RequestState] = {}
        for request in updated:
            state = self.states.get(self._child_to_parent.get(request.request_id, ""))
            if state is None:
                continue
            sample = next(s for s in state.samples if s.request is request)
            self.absorb(state, sample, runner_output.logprobs_for(request.request_id),
                        runner_output.prompt_logprobs.get(request.request_id))
            touched[state.request_id] = state
        self.stats.prompt_tokens += sum(
            len(c.token_ids) for c in scheduler_output.chunks if c.start_position < self._prompt_len(c.request_id))
        outputs, self.pending = self.pending, []
        for state in touched.values():
            if state.finished:
                outputs.append(self.finish(state))
            elif state.output_kind != "final":
                outputs.append(self.output(state, finished=False))
        return outputs

    def _prompt_len(self, child_id: str) -> int:
        request = self.scheduler.requests.get(child_id)
        return request.num_prompt_tokens if request is not None else 0

    def absorb(self, state: RequestState, sample: SampleState, logprobs: list[PositionLogprobs] | None,
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
            visible = new_tokens[:-1] if stop_token_ended(request) else new_tokens
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

    # ---- outputs -----------------------------------------------------------------------------------------
    def output(self, state: RequestState, finished: bool) -> RequestOutput:
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

    def _completion(self, state: RequestState, index: int, finished: bool) -> CompletionOutput:
        sample = state.samples[index]
        request = sample.request
        params = request.sampling_params
        if sample.detokenizer is not None:
            text = sample.detokenizer.visible_text(finished)
        elif finished:
            shown = request.output_token_ids[:-1] if stop_token_ended(request) else request.output_token_ids
            text = decode_all(self.tokenizer, shown, params.skip_special_tokens)
        else:
            text = ""
        token_ids = list(request.output_token_ids)
        logprobs = sample.logprobs
        if state.output_kind == "delta":
            text, sample.sent_chars = text[sample.sent_chars :], len(text)
        return CompletionOutput(index, text, token_ids, sample.cumulative_logprob, logprobs,
                                request.status.finish_reason if finished else None, request.stop_reason)

    def finish(self, state: RequestState) -> RequestOutput:
        """The final output; counts the request's timings and finish reason and drops its state."""
        output = self.output(state, finished=True)
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
        self.states.pop(state.request_id, None)
        output.metrics = {"arrival_time": state.arrival}
        return output

    def take_finished_timings(self) -> list[FinishedRequestTiming]:
        timings, self.finished_timings = self.finished_timings, []
        return timings
