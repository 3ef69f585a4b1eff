"""schemathesis against the engine's OpenAPI document: no input makes the engine answer 5xx.

Runs against a real engine server (SmolLM2 on the CPU) with the internal token, so generated requests
reach the routes, the engine and its adapter registry, not only the token check. The context is short
(max_model_len 48), so no generated request can ask for more than a few dozen tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis

# schemathesis loads its OpenAPI modules on first use, and pytest rewrites their asserts as it imports them
# (schemathesis is a pytest plugin). A test elsewhere in the same worker that ends in a RecursionError (the
# deep-nesting JSON refusals) can leave CPython 3.11's AST recursion counter off, and that import then fails
# with "SystemError: AST constructor recursion depth mismatch": so they are imported here, at collection.
import schemathesis.specs.openapi.schemas
from hypothesis import HealthCheck, given, settings

from tests.engine.server.conftest import DEMO_ADAPTER, INTERNAL, TOKEN, Server, running_server


@pytest.fixture(scope="module")
def server(engine_factory: Any) -> Iterator[Server]:
    engine = {"num_pages": 64, "max_num_seqs": 8, "max_model_len": 48}
    with running_server(
        engine_factory, engine, internal_token=TOKEN, adapters=[f"uppercase={DEMO_ADAPTER}"]
    ) as shared:
        yield shared


@pytest.mark.slow
def test_no_server_errors(server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=INTERNAL)
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/internal/adapters"} <= paths

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            response = case.call(base_url=server.url, headers=INTERNAL, timeout=120)
            assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.text[:300]}"

        check()
    # Whatever it sent, the engine is still ready and the adapter it started with still serves.
    assert server.state.ready
    assert "uppercase" in server.engine.registry
