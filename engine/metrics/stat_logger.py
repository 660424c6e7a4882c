"""vLLM's periodic stats line, from the engine's cumulative `EngineStats` snapshots:

    Engine 000: Avg prompt throughput: 1234.5 tokens/s, Avg generation throughput: 456.7 tokens/s, Running: 12 reqs,
    Swapped: 0 reqs, Waiting: 3 reqs, GPU KV cache usage: 41.2%, Prefix cache hit rate: 63.0%, Preemptions: 0

Throughputs and the hit rate are over the interval since the last line; preemptions are counted since start. With
a host KV tier (`--kv-offloading-size`) the hit rate is followed, as vLLM's with a KV connector, by
`External prefix cache hit rate: X%` (tokens loaded back from the host tier, over the interval's lookups).
`observe` is cheap (a clock read) and may be called every step; it logs at most once per interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.metrics.stats import EngineStats

logger = logging.getLogger("kvflow.stats")
LOG_INTERVAL_S = 10.0  # vLLM's


class StatLogger:
    def __init__(self, device_type: str, name: str = "Engine 000", interval_s: float = LOG_INTERVAL_S,
                 log: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.interval_s = interval_s
        self.cache_label = "GPU KV cache usage" if device_type == "cuda" else "CPU KV cache usage"
        self._log = log or logger.info
        self._last_time: float | None = None
        self._last = EngineStats()

    def observe(self, stats: EngineStats, now: float | None = None) -> str | None:
        """Log (and return) the line if an interval has passed since the last one."""
        now = time.monotonic() if now is None else now
        if self._last_time is None:
            self._last_time, self._last = now, _copy(stats)
            return None
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        last = self._last
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        external_queries = stats.external_prefix_cache_queries - last.external_prefix_cache_queries
        external_hits = stats.external_prefix_cache_hits - last.external_prefix_cache_hits
        external = (f", External prefix cache hit rate: {external_hits / external_queries:.1%}"
                    if external_queries else "")
        line = (f"{self.name}: Avg prompt throughput: {(stats.prompt_tokens - last.prompt_tokens) / elapsed:.1f} "
                f"tokens/s, Avg generation throughput: "
                f"{(stats.generation_tokens - last.generation_tokens) / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_requests_running} reqs, Swapped: {stats.num_requests_swapped} reqs, "
                f"Waiting: {stats.num_requests_waiting} reqs, {self.cache_label}: {stats.kv_cache_usage:.1%}, "
                f"Prefix cache hit rate: {hits / queries if queries else 0.0:.1%}{external}, "
                f"Preemptions: {stats.num_preemptions}")
        self._last_time, self._last = now, _copy(stats)
        self._log(line)
        drafts = stats.spec_decode_num_drafts - last.spec_decode_num_drafts
        if drafts > 0:  # vLLM's SpecDecoding line, over the same interval
            accepted = stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens
            drafted = stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens
            before = last.spec_decode_num_accepted_tokens_per_pos
            rates = [(n - (before[i] if i < len(before) else 0)) / drafts
                     for i, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)]
            self._log(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted: "
                      f"{accepted} tokens, Drafted: {drafted} tokens, Draft acceptance rate: "
                      f"{accepted / drafted if drafted else 0.0:.1%}, Per-position acceptance rate: "
                      f"{', '.join(f'{r:.3f}' for r in rates)}")
        return line


def _copy(stats: EngineStats) -> EngineStats:
    return EngineStats(**{**stats.__dict__, "request_success": dict(stats.request_success),
                          "spec_decode_num_accepted_tokens_per_pos": list(stats.spec_decode_num_accepted_tokens_per_pos)})
