"""An engine's /metrics is the internal token's (issue 29, item 7).

Before: /metrics answered anyone who reached the pod, and its per-tenant counters were labelled with the
tenant ids the gateway sends. Now, with LORAPLEX_INTERNAL_TOKEN set (every cluster), /metrics needs the
token, in the gateway's header or as `Authorization: Bearer` (how Prometheus sends a Secret); and no
series names a tenant unless the operator turns `tenant_metrics` on, and then under an opaque id (a keyed
hash under the internal token), never the tenant's id or name.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loraplex.engine.server.metrics import opaque_tenant_id, tenant_label_key
from tests.engine.server.conftest import BASE, INTERNAL, TOKEN, Server, running_server

ENGINE = {"num_pages": 64, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def server(engine_factory: Any) -> Iterator[Server]:
    with running_server(engine_factory, ENGINE, internal_token=TOKEN) as shared:
        yield shared


def opaque(tenant: str) -> str:
    """The label an engine with TOKEN gives `tenant`."""
    return opaque_tenant_id(tenant_label_key(TOKEN), tenant)


def metrics(server: Server, headers: dict[str, str]) -> httpx.Response:
    return httpx.get(f"{server.url}/metrics", headers=headers, timeout=10)


def complete_as(server: Server, tenant: str) -> None:
    """One request through the gateway's door: the token and the tenant's id."""
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": BASE, "prompt": "Hi", "max_tokens": 2, "temperature": 0},
        headers={**INTERNAL, "X-Loraplex-Tenant": tenant},
        timeout=60,
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"X-Loraplex-Internal-Token": TOKEN + "x"},
        {"X-Loraplex-Internal-Token": ""},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": TOKEN},  # no scheme
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
        {"X-Loraplex-Internal-Token": "wrong", "Authorization": f"Bearer {TOKEN}"},  # the header decides
    ],
    ids=["none", "wrong", "empty", "short bearer", "no scheme", "basic", "empty bearer", "wrong header"],
)
def test_metrics_are_refused_without_the_internal_token(server: Server, headers: dict[str, str]) -> None:
    refused = metrics(server, headers)
    assert refused.status_code == 401, refused.text
    assert "loraplex_" not in refused.text and "vllm:" not in refused.text
    error = refused.json()["error"]
    assert error["code"] in ("missing_internal_token", "invalid_internal_token")
    if error["code"] == "missing_internal_token":  # says how to get in
        assert "X-Loraplex-Internal-Token" in error["message"] and "Bearer" in error["message"]


@pytest.mark.parametrize(
    "headers",
    [INTERNAL, {"Authorization": f"Bearer {TOKEN}"}, {"authorization": f"bearer  {TOKEN}"}],
    ids=["gateway header", "bearer", "bearer, any case"],
)
def test_the_token_holder_reads_metrics(server: Server, headers: dict[str, str]) -> None:
    allowed = metrics(server, headers)
    assert allowed.status_code == 200, allowed.text
    assert "\nloraplex_requests_waiting " in allowed.text  # the autoscaler's gauge
    assert "\nvllm:num_requests_waiting{" in allowed.text  # the model-server protocol's


def test_a_bearer_token_opens_metrics_only(server: Server) -> None:
    """The bearer form is for Prometheus on /metrics; the API keeps to the gateway's header."""
    for path in ("/v1/models", "/internal/adapters"):
        response = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert response.status_code == 401, (path, response.text)


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_probes_stay_open(server: Server, path: str) -> None:
    assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 200


def test_no_series_names_or_counts_a_tenant_by_default(server: Server) -> None:
    tenant = f"acme-{uuid.uuid4()}"
    complete_as(server, tenant)
    text = server.metrics()
    assert tenant not in text and "acme" not in text
    assert "loraplex_tenant_" not in text  # no per-tenant series at all
    assert server.sample("loraplex_prompt_tokens_total") > 0  # the request was counted, unlabelled


def test_tenant_metrics_label_tenants_by_an_opaque_id(engine_factory: Any) -> None:
    with running_server(engine_factory, ENGINE, internal_token=TOKEN, tenant_metrics=True) as first:
        tenant = f"acme-{uuid.uuid4()}"
        complete_as(first, tenant)
        text = first.metrics()
        prompt = first.sample("loraplex_tenant_prompt_tokens_total", f'tenant="{opaque(tenant)}"')
        generated = first.sample("loraplex_tenant_generation_tokens_total", f'tenant="{opaque(tenant)}"')
    assert tenant not in text and "acme" not in text
    labels = set(re.findall(r'^loraplex_tenant_\w+_total\{tenant="([^"]*)"\}', text, re.MULTILINE))
    expected = opaque(tenant)
    assert re.fullmatch(r"t-[0-9a-f]{16}", expected)
    assert labels == {expected}, labels
    assert prompt > 0 and generated > 0
    # Keyed by the internal token: another engine of the cluster gives the tenant the same label (sums
    # across pods work); a different token (another cluster, or a guess) gives another.
    assert opaque(tenant) == expected
    assert opaque_tenant_id(tenant_label_key(TOKEN + "x"), tenant) != expected
