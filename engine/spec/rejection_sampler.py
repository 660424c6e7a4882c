"""Verification of draft tokens against the target's distributions (speculative decoding).

Greedy: accept drafts while they equal the target's argmax, then take the target's token at the first mismatch
(or the bonus token after the last draft): the output is exactly what plain greedy decoding produces.

Sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft d_j with probability min(1, p_j(d_j) / q_j(d_j));
at the first rejection sample from norm(max(0, p_j - q_j)); if all are accepted sample the bonus token from
p_{k}. Every emitted token is then distributed exactly as the target's p. n-gram and greedy draft models
propose deterministically: q is one-hot on the draft (`draft_probs=None`), so acceptance is p_j(d_j) and the
residual is p_j with d_j removed.

Each call draws exactly k + 1 uniforms from the row's generator whatever is accepted, so a seeded request
replays the same stream.
"""

from __future__ import annotations

import torch


def verify_greedy(target_ids: list[int], draft_ids: list[int]) -> list[int]:
    """target_ids: the target's argmax at each of the k + 1 positions; returns the tokens to emit (1..k+1)."""
    out: list[int] = []
    for target, draft in zip(target_ids, draft_ids, strict=False):
        out.append(target)
        if target != draft:
            return out
    out.append(target_ids[len(draft_ids)])
    return out


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> int:
    cdf = probs.cumsum(dim=-1)
    index = torch.searchsorted(cdf, (uniform * cdf[-1]).reshape(1), right=True)
    return int(index.clamp_(max=probs.shape[-1] - 1).item())


def rejection_sample(target_probs: torch.Tensor, draft_ids: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """target_probs [k+1, V] (rows may be unnormalized), draft_probs [k, V] or None (one-hot drafts); returns
    the accepted drafts plus one token sampled by the rule above."""
    k = len(draft_ids)
    device = target_probs.device
    p = target_probs / target_probs.sum(dim=-1, keepdim=True)
    uniforms = torch.rand(k + 1, generator=generator, device=device)
    index = torch.as_tensor(draft_ids, dtype=torch.int64, device=device)
    rows = torch.arange(k, device=device)
    p_draft = p[rows, index]
    if draft_probs is None:
        accept = uniforms[:k] < p_draft  # q(d) = 1
    else:
        q = draft_probs / draft_probs.sum(dim=-1, keepdim=True)
        accept = uniforms[:k] * q[rows, index] < p_draft
    accepted = k
    for j, ok in enumerate(accept.tolist()):
        if not ok:
            accepted = j
            break
    if accepted == k:
        final = p[k]
    else:
        if draft_probs is None:
            final = p[accepted].clone()
            final[draft_ids[accepted]] = 0.0
        else:
            final = (p[accepted] - q[accepted]).clamp_min(0.0)
        if not bool(final.sum() > 0):  # only through rounding (p == q): p itself is then the residual's limit
            final = p[accepted]
    return [*draft_ids[:accepted], _inverse_cdf(final, uniforms[k])]
