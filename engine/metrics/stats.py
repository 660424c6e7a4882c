"""Engine counters and per-request timestamps; exporters (Prometheus, logs) read these off the hot loop."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.metrics.buckets import MOE_EXPERT_TOKENS_BUCKETS
from engine.outputs import ModelRunnerOutput, SchedulerOutput


@dataclass
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0  # preempted to CPU swap space (counted in waiting too)
    kv_cache_usage: float = 0.0
    num_gpu_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    # Host KV tier (--kv-offloading-size), as vLLM counts its connector's: tokens looked up, tokens loaded back.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offloaded_blocks: int = 0  # blocks copied to the host tier
    kv_host_dropped_blocks: int = 0  # blocks a full host tier let go (its LRU end, or every slot held)
    kv_host_cache_usage: float = 0.0  # 0..1 of the host tier's blocks in use
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    generation_tokens: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    num_steps: int = 0
    itl_prefill_token_budget: int = 0  # --itl-target-ms: the last step's prefill token cap (0: uncapped or off)
    # Speculative decoding, as vLLM counts it: one draft per verified chunk; accepted excludes the bonus token.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # MoE expert load: one observation per (sparse layer, expert) per step, the tokens routed to it, kept as a
    # cumulative histogram over MOE_EXPERT_TOKENS_BUCKETS (the last entry is +Inf); empty for dense models
    moe_expert_tokens_buckets: list[int] = field(default_factory=list)
    moe_expert_tokens_sum: int = 0

    def count_spec(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for chunk in scheduler_output.chunks:
            accepted = runner_output.accepted_token_ids.get(chunk.request_id)
            if not chunk.spec_token_ids or accepted is None:
                continue
            num_accepted = len(accepted) - 1
            self.spec_decode_num_drafts += 1
            self.spec_decode_num_draft_tokens += len(chunk.spec_token_ids)
            self.spec_decode_num_accepted_tokens += num_accepted
            per_pos = self.spec_decode_num_accepted_tokens_per_pos
            if len(per_pos) < len(chunk.spec_token_ids):
                per_pos.extend([0] * (len(chunk.spec_token_ids) - len(per_pos)))
            for position in range(num_accepted):
                per_pos[position] += 1

    def count_expert_load(self, load: np.ndarray) -> None:
        """Observe one step's tokens per expert ([sparse layer, expert] counts) into the histogram."""
        if not self.moe_expert_tokens_buckets:
            self.moe_expert_tokens_buckets = [0] * (len(MOE_EXPERT_TOKENS_BUCKETS) + 1)
        # bucket i counts values <= its bound (Prometheus' `le`); values past the last bound fall into +Inf
        per_bucket = np.bincount(np.searchsorted(MOE_EXPERT_TOKENS_BUCKETS, load.ravel(), side="left"),
                                 minlength=len(MOE_EXPERT_TOKENS_BUCKETS) + 1)
        running = np.cumsum(per_bucket)
        self.moe_expert_tokens_buckets = [a + int(b) for a, b in zip(self.moe_expert_tokens_buckets, running,
                                                                     strict=True)]
        self.moe_expert_tokens_sum += int(load.sum())

    @property
    def spec_decode_mean_acceptance_length(self) -> float | None:
        """vLLM's: 1 + accepted tokens per draft (tokens emitted per verify step)."""
        if not self.spec_decode_num_drafts:
            return None
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts


@dataclass(frozen=True)
class FinishedRequestTiming:
    """Monotonic-clock intervals of one finished request, for latency histograms."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    queue_s: float
    ttft_s: float | None
    e2e_s: float
    mean_tpot_s: float | None
