"""Shared pieces of the engine tests: the real SmolLM2 model, its HF oracle, prompts and comparisons."""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.models.loader import resolve_model

# Varied prompts: chat-ish, code, lists, numbers, unicode, a long-ish one.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of three fruits:",
    "In 1969, the first humans",
    "Translate to French: Good morning, my friend.",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "Les élèves ont étudié la révolution française et",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
    "1, 2, 3, 4, 5,",
    "Water boils at",
]

SMALL_KV = 256 << 20


@functools.cache
def smollm2_path() -> str:
    resolved = resolve_model("smollm2")
    assert resolved.path is not None
    return resolved.path


@functools.cache
def hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    return model.eval()


@functools.cache
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path())


def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=2,
                             eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def hf_next_logprobs(token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model()(torch.tensor([token_ids])).logits[0, -1].float()
    return logits.log_softmax(-1)


def assert_matches_oracle(prompt_ids: list[int], ours: list[int], theirs: list[int], tol: float = 1e-2) -> None:
    """Exact match, or a first divergence at a near-tie: our token is the oracle's second choice within `tol`
    nats of its first."""
    if ours == theirs:
        return
    k = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    logprobs = hf_next_logprobs(prompt_ids + theirs[:k])
    top2 = logprobs.topk(2)
    assert top2.indices[0].item() == theirs[k], "oracle's own choice must be its argmax"
    assert top2.indices[1].item() == ours[k], f"divergence at {k}: ours {ours[k]} is not the oracle's 2nd choice"
    gap = (top2.values[0] - top2.values[1]).item()
    assert gap <= tol, f"divergence at {k} is not a near-tie: gap {gap:.4f} nats"
