"""Engine counters and per-request timestamps; exporters (Prometheus, logs) read these off the hot loop."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0  # preempted to CPU swap space (counted in waiting too)
    kv_cache_usage: float = 0.0
    num_gpu_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    generation_tokens: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    num_steps: int = 0


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
