"""Our GGUF-built tokenizer and chat template against transformers' on the same file."""

from __future__ import annotations

import pytest

from loraplex.engine.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello world, héllo 日本語 🙂",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x  # comment\n\n\n",
    "   leading and trailing spaces   ",
    "<|im_start|>user\nHi<|im_end|>\n",
    "Ünïcödé, Ελληνικά, русский, العربية",
    "it's we'll they've I'm you'd",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers(smollm2, hf_tokenizer, text: str) -> None:
    ours = smollm2.tokenizer.encode(text)
    assert ours == hf_tokenizer(text, add_special_tokens=True).input_ids
    assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_digits_are_split_one_by_one(smollm2) -> None:
    # SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) splits every digit.
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode("2024", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_tokens_stay_whole(smollm2) -> None:
    ids = smollm2.tokenizer.encode("<|im_start|>assistant")
    assert ids[0] == 1 and smollm2.tokenizer.decode(ids) == "assistant"


def test_chat_template_matches_transformers(smollm2, hf_tokenizer) -> None:
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
    ]
    for messages in conversations:
        expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert smollm2.tokenizer.apply_chat_template(messages) == expected
        expected_ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
            expected_ids = expected_ids["input_ids"]
        assert smollm2.tokenizer.encode_chat(messages) == list(expected_ids)


def test_bad_messages_are_refused(smollm2) -> None:
    with pytest.raises(TokenizerError, match="role"):
        smollm2.tokenizer.apply_chat_template([{"content": "no role"}])


def test_unsupported_gguf_tokenizer_is_named() -> None:
    with pytest.raises(TokenizerError, match="'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


def test_template_less_model_refuses_chat(smollm2) -> None:
    tokenizer = Tokenizer(backend=smollm2.tokenizer.backend)
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
