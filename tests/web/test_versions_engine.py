"""Two versions of one adapter served side by side by a real engine (SmolLM2 on the CPU) behind the
control plane: each version is its own engine adapter, requests for both run at once, and every reply is
its version's own (greedy), even for requests sent before a rollback switched the name to the other."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from loraplex import wire
from loraplex.web.app import create_app
from tests.engine.server.conftest import TOKEN, Server, running_server

from .conftest import ADMIN, FILES, make_settings
from .servers import serve

DEMO = Path(__file__).resolve().parents[2] / "fixtures" / "adapters" / "demo-uppercase"
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Name two colours of the sky."}]


@pytest.fixture(scope="module")
def engine_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("versions-store")


@pytest.fixture(scope="module")
def engine(engine_factory: Any, engine_store: Path) -> Iterator[Server]:
    overrides = {"max_num_seqs": 8}
    with running_server(
        engine_factory, overrides, internal_token=TOKEN, adapter_store=str(engine_store)
    ) as server:
        yield server


@pytest.fixture
def plane(
    pg_url: str, engine: Server, engine_store: Path, tmp_path: Path
) -> Iterator[tuple[str, dict[str, str]]]:
    """A served control plane on the engine's store, deployment `smol` on the engine, a tenant's key."""
    with ExitStack() as stack:
        app = create_app(make_settings(pg_url, tmp_path, adapter_store=str(engine_store)))
        url = stack.enter_context(serve(app))
        made = httpx.post(
            f"{url}/admin/v1/deployments",
            json={"name": "smol", "base_model": BASE_MODEL, "endpoints": [engine.url]},
            headers=ADMIN,
        )
        assert made.status_code == 201, made.text
        tenant = httpx.post(f"{url}/admin/v1/tenants", json={"name": "acme"}, headers=ADMIN).json()
        key = httpx.post(f"{url}/admin/v1/tenants/{tenant['id']}/keys", json={"name": "k"}, headers=ADMIN)
        yield url, {"Authorization": f"Bearer {key.json()['key']}"}


def upload(url: str, headers: dict[str, str], files: dict[str, bytes]) -> dict[str, Any]:
    parts = [("files", (n, content, "application/octet-stream")) for n, content in files.items()]
    response = httpx.post(
        f"{url}/api/v1/adapters", data={"name": "shout", "deployment": "smol"}, files=parts, headers=headers
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def reply(url: str, headers: dict[str, str], model: str) -> str:
    client = OpenAI(base_url=f"{url}/v1", api_key=headers["Authorization"][7:], max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=model, messages=HI, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    return answer.choices[0].message.content or ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_versions_are_two_engine_adapters_served_at_once(
    engine: Server, plane: tuple[str, dict[str, str]]
) -> None:
    url, headers = plane
    demo = {name: (DEMO / name).read_bytes() for name in FILES}
    v1 = upload(url, headers, demo)
    # Version 2: the same weights at a quarter of the scale (lora_alpha 16 -> 4): other bytes, other replies.
    config = json.loads(demo[FILES[0]]) | {"lora_alpha": 4}
    v2 = upload(url, headers, {**demo, FILES[0]: json.dumps(config).encode()})
    assert (v1["version"], v2["version"]) == (1, 2) and v1["sha256"] != v2["sha256"]

    alone = {model: reply(url, headers, model) for model in ("shout@1", "shout@2")}
    assert alone["shout@1"] != alone["shout@2"], alone
    assert reply(url, headers, "shout") == alone["shout@2"]  # the bare name: the active version

    # Both versions at once, and the name switched back to version 1 while its requests run: each reply is
    # the one of the version it was sent to (the bare name's as it was when it was sent).
    asks = ["shout@1", "shout@2", "shout", "shout@1", "shout@2", "shout"]
    with ThreadPoolExecutor(len(asks)) as pool:
        running = [pool.submit(reply, url, headers, model) for model in asks]
        rolled = httpx.post(f"{url}/api/v1/adapters/shout/rollback", json={"version": 1}, headers=headers)
        assert rolled.status_code == 200 and rolled.json()["version"] == 1
        after = pool.submit(reply, url, headers, "shout")
        replies = [r.result() for r in running]
    for model, text in zip(asks, replies, strict=True):
        if model == "shout":
            assert text in alone.values(), text  # sent before or after the switch: one version's own
        else:
            assert text == alone[model], model
    assert after.result() == alone["shout@1"]

    listed = httpx.get(f"{engine.url}{wire.ADAPTERS_PATH}", headers={wire.INTERNAL_TOKEN_HEADER: TOKEN})
    names = {entry["name"] for entry in listed.json()["data"]}
    assert {wire.adapter_name(v1["id"]), wire.adapter_name(v2["id"])} <= names  # two engine adapters
