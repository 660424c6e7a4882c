"""The steps the runner replays from its decode CUDA graphs (engine/runner/cuda_graphs.py) instead of running
an eager forward: decode steps (with decode-ahead, engine/runner/decode_ahead.py) and speculative verify steps
whose chunks all sample.

Invariants:
- A step replays only if every row fits the captured graphs (batch size and context); otherwise these functions
  return None and the runner runs the step eagerly, with the same result.
- A replay computes the raw logits' argmax itself: rows that would take exactly that (plain greedy) take it without
  any logits work; every other row is sampled (or verified) from the replay's logits by the runner's sampling.
- Tokens reach the host through the graphs' pinned buffer; a decode step waits for its own ids only, never for
  the replay it queued ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine.outputs import ModelRunnerOutput, PositionLogprobs, ScheduledChunk
from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.decode_ahead import DecodeAhead
from engine.runner.input_batch import DecodeRows, RunnerRequestState, expand_to_decode_rows
from engine.spec.rejection_sampler import verify_greedy

# The runner's sampling of logits rows for these requests: (tokens on the device, logprobs where asked).
SampleRows = Callable[[torch.Tensor, list[str], list[RunnerRequestState]],
                      tuple[torch.Tensor, dict[str, PositionLogprobs]]]
# The runner's verification of a step's drafts (and sampling of its other rows) from every row's logits.
VerifyRows = Callable[[torch.Tensor, DecodeRows], ModelRunnerOutput]


def decode_graph_step(chunks: list[ScheduledChunk], block_size: int, graphs: DecodeGraphs, ahead: DecodeAhead,
                      requests: Mapping[str, RunnerRequestState], sample: SampleRows) -> ModelRunnerOutput | None:
    """A decode-only step within the captured bounds: the matching decode-ahead replay, or one replay now;
    then queue the next step's replay before waiting for this step's ids. None: not such a step."""
    for chunk in chunks:
        if len(chunk.token_ids) != 1 or not chunk.sample or chunk.prompt_logprobs:
            return None
    positions = [chunk.start_position for chunk in chunks]
    n = len(chunks)
    if not graphs.can_run(n, max(positions) + 1):
        return None
    result = ahead.take(chunks)
    if result is None:
        bs = block_size
        slots = [chunk.block_ids[p // bs] * bs + p % bs for chunk, p in zip(chunks, positions, strict=True)]
        result = graphs.run([chunk.token_ids[0] for chunk in chunks], positions, slots,
                            [p + 1 for p in positions], [chunk.block_ids for chunk in chunks])
    ids = [chunk.request_id for chunk in chunks]
    states = [requests[rid] for rid in ids]
    logprobs: dict[str, PositionLogprobs] = {}
    if all(state.plain_greedy for state in states):
        tokens = result.tokens  # the sampler would take the same argmax of the same logits
    else:  # grammar masks (filled on the host while the GPU runs), or sampling
        tokens, logprobs = sample(result.logits, ids, states)
    graphs.tokens_to_host(tokens)
    # The next step's inputs are on the device now: queue its replay (logits only). Its sampling, and a
    # constrained row's next mask, need this step's tokens on the host, which they have by the next step.
    ahead.queue(chunks, positions, states, tokens, graphs)
    token_list = graphs.host_tokens(n)  # waits for this step only, not for the replay queued ahead
    ahead.fed(token_list)
    for state, token in zip(states, token_list, strict=True):
        state.record(token)
    return ModelRunnerOutput(dict(zip(ids, token_list, strict=True)), logprobs, {})


def verify_graph_step(chunks: list[ScheduledChunk], block_size: int, graphs: DecodeGraphs, ahead: DecodeAhead,
                      requests: Mapping[str, RunnerRequestState], verify: VerifyRows) -> ModelRunnerOutput | None:
    """A speculative step whose chunks all sample, replayed from a decode graph with one row per token
    (`expand_to_decode_rows`): the eager extend forward it replaces cost 2.3x a decode replay on an H100 at
    batch 1. None: not such a step, or more rows / context than the graphs cover."""
    if not any(chunk.spec_token_ids for chunk in chunks):
        return None
    for chunk in chunks:
        if not chunk.sample or chunk.prompt_logprobs:
            return None
    num_rows = sum(len(chunk.token_ids) for chunk in chunks)
    max_len = max(chunk.start_position + len(chunk.token_ids) for chunk in chunks)
    if not graphs.can_run(num_rows, max_len):
        return None
    ahead.drop()  # its KV slots are rewritten by this step's rows
    rows = expand_to_decode_rows(chunks, block_size)
    result = graphs.run(rows.input_ids, rows.positions, rows.slots, rows.seq_lens, rows.block_tables)
    if not all(requests[chunk.request_id].plain_greedy for chunk in chunks):
        return verify(result.logits, rows)
    # The graph's argmax is the verdict: no logits work.
    graphs.tokens_to_host(result.tokens)
    ids = graphs.host_tokens(len(rows.positions))
    sampled = {rid: ids[row] for rid, row in zip(rows.sample_ids, rows.sample_rows, strict=True)}
    accepted = {rid: verify_greedy(ids[first : first + len(drafts) + 1], drafts)
                for rid, first, drafts in rows.spec_spans}
    for rid, token in sampled.items():
        requests[rid].record(token)
    for rid, tokens in accepted.items():
        requests[rid].output_token_ids.extend(tokens)
        sampled[rid] = tokens[-1]
    return ModelRunnerOutput(sampled, {}, {}, accepted, {})
