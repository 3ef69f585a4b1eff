"""Several prompts, several choices and echo through the gateway to a real engine (the session's SmolLM2
engine server), with the official `openai` client: OpenAI's indices, streamed and whole, the tenant's demo
adapter and the base model in one engine batch, lm-eval's loglikelihood request, and the usage the gateway
records (each prompt once, every choice's completion)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from .conftest import ADMIN
from .test_platform_e2e import BASE_MODEL, DEMO, uppercase_share
from .test_platform_e2e import control_plane as control_plane  # this module's own, on the session's engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["The capital of France is", "Two plus two equals", "My favourite colour is"]


@pytest.fixture(scope="module")
def tenant(control_plane: str) -> Iterator[dict[str, str]]:
    """A tenant's key (as `api_key`) with the demo adapter uploaded as `shout`."""
    made = httpx.post(f"{control_plane}/admin/v1/tenants", json={"name": "choices"}, headers=ADMIN)
    assert made.status_code == 201, made.text
    key = httpx.post(
        f"{control_plane}/admin/v1/tenants/{made.json()['id']}/keys", json={"name": "ci"}, headers=ADMIN
    )
    assert key.status_code == 201, key.text
    files = [
        ("files", (p.name, p.read_bytes(), "application/octet-stream"))
        for p in sorted(Path(DEMO).iterdir())
        if p.suffix in (".json", ".safetensors")
    ]
    uploaded = httpx.post(
        f"{control_plane}/api/v1/adapters",
        data={"name": "shout", "deployment": "smol"},
        files=files,
        headers={"Authorization": f"Bearer {key.json()['key']}"},
        timeout=120,
    )
    assert uploaded.status_code == 201 and uploaded.json()["status"] == "ready", uploaded.text
    yield {"url": control_plane, "api_key": key.json()["key"]}


def sdk(tenant: dict[str, str]) -> OpenAI:
    return OpenAI(base_url=f"{tenant['url']}/v1", api_key=tenant["api_key"], max_retries=0, timeout=120)


def usage_rows(tenant: dict[str, str]) -> dict[str, dict]:
    answer = httpx.get(
        f"{tenant['url']}/api/v1/usage", headers={"Authorization": f"Bearer {tenant['api_key']}"}
    )
    return {row["model"]: row for row in answer.json()["rows"]}


def test_several_prompts_reach_the_engine_and_answer_one_choice_each(tenant: dict[str, str]) -> None:
    client = sdk(tenant)
    before = usage_rows(tenant).get(BASE_MODEL, {"prompt_tokens": 0, "completion_tokens": 0})
    answer = client.completions.create(model=BASE_MODEL, prompt=PROMPTS, max_tokens=5, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    singles = [
        client.completions.create(model=BASE_MODEL, prompt=p, max_tokens=5, temperature=0) for p in PROMPTS
    ]
    assert [c.text for c in answer.choices] == [s.choices[0].text for s in singles]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    after = usage_rows(tenant)[BASE_MODEL]
    # Metered as the engine counted: the list's request and the three single ones.
    assert after["prompt_tokens"] - before["prompt_tokens"] == 2 * answer.usage.prompt_tokens
    assert after["completion_tokens"] - before["completion_tokens"] == 2 * answer.usage.completion_tokens


def test_streamed_choices_carry_their_index_through_the_gateway(tenant: dict[str, str]) -> None:
    stream = sdk(tenant).completions.create(
        model=BASE_MODEL,
        prompt=PROMPTS[:2],
        n=2,
        max_tokens=6,
        temperature=0.8,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = defaultdict(str)
    finished, usage = [], []
    for chunk in stream:
        if not chunk.choices:
            usage.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2, 3] and len(usage) == 1
    whole = sdk(tenant).completions.create(
        model=BASE_MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0.8, seed=11
    )
    assert dict(texts) == {c.index: c.text for c in whole.choices}  # seeded: the same either way


def test_the_adapter_and_the_base_model_in_one_batch(tenant: dict[str, str]) -> None:
    client = AsyncOpenAI(
        base_url=f"{tenant['url']}/v1", api_key=tenant["api_key"], max_retries=0, timeout=120
    )
    question = [{"role": "user", "content": "Name two colours of the sky."}]

    async def both() -> tuple:
        return tuple(
            await asyncio.gather(
                client.chat.completions.create(
                    model="shout",
                    messages=question,
                    n=2,
                    max_tokens=12,
                    temperature=0.7,
                    seed=4,  # type: ignore[arg-type]
                ),
                client.completions.create(model=BASE_MODEL, prompt=PROMPTS, max_tokens=8, temperature=0),
            )
        )

    shouted, plain = asyncio.run(both())
    assert [c.index for c in shouted.choices] == [0, 1]
    assert all(uppercase_share(c.message.content or "") >= 0.9 for c in shouted.choices)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    assert all(uppercase_share(c.text) < 0.5 for c in plain.choices)


def test_lm_eval_loglikelihood_through_the_gateway(tenant: dict[str, str]) -> None:
    answer = sdk(tenant).completions.create(
        model=BASE_MODEL, prompt=PROMPTS[:2], echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    for prompt, choice in zip(PROMPTS[:2], answer.choices, strict=True):
        assert choice.text == prompt and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert logprobs.token_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in logprobs.token_logprobs[1:])
    assert answer.usage is not None and answer.usage.completion_tokens == 0
