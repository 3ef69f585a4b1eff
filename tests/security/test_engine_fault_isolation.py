"""One tenant's adapter cannot fail another tenant's requests, against the real engine server.

Each test is an attack: an adapter whose weights hold NaN, one whose finite weights overflow to NaN
logits inside a step, one that makes a step raise mid-stream, one whose file changes after
registration. In each, only the guilty adapter's requests fail (`adapter_failed`, as the gateway
expects), the adapter is refused from then on with the reason, every other request completes with the
answer it gets alone, and /ready stays on.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam
from safetensors.torch import load_file, save_file

from loraplex.adapters.digest import adapter_digest
from tests.engine.server.conftest import BASE, DEMO_ADAPTER, INTERNAL, TOKEN, Server, running_server

WEIGHTS = "adapter_model.safetensors"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(engine_factory: Any) -> Iterator[Server]:
    engine = {"num_pages": 256, "max_num_seqs": 32}
    with running_server(
        engine_factory, engine, internal_token=TOKEN, adapters=[f"uppercase={DEMO_ADAPTER}"], max_queue=64
    ) as shared:
        yield shared


def crafted(target: Path, change: Callable[[str, torch.Tensor], torch.Tensor]) -> Path:
    """The demo adapter with every tensor passed through `change(name, tensor)`."""
    shutil.copytree(DEMO_ADAPTER, target)
    tensors = load_file(target / WEIGHTS)
    save_file({name: change(name, t).contiguous() for name, t in tensors.items()}, target / WEIGHTS)
    return target


def as_gateway(adapter: Path, adapter_id: str | None = None, tenant: str = "mallory") -> dict[str, str]:
    return {
        **INTERNAL,
        "X-Loraplex-Tenant": tenant,
        "X-Loraplex-Adapter-Id": adapter_id or str(uuid.uuid4()),
        "X-Loraplex-Adapter-Uri": adapter.as_uri(),
        "X-Loraplex-Adapter-Sha256": adapter_digest(adapter),
    }


def chat(server: Server, model: str, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": QUESTION, "max_tokens": 12, "temperature": 0, **extra}
    return httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers=headers or INTERNAL, timeout=120
    )


def answer(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def step_errors(server: Server) -> float:
    return server.sample("loraplex_engine_step_errors_total")


def innocent_answers(server: Server) -> dict[str, str]:
    """What the other tenants get alone: the references their answers under attack must equal."""
    return {"base": answer(chat(server, BASE)), "uppercase": answer(chat(server, "uppercase"))}


def test_nan_weights_are_refused_at_load_and_nobody_else_notices(server: Server, tmp_path: Path) -> None:
    expected = innocent_answers(server)
    nan = crafted(tmp_path / "nan", lambda name, t: t if "lora_A" in name else t.fill_(float("nan")))
    headers = as_gateway(nan)
    errors_before = step_errors(server)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(chat, server, m) for m in (BASE, "uppercase", BASE, "uppercase")]
        attacks = [pool.submit(chat, server, "mine", headers) for _ in range(2)]
        for attack in attacks:
            refused = attack.result()
            assert refused.status_code == 422, refused.text
            assert error_of(refused)["code"] == "adapter_failed"
            assert "NaN" in error_of(refused)["message"] or "finite" in error_of(refused)["message"]
        texts = [answer(f.result()) for f in others]
    assert texts == [expected["base"], expected["uppercase"]] * 2
    assert step_errors(server) == errors_before  # refused at load: no step ever ran it
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200


def test_finite_weights_that_overflow_fail_only_their_own_requests(server: Server, tmp_path: Path) -> None:
    """1e20 passes a finiteness check, but x·A·B overflows float32: the step's logits turn NaN for this
    adapter's rows only. The step is retried once, then bisected by adapter."""
    expected = innocent_answers(server)
    huge = crafted(tmp_path / "huge", lambda name, t: t.sign().add_(0.5).sign() * 1e20)
    adapter_id = str(uuid.uuid4())
    headers = as_gateway(huge, adapter_id)
    release = threading.Barrier(7)

    def at_once(model: str, extra: dict[str, str] | None = None) -> httpx.Response:
        release.wait(timeout=60)
        return chat(server, model, extra, temperature=0.7, seed=7) if extra else chat(server, model)

    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        others = [pool.submit(at_once, m) for m in (BASE, "uppercase", BASE, "uppercase", BASE)]
        attacks = [pool.submit(at_once, "mine", headers) for _ in range(2)]
        for attack in attacks:
            failed = attack.result()
            assert failed.status_code == 422, failed.text
            assert error_of(failed)["code"] == "adapter_failed"
            assert "not finite" in error_of(failed)["message"]
        texts = [answer(f.result()) for f in others]
    assert texts == [
        expected["base"],
        expected["uppercase"],
        expected["base"],
        expected["uppercase"],
        expected["base"],
    ]

    # Refused from then on with the reason, without running it again; /ready never turned off.
    again = chat(server, "mine", headers)
    assert again.status_code == 422 and error_of(again)["code"] == "adapter_failed"
    assert "not finite" in error_of(again)["message"]
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    # The tenant fixes the adapter: other weights (another digest) under the same id are served.
    fixed = as_gateway(crafted(tmp_path / "fixed", lambda name, t: t), adapter_id)
    assert answer(chat(server, "mine", fixed)) == expected["uppercase"]
    server.wait_idle()
    assert server.engine.pool.pages_by_kind()["kv"] == 0


