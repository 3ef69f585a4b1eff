# ruff: noqa: F811  (the fixtures imported from tests/web/conftest come back as test parameters)
"""Artifacts and storage quotas: what one tenant can do to another's adapters through the artifact store,
and whether quotas hold under parallel uploads (on Postgres and SQLite)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from loraplex.adapters import DigestMismatch, LocalArtifactStore, StoreUnavailable, adapter_digest, local_path
from loraplex.adapters.manifest import WEIGHTS_FILE
from loraplex.adapters.peft_config import CONFIG_FILE
from loraplex.web.db.models import Adapter, Artifact, StorageUsage
from tests.web.conftest import (  # noqa: F401  (fixtures)
    ADMIN,
    SHAPE,
    Api,
    api,
    app_factory,
    client,
    db_url,
    empty_pg_url,
    loose,
    peft_dir,
    pg_admin_url,
    pg_template,
    pg_url,
    sqlite_template,
    sqlite_url,
    upload,
)


@dataclass
class Tenant:
    id: str
    headers: dict[str, str]


@dataclass
class Platform:
    client: TestClient
    api: Api
    a: Tenant
    b: Tenant

    def set_quota(self, tenant: Tenant, **limits: int) -> None:
        response = self.client.put(f"/admin/v1/tenants/{tenant.id}/quota", json=limits, headers=ADMIN)
        assert response.status_code == 200, response.text

    def storage(self, tenant: Tenant) -> dict[str, int | None]:
        response = self.client.get("/api/v1/storage", headers=tenant.headers)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def rows(self, model: type) -> list:  # type: ignore[type-arg]
        with self.client.app.state.db.session() as session:  # type: ignore[attr-defined]
            return list(session.scalars(select(model)))

    @property
    def root(self) -> Path:
        return Path(self.client.app.state.settings.artifacts())  # type: ignore[attr-defined]

    def objects(self) -> list[str]:
        """The digests the store holds (staging and deleted folders start with a dot)."""
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith("."))


@pytest.fixture
def platform(client: TestClient, api: Api) -> Platform:
    api.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
    tenants = []
    for name in ("tenant-a", "tenant-b"):
        tenant, headers = api.tenant_with_key(name)
        tenants.append(Tenant(str(tenant["id"]), headers))
    return Platform(client, api, *tenants)


def with_config(peft_dir: Path, **changes: object) -> list[tuple[str, bytes]]:
    """The same weights with another adapter_config.json."""
    config = json.loads((peft_dir / CONFIG_FILE).read_bytes())
    config.update(changes)
    return [
        (CONFIG_FILE, json.dumps(config).encode()),
        (WEIGHTS_FILE, (peft_dir / WEIGHTS_FILE).read_bytes()),
    ]


def total_bytes(files: list[tuple[str, bytes]]) -> int:
    return sum(len(content) for _, content in files)


def test_same_weights_with_another_config_is_another_artifact(platform: Platform, peft_dir: Path) -> None:
    """Tenant B uploads A's weights with a config of its own (another alpha): the old weights-only
    identity gave both one artifact, so whichever config was stored first served both tenants."""
    mine = loose(peft_dir)
    theirs = with_config(peft_dir, lora_alpha=128)
    first = upload(platform.client, platform.a.headers, mine, name="shared-weights")
    second = upload(platform.client, platform.b.headers, theirs, name="shared-weights")
    assert first.status_code == second.status_code == 201, (first.text, second.text)
    assert first.json()["sha256"] != second.json()["sha256"]
    assert len(platform.objects()) == 2

    store = platform.client.app.state.store  # type: ignore[attr-defined]
    served = {}
    for row in platform.rows(Adapter):  # what the gateway sends the engine: the row's URI and digest
        fetched = store.fetch(row.storage_uri, row.sha256)
        served[str(row.tenant_id)] = (fetched / CONFIG_FILE).read_bytes()
    assert served == {platform.a.id: mine[0][1], platform.b.id: theirs[0][1]}  # each its own, byte for byte


def test_an_artifact_is_deleted_with_its_last_adapter(platform: Platform, peft_dir: Path) -> None:
    files = loose(peft_dir)
    digest = upload(platform.client, platform.a.headers, files, name="x").json()["sha256"]
    assert upload(platform.client, platform.b.headers, files, name="y").json()["sha256"] == digest
    assert upload(platform.client, platform.b.headers, files, name="z").status_code == 201
    assert platform.objects() == [digest]  # stored once
    assert [(a.digest, a.refcount) for a in platform.rows(Artifact)] == [(digest, 3)]

    assert platform.client.delete("/api/v1/adapters/x", headers=platform.a.headers).status_code == 204
    assert platform.client.delete("/api/v1/adapters/y", headers=platform.b.headers).status_code == 204
    assert platform.objects() == [digest]  # kept while tenant B's "z" uses it
    store = platform.client.app.state.store  # type: ignore[attr-defined]
    assert store.fetch(store.uri_of(digest), digest).is_dir()

    assert platform.client.delete("/api/v1/adapters/z", headers=platform.b.headers).status_code == 204
    assert platform.objects() == []  # gone with the last adapter
    assert platform.rows(Artifact) == []
    # Another tenant cannot delete what is not theirs (and learns nothing: a plain 404).
    assert upload(platform.client, platform.a.headers, files, name="x").status_code == 201
    assert platform.client.delete("/api/v1/adapters/x", headers=platform.b.headers).status_code == 404
    assert platform.objects() == [digest]


def test_deleting_a_tenant_gives_back_its_artifact_references(
    platform: Platform, peft_dir: Path, db_url: str, app_factory
) -> None:
    files = loose(peft_dir)
    digest = upload(platform.client, platform.a.headers, files, name="x").json()["sha256"]
    assert upload(platform.client, platform.b.headers, files, name="y").status_code == 201
    assert platform.client.delete(f"/admin/v1/tenants/{platform.a.id}", headers=ADMIN).status_code == 204
    assert [(a.digest, a.refcount) for a in platform.rows(Artifact)] == [(digest, 1)]  # B still uses it
    assert platform.client.delete(f"/admin/v1/tenants/{platform.b.id}", headers=ADMIN).status_code == 204
    assert [(a.digest, a.refcount) for a in platform.rows(Artifact)] == [(digest, 0)]
    assert platform.objects() == [digest]  # deleted by the next sweep, here the one at start-up
    with TestClient(app_factory(db_url)):
        pass
    assert platform.objects() == [] and platform.rows(Artifact) == []


def test_storage_quota_counts_the_tenants_bytes(platform: Platform, peft_dir: Path) -> None:
    files = loose(peft_dir)
    size = total_bytes(files)
    platform.set_quota(platform.a, max_storage_bytes=size * 2 - 1)
    assert upload(platform.client, platform.a.headers, files, name="one").status_code == 201
    assert platform.storage(platform.a) == {
        "adapters": 1,
        "max_adapters": None,
        "bytes": size,
        "max_storage_bytes": size * 2 - 1,
    }
    # The same adapter again is stored once, but counted again: a tenant's quota never depends on
    # what other tenants happen to have uploaded.
    refused = upload(platform.client, platform.a.headers, files, name="two")
    # Refused before the body is read (413: more than the storage left), or when the bytes are claimed
    # (403 naming max_storage_bytes) by an upload that raced past that early check.
    assert refused.status_code in (403, 413), refused.text
    assert platform.storage(platform.a)["bytes"] == size and platform.storage(platform.a)["adapters"] == 1
    assert upload(platform.client, platform.b.headers, files, name="two").status_code == 201  # B's own quota

    assert platform.client.delete("/api/v1/adapters/one", headers=platform.a.headers).status_code == 204
    assert platform.storage(platform.a)["bytes"] == 0
    assert upload(platform.client, platform.a.headers, files, name="two").status_code == 201


def parallel_uploads(platform: Platform, files: list[tuple[str, bytes]], count: int) -> list[int]:
    def one(i: int) -> int:
        return int(upload(platform.client, platform.a.headers, files, name=f"p{i}").status_code)

    with ThreadPoolExecutor(count) as pool:
        return sorted(pool.map(one, range(count)))


def test_parallel_uploads_cannot_exceed_max_adapters(platform: Platform, peft_dir: Path) -> None:
    platform.set_quota(platform.a, max_adapters=1)
    statuses = parallel_uploads(platform, loose(peft_dir), 8)
    assert statuses == [201] + [403] * 7, statuses
    assert len(platform.rows(Adapter)) == 1
    assert platform.storage(platform.a)["adapters"] == 1


def test_parallel_uploads_cannot_exceed_max_storage_bytes(platform: Platform, peft_dir: Path) -> None:
    files = with_config(peft_dir, lora_alpha=3)
    platform.set_quota(platform.a, max_storage_bytes=total_bytes(files))  # room for exactly one
    statuses = parallel_uploads(platform, files, 6)
    assert statuses == [201] + [403] * 5, statuses
    assert platform.storage(platform.a) == {
        "adapters": 1,
        "max_adapters": None,
        "bytes": total_bytes(files),
        "max_storage_bytes": total_bytes(files),
    }
    assert [a.refcount for a in platform.rows(Artifact)] == [1]


def test_uploads_and_deletes_of_one_digest_in_parallel_never_lose_its_object(
    platform: Platform, peft_dir: Path
) -> None:
    """Deletes of the last user race uploads of the same digest: the sweep holds the artifact row while
    it deletes the object, so an upload either keeps the row alive or waits and writes the object again."""
    files = loose(peft_dir)
    store = platform.client.app.state.store  # type: ignore[attr-defined]

    def churn(worker: int) -> list[int]:
        statuses = []
        for round_ in range(3):
            name = f"w{worker}-{round_}"
            uploaded = upload(platform.client, platform.a.headers, files, name=name)
            statuses.append(uploaded.status_code)
            digest = uploaded.json()["sha256"]
            assert store.fetch(store.uri_of(digest), digest).is_dir()  # while it is used, it is there
            statuses.append(
                platform.client.delete(f"/api/v1/adapters/{name}", headers=platform.a.headers).status_code
            )
        return statuses

    with ThreadPoolExecutor(5) as pool:
        churning = [pool.submit(churn, worker) for worker in range(4)]
        kept = pool.submit(upload, platform.client, platform.b.headers, files, "keep")
        assert all(status in (201, 204) for job in churning for status in job.result())
        assert kept.result().status_code == 201
    digest = kept.result().json()["sha256"]
    assert [(a.digest, a.refcount) for a in platform.rows(Artifact)] == [(digest, 1)]
    assert store.fetch(store.uri_of(digest), digest).is_dir()  # B's adapter is still servable


def test_every_fetch_rechecks_the_digest(platform: Platform, peft_dir: Path) -> None:
    digest = upload(platform.client, platform.a.headers, loose(peft_dir)).json()["sha256"]
    assert digest == adapter_digest(peft_dir)
    store = platform.client.app.state.store  # type: ignore[attr-defined]
    uri = store.uri_of(digest)
    store.fetch(uri, digest)
    weights = local_path(uri) / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")  # changed in the store after the upload
    with pytest.raises(DigestMismatch):
        store.fetch(uri, digest)


class FlakyStore(LocalArtifactStore):
    """A local store whose writes land but whose answers can be made to fail, like a store that goes
    down mid-request."""

    fail_put = False
    fail_delete = False

    def put(self, directory: Path, digest: str) -> str:
        uri = super().put(directory, digest)
        if self.fail_put:
            raise StoreUnavailable(f"artifact store {self.root}: connection reset")
        return uri

    def delete(self, uri: str) -> None:
        if self.fail_delete:
            raise StoreUnavailable(f"artifact store {self.root}: connection reset")
        super().delete(uri)


@pytest.fixture
def flaky(platform: Platform) -> Iterator[FlakyStore]:
    store = FlakyStore(platform.root)
    platform.client.app.state.store = store  # type: ignore[attr-defined]
    yield store


def test_a_store_failure_mid_upload_leaves_nothing_behind(
    platform: Platform, flaky: FlakyStore, peft_dir: Path
) -> None:
    flaky.fail_put = True
    response = upload(platform.client, platform.a.headers, loose(peft_dir))
    assert response.status_code == 503
    assert f"artifact store {platform.root}" in response.json()["detail"]
    assert platform.rows(Adapter) == [] and platform.rows(Artifact) == []
    assert platform.objects() == []  # the half-done write was cleaned up at once
    assert platform.storage(platform.a)["adapters"] == 0 and platform.storage(platform.a)["bytes"] == 0


def test_a_delete_while_the_store_is_down_is_finished_later(
    platform: Platform, flaky: FlakyStore, peft_dir: Path
) -> None:
    digest = upload(platform.client, platform.a.headers, loose(peft_dir)).json()["sha256"]
    flaky.fail_delete = True
    assert platform.client.delete("/api/v1/adapters/a1", headers=platform.a.headers).status_code == 204
    assert platform.objects() == [digest]  # not deleted yet, but not forgotten:
    assert [(a.digest, a.refcount) for a in platform.rows(Artifact)] == [(digest, 0)]
    flaky.fail_delete = False
    # Uploading the same adapter again revives the artifact rather than losing it to the sweep.
    assert upload(platform.client, platform.b.headers, loose(peft_dir)).status_code == 201
    assert [(a.digest, a.refcount) for a in platform.rows(Artifact)] == [(digest, 1)]
    assert platform.client.delete("/api/v1/adapters/a1", headers=platform.b.headers).status_code == 204
    assert platform.objects() == [] and platform.rows(Artifact) == []


def test_the_startup_sweep_deletes_what_a_failed_delete_left(
    sqlite_url: str, app_factory, peft_dir: Path, tmp_path: Path
) -> None:
    with TestClient(app_factory(sqlite_url)) as client:
        api_ = Api(client)
        api_.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
        _, headers = api_.tenant_with_key("acme")
        assert upload(client, headers, loose(peft_dir)).status_code == 201
        store = FlakyStore(client.app.state.store.root)  # type: ignore[attr-defined]
        store.fail_delete = True
        client.app.state.store = store  # type: ignore[attr-defined]
        assert client.delete("/api/v1/adapters/a1", headers=headers).status_code == 204
        root = store.root
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == [adapter_digest(peft_dir)]
    with TestClient(app_factory(sqlite_url)):  # a restart, the store healthy again
        pass
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []


def test_an_unreachable_store_refuses_the_upload_and_says_which(
    sqlite_url: str, app_factory, peft_dir: Path
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = app_factory(sqlite_url, adapter_store="s3://artifacts/lpx", s3_endpoint_url=closed)
    with TestClient(app) as client:
        api_ = Api(client)
        api_.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
        tenant, headers = api_.tenant_with_key("acme")
        response = upload(client, headers, loose(peft_dir))
        assert response.status_code == 503, response.text
        assert f"s3://artifacts/lpx at {closed}" in response.json()["detail"]
        assert client.get("/api/v1/adapters", headers=headers).json() == []
        assert client.get("/api/v1/storage", headers=headers).json()["adapters"] == 0
        with client.app.state.db.session() as session:  # type: ignore[attr-defined]
            assert session.get(StorageUsage, uuid.UUID(str(tenant["id"]))) is None


# -- the engine's side: it fetches only from its store, and verifies every read ------------------------------


def engine_fetcher(tmp_path: Path, **settings: object):  # type: ignore[no-untyped-def]
    from loraplex.engine.server.registrar import ArtifactFetcher
    from loraplex.engine.server.settings import ServerSettings

    return ArtifactFetcher(ServerSettings(model_cache=tmp_path / "cache", **settings))


def test_the_engine_refuses_an_adapter_changed_after_registration(peft_dir: Path, tmp_path: Path) -> None:
    """The hash used to be checked at registration only, and only over the weights: a config rewritten
    later (here: another alpha, so other outputs) loaded silently. Every load now re-hashes both files."""
    import shutil

    import torch

    from loraplex.engine.lora.sources import DirectorySource
    from tests.adapters.conftest import TINY_SHAPE

    copy = tmp_path / "adapter"
    shutil.copytree(peft_dir, copy)
    source = DirectorySource.open(copy, TINY_SHAPE, adapter_digest(peft_dir))
    assert set(source.load(torch.float32)) == {(layer, m) for layer in (0, 1) for m in ("q", "v")}
    config = json.loads((copy / CONFIG_FILE).read_text())
    (copy / CONFIG_FILE).write_text(json.dumps({**config, "lora_alpha": 1024}))
    with pytest.raises(DigestMismatch, match="changed since it was registered"):
        source.load(torch.float32)
    with pytest.raises(DigestMismatch, match="refusing it"):  # and a new registration is refused too
        DirectorySource.open(copy, TINY_SHAPE, adapter_digest(peft_dir))


def test_the_engine_fetches_only_from_its_store(peft_dir: Path, tmp_path: Path) -> None:
    import asyncio

    from loraplex.engine.server.async_engine import AdapterFetchFailed, AdapterUnavailable

    store = LocalArtifactStore(tmp_path / "store")
    digest = adapter_digest(peft_dir)
    uri = store.put(peft_dir, digest)
    fetcher = engine_fetcher(tmp_path, adapter_store=str(store.root))
    assert asyncio.run(fetcher.local_adapter(uri, digest)) == str(local_path(uri))
    assert asyncio.run(fetcher.local_adapter(digest, digest)) == str(
        local_path(uri)
    )  # relative: in the store
    # Outside the store: refused, and not blamed on the adapter (the control plane, which sent the URI,
    # and this engine are configured with different stores).
    with pytest.raises(
        AdapterUnavailable, match=r"outside the artifact store.*must share LORAPLEX_ADAPTER_STORE"
    ):
        asyncio.run(fetcher.local_adapter(peft_dir.as_uri(), digest))
    with pytest.raises(AdapterFetchFailed, match="no adapter at"):  # inside it, but nothing there
        asyncio.run(fetcher.local_adapter(f"{store.root}/{'0' * 64}", None))
    with pytest.raises(DigestMismatch):  # the gateway's digest is not what the store holds
        asyncio.run(fetcher.local_adapter(uri, "0" * 64))


def test_an_unreachable_store_is_unavailable_to_the_engine_not_a_fault(
    peft_dir: Path, tmp_path: Path
) -> None:
    import asyncio
    import socket

    from loraplex.engine.server.async_engine import AdapterUnavailable

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    fetcher = engine_fetcher(tmp_path, adapter_store="s3://artifacts/lpx", s3_endpoint_url=closed)
    digest = adapter_digest(peft_dir)
    with pytest.raises(AdapterUnavailable, match="could not be read"):
        asyncio.run(fetcher.local_adapter(f"s3://artifacts/lpx/{digest}", digest))


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_migration_0003_counts_existing_adapters_and_asks_for_a_reupload(
    database: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Adapters stored before 0003 count against the new quotas from the start, their objects become
    reference-counted artifacts, and they are marked failed: their weights-only hash can never verify."""
    import datetime as dt

    import sqlalchemy as sa

    from loraplex.web.db.migrate import upgrade
    from loraplex.web.db.session import make_engine

    url = (
        f"sqlite:///{tmp_path / 'old.db'}"
        if database == "sqlite"
        else request.getfixturevalue("empty_pg_url")
    )
    upgrade(url, "0002")
    now = dt.datetime.now(dt.UTC)
    tenant, deployment = uuid.uuid4(), uuid.uuid4()
    weights_hash, uri = "ab" * 32, "file:///old/artifacts/" + "ab" * 32
    when = sa.DateTime(timezone=True)
    tenants = sa.table(
        "tenants",
        sa.column("id", sa.Uuid()),
        sa.column("name"),
        sa.column("disabled"),
        sa.column("created_at", when),
    )
    deployments = sa.table(
        "deployments",
        *(sa.column(c) for c in ("name", "base_model", "num_layers", "hidden_size", "intermediate_size")),
        *(sa.column(c) for c in ("q_size", "kv_size")),
        sa.column("id", sa.Uuid()),
        sa.column("endpoints", sa.JSON()),
        sa.column("created_at", when),
    )
    adapters = sa.table(
        "adapters",
        *(sa.column(c, sa.Uuid()) for c in ("id", "tenant_id", "deployment_id")),
        *(sa.column(c) for c in ("name", "status", "bytes", "sha256", "storage_uri")),
        sa.column("target_modules", sa.JSON()),
        sa.column("created_at", when),
    )
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(tenants.insert().values(id=tenant, name="old", disabled=False, created_at=now))
        connection.execute(
            deployments.insert().values(
                id=deployment, name="d", base_model="m", endpoints=[], created_at=now,
                num_layers=2, hidden_size=64, intermediate_size=96, q_size=64, kv_size=32,
            )
        )  # fmt: skip
        for name in ("one", "two"):  # the same weights twice: one stored object
            connection.execute(
                adapters.insert().values(
                    id=uuid.uuid4(), tenant_id=tenant, deployment_id=deployment, name=name, status="ready",
                    target_modules=["q"], bytes=1000, sha256=weights_hash, storage_uri=uri, created_at=now,
                )
            )  # fmt: skip
    upgrade(url)
    with engine.connect() as connection:
        usage = connection.execute(sa.text("SELECT adapters, bytes FROM storage_usage")).all()
        artifacts = connection.execute(sa.text("SELECT digest, uri, bytes, refcount FROM artifacts")).all()
        states = connection.execute(sa.text("SELECT DISTINCT status, error FROM adapters")).all()
    engine.dispose()
    assert [tuple(row) for row in usage] == [(2, 2000)]
    assert [tuple(row) for row in artifacts] == [(weights_hash, uri, 1000, 2)]
    assert len(states) == 1 and states[0][0] == "failed" and "upload it again" in states[0][1]
