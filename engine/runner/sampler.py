"""Batched sampling: grammar bitmasks (structured output), logit bias, allowed/banned tokens, penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Everything runs as whole-batch tensor ops on the logits' device; the only per-row loop draws the uniform number of
rows with their own seed, so a seeded request samples the same tokens whatever batch it lands in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import Logprob, PositionLogprobs
from engine.sampling_params import SamplingParams
from engine.structured.grammar import apply_bitmask


@dataclass(frozen=True)
class GrammarMask:
    """The batch's one token bitmask (int32 [B, ceil(V / 32)]) and the rows it constrains; other rows are not
    touched, so unconstrained requests pay nothing per row."""

    bitmask: torch.Tensor
    rows: list[int]


@dataclass
class SamplingRow:
    """What the sampler needs about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI's logit_bias: added to the raw logits, before penalties and temperature (as vLLM orders it)."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            row_ids += [i] * len(bias)
            token_ids += bias.keys()
            biases += bias.values()
    if not row_ids:
        return logits
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def apply_token_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """allowed_token_ids and bad_words (vLLM's semantics): every token outside a row's allowed set, and the last
    token of each bad word whose other tokens were just generated, gets -inf. A single-token word is always
    banned."""
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    allowed_rows: list[int] = []
    allowed_tokens: list[int] = []
    for i, row in enumerate(rows):
        allowed = row.params.allowed_token_ids
        if allowed is not None:
            allowed_rows += [i] * len(allowed)
            allowed_tokens += allowed
        for word in row.params.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or row.output_token_ids[-len(prefix):] == prefix:
                ban_rows.append(i)
                ban_tokens.append(word[-1])
    if not allowed_rows and not ban_rows:
        return logits
    device = logits.device
    if allowed_rows:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[torch.tensor(allowed_rows, device=device), torch.tensor(allowed_tokens, device=device)] = True
        constrained = torch.tensor([r.params.allowed_token_ids is not None for r in rows], device=device)
        logits = logits.masked_fill(constrained[:, None] & ~keep, float("-inf"))
    if ban_rows:
        logits = logits.index_put((torch.tensor(ban_rows, device=device), torch.tensor(ban_tokens, device=device)),
                                  torch.tensor(float("-inf"), dtype=logits.dtype, device=device))
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens; presence/frequency over output tokens only."""
    num_rows, vocab = logits.shape
    device = logits.device

    def counts(token_lists: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in token_lists), default=0)
        out = torch.zeros(num_rows, vocab + 1, dtype=torch.int32, device=device)
        if width:
            padded = torch.full((num_rows, width), vocab, dtype=torch.int64)
            for i, tokens in enumerate(token_lists):
                padded[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64)
            out.scatter_add_(1, padded.to(device), torch.ones(num_rows, width, dtype=torch.int32, device=device))
        return out[:, :vocab]

    output_counts = counts([r.output_token_ids for r in rows])
    prompt_mask = counts([r.prompt_token_ids for r in rows]) > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype, device=device)[:, None]
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype, device=device)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype, device=device)[:, None]
    seen = prompt_mask | (output_counts > 0)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * output_counts - pres * (output_counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]  # keeps at least the top token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def adjust_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Logit bias, token masks, then penalties: what greedy takes the argmax of."""
    logits = apply_logit_bias(logits, rows)
    logits = apply_token_masks(logits, rows)
    if any(r.params.needs_penalties for r in rows):
        logits = apply_penalties(logits, rows)
    return logits


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution a non-greedy row samples from (temperature, top-k, top-p, min-p applied to the adjusted
    logits); rows unnormalized after min-p (the sampler scales by the CDF's end)."""
    device = logits.device
    temperatures = [max(r.params.temperature, 1e-5) for r in rows]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=device)[:, None]
    vocab = logits.shape[-1]
    top_ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_ps = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = _top_k_top_p(logits, torch.tensor(top_ks, device=device), torch.tensor(top_ps, device=device))
    probs = logits.softmax(dim=-1)
    min_ps = [r.params.min_p for r in rows]
    if any(p > 0 for p in min_ps):
        min_p = torch.tensor(min_ps, device=device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def seeded_generator_state(seed: int, num_sampled: int, device: torch.device) -> bytes:
    """The state of a request's seeded generator after it sampled `num_sampled` tokens (non-greedy), which
    `Sampler.sample` draws as exactly one scalar uniform each: a request resumed elsewhere (migration) continues
    the same random stream."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(num_sampled):
        torch.rand((), generator=generator, device=device)
    return generator.get_state().numpy().tobytes()


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], grammar: GrammarMask | None = None
               ) -> torch.Tensor:
        """logits [B, V] float32 -> next token ids [B] (on the logits' device). `grammar` masks the constrained
        rows' disallowed tokens to -inf first (in place), as vLLM applies its bitmask before the sampler."""
        if grammar is not None and grammar.rows:
            apply_bitmask(logits, grammar.bitmask, grammar.rows)
        logits = adjust_logits(logits, rows)
        # Decisions come from host-side params, never from device tensors: no GPU sync here.
        is_greedy = [r.params.is_greedy for r in rows]
        if all(is_greedy):
            return logits.argmax(dim=-1)
        device = logits.device
        greedy_tokens = logits.argmax(dim=-1) if any(is_greedy) else None
        vocab = logits.shape[-1]
        probs = sampling_probs(logits, rows)
        # Inverse-CDF sampling: one uniform draw per row (V exponentials per row cost ~4x more on CPU). Seeded
        # rows draw from their own generator, so their tokens do not depend on the rest of the batch; exactly one
        # scalar draw per sampled token (seeded_generator_state replays that to resume a request elsewhere).
        cdf = probs.cumsum(dim=-1)
        uniform = torch.rand(len(rows), generator=self.generator, device=device)
        for i, row in enumerate(rows):
            if row.generator is not None and not row.params.is_greedy:
                uniform[i] = torch.rand((), generator=row.generator, device=device)
        targets = (uniform * cdf[:, -1])[:, None]
        random_tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=vocab - 1)
        if greedy_tokens is None:
            return random_tokens
        return torch.where(torch.tensor(is_greedy, device=device), greedy_tokens, random_tokens)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[PositionLogprobs]:
    """Per row: the chosen token's logprob and rank, plus the top-k alternatives (k = num_top[row])."""
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    k_max = max(num_top, default=0)
    top_vals, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    chosen_l, ranks_l, ids_l = chosen.tolist(), ranks.tolist(), token_ids.tolist()
    top_vals_l = top_vals.tolist() if top_vals is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    out: list[PositionLogprobs] = []
    for row, k in enumerate(num_top):
        entry: PositionLogprobs = {}
        if top_vals_l is not None and top_ids_l is not None:
            for rank, (tok, val) in enumerate(zip(top_ids_l[row][:k], top_vals_l[row][:k], strict=True), start=1):
                entry[tok] = Logprob(val, rank)
        entry[ids_l[row]] = Logprob(chosen_l[row], ranks_l[row])
        out.append(entry)
    return out