def test_a_step_failure_mid_stream_ends_only_the_guilty_stream(server: Server, tmp_path: Path) -> None:
    """Anything that makes a step raise because of one adapter (here: its LoRA stack raising once the
    stream is under way) ends that adapter's stream with an SSE error event, and only that stream."""
    expected = answer(chat(server, BASE, max_tokens=40))
    register = {"name": "poison", "uri": str(DEMO_ADAPTER)}
    assert (
        httpx.post(f"{server.url}/internal/adapters", json=register, headers=INTERNAL, timeout=30).status_code
        == 201
    )
    runner = server.engine.runner
    assert runner.lora is not None
    real_build, armed = runner.lora.build, threading.Event()

    def build(batch: Any) -> Any:
        if armed.is_set() and "poison" in batch.token_adapters:
            raise RuntimeError("poison's LoRA stack is corrupt")
        return real_build(batch)

    sdk = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", default_headers=INTERNAL, max_retries=0, timeout=120
    )
    runner.lora.build = build
    try:
        guilty = sdk.chat.completions.create(
            model="poison", messages=QUESTION, max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        innocent = sdk.chat.completions.create(
            model=BASE, messages=QUESTION, max_tokens=40, temperature=0, stream=True
        )
        chunks = iter(guilty)
        next(chunks), next(chunks)  # under way
        armed.set()
        with pytest.raises(openai.APIError) as ended:
            for _ in chunks:
                pass
        assert ended.value.code == "adapter_failed" and "corrupt" in ended.value.message
        text = "".join(c.choices[0].delta.content or "" for c in innocent if c.choices)
        assert text == expected
    finally:
        del runner.lora.build
    listed = httpx.get(f"{server.url}/internal/adapters", headers=INTERNAL, timeout=10).json()["data"]
    assert "corrupt" in next(a for a in listed if a["name"] == "poison")["failed"]
    refused = chat(server, "poison")
    assert refused.status_code == 422 and error_of(refused)["code"] == "adapter_failed"
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    assert (
        httpx.delete(f"{server.url}/internal/adapters/poison", headers=INTERNAL, timeout=10).status_code
        == 200
    )


def test_a_step_failure_no_adapter_explains_is_retried_before_anything_fails(server: Server) -> None:
    expected = answer(chat(server, BASE))
    runner = server.engine.runner
    real_execute, failures = runner.execute, [0]

    def flaky(batch: Any) -> Any:
        if failures[0] < 1:
            failures[0] += 1
            raise RuntimeError("a transient device error")
        return real_execute(batch)

    runner.execute = flaky
    try:
        assert answer(chat(server, BASE)) == expected
    finally:
        del runner.execute
    assert failures[0] == 1
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200


def test_weights_changed_after_registration_fail_only_that_adapter(server: Server, tmp_path: Path) -> None:
    """The store's bytes are replaced by other valid weights after registration: the engine verifies the
    digest when it loads them, so the request fails with adapter_failed instead of silently serving
    weights nobody registered."""
    expected = innocent_answers(server)
    copy = crafted(tmp_path / "swapped", lambda name, t: t)
    adapter_id = str(uuid.uuid4())
    headers = as_gateway(copy, adapter_id)
    response = httpx.post(
        f"{server.url}/internal/adapters",
        json={
            "name": f"id:{adapter_id}",
            "uri": copy.as_uri(),
            "sha256": headers["X-Loraplex-Adapter-Sha256"],
        },
        headers=INTERNAL,
        timeout=30,
    )
    assert response.status_code == 201, response.text
    tensors = load_file(copy / WEIGHTS)
    save_file({k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()}, copy / WEIGHTS)

    swapped = chat(server, "mine", headers)
    assert swapped.status_code == 422, swapped.text
    assert error_of(swapped)["code"] == "adapter_failed"
    assert answer(chat(server, BASE)) == expected["base"]
    assert answer(chat(server, "uppercase")) == expected["uppercase"]
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
