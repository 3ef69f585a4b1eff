"""Prewarm (wire.PREWARM_PATH): a pod that joins an adapter's replica set loads it before it takes the
adapter's traffic, so the first request it serves pays no load; failures say whose fault they are."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from loraplex import wire
from loraplex.adapters import AdapterError
from loraplex.adapters.digest import adapter_digest
from loraplex.engine.lora.registry import AdapterRegistry
from loraplex.engine.pool import PagePool

from .conftest import DEMO_ADAPTER, INTERNAL, Server
from .test_adapters_api import WEIGHTS, chat, content, gateway_headers


def prewarm(server: Server, name: str, uri: str, sha256: str | None = None, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}{wire.PREWARM_PATH}",
        json={"name": name, "uri": uri, "sha256": sha256},
        headers={**INTERNAL, **headers},
        timeout=60,
    )


def listed(server: Server, name: str) -> dict[str, object]:
    answer = httpx.get(f"{server.url}{wire.ADAPTERS_PATH}", headers=INTERNAL, timeout=10).json()["data"]
    return dict(next(a for a in answer if a["name"] == name))


def resident(server: Server, name: str) -> bool:
    return bool(listed(server, name)["resident"])


def test_a_prewarmed_adapter_s_first_request_pays_no_load(server: Server, tmp_path: Path) -> None:
    copy = shutil.copytree(DEMO_ADAPTER, tmp_path / "demo")
    adapter_id, sha256 = str(uuid.uuid4()), adapter_digest(copy)
    name = f"id:{adapter_id}"
    loads = server.sample("loraplex_adapter_loads_total")

    warmed = prewarm(server, name, copy.as_uri(), sha256)
    assert warmed.status_code == 200, warmed.text
    assert warmed.json() == {"name": name, "sha256": sha256, "level": "device"}
    assert resident(server, name)
    assert server.sample("loraplex_adapter_loads_total") == loads + 1
    # Twice is harmless: nothing is read or copied again.
    assert prewarm(server, name, copy.as_uri(), sha256).json()["level"] == "device"
    assert server.sample("loraplex_adapter_loads_total") == loads + 1

    # The store goes away: a request could only be served from what the prewarm loaded.
    shutil.rmtree(copy)
    answer = chat(server, "mine", gateway_headers(adapter_id, copy.as_uri(), sha256, "tenant-w"))
    assert content(answer).isupper()
    server.wait_idle()
    assert server.sample("loraplex_adapter_loads_total") == loads + 1  # no load on the request path
    counts = listed(server, name)  # and the adapter's own counts say so, on this pod
    assert (counts["admissions"], counts["cold_admissions"], counts["loads"]) == (1, 0, 1)


def test_a_request_that_waits_for_its_adapter_s_load_is_counted_cold(server: Server, tmp_path: Path) -> None:
    copy = shutil.copytree(DEMO_ADAPTER, tmp_path / "demo")
    adapter_id, sha256 = str(uuid.uuid4()), adapter_digest(copy)
    headers = gateway_headers(adapter_id, copy.as_uri(), sha256, "tenant-c")
    for _ in range(2):  # the first loads it, the second finds it in the pool
        assert content(chat(server, "mine", headers)).isupper()
    server.wait_idle()
    counts = listed(server, f"id:{adapter_id}")
    assert (counts["admissions"], counts["cold_admissions"], counts["loads"]) == (2, 1, 1)


def test_prewarm_failures_say_whose_fault(server: Server, tmp_path: Path) -> None:
    copy = shutil.copytree(DEMO_ADAPTER, tmp_path / "demo")
    assert prewarm(server, "id:x", copy.as_uri(), **{wire.INTERNAL_TOKEN_HEADER: "wrong"}).status_code == 401
    assert prewarm(server, "id:x", copy.as_uri(), **{wire.INTERNAL_TOKEN_HEADER: ""}).status_code == 401

    mismatch = prewarm(server, f"id:{uuid.uuid4()}", copy.as_uri(), "f" * 64)
    assert mismatch.status_code == 422 and mismatch.json()["error"]["code"] == wire.ADAPTER_FAILED

    # Registered fine, damaged before the prewarm reads the weights: refused with the reason.
    adapter_id = str(uuid.uuid4())
    registered = httpx.post(
        f"{server.url}{wire.ADAPTERS_PATH}",
        json={"name": f"id:{adapter_id}", "uri": copy.as_uri()},
        headers=INTERNAL,
        timeout=30,
    )
    assert registered.status_code == 201
    (copy / WEIGHTS).write_bytes(b"not safetensors any more")
    damaged = prewarm(server, f"id:{adapter_id}", copy.as_uri())
    assert damaged.status_code == 422 and damaged.json()["error"]["code"] == wire.ADAPTER_FAILED
    assert not resident(server, f"id:{adapter_id}")
    assert content(chat(server, "uppercase")).isupper()  # the others are served all along


class Source:
    manifest = SimpleNamespace(sha256="0" * 64)


def test_a_warm_adapter_is_idle_and_gives_way_like_any_idle_one() -> None:
    pool = PagePool(num_pages=8)
    registry = AdapterRegistry(pool)
    for name in ("a", "b", "c"):
        registry.register(name, Source(), num_pages=4)  # type: ignore[arg-type]

    load = registry.warm("a")
    assert load is not None and load.name == "a" and len(load.pages) == 4
    registry.loaded("a")
    assert registry.warm("a") is None  # resident and loaded: nothing to copy
    registry.add_user("b")
    assert registry.acquire("b")  # a request holds b: the pool is full now
    registry.loaded("b")
    # c may take a's pages (idle), never b's (held): a goes, c comes.
    assert registry.warm("c") is not None
    assert registry.resident_names() == ["b", "c"]
    registry.add_user("a")
    assert registry.acquire("a")  # and c, idle, gives way to a request in turn
    assert registry.resident_names() == ["b", "a"]
    # Per adapter: admissions, those that found it not loaded (a waited for its reload), loads.
    counts = {n: (e.admissions, e.cold_admissions, e.loads) for n in "abc" if (e := registry.entry(n))}
    assert counts == {"a": (1, 1, 1), "b": (1, 1, 1), "c": (0, 0, 0)}


def test_warming_what_cannot_be_warmed_says_why() -> None:
    pool = PagePool(num_pages=8)
    registry = AdapterRegistry(pool)
    registry.register("a", Source(), num_pages=4)  # type: ignore[arg-type]
    registry.register("b", Source(), num_pages=7)  # type: ignore[arg-type]
    with pytest.raises(AdapterError, match="not registered"):
        registry.warm("nobody")
    registry.mark_failed("a", "weights not finite")
    with pytest.raises(AdapterError, match="weights not finite"):
        registry.warm("a")
    registry.add_user("b")
    assert registry.acquire("b")
    registry.register("c", Source(), num_pages=2)  # type: ignore[arg-type]
    assert registry.warm("c") is None  # every page is held by a request: the host copy has to do
    assert registry.resident_names() == ["b"]
    # A warm load that failed through no fault of the adapter gives its pages back.
    registry.release("b")
    registry.remove_user("b")
    assert registry.warm("c") is not None
    registry.unwarm("c")
    assert "c" not in registry.resident_names()
