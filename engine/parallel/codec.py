"""Rank 0 -> other ranks: each step's `SchedulerOutput` as bytes, by an explicit JSON codec (no pickle).

Every field is written by name and read back into the same typed dataclasses, so a field added to
`SchedulerOutput`, `ScheduledChunk`, `NewRequestData` or `SamplingParams` without a codec entry fails loudly
(`encode` checks the field sets) instead of silently going missing on the other ranks.
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
                 "spec_token_ids")
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


def encode(so: SchedulerOutput) -> bytes:
    doc = {
        "new": [[n.request_id, n.prompt_token_ids, _params_to_json(n.sampling_params), n.output_token_ids,
                 n.generator_state.hex()] for n in so.new_requests],
        "chunks": [[getattr(c, name) for name in _CHUNK_FIELDS] for c in so.chunks],
        "total": so.total_num_scheduled_tokens,
        "swap_out": so.blocks_to_swap_out,
        "swap_in": so.blocks_to_swap_in,
        "tier": so.kv_tier_copies,
        "finished": sorted(so.finished_request_ids),
        "mix": [so.num_decode_seqs, so.num_prefill_tokens, so.prefill_attention_pairs, so.prefill_token_cap],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes) -> SchedulerOutput:
    doc = json.loads(data)
    return SchedulerOutput(
        new_requests=[NewRequestData(rid, list(prompt), _params_from_json(params), list(out), bytes.fromhex(state))
                      for rid, prompt, params, out, state in doc["new"]],
        chunks=[ScheduledChunk(*row) for row in doc["chunks"]],
        total_num_scheduled_tokens=int(doc["total"]),
        blocks_to_swap_out=[(int(a), int(b)) for a, b in doc["swap_out"]],
        blocks_to_swap_in=[(int(a), int(b)) for a, b in doc["swap_in"]],
        kv_tier_copies=[(bool(d), int(a), int(b)) for d, a, b in doc["tier"]],
        finished_request_ids=set(doc["finished"]),
        num_decode_seqs=int(doc["mix"][0]),
        num_prefill_tokens=int(doc["mix"][1]),
        prefill_attention_pairs=int(doc["mix"][2]),
        prefill_token_cap=doc["mix"][3],
    )
