"""What a host-tier hit saves, measured: loading a block back costs this fraction of recomputing it.

Invariants:
- Recompute cost is the engine's own prefill time per token, from steps that only prefilled (no decodes, no KV
  copies), so it is the rate a routed prompt would see; the load cost is the runner's measured copy time per block.
- 0.0 means not measured yet (the router then uses its configured default); a measured value is kept in (0, 1]:
  a load slower than recomputing is reported as 1, no better than a miss.
"""

from __future__ import annotations

EMA_WEIGHT = 0.2


class ReloadCost:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prefill_seconds_per_token = 0.0  # 0: not measured yet

    def observe_prefill(self, num_prefill_tokens: int, seconds: float) -> None:
        """A step that only prefilled `num_prefill_tokens` tokens (at least a block's worth) in `seconds`."""
        if num_prefill_tokens < self.block_size or seconds <= 0:
            return
        rate = seconds / num_prefill_tokens
        before = self.prefill_seconds_per_token
        self.prefill_seconds_per_token = rate if not before else (1 - EMA_WEIGHT) * before + EMA_WEIGHT * rate

    def fraction(self, copy_seconds_per_block: float) -> float:
        """A block's load time over its recompute time, in (0, 1]; 0.0 while either is unknown."""
        if copy_seconds_per_block <= 0 or self.prefill_seconds_per_token <= 0:
            return 0.0
        return min(1.0, max(1e-3, copy_seconds_per_block / (self.prefill_seconds_per_token * self.block_size)))
