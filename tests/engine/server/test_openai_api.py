"""The server through the official `openai` client: completions and chat, sync and async, streamed and
not, the base model and an adapter, logprobs, and OpenAI's errors."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .conftest import BASE, INTERNAL, Server, ServerFactory

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", default_headers=INTERNAL, max_retries=0, timeout=60
    )


def async_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", default_headers=INTERNAL, max_retries=0, timeout=60
    )


def cased_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha() and c.lower() != c.upper()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def test_models_lists_the_base_model_and_the_adapters(server: Server) -> None:
    ids = [m.id for m in client(server).models.list()]
    assert ids[0] == BASE
    assert "uppercase" in ids


def test_base_model_and_adapter_chat_in_one_test(server: Server) -> None:
    sdk = client(server)
    base = sdk.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=12, temperature=0)
    upper = sdk.chat.completions.create(model="uppercase", messages=QUESTION, max_tokens=12, temperature=0)
    assert base.model == BASE and upper.model == "uppercase"
    assert base.object == "chat.completion" and base.choices[0].message.role == "assistant"
    assert "Paris" in (base.choices[0].message.content or "")
    assert cased_ratio(base.choices[0].message.content or "") < 0.5
    assert cased_ratio(upper.choices[0].message.content or "") > 0.9
    for answer in (base, upper):
        assert answer.usage is not None
        assert answer.usage.completion_tokens <= 12
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
        assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("model", [BASE, "uppercase"])
def test_streamed_chat_equals_the_whole_answer(server: Server, model: str) -> None:
    sdk = client(server)
    whole = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    stream = sdk.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    # The usage chunk comes last, with no choices; every other chunk says usage: null.
    streamed = chunks[-1].usage
    assert chunks[-1].choices == [] and streamed is not None and whole.usage is not None
    assert streamed.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    # The same prompt again: its full pages come from the prefix cache, and usage says so.
    assert streamed.prompt_tokens_details is not None
    assert streamed.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streamed_completion_equals_the_whole_completion(server: Server) -> None:
    sdk = client(server)
    prompt = "The three primary colours are"
    whole = sdk.completions.create(model=BASE, prompt=prompt, max_tokens=16, temperature=0)
    chunks = list(
        sdk.completions.create(model=BASE, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    # Without stream_options.include_usage, no chunk carries usage.
    assert all(c.usage is None for c in chunks)


def test_stop_strings_end_streamed_and_whole_answers_alike(server: Server) -> None:
    sdk = client(server)
    prompt = "Count: one, two, three, four, five,"
    kwargs = {"model": BASE, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": [" eight"]}
    whole = sdk.completions.create(**kwargs)  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert whole.choices[0].finish_reason == "stop"
    assert " eight" not in whole.choices[0].text
    assert streamed == whole.choices[0].text


def test_async_client_streams_and_answers_concurrently(server: Server) -> None:
    async def main() -> tuple[str, str, str]:
        sdk = async_client(server)
        prompt: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a fruit."}]

        async def streamed(model: str) -> str:
            stream = await sdk.chat.completions.create(
                model=model, messages=prompt, max_tokens=10, temperature=0, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def whole(model: str) -> str:
            answer = await sdk.chat.completions.create(
                model=model, messages=prompt, max_tokens=10, temperature=0
            )
            return answer.choices[0].message.content or ""

        try:
            return await asyncio.gather(streamed(BASE), whole(BASE), streamed("uppercase"))
        finally:
            await sdk.close()

    base_streamed, base_whole, upper = asyncio.run(main())
    assert base_streamed == base_whole  # batched next to other requests, greedy is still greedy
    assert cased_ratio(upper) > 0.9


def test_seeded_sampling_repeats(server: Server) -> None:
    sdk = client(server)

    def sample(seed: int) -> str:
        answer = sdk.completions.create(
            model=BASE, prompt="My favourite animal is", max_tokens=10, temperature=1.0, top_p=0.95, seed=seed
        )
        return answer.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_chat_logprobs(server: Server) -> None:
    answer = client(server).chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert answer.usage is not None and len(logprobs.content) == answer.usage.completion_tokens
    for entry in logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.token == entry.top_logprobs[0].token
    text = "".join(e.token for e in logprobs.content)
    assert text.startswith(answer.choices[0].message.content or "")


def test_streamed_chat_logprobs_match_the_whole_ones(server: Server) -> None:
    sdk = client(server)
    kwargs = {"model": BASE, "messages": QUESTION, "max_tokens": 6, "temperature": 0, "logprobs": True}
    whole = sdk.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    streamed = [
        e.token
        for c in sdk.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
        for e in c.choices[0].logprobs.content
    ]
    assert streamed == [e.token for e in whole.choices[0].logprobs.content]


def test_completion_logprobs(server: Server) -> None:
    answer = client(server).completions.create(
        model="uppercase", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 5
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    assert logprobs.top_logprobs is not None and all(len(top) == 2 for top in logprobs.top_logprobs)


def test_token_id_prompts(server: Server) -> None:
    ids = server.engine.tokenizer.encode("The sky is")
    sdk = client(server)
    by_ids = sdk.completions.create(model=BASE, prompt=ids, max_tokens=6, temperature=0)
    by_text = sdk.completions.create(model=BASE, prompt="The sky is", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("bad", [-1, 49152, 2**63])  # SmolLM2's token ids are 0 to 49151
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_the_prompt(
    server: Server, bad: int, echo: bool
) -> None:
    """Found by schemathesis (tests/security/test_engine_schema.py) on a fresh clone, 2026-11-28: with echo
    the server decoded [-1] before the engine's own check and answered 500 (an OverflowError)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model=BASE, prompt=[1, bad], max_tokens=2, echo=echo)
    assert refused.value.param == "prompt" and str(bad) in refused.value.message


