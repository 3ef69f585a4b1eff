"""Migration 0007 on existing data: every adapter becomes version 1 of its name (the active one) and every
key keeps full scope; downgrading keeps each name's active version, gives back what the others held, and
revokes the keys that were limited (before 0007 they would have had full scope)."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import Connection, Engine, text

from loraplex.web.db.migrate import downgrade, upgrade
from loraplex.web.db.session import make_engine

NOW = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


@pytest.fixture(params=["postgres", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("empty_pg_url"))
    return f"sqlite:///{tmp_path / 'old.db'}"


def _insert(connection: Connection, table: str, **values: object) -> None:
    """A row written through typed columns, so ids and times are stored as each database stores them."""
    kinds = {uuid.UUID: sa.Uuid(), dt.datetime: sa.DateTime(timezone=True), dt.date: sa.Date()}
    columns = [sa.column(k, kinds.get(type(v))) for k, v in values.items()]
    connection.execute(sa.table(table, *columns).insert().values(**values))


def _ids(engine: Engine) -> dict[str, uuid.UUID]:
    """Rows as revision 0006 knew them: a tenant, a deployment, an adapter, a key and a usage record."""
    ids = {name: uuid.uuid4() for name in ("tenant", "deployment", "adapter", "key")}
    tenant = ids["tenant"]
    with engine.begin() as c:
        _insert(c, "tenants", id=tenant, name="acme", disabled=False, created_at=NOW)
        _insert(
            c,
            "deployments",
            id=ids["deployment"],
            name="d",
            base_model="m",
            num_layers=1,
            hidden_size=1,
            intermediate_size=1,
            q_size=1,
            kv_size=1,
            endpoints="[]",
            created_at=NOW,
        )
        _adapter(c, ids["adapter"], tenant, ids["deployment"], "a" * 64, 100)
        _insert(c, "storage_usage", tenant_id=tenant, adapters=1, bytes=100)
        _insert(
            c,
            "api_keys",
            id=ids["key"],
            tenant_id=tenant,
            name="k",
            key_hash="h" * 64,
            prefix="lpx_x",
            created_at=NOW,
        )
        _insert(
            c,
            "usage_records",
            tenant_id=tenant,
            api_key_id=ids["key"],
            adapter_id=ids["adapter"],
            model="poet",
            endpoint="completions",
            prompt_tokens=1,
            completion_tokens=1,
            cached_tokens=0,
            exact=True,
            latency_ms=1,
            status="ok",
            created_at=NOW,
            day=NOW.date(),
        )
    return ids


def _adapter(
    c: Connection,
    adapter_id: uuid.UUID,
    tenant: uuid.UUID,
    deployment: uuid.UUID,
    digest: str,
    size: int,
    **more: object,
) -> None:
    _insert(
        c,
        "adapters",
        id=adapter_id,
        tenant_id=tenant,
        deployment_id=deployment,
        name="poet",
        status="ready",
        target_modules="[]",
        bytes=size,
        sha256=digest,
        storage_uri=f"file:///{digest[:4]}",
        created_at=NOW,
        **more,
    )
    _insert(c, "artifacts", digest=digest, uri="u", bytes=size, refcount=1, created_at=NOW)


def test_existing_adapters_become_version_1_and_keys_keep_full_scope(url: str) -> None:
    upgrade(url, "0006")
    engine = make_engine(url)
    try:
        ids = _ids(engine)
        upgrade(url, "0007")
        with engine.connect() as c:
            version, uploaded_by = c.execute(text("SELECT version, uploaded_by FROM adapters")).one()
            assert (version, uploaded_by) == (1, None)
            assert c.execute(text("SELECT name, active_version, last_version FROM adapter_names")).one() == (
                "poet",
                1,
                1,
            )
            scope, limited_to, base = c.execute(
                text("SELECT scope, adapters, base_model FROM api_keys")
            ).one()
            assert (scope, limited_to, bool(base)) == ("all", None, True)
            # The usage record still names its adapter and key (SQLite rebuilt the adapters table).
            links = c.execute(text("SELECT adapter_id, api_key_id FROM usage_records")).one()
            assert [uuid.UUID(str(v)) for v in links] == [ids["adapter"], ids["key"]]

        # A second version (active) and a limited key, then back to 0006.
        with engine.begin() as c:
            _adapter(c, uuid.uuid4(), ids["tenant"], ids["deployment"], "b" * 64, 50, version=2)
            c.execute(text("UPDATE storage_usage SET bytes = 150"))
            c.execute(text("UPDATE adapter_names SET active_version = 2, last_version = 2"))
            _insert(
                c,
                "api_keys",
                id=uuid.uuid4(),
                tenant_id=ids["tenant"],
                name="reader",
                key_hash="r" * 64,
                prefix="lpx_y",
                created_at=NOW,
                scope="read",
                base_model=True,
            )
        downgrade(url, "0006")
        with engine.connect() as c:
            assert c.execute(text("SELECT sha256, bytes FROM adapters")).one() == ("b" * 64, 50)
            refcounts = dict(c.execute(text("SELECT digest, refcount FROM artifacts")).all())
            assert refcounts == {"a" * 64: 0, "b" * 64: 1}  # the sweep deletes the first at next start
            assert c.execute(text("SELECT adapters, bytes FROM storage_usage")).one() == (1, 50)
            revoked = dict(c.execute(text("SELECT name, revoked_at FROM api_keys")).all())
            assert revoked["k"] is None and revoked["reader"] is not None
            links = c.execute(text("SELECT adapter_id, api_key_id FROM usage_records")).one()
            assert links[0] is None and uuid.UUID(str(links[1])) == ids["key"]  # its version was deleted
    finally:
        engine.dispose()
