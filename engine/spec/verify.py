"""The target side of speculative decoding: turn the k + 1 scored positions of each verified chunk into the
tokens to emit (engine/spec/rejection_sampler.py), with the same logit processing as plain sampling.

Row j of a chunk sees the request's history plus drafts d_1..d_j as output, so logit bias, penalties (which
count output tokens), bad words (which match them) and the stop rules downstream behave exactly as when those tokens were decoded one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from engine.outputs import PositionLogprobs
from engine.runner.sampler import SamplingRow, adjust_logits, gather_logprobs, sampling_probs
from engine.sampling_params import SamplingParams
from engine.spec.rejection_sampler import rejection_sample, verify_greedy


class _State(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


def verify_spans(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                 spans: list[tuple[str, int, list[int]]], states: Mapping[str, _State],
                 default_generator: torch.Generator) -> tuple[dict[str, list[int]], dict[str, list[PositionLogprobs]]]:
    """spans: (request id, first row in `hidden`, drafts); rows first .. first + k score positions that predict
    d_1 .. d_k and the bonus token. Returns each request's emitted tokens (appended to its runner state) and,
    where asked, their logprobs (of the raw logits, as plain sampling reports them)."""
    device = hidden.device
    index: list[int] = []
    rows: list[SamplingRow] = []
    for request_id, first, drafts in spans:
        state = states[request_id]
        for j in range(len(drafts) + 1):
            index.append(first + j)
            history = state.output_token_ids + drafts[:j] if state.params.needs_output_history else state.output_token_ids
            rows.append(SamplingRow(state.params, state.prompt_token_ids, history, state.generator))
    logits = compute_logits(hidden[torch.as_tensor(index, device=device)])
    adjusted = adjust_logits(logits, rows)
    greedy_ids = adjusted.argmax(dim=-1).tolist()
    accepted: dict[str, list[int]] = {}
    logprobs: dict[str, list[PositionLogprobs]] = {}
    offset = 0
    for request_id, _, drafts in spans:
        state = states[request_id]
        width = len(drafts) + 1
        if state.params.is_greedy:
            tokens = verify_greedy(greedy_ids[offset : offset + width], drafts)
        else:
            span_rows = rows[offset : offset + width]
            probs = sampling_probs(adjusted[offset : offset + width], span_rows)
            tokens = rejection_sample(probs, drafts, None, state.generator or default_generator)
        if state.params.logprobs is not None:
            lp = logits[offset : offset + len(tokens)].log_softmax(dim=-1)
            logprobs[request_id] = gather_logprobs(lp, torch.as_tensor(tokens, device=device),
                                                   [state.params.logprobs] * len(tokens))
        state.output_token_ids.extend(tokens)
        accepted[request_id] = tokens
        offset += width
    return accepted, logprobs
