"""Incremental detokenization: text grows one token at a time, never showing half a character."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

# How many tokens before the new one are decoded with it: enough for a tokenizer to place spaces and
# join the bytes of a character split over several tokens.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas (the vLLM prefix/read offset method).

    The tokens from `prefix_offset` are decoded with and without the newest ones; the difference is new
    text, held back while it ends in U+FFFD (bytes of a character that the next token completes).
    """

    def __init__(self, decode: Decode, prompt_ids: Sequence[int]):
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the window short: older tokens never change the decoding of new ones here.
        if self._prefix_offset > 4 * _CONTEXT_TOKENS:
            drop = self._prefix_offset - _CONTEXT_TOKENS
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        self.text += delta
        return delta
