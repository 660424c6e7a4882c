"""Continuous-batching scheduler: one token budget per step covers decode, chunked prefill and prefix hits.

Every request simply has `num_computed_tokens` catching up with `num_tokens` (prompt + generated). Each step
serves running requests first, then admits waiting ones while budget, sequence slots and blocks last. When
blocks run out, the most recently admitted running request is preempted (recompute, or swap to CPU).

With pipeline parallelism several scheduled batches are in flight at once (engine/parallel/batch_queue.py):
`schedule(in_flight=...)` leaves the requests of those batches out (their next tokens are not known yet) and never
preempts them (their blocks are being written), and `max_seqs` caps the batch's share of the requests.

With `itl_target_ms` set (and chunked prefill on), a step that holds at least one decoding request also caps its
prefill tokens (running prefill chunks and new admissions together) at the step-time model's budget
(engine/core/step_budget.py), so the decodes' inter-token gap stays near the target. Decode tokens are never
capped; a step without decodes is not capped either. With `ttft_target_ms` too, the cap yields to the chunk that
prefills every queued prompt token within that target.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.step_budget import PrefillBudget, attention_pairs
from engine.core.swap_space import SwapSpace
from engine.outputs import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)


def is_decoding(request: Request) -> bool:
    """Its prompt is computed and only the last sampled token is pending (drafts aside): a decode this step."""
    return (request.num_computed_tokens >= request.num_prompt_tokens
            and request.num_tokens - request.num_computed_tokens == 1)


@dataclass
class _StepBudget:
    """One step's token budgets: `tokens` left for everything, and at most `prefill_cap` (None: uncapped) prefill
    tokens in all."""

    tokens: int
    prefill_cap: int | None
    num_decode_seqs: int = 0
    num_prefill_tokens: int = 0
    prefill_attention_pairs: int = 0

    def limit(self, decode: bool) -> int:
        """The most new tokens the next chunk may take."""
        if decode or self.prefill_cap is None:
            return self.tokens
        return max(0, min(self.tokens, self.prefill_cap - self.num_prefill_tokens))

    def take(self, num_new: int, decode: bool, num_cached: int) -> None:
        self.tokens -= num_new
        if decode:
            self.num_decode_seqs += 1
        else:
            self.num_prefill_tokens += num_new
            self.prefill_attention_pairs += attention_pairs(num_new, num_cached)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, swap_space: SwapSpace | None,
                 prefill_budget: PrefillBudget | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.swap_space = swap_space
        # Asked each step while config.itl_target_ms is set; the engine feeds it step times.
        self.prefill_budget = prefill_budget
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Decode side of P/D: requests whose prompt KV another worker is computing; never scheduled meanwhile.
        self.remote_waiting: dict[str, Request] = {}
        self.num_preemptions = 0
        self._known_to_runner: set[str] = set()
        self._finished_since_last_step: set[str] = set()

    # ---- queue management -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.kv.reserve_prefix(request)  # its host-tier prefix stays until admission (the router counted on it)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self.remote_waiting.pop(request_id, None)
            self._release(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return sum(1 for r in self.waiting if r.status is RequestStatus.SWAPPED)

    # ---- remote prefill (decode side of P/D) ---------------------------------------------------------------
    def admit_remote(self, request: Request, min_uncached_tokens: int) -> bool:
        """Reserve blocks for the whole prompt of a request whose KV another worker computes and writes.

        False (nothing reserved) when fewer than `min_uncached_tokens` prompt tokens miss the prefix cache or the
        pool has no room: the caller then prefills locally.
        """
        hit_blocks, num_hit = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit
        if num_new < min_uncached_tokens or self.kv.allocate_slots(request, num_new, hit_blocks) is None:
            return False
        request.num_computed_tokens = num_hit
        request.num_cached_tokens = num_hit
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.remote_waiting[request.request_id] = request
        return True

    def take_remote_first_token(self, request: Request, first_token: int, sampler_state: bytes = b"") -> bool:
        """The prefill worker's first token, arriving before the prompt's KV: count it as output now, so that it
        streams at once. Declined (False, nothing changed) when the token ends the request: ending it frees blocks
        that the transfer may still be writing, so that case waits for `resume_remote` as before."""
        request.append_output_token(first_token)
        if self._check_stop(request, first_token) is not None:
            request.output_token_ids.pop()
            request.all_token_ids.pop()
            request.stop_reason = None
            return False
        request.remote_sampler_state = sampler_state
        return True

    def resume_remote(self, request: Request, first_token: int, sampler_state: bytes = b"") -> None:
        """The prompt's KV is in the reserved blocks: run on as a decoding request with its first token (and the
        prefill side's generator state, handed to the runner with the request's `NewRequestData`)."""
        del self.remote_waiting[request.request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        request.first_scheduled_time = time.monotonic()
        self.kv.cache_blocks(request)
        if request.num_output_tokens:  # the first token was taken early (a remote request has no other output)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            return
        request.remote_sampler_state = sampler_state
        request.append_output_token(first_token)
        status = self._check_stop(request, first_token)
        if status is not None:
            self._release(request, status)
            return
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def requeue_remote(self, request: Request) -> None:
        """The remote prefill failed: drop the reserved blocks and recompute the prompt here."""
        del self.remote_waiting[request.request_id]
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = -1
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    # ---- one step -----------------------------------------------------------------------------------------
    def schedule(self, in_flight: frozenset[str] = frozenset(), max_seqs: int | None = None) -> SchedulerOutput:
        """The next batch. `in_flight`: ids of requests in batches not yet back (skipped, never preempted);
        `max_seqs`: at most this many requests in the batch (pipeline micro-batches)."""
        step = _StepBudget(self.config.max_num_batched_tokens, self._prefill_cap())
        max_seqs = self.config.max_num_seqs if max_seqs is None else max_seqs
        chunks: list[ScheduledChunk] = []
        new_requests: list[NewRequestData] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted = False

        index = 0
        while index < len(self.running) and step.tokens > 0 and len(chunks) < max_seqs:
            request = self.running[index]
            if request.request_id in in_flight:
                index += 1
                continue
            decode = is_decoding(request)
            limit = step.limit(decode)
            if limit == 0:  # a prefill chunk over the ITL cap: it waits; the decodes after it still run
                index += 1
                continue
            # Draft tokens (speculative decoding) are scheduled after the last token; each counts in the budget.
            num_new = min(request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens, limit)
            while self.kv.allocate_slots(request, num_new) is None:
                if request.spec_token_ids:  # no room for the drafts: drop them before preempting anyone
                    request.spec_token_ids = []
                    num_new = min(request.num_tokens - request.num_computed_tokens, limit)
                    continue
                victim = self._victim(in_flight)
                self._preempt(victim, swap_out)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            step.take(num_new, decode, request.num_computed_tokens)
            chunks.append(self._chunk(request, num_new, new_requests))
            index += 1

        skipped: list[Request] = []
        while (not preempted and self.waiting and step.tokens > 0 and len(self.running) < self.config.max_num_seqs
               and len(chunks) < max_seqs):
            request = self.waiting[0]
            if request.wait_for is not None and not request.wait_for.prefill_done:
                skipped.append(self.waiting.popleft())  # its sibling's prompt blocks are not cached yet
                continue
            decode = is_decoding(request)  # only a swapped-out decode, among waiting requests
            limit = step.limit(decode)
            if limit == 0:  # the ITL cap is spent (before the prefix lookup, which counts a cache query)
                break
            if request.status is RequestStatus.SWAPPED:
                num_new = request.num_tokens - request.num_computed_tokens
                if num_new > limit or not self._swap_in(request, num_new, swap_in):
                    break
            else:
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
                num_new = request.num_tokens - num_hit
                if num_new > limit:
                    if not self.config.enable_chunked_prefill:
                        break
                    num_new = limit
                if self.kv.allocate_slots(request, num_new, hit_blocks) is None:
                    break
                request.num_computed_tokens = num_hit
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
            self.waiting.popleft()
            self.kv.release_prefix(request)  # admitted: its prefix blocks are referenced or being loaded
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            step.take(num_new, decode, request.num_computed_tokens)
            chunks.append(self._chunk(request, num_new, new_requests))
        self.waiting.extendleft(reversed(skipped))

        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        return SchedulerOutput(
            new_requests=new_requests,
            chunks=chunks,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.tokens,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            kv_tier_copies=self.kv.take_tier_copies(),
            finished_request_ids=finished,
            num_decode_seqs=step.num_decode_seqs,
            num_prefill_tokens=step.num_prefill_tokens,
            prefill_attention_pairs=step.prefill_attention_pairs,
            prefill_token_cap=step.prefill_cap,
        )

    def _prefill_cap(self) -> int | None:
        """Prefill tokens this step may carry under `itl_target_ms`; None (uncapped) when it is off, without
        chunked prefill (a prompt could never fit), when no running request decodes, or while the step-time model
        has no budget to give."""
        target_ms = self.config.itl_target_ms
        if target_ms is None or self.prefill_budget is None or not self.config.enable_chunked_prefill:
            return None
        num_decodes = sum(1 for request in self.running if is_decoding(request))
        if not num_decodes:
            return None
        # The chunk the cap will mostly go to: a running prompt's next one, else the next admission's first.
        first = next((r for r in self.running if not is_decoding(r)), self.waiting[0] if self.waiting else None)
        context = first.num_computed_tokens if first is not None else 0
        cap = self.prefill_budget.prefill_token_budget(num_decodes, target_ms / 1000.0, context)
        return self._yield_to_queue(cap, num_decodes, context)

    def _yield_to_queue(self, cap: int | None, num_decodes: int, context: int) -> int | None:
        """`ttft_target_ms`: the cap grows to the chunk predicted to prefill every queued prompt token within the
        target (gaps stretch while a burst of prompts drains, instead of every prompt waiting past its TTFT)."""
        ttft_ms = self.config.ttft_target_ms
        if cap is None or ttft_ms is None or self.prefill_budget is None:
            return cap
        rate = self.queued_prefill_tokens() / (ttft_ms / 1000.0)
        needed = self.prefill_budget.prefill_tokens_for_rate(num_decodes, rate, context,
                                                             self.config.max_num_batched_tokens)
        return max(cap, needed)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting here but not computed yet (a remote prefill's are not this
        engine's work: those requests wait in `remote_waiting`)."""
        return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in (*self.waiting, *self.running))

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply stop rules; returns the requests that changed."""
        updated = []
        for chunk in scheduler_output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.is_finished or request.status is not RequestStatus.RUNNING:
                continue
            tokens = runner_output.tokens_for(chunk.request_id)
            if chunk.spec_token_ids:  # KV stays for the last token and the accepted drafts; the rest rolls back
                request.num_computed_tokens += len(chunk.token_ids) - len(chunk.spec_token_ids) + len(tokens) - 1
            else:
                request.num_computed_tokens += len(chunk.token_ids)
            request.spec_token_ids = []
            for token in tokens:  # stop rules token by token: accepted drafts past a stop are dropped
                request.append_output_token(token)
                status = self._check_stop(request, token)
                if status is not None:
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                    break
            else:
                status = None
            if chunk.spec_token_ids:
                self.kv.trim(request, request.num_tokens)
            self.kv.cache_blocks(request)
            if status is not None:
                self.running.remove(request)
                self._release(request, status)
            updated.append(request)
        return updated

    # ---- helpers ------------------------------------------------------------------------------------------
    def _chunk(self, request: Request, num_new: int, new_requests: list[NewRequestData]) -> ScheduledChunk:
        if request.request_id not in self._known_to_runner:
            self._known_to_runner.add(request.request_id)
            new_requests.append(NewRequestData(request.request_id, request.prompt_token_ids, request.sampling_params,
                                               list(request.output_token_ids), request.remote_sampler_state))
        start = request.num_computed_tokens
        end = start + num_new
        num_spec = max(0, end - request.num_tokens)
        token_ids = request.all_token_ids[start:end]
        if num_spec:
            token_ids += request.spec_token_ids[:num_spec]
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=end >= request.num_tokens,
            prompt_logprobs=request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens,
            spec_token_ids=request.spec_token_ids[:num_spec],
        )

    def _victim(self, in_flight: frozenset[str]) -> Request:
        """The most recently admitted running request that no batch in flight holds (the request being scheduled
        is one, so there always is one)."""
        for index in range(len(self.running) - 1, -1, -1):
            if self.running[index].request_id not in in_flight:
                return self.running.pop(index)
        raise RuntimeError("every running request is in flight: nothing to preempt")

    def _swap_in(self, request: Request, num_new: int, swap_in: list[tuple[int, int]]) -> bool:
        assert self.swap_space is not None  # only swap mode produces SWAPPED requests
        blocks = self.kv.allocate_for_swap_in(request, request.num_computed_tokens + num_new)
        if blocks is None:
            return False
        num_swapped = len(self.swap_space.req_to_cpu_blocks[request.request_id])
        swap_in.extend(self.swap_space.swap_in(request.request_id, [b.block_id for b in blocks[:num_swapped]]))
        return True

    def _preempt(self, victim: Request, swap_out: list[tuple[int, int]]) -> None:
        pairs = None
        if self.config.preemption_mode == "swap" and self.swap_space is not None and victim.num_computed_tokens:
            used = self.kv.blocks_needed(victim.num_computed_tokens)
            pairs = self.swap_space.swap_out(victim.request_id, self.kv.block_ids(victim.request_id)[:used])
        self.kv.free(victim)
        victim.spec_token_ids = []
        if pairs is not None:
            swap_out.extend(pairs)
            victim.status = RequestStatus.SWAPPED
        else:
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        if self.num_preemptions == 1 or self.num_preemptions % 50 == 0:
            mode = "SWAP" if pairs is not None else "RECOMPUTE"
            logger.warning(
                "Request %s is preempted by PreemptionMode.%s mode because there is not enough KV cache space. "
                "This can affect the end-to-end performance. Increase gpu_memory_utilization (or "
                "kv_cache_memory_bytes) to provide more KV cache memory. total_num_cumulative_preemption=%d",
                victim.request_id, mode, self.num_preemptions,
            )

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:  # type: ignore[operator]
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _release(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.release_prefix(request)
        if request.kv_lease_s is not None and status is not RequestStatus.FINISHED_ABORTED:
            self.kv.hold(request, time.monotonic() + request.kv_lease_s)
        else:
            self.kv.free(request)
        if self.swap_space is not None:
            self.swap_space.discard(request.request_id)
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._finished_since_last_step.add(request.request_id)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record once its output was delivered."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            del self.requests[request_id]
