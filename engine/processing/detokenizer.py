"""Incremental detokenization that is correct across multi-byte characters, plus stop-string matching.

Text for new tokens is the difference between decoding a short trailing window with and without them; while
the window ends in an incomplete UTF-8 sequence (decoded as U+FFFD) nothing is emitted, so a character split
across tokens appears whole, once.
"""

from __future__ import annotations

from typing import Any

INITIAL_CONTEXT_TOKENS = 5  # prompt tokens used as left context, so the first word's spacing is right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        context = prompt_token_ids[-INITIAL_CONTEXT_TOKENS:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.stop_matched: str | None = None
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string if one now appears (the text is cut before it)."""
        if self.tokenizer is None or self.stop_matched is not None:
            return self.stop_matched
        for token in new_token_ids:
            self.ids.append(token)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta = full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self.text += delta
                if self.stop and self._match_stop(len(delta)):
                    break
        return self.stop_matched

    def _match_stop(self, delta_len: int) -> bool:
        for stop in self.stop:
            begin = max(0, len(self.text) - delta_len - len(stop) + 1)
            index = self.text.find(stop, begin)
            if index != -1:
                self.stop_matched = stop
                self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
                return True
        return False

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back what could still become a stop string."""
        if finished or not self._holdback or self.stop_matched is not None:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]


def decode_all(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
