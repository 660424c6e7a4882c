"""Rank 0 -> other ranks: each step's `SchedulerOutput` as bytes, by an explicit JSON codec (no pickle).

Every field is written by name and read back into the same typed dataclasses, so a field added to
`SchedulerOutput`, `ScheduledChunk`, `NewRequestData` or `SamplingParams` without a codec entry fails loudly
(`encode` checks the field sets) instead of silently going missing on the other ranks.

Block tables travel as deltas between a `StepEncoder` (rank 0) and a `StepDecoder` (each other rank): a chunk's
table is sent as (how many leading blocks equal the table last sent for that request, the rest). A decode step
carries every running request's whole table, which grows by one block every block-size tokens, so sent whole it
was most of the frame: 74 KB for 288 rows of ~40 blocks, 15 KB as deltas, and its encode + decode 2.4 + 2.5 ms on
the 2-core CI box against 0.4 + 0.8 ms. On 2 x H200, TP2's offline throughput rose from 0.50x to 0.58x of two
replicas with it (bench/results/tp_tput8b_h200.json).

Invariants of the pair: the decoder sees every frame the encoder made, in order (the ranks' stdin pipes), and both
forget a request when a frame lists it as finished, before its chunks are read (a reused id starts afresh). The
module functions `encode` / `decode` are the stateless pair (whole tables).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from engine.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.structured.grammar import StructuredOutputsParams

_SO_FIELDS = {"new_requests", "chunks", "total_num_scheduled_tokens", "blocks_to_swap_out", "blocks_to_swap_in",
              "kv_tier_copies", "finished_request_ids", "num_decode_seqs", "num_prefill_tokens", "prefill_attention_pairs",
              "prefill_token_cap"}
_CHUNK_FIELDS = ("request_id", "token_ids", "start_position", "block_ids", "sample", "prompt_logprobs",
                 "spec_token_ids")  # StepEncoder._chunk writes them in this order, block_ids as (keep, tail)
_NEW_FIELDS = {"request_id", "prompt_token_ids", "sampling_params", "output_token_ids", "generator_state"}
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "_explicit")


def _check(cls: type, expected: set[str]) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    if names != expected:
        raise TypeError(f"engine/parallel/codec.py does not know {cls.__name__} fields {sorted(names ^ expected)}")


_check(SchedulerOutput, _SO_FIELDS)
_check(ScheduledChunk, set(_CHUNK_FIELDS))
_check(NewRequestData, _NEW_FIELDS)


def _params_to_json(params: SamplingParams) -> dict[str, Any]:
    out = {name: getattr(params, name) for name in _PARAM_FIELDS}
    if params.logit_bias:
        out["logit_bias"] = [[int(k), float(v)] for k, v in params.logit_bias.items()]
    if params.structured_outputs is not None:  # a dataclass of JSON values (the schema itself is JSON)
        out["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    out["_explicit"] = sorted(params._explicit)
    return out


def _params_from_json(raw: dict[str, Any]) -> SamplingParams:
    params = SamplingParams.__new__(SamplingParams)  # as sent: already validated and defaulted on rank 0
    for name in _PARAM_FIELDS:
        setattr(params, name, raw[name])
    if raw["logit_bias"]:
        params.logit_bias = {int(k): float(v) for k, v in raw["logit_bias"]}
    if raw["structured_outputs"] is not None:
        params.structured_outputs = StructuredOutputsParams(**raw["structured_outputs"])
    params._explicit = frozenset(raw["_explicit"])
    return params


class StepEncoder:
    """Rank 0's side: remembers the block table last sent for each request (see the module docstring)."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def encode(self, so: SchedulerOutput) -> bytes:
        for request_id in so.finished_request_ids:
            self._tables.pop(request_id, None)
        doc = {
            "new": [[n.request_id, n.prompt_token_ids, _params_to_json(n.sampling_params), n.output_token_ids,
                     n.generator_state.hex()] for n in so.new_requests],
            "chunks": [self._chunk(c) for c in so.chunks],
            "total": so.total_num_scheduled_tokens,
            "swap_out": so.blocks_to_swap_out,
            "swap_in": so.blocks_to_swap_in,
            "tier": so.kv_tier_copies,
            "finished": sorted(so.finished_request_ids),
            "mix": [so.num_decode_seqs, so.num_prefill_tokens, so.prefill_attention_pairs, so.prefill_token_cap],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    def _chunk(self, chunk: ScheduledChunk) -> list[Any]:
        table = chunk.block_ids
        known = self._tables.get(chunk.request_id)
        keep = len(known) if known is not None and table[: len(known)] == known else 0
        if keep != len(table) or known is None:  # kept as a copy: the scheduler's list grows in place
            self._tables[chunk.request_id] = list(table)
        return [chunk.request_id, chunk.token_ids, chunk.start_position, keep, table[keep:], chunk.sample,
                chunk.prompt_logprobs, chunk.spec_token_ids]


class StepDecoder:
    """Another rank's side: rebuilds each chunk's whole block table from the delta and the table it last had."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def decode(self, data: bytes) -> SchedulerOutput:
        doc = json.loads(data)
        finished = set(doc["finished"])
        for request_id in finished:
            self._tables.pop(request_id, None)
        return SchedulerOutput(
            new_requests=[NewRequestData(rid, list(prompt), _params_from_json(params), list(out),
                                         bytes.fromhex(state)) for rid, prompt, params, out, state in doc["new"]],
            chunks=[self._chunk(row) for row in doc["chunks"]],
            total_num_scheduled_tokens=int(doc["total"]),
            blocks_to_swap_out=[(int(a), int(b)) for a, b in doc["swap_out"]],
            blocks_to_swap_in=[(int(a), int(b)) for a, b in doc["swap_in"]],
            kv_tier_copies=[(bool(d), int(a), int(b)) for d, a, b in doc["tier"]],
            finished_request_ids=finished,
            num_decode_seqs=int(doc["mix"][0]),
            num_prefill_tokens=int(doc["mix"][1]),
            prefill_attention_pairs=int(doc["mix"][2]),
            prefill_token_cap=doc["mix"][3],
        )

    def _chunk(self, row: list[Any]) -> ScheduledChunk:
        request_id, token_ids, start, keep, tail, sample, prompt_logprobs, spec = row
        known = self._tables.get(request_id, [])
        if keep > len(known):
            raise ValueError(f"step frame out of order: request {request_id!r} keeps {keep} blocks of "
                             f"{len(known)} known")
        if keep != len(known) or tail:  # most decode steps change no table: nothing to rebuild
            known = known[:keep] + tail
            self._tables[request_id] = known
        return ScheduledChunk(request_id, token_ids, start, list(known), sample, prompt_logprobs, spec)


def encode(so: SchedulerOutput) -> bytes:
    """A self-contained frame (whole block tables): `decode` reads it without any earlier frame."""
    return StepEncoder().encode(so)


def decode(data: bytes) -> SchedulerOutput:
    return StepDecoder().decode(data)
