"""Canary splits (issue 28 item 2): a name's requests shared between ready versions by weight, sticky per
caller (`user`) when asked; the split's API, how it meets uploads, rollback and deletes; and the gateway
sending each request to the version the split gives it, with usage per version."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loraplex.web.services.traffic import choose_version

from .conftest import SHAPE, Api, loose, recorded_usage, upload
from .servers import StubEngine, serve

HI = [{"role": "user", "content": "hi"}]


# -- the choice, on its own -------------------------------------------------------------------------------


def test_every_point_of_the_weights_goes_to_its_version() -> None:
    split = {"1": 90, "2": 10, "3": 0}
    counts = collections.Counter(
        choose_version(split, sticky=False, caller=None, salt="s", draw=lambda _t, p=p: p) for p in range(100)
    )
    assert counts == {1: 90, 2: 10}  # a weight of 0 gets nothing


def test_a_sticky_caller_keeps_its_version_and_raising_the_canary_only_moves_callers_onto_it() -> None:
    callers = [f"user-{i}" for i in range(2000)]
    at_10 = {c: choose_version({"1": 90, "2": 10}, True, c, "t/poet") for c in callers}
    assert all(choose_version({"1": 90, "2": 10}, True, c, "t/poet") == at_10[c] for c in callers[:50])
    share = sum(v == 2 for v in at_10.values()) / len(callers)
    assert 0.07 < share < 0.13
    at_30 = {c: choose_version({"1": 70, "2": 30}, True, c, "t/poet") for c in callers}
    assert all(at_30[c] == 2 for c in callers if at_10[c] == 2)  # nobody on the canary leaves it
    assert 0.26 < sum(v == 2 for v in at_30.values()) / len(callers) < 0.34
    # Another name (or tenant) places the same caller independently.
    elsewhere = {c: choose_version({"1": 90, "2": 10}, True, c, "t/other") for c in callers}
    assert elsewhere != at_10
    # Not sticky, or no caller: drawn each time.
    drawn = {choose_version({"1": 1, "2": 1}, False, "same", "t/poet") for _ in range(200)}
    assert drawn == {1, 2}


# -- the API ------------------------------------------------------------------------------------------------


@pytest.fixture
def tenant(pg_client: TestClient, peft_dir: Path, peft_dir_2: Path) -> dict[str, str]:
    api = Api(pg_client)
    api.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
    _, headers = api.tenant_with_key("acme")
    for directory in (peft_dir, peft_dir_2):
        assert upload(pg_client, headers, loose(directory)).status_code == 201
    return headers


def test_a_split_is_set_shown_and_ended(pg_client: TestClient, tenant: dict[str, str]) -> None:
    split = pg_client.put("/api/v1/adapters/a1/traffic", json={"traffic": {"1": 90, "2": 10}}, headers=tenant)
    assert split.status_code == 200, split.text
    assert split.json()["traffic"] == {"1": 90, "2": 10} and split.json()["sticky"] is True
    assert split.json()["version"] == 2  # the active version stays what it was
    listed = pg_client.get("/api/v1/adapters/a1/versions", headers=tenant).json()
    assert [(v["version"], v["weight"]) for v in listed] == [(1, 90), (2, 10)]
    ended = pg_client.delete("/api/v1/adapters/a1/traffic", headers=tenant)
    assert ended.status_code == 200 and ended.json()["traffic"] is None
    assert [v["weight"] for v in pg_client.get("/api/v1/adapters/a1/versions", headers=tenant).json()] == [
        None,
        None,
    ]


@pytest.mark.parametrize(
    "body",
    [
        {"traffic": {}},
        {"traffic": {"0": 1}},
        {"traffic": {"one": 1}},
        {"traffic": {"1": -1}},
        {"traffic": {"1": 0, "2": 0}},
        {"traffic": {"1": 1.5}},
        {"traffic": {"1": 10**7}},
        {"traffic": {str(v): 1 for v in range(1, 18)}},
        {"traffic": {"1": 1}, "sticky": "maybe"},
    ],
)
def test_a_split_out_of_bounds_is_a_422(pg_client: TestClient, tenant: dict[str, str], body: object) -> None:
    assert pg_client.put("/api/v1/adapters/a1/traffic", json=body, headers=tenant).status_code == 422


def test_a_split_holds_ready_versions_only_and_keeps_them(
    pg_client: TestClient, tenant: dict[str, str], peft_dir: Path
) -> None:
    refused = pg_client.put("/api/v1/adapters/a1/traffic", json={"traffic": {"1": 1, "3": 1}}, headers=tenant)
    assert refused.status_code == 409 and "version 3" in refused.json()["detail"]
    missing = pg_client.put("/api/v1/adapters/nope/traffic", json={"traffic": {"1": 1}}, headers=tenant)
    assert missing.status_code == 404
    pg_client.put("/api/v1/adapters/a1/traffic", json={"traffic": {"1": 50, "2": 50}}, headers=tenant)
    in_split = pg_client.delete("/api/v1/adapters/a1/versions/1", headers=tenant)
    assert in_split.status_code == 409 and "traffic split" in in_split.json()["detail"]
    # A rollback ends the split: the version it names takes every request.
    rolled = pg_client.post("/api/v1/adapters/a1/rollback", json={"version": 1}, headers=tenant)
    assert rolled.status_code == 200 and rolled.json()["traffic"] is None and rolled.json()["version"] == 1
    assert pg_client.delete("/api/v1/adapters/a1/versions/2", headers=tenant).status_code == 204


def test_an_upload_under_a_split_does_not_move_its_requests(
    pg_client: TestClient, tenant: dict[str, str], peft_dir: Path
) -> None:
    from tests.adapters.conftest import make_peft_adapter

    pg_client.put("/api/v1/adapters/a1/traffic", json={"traffic": {"1": 100}}, headers=tenant)  # pinned
    third = peft_dir.parent / "third"
    make_peft_adapter(third, seed=9, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    made = upload(pg_client, tenant, loose(third))
    assert made.status_code == 201 and made.json()["version"] == 3 and made.json()["status"] == "ready"
    shown = pg_client.get("/api/v1/adapters/a1", headers=tenant).json()
    assert shown["version"] == 2 and shown["traffic"] == {"1": 100}  # ready, but not given any request
    back = upload(pg_client, tenant, loose(peft_dir))  # version 1's bytes: the split still decides
    assert (
        back.status_code == 200
        and pg_client.get("/api/v1/adapters/a1", headers=tenant).json()["version"] == 2
    )


# -- through the gateway --------------------------------------------------------------------------------


Served = tuple[FastAPI, str, StubEngine, TestClient, dict[str, str], list[dict[str, Any]]]


@pytest.fixture
def served(
    pg_url: str, app_factory: Callable[..., FastAPI], peft_dir: Path, peft_dir_2: Path
) -> Iterator[Served]:
    with ExitStack() as stack:
        engine = StubEngine("e1")
        engine_url = stack.enter_context(serve(engine.app()))
        app = app_factory(pg_url)
        url = stack.enter_context(serve(app))
        admin = stack.enter_context(TestClient(app_factory(pg_url)))
        api = Api(admin)
        api.deployment("tiny", "tiny-llama", [engine_url], shape=SHAPE)
        _, headers = api.tenant_with_key("acme")
        made = [upload(admin, headers, loose(d), name="poet").json() for d in (peft_dir, peft_dir_2)]
        yield app, url, engine, admin, headers, made


@pytest.mark.timeout(120)
def test_the_gateway_splits_a_name_s_requests_sticky_per_user_with_usage_per_version(served: Served) -> None:
    app, url, engine, admin, headers, made = served
    by_digest = {str(v["sha256"]): int(v["version"]) for v in made}
    split = admin.put("/api/v1/adapters/poet/traffic", json={"traffic": {"1": 50, "2": 50}}, headers=headers)
    assert split.status_code == 200
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key=headers["Authorization"][7:], max_retries=0, timeout=10
    )

    def served_version(**extra: object) -> int:
        client.chat.completions.create(model="poet", messages=HI, **extra)  # type: ignore[arg-type, call-overload]
        return by_digest[engine.received[-1]["headers"]["x-loraplex-adapter-sha256"]]

    users = [f"user-{i}" for i in range(24)]
    first = {u: served_version(user=u) for u in users}
    assert set(first.values()) == {1, 2}  # both versions serve (each user's share is 1/2)
    assert all(served_version(user=u) == first[u] for u in users[:8])  # and each user keeps its own
    assert all(served_version() in (1, 2) for _ in range(4))

    # Usage per version: the name as asked, the version that served it.
    rows = recorded_usage(app, count=len(users) + 8 + 4)
    assert {r.model for r in rows} == {"poet"}
    summary = admin.get("/api/v1/usage", params={"by_version": True}, headers=headers).json()
    per_version = {r["version"]: r["requests"] for r in summary["rows"]}
    served_counts = collections.Counter(
        by_digest[r["headers"]["x-loraplex-adapter-sha256"]] for r in engine.received
    )
    assert per_version == dict(served_counts) and sum(per_version.values()) == len(rows)
    plain = admin.get("/api/v1/usage", headers=headers).json()["rows"]
    assert [(r["model"], r["version"], r["requests"]) for r in plain] == [("poet", None, len(rows))]

    # name@N is never split; ending the split sends everything to the active version (2).
    assert by_digest[_sent_after(client, engine, "poet@1")] == 1
    admin.delete("/api/v1/adapters/poet/traffic", headers=headers)
    assert {served_version(user=u) for u in users[:6]} == {2}


def _sent_after(client: openai.OpenAI, engine: StubEngine, model: str) -> str:
    client.chat.completions.create(model=model, messages=HI)  # type: ignore[arg-type]
    return str(engine.received[-1]["headers"]["x-loraplex-adapter-sha256"])