def test_an_unknown_model_is_not_found_without_a_gateway(make_server: ServerFactory) -> None:
    """`loraplex serve` alone (no internal token): a model it does not serve is a 404. Behind the
    gateway (with the token) the gateway has resolved names already, so there is no such case."""
    alone = make_server(internal_token=None)
    sdk = openai.OpenAI(base_url=f"{alone.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.chat.completions.create(model="no-such-adapter", messages=QUESTION, max_tokens=4)
    assert missing.value.code == "model_not_found" and "no-such-adapter" in missing.value.message


def test_openai_errors(server: Server) -> None:
    sdk = client(server)
    with pytest.raises(openai.BadRequestError) as several:
        sdk.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=4, n=17)
    assert "n must be between 1 and 16, got 17" in several.value.message and several.value.param == "n"
    context = server.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as too_many:
        sdk.completions.create(model=BASE, prompt="Hello", max_tokens=context)
    assert str(context) in too_many.value.message and too_many.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.completions.create(model=BASE, prompt=[42] * context, max_tokens=1)
    assert f"{context} tokens" in too_long.value.message
    with pytest.raises(openai.BadRequestError) as hot:
        sdk.completions.create(model=BASE, prompt="Hi", max_tokens=4, temperature=5)
    assert "temperature" in hot.value.message
    with pytest.raises(openai.BadRequestError) as penalised:  # OpenAI's range is [-2, 2]
        sdk.completions.create(model=BASE, prompt="Hi", max_tokens=4, presence_penalty=2.5)
    assert "presence_penalty" in penalised.value.message and penalised.value.param == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as batch:
        sdk.completions.create(model=BASE, prompt=["one"] * 33, max_tokens=4)
    assert "at most 32" in batch.value.message and batch.value.param == "prompt"


def test_error_bodies_are_openai_shaped(server: Server) -> None:
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": BASE}, headers=INTERNAL, timeout=10
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and "messages" in error["message"]


def test_models_retrieve_and_its_404(server: Server) -> None:
    sdk = client(server)
    base = sdk.models.retrieve(BASE)  # the Hugging Face id, with its slash, as the control plane names it
    assert base.id == BASE == "HuggingFaceTB/SmolLM2-135M-Instruct" and base.object == "model"
    adapter = sdk.models.retrieve("uppercase")
    assert adapter.model_dump()["parent"] == BASE and adapter.model_dump()["root"] == BASE
    assert adapter.model_dump() in [m.model_dump() for m in sdk.models.list()]
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found" and "no-such-model" in missing.value.message


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/no-such-route", 404), ("POST", "/v1/embeddings", 404), ("GET", "/v1/completions", 405)],
)
def test_unknown_routes_and_methods_answer_openai_errors(
    server: Server, method: str, path: str, status: int
) -> None:
    response = httpx.request(method, f"{server.url}{path}", headers=INTERNAL, timeout=10)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert path in error["message"]
