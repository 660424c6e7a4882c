"""Decode-ahead (CUDA graphs, every decode batch: greedy, sampled and grammar-constrained rows alike): after a
decode step the runner queues the replay of the step it expects next (same requests, each one position further,
fed this step's ids on the device: the argmax, the grammar-masked argmax or the sampled token) before it waits for
this step's ids. The GPU then runs step n+1 while the host finishes step n and schedules n+1, as vLLM V1's async
scheduling overlaps them. The replay computes logits only; step n+1's sampling runs when that step is taken, after
the host has recorded step n's tokens (penalties, grammars and seeded generators see them in order).

Invariants:
- At most one replay is queued, and the next step takes it only if the scheduler asks for those rows: the same
  requests in the same order with the predicted positions, tokens and KV slots, or a subsequence of them (rows
  whose request finished, by a stop token or string, are left out; each row's logits depend on its own context
  only). Otherwise it is dropped.
- A dropped replay, or a left-out row, only wrote K/V at a slot its request owned when it was queued, one past its
  context, which the real next write of that slot replaces (stream order). A KV import writes on its transfer
  stream instead, unordered with the replay. A freed block joins the tail of the free queue
  (engine/core/block_pool.py) and is handed out again only after every other free block, so an import reaches a
  slot a replay in flight writes only if the free queue runs dry within one step (not guarded further).
- Nothing is queued for a row that may finish at the next step (max_tokens, max_model_len) or whose next KV slot
  is not in a block it already holds (the scheduler allocates first: nothing to guess).
- Under tensor parallelism every rank queues and takes the same replays, or the ranks' collectives would no longer
  pair: the ranks sample alike (same logits, seeds and generators), except a grammar-constrained row, whose
  matcher only rank 0 holds; so a batch with such a row queues nothing there.
- Each miss costs a step of GPU time, so a score (the share of recent replays that were used) gates queueing:
  below AHEAD_MIN_SCORE nothing is queued and the score creeps back by AHEAD_RECOVERY per eligible step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.outputs import ScheduledChunk
from engine.runner.cuda_graphs import DecodeGraphs, DecodeResult
from engine.runner.input_batch import RunnerRequestState

AHEAD_MIN_SCORE = 0.3  # two misses in a row from a clean record stop decode-ahead ...
AHEAD_RECOVERY = 0.02  # ... for about 10 eligible steps


@dataclass
class AheadStep:
    """A decode replay queued before the scheduler asked for it, and the step it assumed."""

    request_ids: list[str]
    positions: list[int]
    slot_blocks: list[int]  # the block holding each row's new KV
    result: DecodeResult
    tokens: list[int] = field(default_factory=list)  # the fed ids, known on the host once the step before returns

    def rows_for(self, chunks: list[ScheduledChunk], block_size: int) -> list[int] | None:
        """The replay's rows that are this step's chunks, in order, if every chunk is one of them (the rows of
        requests that finished in between may be missing); None if any chunk is not."""
        rows: list[int] = []
        row = 0
        for chunk in chunks:
            while row < len(self.request_ids) and self.request_ids[row] != chunk.request_id:
                row += 1
            if row == len(self.request_ids):
                return None
            pos = self.positions[row]
            if (chunk.start_position != pos or chunk.token_ids[0] != self.tokens[row]
                    or chunk.block_ids[pos // block_size] != self.slot_blocks[row]):
                return None
            rows.append(row)
            row += 1
        return rows


class DecodeAhead:
    """The replay queued ahead (if any) and the record of how often one was used."""

    def __init__(self, block_size: int, max_model_len: int, tensor_parallel: bool = False) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.tensor_parallel = tensor_parallel
        self.pending: AheadStep | None = None
        self.score = 1.0
        self.hits = 0
        self.partial_hits = 0  # hits that left out the rows of requests that finished
        self.misses = 0

    def take(self, chunks: list[ScheduledChunk]) -> DecodeResult | None:
        """The queued replay's result for exactly this step's rows (see `AheadStep.rows_for`); otherwise None (a
        miss, if one was queued). Either way nothing stays queued."""
        ahead, self.pending = self.pending, None
        if ahead is None:
            return None
        rows = ahead.rows_for(chunks, self.block_size)
        if rows is None or not rows:
            self._count_miss()
            return None
        self.hits += 1
        self.score = min(1.0, 0.9 * self.score + 0.1)
        if len(rows) == len(ahead.request_ids):
            return ahead.result
        self.partial_hits += 1
        return select_rows(ahead.result, rows)

    def queue(self, chunks: list[ScheduledChunk], positions: list[int], states: list[RunnerRequestState],
              tokens: torch.Tensor, graphs: DecodeGraphs) -> None:
        """Replay the step after this one now, fed `tokens` (this step's ids, on the device), if every row will
        still be running and its next KV slot is in a block it already holds."""
        if self.tensor_parallel and any(state.constrained for state in states):
            return  # only rank 0 holds the grammar: the other ranks' ids for that row may differ
        if self.score < AHEAD_MIN_SCORE:
            self.score += AHEAD_RECOVERY
            return
        bs = self.block_size
        nxt = [p + 1 for p in positions]
        for chunk, state, p in zip(chunks, states, nxt, strict=True):
            max_tokens = state.params.max_tokens
            if (p // bs >= len(chunk.block_ids) or p + 1 >= self.max_model_len
                    or (max_tokens is not None and len(state.output_token_ids) + 1 >= max_tokens)):
                return
        if not graphs.can_run(len(nxt), max(nxt) + 1):
            return
        slot_blocks = [chunk.block_ids[p // bs] for chunk, p in zip(chunks, nxt, strict=True)]
        slots = [blk * bs + p % bs for blk, p in zip(slot_blocks, nxt, strict=True)]
        result = graphs.run_ahead(tokens, nxt, slots, [p + 1 for p in nxt], [chunk.block_ids for chunk in chunks])
        self.pending = AheadStep([chunk.request_id for chunk in chunks], nxt, slot_blocks, result)

    def fed(self, tokens: list[int]) -> None:
        """The queued replay's input ids, now known on the host (what `take` compares with the next step)."""
        if self.pending is not None:
            self.pending.tokens = tokens

    def drop(self) -> None:
        """The next step is not a graph decode step: a queued replay is a miss."""
        if self.pending is not None:
            self.pending = None
            self._count_miss()

    def clear(self) -> None:
        """Forget a queued replay without counting it (the graphs are being released)."""
        self.pending = None

    def _count_miss(self) -> None:
        self.misses += 1
        self.score *= 0.5


def select_rows(result: DecodeResult, rows: list[int]) -> DecodeResult:
    """Some rows of a replay's outputs (copies: a later replay overwrites the static buffers), in order."""
    device = result.logits.device
    index = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":  # no stream sync: the replay may still be running
        index = index.pin_memory().to(device, non_blocking=True)
    return DecodeResult(result.logits.index_select(0, index), result.tokens.index_select(0, index))
