"""Pins over the internal API (wire.PINS_PATH): registered where needed, resident, shown in the listing and
/metrics (pinned label, digest, count); a pin past the pool's budget is a 409 naming the pool that changes
nothing; unpinning lets the adapter go like any other."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import httpx

from loraplex import wire
from loraplex.adapters.digest import adapter_digest

from .conftest import DEMO_ADAPTER, INTERNAL, Server, ServerFactory


def pin(server: Server, name: str, uri: str, sha256: str | None = None) -> httpx.Response:
    return httpx.post(
        f"{server.url}{wire.PINS_PATH}",
        json={"name": name, "uri": uri, "sha256": sha256},
        headers=INTERNAL,
        timeout=60,
    )


def unpin(server: Server, name: str) -> httpx.Response:
    return httpx.delete(f"{server.url}{wire.pin_path(name)}", headers=INTERNAL, timeout=30)


def listing(server: Server) -> dict[str, dict[str, object]]:
    data = httpx.get(f"{server.url}{wire.ADAPTERS_PATH}", headers=INTERNAL, timeout=10).json()["data"]
    return {entry["name"]: entry for entry in data}


def test_pin_over_the_internal_api(make_server: ServerFactory, tmp_path: Path) -> None:
    # A small pool: 40 pages, 1 reserved, half kept for requests (the context is longer): 20 for pins.
    server = make_server(engine={"num_pages": 40})
    copy = shutil.copytree(DEMO_ADAPTER, tmp_path / "demo")
    sha256 = adapter_digest(copy)
    budget = server.engine.registry.pin_budget
    assert budget == 39 - 19

    first = f"id:{uuid.uuid4()}"
    pinned = pin(server, first, copy.as_uri(), sha256)
    assert pinned.status_code == 200, pinned.text
    assert pinned.json() == {"name": first, "sha256": sha256, "level": "device", "pinned": True}
    entry = listing(server)[first]
    assert entry["pinned"] is True and entry["resident"] is True
    assert server.sample("loraplex_adapters_pinned") == 1
    labels = f'adapter_name="{first}",level="gpu",pinned="true",sha256="{sha256}"'
    assert server.sample("loraplex_adapter_loaded", labels) == 1
    assert server.sample(
        "vllm:lora_adapter_loaded", f'adapter_name="{first}",level="gpu",pinned="true",rank="8"'
    )

    # More pins until the budget is spent: the next is 409 pool_full, naming the pool, and changes nothing.
    names = [first]
    size = server.engine.registry.pages_of(first)
    while (len(names) + 1) * size <= budget:
        names.append(f"id:{uuid.uuid4()}")
        assert pin(server, names[-1], copy.as_uri(), sha256).status_code == 200
    refused_name = f"id:{uuid.uuid4()}"
    refused = pin(server, refused_name, copy.as_uri(), sha256)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == wire.POOL_FULL and "pool's 40 pages" in error["message"]
    assert listing(server)[refused_name]["pinned"] is False  # registered, not pinned
    assert server.sample("loraplex_adapters_pinned") == len(names)

    # Unpinned: evictable again, and the refused one fits now.
    assert unpin(server, first).json() == {"name": first, "pinned": False}
    assert listing(server)[first]["pinned"] is False
    assert pin(server, refused_name, copy.as_uri(), sha256).status_code == 200
    assert unpin(server, "id:nobody").status_code == 404
    assert (
        httpx.post(f"{server.url}{wire.PINS_PATH}", json={"name": "x", "uri": copy.as_uri()}).status_code
        == 401
    )
