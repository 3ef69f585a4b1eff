"""vLLM's /tokenize and /detokenize on the engine, through httpx: the engine's own tokenizer and chat
template, the base model and an adapter alike, and every field bounded by wire/limits.py (a 400 naming it)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loraplex.wire import limits

from .conftest import BASE, INTERNAL, Server, ServerFactory

TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Digits 1234567890 and 3.14159",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🚀🔥, Ελληνικά, עברית",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Wie heißt die Hauptstadt von Frankreich? 🇫🇷"},
]


def post(server: Server, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}", json=body, headers=INTERNAL if headers is None else headers, timeout=60
    )


def refused(response: httpx.Response, status: int, param: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    return dict(error)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_a_text_is_the_engines_encoding(server: Server, text: str) -> None:
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    answer = post(server, "/tokenize", {"model": BASE, "prompt": text})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == server.engine.max_model_len
    assert body["token_strs"] is None
    back = post(server, "/detokenize", {"model": BASE, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": text}


def test_tokenize_a_conversation_applies_the_chat_template(server: Server) -> None:
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    answer = post(server, "/tokenize", {"model": BASE, "messages": CHAT})
    assert answer.status_code == 200, answer.text
    assert answer.json()["tokens"] == tokenizer.encode_chat(CHAT)
    without = post(server, "/tokenize", {"model": BASE, "messages": CHAT, "add_generation_prompt": False})
    ids = without.json()["tokens"]
    assert ids == tokenizer.encode_chat(CHAT, add_generation_prompt=False)
    assert len(ids) < answer.json()["count"]  # the generation prompt is `<|im_start|>assistant\n`
    prompt = post(server, "/detokenize", {"tokens": answer.json()["tokens"]}).json()["prompt"]
    assert prompt == tokenizer.apply_chat_template(CHAT) and prompt.endswith("<|im_start|>assistant\n")


def test_token_strs_and_the_model_field(server: Server) -> None:
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    # The adapter and no model at all answer as the base model: they share its tokenizer.
    answers = [
        post(server, "/tokenize", {**model, "prompt": "Say hi", "return_token_strs": True}).json()
        for model in ({"model": BASE}, {"model": "uppercase"}, {})
    ]
    assert answers[0] == answers[1] == answers[2]
    assert answers[0]["token_strs"] == [tokenizer.backend.id_to_token(i) for i in answers[0]["tokens"]]
    assert answers[0]["token_strs"][-1] == "Ġhi"  # the byte-level spelling, as vLLM's token_strs


def test_special_tokens_kept_on_detokenize(server: Server) -> None:
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    eos = tokenizer.eos_token_ids[0]
    prompt = post(server, "/detokenize", {"tokens": [eos]}).json()["prompt"]
    assert prompt == tokenizer.decode([eos], skip_special_tokens=False) and prompt.startswith("<|")


def test_limits_are_400s_naming_the_field(server: Server) -> None:
    too_long = "a" * (limits.MAX_PROMPT_CHARS + 1)
    error = refused(post(server, "/tokenize", {"prompt": too_long}), 400, "prompt")
    assert error["code"] == "limit_exceeded"
    many = [{"role": "user", "content": "x"}] * (limits.MAX_CHAT_MESSAGES + 1)
    refused(post(server, "/tokenize", {"messages": many}), 400, "messages")
    long_chat = [{"role": "user", "content": too_long}]
    refused(post(server, "/tokenize", {"messages": long_chat}), 400, "messages")
    refused(post(server, "/detokenize", {"tokens": [1] * (limits.MAX_PROMPT_TOKENS + 1)}), 400, "tokens")
    refused(post(server, "/detokenize", {"tokens": [5, -1]}), 400, "tokens")
    refused(post(server, "/detokenize", {"tokens": [2**63]}), 400, "tokens")
    refused(post(server, "/detokenize", {"tokens": ["5"]}), 400, "tokens")
    vocab = server.engine.tokenizer.vocab_size  # type: ignore[union-attr]
    error = refused(post(server, "/detokenize", {"tokens": [vocab]}), 400, "tokens")
    assert str(vocab) in error["message"]


def test_malformed_bodies_are_openai_shaped_400s(server: Server) -> None:
    refused(post(server, "/tokenize", {"model": BASE}), 400, "prompt")
    refused(post(server, "/tokenize", {"messages": []}), 400, "messages")
    refused(post(server, "/detokenize", {}), 400, "tokens")
    refused(post(server, "/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}), 400, "tools")
    refused(
        post(server, "/tokenize", {"messages": CHAT, "continue_final_message": True}),
        400,
        "continue_final_message",
    )
    raw = httpx.post(
        f"{server.url}/tokenize",
        content=b"{not json",
        headers={**INTERNAL, "Content-Type": "application/json"},
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"


def test_the_internal_token_is_required(server: Server) -> None:
    answer = post(server, "/tokenize", {"prompt": "hi"}, headers={})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "missing_internal_token"


def test_without_a_token_only_served_models_are_named(make_server: ServerFactory) -> None:
    alone = make_server(internal_token=None)
    assert post(alone, "/tokenize", {"model": BASE, "prompt": "hi"}, headers={}).status_code == 200
    error = refused(post(alone, "/tokenize", {"model": "nope", "prompt": "hi"}, headers={}), 404, "model")
    assert error["code"] == "model_not_found"
    refused(post(alone, "/detokenize", {"model": "nope", "tokens": [1]}, headers={}), 404, "model")
