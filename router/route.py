"""Where one request goes: the decode worker, the worker that prefills its prompt (itself, another, or a holder
of more of its cached blocks), and what the index predicted that worker holds."""

from __future__ import annotations

from dataclasses import dataclass

from router.workers import Worker


@dataclass(frozen=True)
class Route:
    decode: Worker
    prefill: Worker | None  # None: the decode worker prefills the prompt itself
    matched_blocks: int  # cached on the worker that prefills (either tier)
    num_prompt_tokens: int
    block_size: int
    host_blocks: int = 0  # of those, in its host tier (loaded back, not recomputed)
    fetch: bool = False  # `prefill` holds more of the prompt than the planned prefiller: its cached blocks are pulled

    @property
    def predicted_cached_tokens(self) -> int:
        """Prompt tokens the index says the prefilling worker will not compute (never the last one, which an
        engine always computes for its logits)."""
        last_full = (self.num_prompt_tokens - 1) // self.block_size * self.block_size
        return min(self.matched_blocks * self.block_size, last_full)

    @property
    def uncached_tokens(self) -> int:
        return uncached_tokens(self.num_prompt_tokens, self.matched_blocks, self.block_size)

    @property
    def prefills_on(self) -> Worker:
        return self.prefill if self.prefill is not None else self.decode


def uncached_tokens(num_prompt_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Prompt tokens past the matched (cached) blocks."""
    return max(num_prompt_tokens - matched_blocks * block_size, 0)
