"""The decode side of prefill/decode disaggregation in the engine: a request whose prompt KV a prefill worker
computes and a KV transport writes into blocks reserved here.

Invariants:
- Only single-sample requests without prompt_logprobs prefill remotely; the others always prefill locally.
- Blocks for the whole prompt are reserved at admission; the request waits (WAITING_FOR_REMOTE_KV), never
  scheduled, until its KV has been written (`finish`) or the transfer failed (`fail`: the prompt is recomputed
  here, and the first token too if it was taken early).
- A refused admission (too few uncached tokens, no room) leaves nothing enqueued: the caller prefills locally.
- A first token delivered before its KV (`take_first_token`) stays delivered whatever the transfer does; one that
  would end the request, or a request with stop strings, waits for the KV (either ends it, which must wait until
  no transfer writes into its blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.errors import InvalidRequest
from engine.outputs import PositionLogprobs
from engine.processing.output_processor import OutputProcessor, RequestState
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RemoteSlot:
    """Blocks reserved on the decode side for a prompt whose KV comes from a prefill worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # after generation-config defaults: what the prefill worker must sample with
    block_ids: list[int]  # the whole prompt's block table
    num_cached_blocks: int  # leading blocks already in this worker's prefix cache: not transferred


def check_remote_params(params: SamplingParams) -> None:
    if params.n != 1 or params.prompt_logprobs is not None:
        raise InvalidRequest("remote prefill serves single-sample requests without prompt_logprobs")


class RemotePrefill:
    def __init__(self, scheduler: Scheduler, kv_manager: KVCacheManager, outputs: OutputProcessor,
                 block_size: int) -> None:
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.outputs = outputs
        self.block_size = block_size

    def admit(self, state: RequestState, min_uncached_tokens: int) -> RemoteSlot | None:
        """Reserve blocks for the whole prompt of a checked request; None (and the request dropped) when the
        prompt has fewer than `min_uncached_tokens` uncached tokens or the pool has no room."""
        request = state.samples[0].request
        if not self.scheduler.admit_remote(request, min_uncached_tokens):
            self.outputs.discard(state)
            return None
        num_cached_blocks = request.num_computed_tokens // self.block_size
        return RemoteSlot(state.request_id, list(request.prompt_token_ids), request.sampling_params,
                          self.kv_manager.block_ids(request.request_id), num_cached_blocks)

    def finish(self, request_id: str, first_token: int, logprobs: PositionLogprobs | None,
               sampler_state: bytes) -> None:
        """The prompt's KV was written into the reserved blocks: decode on from the remotely sampled token, with
        the prefill side's seeded generator state after it (both reach the runner through `NewRequestData`)."""
        state = self.outputs.states.get(request_id)
        if state is None:
            return  # aborted meanwhile
        sample = state.samples[0]
        taken_early = sample.request.num_output_tokens > 0
        self.scheduler.resume_remote(sample.request, first_token, sampler_state)
        if taken_early:
            return  # absorbed and delivered by `take_first_token`
        self.outputs.absorb(state, sample, None if logprobs is None else [logprobs], None)
        if state.finished:
            self.outputs.pending.append(self.outputs.finish(state))
        elif state.output_kind != "final":
            self.outputs.pending.append(self.outputs.output(state, finished=False))

    def take_first_token(self, request_id: str, first_token: int, logprobs: PositionLogprobs | None,
                         sampler_state: bytes) -> bool:
        """Deliver the first token while its KV is still on the way (TTFT is then the prefill worker's, not
        prefill + transfer); False when declined, and `finish` takes the token then."""
        state = self.outputs.states.get(request_id)
        if state is None:
            return False
        sample = state.samples[0]
        request = sample.request
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KV or request.num_output_tokens \
                or request.sampling_params.stop:
            return False
        if not self.scheduler.take_remote_first_token(request, first_token, sampler_state):
            return False
        self.outputs.absorb(state, sample, None if logprobs is None else [logprobs], None)
        if state.output_kind != "final":
            self.outputs.pending.append(self.outputs.output(state, finished=False))
        return True

    def fail(self, request_id: str) -> None:
        """The prefill worker failed: recompute the prompt here (its reserved blocks are dropped)."""
        state = self.outputs.states.get(request_id)
        if state is not None and state.samples[0].request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            self.scheduler.requeue_remote(state.samples[0].request)
