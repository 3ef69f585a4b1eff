"""Control-plane fixtures: a throwaway Postgres (or LORAPLEX_TEST_DATABASE_URL), a migrated template
database copied per test, a migrated SQLite file copied per test, and app/client factories."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loraplex.web.app import create_app
from loraplex.web.db.migrate import upgrade
from loraplex.web.settings import Settings

ADMIN_TOKEN = "admin-test-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def recorded_usage(app: FastAPI, count: int = 1, timeout: float = 10.0) -> list[Any]:
    """The usage rows, once at least `count` are recorded (the gateway writes them after the response
    ends), or whatever is there after `timeout` seconds."""
    import time

    from sqlalchemy import select

    from loraplex.web.db.models import UsageRecord

    deadline = time.monotonic() + timeout
    while True:
        with app.state.db.session() as session:
            rows = list(session.scalars(select(UsageRecord).order_by(UsageRecord.id)))
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """A Postgres server URL (database `postgres`) that tests may create databases on."""
    given = os.environ.get("LORAPLEX_TEST_DATABASE_URL")
    if given:
        yield given
        return
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL binaries (initdb) and no LORAPLEX_TEST_DATABASE_URL")
    # Not under pytest's temp root: that is private to root, and the server runs as postgres.
    root = Path(tempfile.mkdtemp(prefix="lpx-pg-"))
    data = root / "data"
    prefix: list[str] = []
    if os.geteuid() == 0:  # Postgres refuses to run as root
        shutil.chown(root, "postgres")
        prefix = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    run = dict(check=True, capture_output=True, timeout=60)
    subprocess.run(
        [
            *prefix,
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        ],
        **run,
    )
    options = (
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
    )
    subprocess.run(
        [
            *prefix,
            str(bindir / "pg_ctl"),
            "-D",
            str(data),
            "-o",
            options,
            "-l",
            str(root / "log"),
            "-w",
            "-t",
            "30",
            "start",
        ],
        **run,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(root, ignore_errors=True)


def _with_database(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


def _admin_sql(url: str, sql: str) -> None:
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def pg_template(pg_admin_url: str) -> Iterator[str]:
    """A database migrated to head once; every test copies it (CREATE DATABASE ... TEMPLATE)."""
    name = f"lpx_template_{uuid.uuid4().hex[:8]}"
    _admin_sql(pg_admin_url, f'CREATE DATABASE "{name}"')
    upgrade(_with_database(pg_admin_url, name))
    yield name
    _admin_sql(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url(pg_admin_url: str, pg_template: str) -> Iterator[str]:
    name = f"lpx_test_{uuid.uuid4().hex[:12]}"
    _admin_sql(pg_admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    yield _with_database(pg_admin_url, name)
    _admin_sql(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_pg_url(pg_admin_url: str) -> Iterator[str]:
    name = f"lpx_empty_{uuid.uuid4().hex[:12]}"
    _admin_sql(pg_admin_url, f'CREATE DATABASE "{name}"')
    yield _with_database(pg_admin_url, name)
    _admin_sql(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "loraplex.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test using this runs on Postgres and on SQLite (the single-machine default)."""
    return str(request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url"))


def make_settings(url: str, data_dir: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "database_url": url,
        "data_dir": data_dir,
        "admin_token": ADMIN_TOKEN,
        "key_pepper": "test-pepper",
        "internal_token": "internal-test-token",
        "endpoint_cooldown_s": 30.0,
        "engine_read_timeout_s": 20.0,
        # The engines of these tests listen on 127.0.0.1, as `loraplex up`'s does (tests/security/
        # test_deployment_endpoints.py runs with it off).
        "allow_loopback_endpoints": True,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def app_factory(tmp_path: Path) -> Callable[..., FastAPI]:
    def make(url: str, **overrides: object) -> FastAPI:
        return create_app(make_settings(url, tmp_path, **overrides))

    return make


@pytest.fixture
def client(db_url: str, app_factory: Callable[..., FastAPI]) -> Iterator[TestClient]:
    with TestClient(app_factory(db_url)) as c:
        yield c


@pytest.fixture
def pg_client(pg_url: str, app_factory: Callable[..., FastAPI]) -> Iterator[TestClient]:
    with TestClient(app_factory(pg_url)) as c:
        yield c


class Api:
    """Small helpers over a TestClient: make tenants, keys and deployments through the admin API."""

    def __init__(self, client: TestClient):
        self.client = client

    def tenant(self, name: str) -> dict[str, object]:
        response = self.client.post("/admin/v1/tenants", json={"name": name}, headers=ADMIN)
        assert response.status_code == 201, response.text
        return dict(response.json())

    def key(self, tenant_id: object, name: str = "k", **extra: object) -> str:
        response = self.client.post(
            f"/admin/v1/tenants/{tenant_id}/keys", json={"name": name, **extra}, headers=ADMIN
        )
        assert response.status_code == 201, response.text
        return str(response.json()["key"])

    def tenant_with_key(self, name: str) -> tuple[dict[str, object], dict[str, str]]:
        tenant = self.tenant(name)
        return tenant, {"Authorization": f"Bearer {self.key(tenant['id'])}"}

    def deployment(
        self, name: str, base_model: str, endpoints: list[str], **extra: object
    ) -> dict[str, object]:
        body = {"name": name, "base_model": base_model, "endpoints": endpoints, **extra}
        response = self.client.post("/admin/v1/deployments", json=body, headers=ADMIN)
        assert response.status_code == 201, response.text
        return dict(response.json())


@pytest.fixture
def api(client: TestClient) -> Api:
    return Api(client)


SHAPE = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 96, "q_size": 64, "kv_size": 32}
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="session")
def peft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real PEFT LoRA (rank 8 on q and v) of the tiny random Llama (SHAPE), saved by peft itself."""
    from tests.adapters.conftest import TINY_SHAPE, make_peft_adapter

    assert vars(TINY_SHAPE) == SHAPE
    path = tmp_path_factory.mktemp("web-peft") / "qv"
    make_peft_adapter(path, seed=3, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return path


@pytest.fixture(scope="session")
def peft_dir_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another real PEFT LoRA of the same shape with other weights: a second version's bytes."""
    from tests.adapters.conftest import make_peft_adapter

    path = tmp_path_factory.mktemp("web-peft-2") / "qv"
    make_peft_adapter(path, seed=4, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return path


def loose(peft_dir: Path) -> list[tuple[str, bytes]]:
    return [(name, (peft_dir / name).read_bytes()) for name in FILES]


def upload(
    client: TestClient,
    headers: dict[str, str],
    files: list[tuple[str, bytes]],
    name: str = "a1",
    deployment: str = "tiny",
):  # type: ignore[no-untyped-def]
    return client.post(
        "/api/v1/adapters",
        data={"name": name, "deployment": deployment},
        files=[("files", (fname, content, "application/octet-stream")) for fname, content in files],
        headers=headers,
    )


ENGINE_INTERNAL_TOKEN = "internal-test-token"  # what make_settings gives the control plane


@pytest.fixture(scope="session")
def engine_url(smollm2: Any) -> Iterator[str]:
    """A real engine server (`loraplex serve`'s app) on a free port: SmolLM2-135M on the CPU, on the
    session's loaded weights, with a small pool. Shared by the end-to-end and browser tests."""
    import time

    import httpx

    from loraplex.engine.config import EngineConfig
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.server.app import create_app as create_engine_app
    from loraplex.engine.server.settings import ServerSettings

    from .servers import serve

    config = EngineConfig(model=None, device="cpu", dtype="float32", num_pages=256, max_num_seqs=4)
    settings = ServerSettings(internal_token=ENGINE_INTERNAL_TOKEN, max_queue=16)
    app = create_engine_app(settings, lambda: LLMEngine(config, loaded=smollm2))
    with serve(app) as url:
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the engine server did not get ready"
            time.sleep(0.2)
        yield url
