"""Engine-side state of one sequence being generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # KV dropped; recomputed when readmitted
    SWAPPED = "swapped"  # KV copied to CPU swap space; swapped back in when readmitted
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved; a prefill worker is computing the prompt
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    # Parallel samples (n > 1) wait for their first sibling's prefill, then hit its cached prompt blocks.
    wait_for: Request | None = None
    extra_keys: tuple[str, ...] = ()
    # Prefill side of P/D: once finished, keep the blocks this many seconds (or until released) so the KV can
    # be shipped; None frees them at once.
    kv_lease_s: float | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    block_hashes: list[bytes] = field(default_factory=list)
    host_reserved: list[int] = field(default_factory=list)  # host-tier slots of its prefix kept while it waits
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # Decode side of P/D: the prefill worker's seeded-generator state after the first token (handed to the runner).
    remote_sampler_state: bytes = b""
    # Speculative decoding: draft tokens proposed for the next step (verified there; never part of all_token_ids).
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens or self.is_finished

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 1 << 30

    def resume_from(self, output_token_ids: list[int]) -> None:
        """Continue a request another engine started: these tokens were generated (and delivered) already; they
        count as output and are prefilled here with the prompt."""
        self.output_token_ids = list(output_token_ids)
        self.all_token_ids = [*self.prompt_token_ids, *output_token_ids]

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past `num_output_tokens` (accepted speculative tokens after a stop)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
