"""schemathesis against the OpenAPI schema: no input makes the control plane answer 5xx."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis

# schemathesis loads its OpenAPI modules on first use, and pytest rewrites their asserts as it imports them
# (schemathesis is a pytest plugin). A test elsewhere in the same worker that ends in a RecursionError (the
# deep-nesting JSON refusals) can leave CPython 3.11's AST recursion counter off, and that import then fails
# with "SystemError: AST constructor recursion depth mismatch": so they are imported here, at collection.
import schemathesis.specs.openapi.schemas
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from loraplex.web.app import create_app

from .conftest import ADMIN, SHAPE, Api, _admin_sql, _with_database, free_port, make_settings


@pytest.fixture(scope="module")
def schema_app(
    pg_admin_url: str, pg_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FastAPI]:
    name = f"lpx_schema_{uuid.uuid4().hex[:12]}"
    _admin_sql(pg_admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    data: Path = tmp_path_factory.mktemp("schema")
    app = create_app(make_settings(_with_database(pg_admin_url, name), data, engine_connect_timeout_s=1.0))
    with TestClient(app) as client:
        api = Api(client)
        api.deployment("tiny", "tiny-llama", [f"http://127.0.0.1:{free_port()}"], shape=SHAPE)
        _, headers = api.tenant_with_key("acme")
        app.state.test_headers = headers
        yield app
    _admin_sql(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_no_server_errors(schema_app: FastAPI) -> None:
    # schemathesis' own pytest plugin does not run under this pytest; drive its strategies directly.
    schema = schemathesis.openapi.from_asgi("/openapi.json", schema_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            headers = ADMIN if case.path.startswith("/admin") else schema_app.state.test_headers
            response = case.call(headers=headers)
            assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.text[:300]}"

        check()
