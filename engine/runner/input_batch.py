"""What the runner keeps per request between steps, and how a step's scheduled chunks become the model's input
rows.

Invariants:
- A request's state arrives once (`NewRequestData`) and then only grows by the tokens the runner itself samples
  or verifies; each step sends only token ids, positions and block tables.
- A token at position p of a chunk with block table T is written to KV slot T[p // block_size] * block_size +
  p % block_size, and its row sees a context of p + 1 tokens.
- `StepRows` keeps the chunks' order, except that decode rows may go first (the Triton backend runs them as one
  decode-kernel group); `DecodeRows` keeps it exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.outputs import NewRequestData, ScheduledChunk
from engine.runner.attention import AttentionBatch
from engine.sampling_params import SamplingParams
from engine.structured.grammar import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class RunnerRequestState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    matcher: Any = None  # xgrammar GrammarMatcher of a structured-output request

    @classmethod
    def from_new(cls, new: NewRequestData, device: torch.device,
                 structured_output: StructuredOutputManager | None, leader: bool = True) -> RunnerRequestState:
        """A request's state when first scheduled (or resumed): its seeded generator, restored to the state the
        request carries, and its grammar matcher, advanced past the tokens it already has. A tensor-parallel rank
        other than rank 0 (`leader` False) builds no matcher: its samples are never used."""
        matcher = _matcher(new, structured_output) if leader else None
        return cls(new.sampling_params, new.prompt_token_ids, list(new.output_token_ids),
                   _generator(new, device), matcher)

    def record(self, token: int) -> None:
        self.output_token_ids.append(token)
        if self.matcher is not None:
            self.matcher.accept_token(token)

    @property
    def greedy_argmax(self) -> bool:
        """Its next token is the argmax of its logits, grammar-masked if it has a grammar: nothing on the host
        (penalties' history, logprobs) stands between one step's logits and the next step's input."""
        params = self.params
        return (params.is_greedy and not params.needs_penalties and not params.logit_bias and not params.masks_tokens
                and params.logprobs is None)

    @property
    def constrained(self) -> bool:
        """It has a grammar (on every rank, though only rank 0 holds its matcher)."""
        return self.params.structured_outputs is not None

    @property
    def plain_greedy(self) -> bool:
        """Its next token is the raw logits' argmax (what a decode graph computes itself). Decided from the
        params alone, so every tensor-parallel rank takes the same path, the ones without matchers included."""
        return self.greedy_argmax and not self.constrained


def _generator(new: NewRequestData, device: torch.device) -> torch.Generator | None:
    seed = new.sampling_params.seed
    if seed is None:
        return None
    generator = torch.Generator(device=device).manual_seed(seed)
    if new.generator_state:
        try:
            generator.set_state(torch.frombuffer(bytearray(new.generator_state), dtype=torch.uint8))
        except RuntimeError as exc:  # another device type produced it: the seeded stream restarts
            logger.warning("request %s: cannot restore the sampler state (%s)", new.request_id, exc)
    return generator


def _matcher(new: NewRequestData, structured_output: StructuredOutputManager | None) -> Any:
    guided = new.sampling_params.structured_outputs
    if guided is None:
        return None
    if structured_output is None:
        raise RuntimeError("a structured-output request reached a runner without a StructuredOutputManager")
    return structured_output.new_matcher(guided, new.output_token_ids)


@dataclass(frozen=True)
class StepRows:
    """A step's chunks as the rows of one eager forward: every new token is a row, each chunk's rows together."""

    input_ids: list[int]
    positions: list[int]
    attention: AttentionBatch
    sample_rows: list[int]  # the last row of each sampling chunk without drafts
    sample_ids: list[str]
    prompt_logprob_spans: list[tuple[str, int, int, int]]  # (request, first row, num rows, start position)
    spec_spans: list[tuple[str, int, list[int]]]  # (request, first verify row, drafts): the last k + 1 rows


def step_rows(chunks: list[ScheduledChunk], block_size: int, decode_first: bool) -> StepRows:
    if decode_first:
        chunks = sorted(chunks, key=lambda c: len(c.token_ids) != 1)
    bs = block_size
    input_ids, positions, slots = [], [], []
    query_lens, seq_lens, block_tables = [], [], []
    sample_rows: list[int] = []
    sample_ids: list[str] = []
    prompt_logprob_spans: list[tuple[str, int, int, int]] = []
    spec_spans: list[tuple[str, int, list[int]]] = []
    row = 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        start = chunk.start_position
        input_ids.extend(chunk.token_ids)
        if n == 1:
            positions.append(start)
            slots.append(chunk.block_ids[start // bs] * bs + start % bs)
        else:
            pos = np.arange(start, start + n)
            table = np.asarray(chunk.block_ids, dtype=np.int64)
            positions.extend(pos.tolist())
            slots.extend((table[pos // bs] * bs + pos % bs).tolist())
        query_lens.append(n)
        seq_lens.append(start + n)
        block_tables.append(chunk.block_ids)
        if chunk.prompt_logprobs:
            prompt_logprob_spans.append((chunk.request_id, row, n, start))
        if chunk.sample and chunk.spec_token_ids:
            spec_spans.append((chunk.request_id, row + n - 1 - len(chunk.spec_token_ids), chunk.spec_token_ids))
        elif chunk.sample:
            sample_rows.append(row + n - 1)
            sample_ids.append(chunk.request_id)
        row += n
    return StepRows(input_ids, positions, AttentionBatch(query_lens, seq_lens, block_tables, slots), sample_rows,
                    sample_ids, prompt_logprob_spans, spec_spans)


@dataclass
class DecodeRows:
    """A step's chunks laid out as one query row per token, each attending to its own prefix of its sequence (the
    decode kernel's shape): how a speculative verify step replays a decode CUDA graph. Row r of a chunk starting at
    position p is position p + r with context p + r + 1; the KV-write kernel stores every row's K/V before the
    attention kernel reads, so row r sees rows 0..r-1 of this step exactly as the extend path would."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    spec_spans: list[tuple[str, int, list[int]]]  # (request, first verify row, drafts)
    sample_rows: list[int]  # chunks without drafts: their last row samples
    sample_ids: list[str]


def expand_to_decode_rows(chunks: list[ScheduledChunk], block_size: int) -> DecodeRows:
    rows = DecodeRows([], [], [], [], [], [], [], [])
    for chunk in chunks:
        first = len(rows.positions)
        n = len(chunk.token_ids)
        for offset in range(n):
            pos = chunk.start_position + offset
            rows.positions.append(pos)
            rows.slots.append(chunk.block_ids[pos // block_size] * block_size + pos % block_size)
            rows.seq_lens.append(pos + 1)
            rows.block_tables.append(chunk.block_ids)
        rows.input_ids.extend(chunk.token_ids)
        if chunk.spec_token_ids:
            rows.spec_spans.append((chunk.request_id, first + n - 1 - len(chunk.spec_token_ids), chunk.spec_token_ids))
        else:
            rows.sample_rows.append(first + n - 1)
            rows.sample_ids.append(chunk.request_id)
    return rows
