"""presence_penalty, frequency_penalty, repetition_penalty and logit_bias through the engine's server, with
the official `openai` client: accepted on both generation endpoints, applied per request in mixed batches
(the demo adapter and the base model side by side), and refused with a 400 naming the field outside their
bounds or the vocabulary."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from loraplex.wire import limits

from .conftest import BASE, Server
from .test_openai_api import QUESTION, async_client, client

PROMPT = "la la la la la la la la"


def forced_token(server: Server) -> int:
    """A token the model would not pick on its own here: " banana"'s last piece."""
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    return int(tokenizer.encode(" banana")[-1])


def test_logit_bias_forces_and_bans_tokens_on_both_endpoints(server: Server) -> None:
    sdk = client(server)
    token = forced_token(server)
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    forced = {str(token): 100}
    chat = sdk.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=5, temperature=0, logit_bias=forced
    )
    assert chat.choices[0].message.content == tokenizer.decode([token] * 5)
    completion = sdk.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias=forced
    )
    assert completion.choices[0].text == tokenizer.decode([token] * 5)
    plain = sdk.completions.create(model=BASE, prompt=PROMPT, max_tokens=1, temperature=0).choices[0].text
    ban = {str(t): -100 for t in tokenizer.encode(plain)}  # the greedy token's id among them
    banned = sdk.completions.create(model=BASE, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias=ban)
    assert banned.choices[0].text != plain


def test_penalties_change_greedy_text_and_streams_agree(server: Server) -> None:
    sdk = client(server)
    kwargs: dict[str, Any] = {"model": BASE, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    plain = sdk.completions.create(**kwargs).choices[0].text
    for extra in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},  # vLLM's extension: not in the SDK's signature
    ):
        penalised = sdk.completions.create(**kwargs, **extra).choices[0].text
        assert penalised != plain, extra
        streamed = "".join(c.choices[0].text for c in sdk.completions.create(**kwargs, **extra, stream=True))
        assert streamed == penalised, extra
    chat = {"model": BASE, "messages": QUESTION, "max_tokens": 10, "temperature": 0}
    assert (
        # The prompt's tokens count for the repetition penalty: "France" and "capital" are penalised.
        sdk.chat.completions.create(**chat, extra_body={"repetition_penalty": 2.0}).choices[0].message.content
        != sdk.chat.completions.create(**chat).choices[0].message.content
    )


def test_mixed_batch_of_adapter_and_base_rows_keeps_the_plain_rows(server: Server) -> None:
    """Penalised and biased requests of the demo adapter and the base model, sent together so they share
    steps, beside plain ones: each plain answer is the one it gets alone, and each seeded penalised one
    repeats."""
    plain = [
        {"model": BASE, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        {"model": "uppercase", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 4},
    ]
    penalised = [
        {"model": "uppercase", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "frequency_penalty": 1.5},
        {
            "model": BASE, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.9, "seed": 8,
            "presence_penalty": 1.0, "logit_bias": {"28": -100}, "extra_body": {"repetition_penalty": 1.3},
        },
    ]  # fmt: skip

    async def together(bodies: list[dict[str, Any]]) -> list[str]:
        sdk = async_client(server)
        try:
            answers = await asyncio.gather(*(sdk.completions.create(**b) for b in bodies))
        finally:
            await sdk.close()
        return [a.choices[0].text for a in answers]

    sdk = client(server)
    alone = [sdk.completions.create(**b).choices[0].text for b in plain + penalised]
    mixed = asyncio.run(together(plain + penalised + plain + penalised))
    assert mixed == alone + alone


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -3}),
        ("repetition_penalty", {"extra_body": {"repetition_penalty": 0}}),
        ("repetition_penalty", {"extra_body": {"repetition_penalty": limits.MAX_REPETITION_PENALTY + 1}}),
        ("logit_bias", {"logit_bias": {"5": 101}}),
        ("logit_bias", {"logit_bias": {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES + 1)}}),
        ("logit_bias", {"logit_bias": {"49152": 5}}),  # SmolLM2's vocabulary is 0 to 49151
    ],
)
def test_out_of_bounds_values_are_400s_naming_the_field(
    server: Server, field: str, kwargs: dict[str, Any]
) -> None:
    sdk = client(server)
    for call in (
        lambda: sdk.completions.create(model=BASE, prompt="Hi", max_tokens=2, **kwargs),
        lambda: sdk.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=2, **kwargs),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == field and field in refused.value.message
