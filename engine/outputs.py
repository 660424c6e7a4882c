"""Typed seams: scheduler -> runner (`SchedulerOutput`), runner -> scheduler (`ModelRunnerOutput`), and the
public per-request results (`RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Sent to the runner once, the first time a request is scheduled (or after it was dropped)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Tokens sampled before the runner saw the request (a remote prefill's first token): penalties count them.
    output_token_ids: list[int] = field(default_factory=list)
    generator_state: bytes = b""  # seeded requests resumed from elsewhere: continue that generator exactly


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one request fed to the model this step."""

    request_id: str
    token_ids: list[int]  # all_token_ids[start_position : start_position + len(token_ids)]
    start_position: int  # tokens whose KV is already in the cache
    block_ids: list[int]  # the request's whole block table
    sample: bool  # this chunk reaches the last known token: sample the next one
    prompt_logprobs: bool  # return logprobs of these prompt positions
    spec_token_ids: list[int] = field(default_factory=list)  # the draft tokens at the chunk's end: verify them


# One host KV tier copy (--kv-offloading-size): (to_host, source, destination), device block ids and host slots.
TierCopy = tuple[bool, int, int]


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    chunks: list[ScheduledChunk]
    total_num_scheduled_tokens: int
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    # Host KV tier (--kv-offloading-size): (to_host, source, destination) copies, run in this order before the
    # step's forward (engine/core/block_pool.py).
    kv_tier_copies: list[TierCopy] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)  # runner may drop their state
    # The step's make-up, for the step-time model of --itl-target-ms (engine/core/step_budget.py).
    num_decode_seqs: int = 0
    num_prefill_tokens: int = 0  # tokens of chunks that are not decodes (prompt, or recompute after preemption)
    prefill_attention_pairs: int = 0  # (query, key) pairs those chunks attend (engine/core/step_budget.py)
    prefill_token_cap: int | None = None  # the --itl-target-ms cap this step ran under (None: uncapped)


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# Per position: the sampled/actual token's logprob plus the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]  # request id -> next token (only chunks with sample=True)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
    # Verified chunks: every token the step produced (accepted drafts + one), their logprobs; sampled_token_ids
    # holds the last of them.
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)

    def tokens_for(self, request_id: str) -> list[int]:
        accepted = self.accepted_token_ids.get(request_id)
        if accepted is not None:
            return accepted
        token = self.sampled_token_ids.get(request_id)
        return [] if token is None else [token]

    def logprobs_for(self, request_id: str) -> list[PositionLogprobs] | None:
        if request_id in self.spec_logprobs:
            return self.spec_logprobs[request_id]
        entry = self.logprobs.get(request_id)
        return None if entry is None else [entry]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
