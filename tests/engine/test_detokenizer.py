"""Incremental detokenization: deltas add up to the full text and never show half a character."""

from __future__ import annotations

import pytest

from loraplex.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, héllo 日本語 🙂 and 👩‍👩‍👧 family",
    "Ελληνικά και русский текст, ünïcödé ✓",
    "emoji only: 🎉🎉🎉🚀",
    "  leading spaces\nnew lines\n\n\ttabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_decoded_text(smollm2, text: str) -> None:
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.decode, prompt)
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text
    # Multi-byte characters span several byte-level tokens: some steps must have held text back.
    if any(ord(c) > 0x7FF for c in text):
        assert "" in deltas
