"""`bad_words` as token id sequences, as vLLM tokenizes them.

Each word is encoded twice, as written (leading spaces stripped) and with one leading space (how it appears mid
sentence), without special tokens. The spaced form is kept only where it differs in its first token but has the
same length, vLLM's rule, so a word is not banned twice by the same ids. The sampler bans a sequence's last token
when the tokens generated just before it match the rest (engine/runner/sampler.py).
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequest


def tokenize_bad_words(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """`words` passed SamplingParams' checks (count and length). Raises InvalidRequest (param "bad_words") without
    a tokenizer or for ids past the model's vocabulary."""
    if tokenizer is None:
        raise InvalidRequest("bad_words needs the model's tokenizer, and this engine runs without one", "bad_words")
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(list(plain))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(list(spaced))
    if any(t >= vocab_size for ids in sequences for t in ids):
        raise InvalidRequest(f"bad_words tokenize to ids outside the model's vocabulary [0, {vocab_size})",
                             "bad_words")
    return [ids for ids in sequences if ids]
