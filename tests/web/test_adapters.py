from __future__ import annotations

import io
import json
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from .conftest import FILES, SHAPE, Api, loose, upload


@pytest.fixture
def tenant(api: Api) -> dict[str, str]:
    api.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
    _, headers = api.tenant_with_key("acme")
    return headers


def tgz(members: list[tuple[str, bytes]], links: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, content in members:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            archive.addfile(info)
    return buffer.getvalue()


def zipped(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in members:
            archive.writestr(name, content)
    return buffer.getvalue()


def stored(client: TestClient) -> list[Path]:
    root = client.app.state.settings.artifacts()  # type: ignore[attr-defined]
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_upload_loose_files_validates_and_stores(
    client: TestClient, tenant: dict[str, str], peft_dir: Path
) -> None:
    response = upload(client, tenant, loose(peft_dir))
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["status"] == "ready" and body["rank"] == 8
    assert body["target_modules"] == ["q", "v"] and body["deployment"] == "tiny"
    stored_files = ("adapter_config.json", "adapter_model.safetensors")  # bytes counts both, as quotas do
    assert body["bytes"] == sum((peft_dir / name).stat().st_size for name in stored_files)
    assert "storage_uri" not in body
    assert len(stored(client)) == 2
    assert client.get("/api/v1/adapters/a1", headers=tenant).json()["sha256"] == body["sha256"]
    assert [a["name"] for a in client.get("/api/v1/adapters", headers=tenant).json()] == ["a1"]
    again = upload(client, tenant, loose(peft_dir))  # the same bytes: one version, no new row
    assert again.status_code == 200 and again.json()["id"] == body["id"] and again.json()["version"] == 1
    assert len(stored(client)) == 2
    assert client.delete("/api/v1/adapters/a1", headers=tenant).status_code == 204
    assert client.get("/api/v1/adapters/a1", headers=tenant).status_code == 404


@pytest.mark.parametrize("kind", ["tar.gz", "zip", "tar.gz-in-folder"])
def test_upload_archives(client: TestClient, tenant: dict[str, str], peft_dir: Path, kind: str) -> None:
    members = loose(peft_dir)
    if kind == "zip":
        archive = ("adapter.zip", zipped(members))
    elif kind == "tar.gz":
        archive = ("adapter.tar.gz", tgz(members))
    else:
        archive = ("adapter.tgz", tgz([(f"my-adapter/{n}", c) for n, c in members]))
    response = upload(client, tenant, [archive])
    assert response.status_code == 201, response.text
    assert response.json()["status"] == "ready"


def _bad_cases(peft_dir: Path) -> dict[str, tuple[list[tuple[str, bytes]], str]]:
    config, weights = ((peft_dir / n).read_bytes() for n in FILES)
    wrong_rank = json.loads(config) | {"r": 4}
    return {
        "malformed config": (
            [("adapter_config.json", b"{not json"), FILES[1:] and ("adapter_model.safetensors", weights)],
            "adapter_config.json",
        ),
        "pickled weights": (
            [("adapter_config.json", config), ("adapter_model.bin", b"\x80\x04pickle")],
            "pickled",
        ),
        "traversal in name": (
            [("../adapter_config.json", config), FILES[1:] and ("adapter_model.safetensors", weights)],
            "traversal",
        ),
        "traversal in tar": ([("a.tar.gz", tgz([("../../etc/adapter_config.json", config)]))], "traversal"),
        "traversal in zip": ([("a.zip", zipped([("../adapter_config.json", config)]))], "traversal"),
        "link in tar": (
            [
                (
                    "a.tar.gz",
                    tgz([("adapter_model.safetensors", weights)], {"adapter_config.json": "/etc/passwd"}),
                )
            ],
            "link",
        ),
        "unexpected file": (
            [
                (
                    "a.tar.gz",
                    tgz(
                        [
                            ("adapter_config.json", config),
                            ("adapter_model.safetensors", weights),
                            ("run.sh", b"rm -rf /"),
                        ]
                    ),
                )
            ],
            "only .json and .safetensors",
        ),
        "shape mismatch": (
            [
                ("adapter_config.json", json.dumps(wrong_rank).encode()),
                ("adapter_model.safetensors", weights),
            ],
            "shape",
        ),
        "missing weights": ([("adapter_config.json", config)], "adapter_model.safetensors"),
        "not an archive": ([("a.zip", b"garbage")], "not a readable .zip"),
    }


BAD = [
    "malformed config",
    "pickled weights",
    "traversal in name",
    "traversal in tar",
    "traversal in zip",
    "link in tar",
    "unexpected file",
    "shape mismatch",
    "missing weights",
    "not an archive",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_uploads_are_refused_kept_failed_with_the_reason_and_nothing_is_stored(
    client: TestClient, tenant: dict[str, str], peft_dir: Path, case: str
) -> None:
    files, expected = _bad_cases(peft_dir)[case]
    response = upload(client, tenant, files)
    assert response.status_code in (400, 413, 422), response.text
    assert expected in response.json()["detail"]
    # The tenant sees the adapter failed, with the reason the upload was refused for; nothing was stored.
    [row] = client.get("/api/v1/adapters", headers=tenant).json()
    assert (row["name"], row["status"], row["error"]) == ("a1", "failed", response.json()["detail"])
    assert row["bytes"] == 0 and row["sha256"] is None and row["rank"] is None
    assert client.get("/api/v1/adapters/a1", headers=tenant).json() == row
    assert stored(client) == []
    assert client.get("/api/v1/storage", headers=tenant).json()["bytes"] == 0
    assert "a1" not in json.dumps(client.get("/v1/models", headers=tenant).json())


def test_shape_mismatch_with_the_base_model(
    client: TestClient, api: Api, tenant: dict[str, str], peft_dir: Path
) -> None:
    api.deployment("smol", "smollm2-135m", ["http://127.0.0.1:9"])
    response = upload(client, tenant, loose(peft_dir), deployment="smol")
    assert response.status_code == 422
    assert "smollm2-135m" in response.json()["detail"] and "shape" in response.json()["detail"]
    assert upload(client, tenant, loose(peft_dir), deployment="nope").status_code == 404
    assert stored(client) == []


def test_oversized_uploads_are_refused(
    client: TestClient, api: Api, tenant: dict[str, str], peft_dir: Path, tmp_path: Path
) -> None:
    tenant_id = client.get("/admin/v1/tenants", headers={"Authorization": "Bearer admin-test-token"}).json()
    quota = {"max_adapter_bytes": 1000}
    client.put(
        f"/admin/v1/tenants/{tenant_id[0]['id']}/quota",
        json=quota,
        headers={"Authorization": "Bearer admin-test-token"},
    )
    response = upload(client, tenant, loose(peft_dir))
    assert response.status_code == 413 and "1000-byte" in response.json()["detail"]
    assert stored(client) == [] and client.get("/api/v1/adapters", headers=tenant).json() == []


def test_request_body_cap(api: Api, app_factory: Callable[..., FastAPI], db_url: str, peft_dir: Path) -> None:
    with TestClient(app_factory(db_url, max_upload_bytes=4096)) as small:
        helper = Api(small)
        helper.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
        _, headers = helper.tenant_with_key("acme")
        response = upload(small, headers, loose(peft_dir))
        assert response.status_code == 413 and "limit" in response.json()["detail"]
        assert stored(small) == []


def test_max_adapters_quota(client: TestClient, tenant: dict[str, str], peft_dir: Path) -> None:
    tenant_id = client.get("/admin/v1/tenants", headers={"Authorization": "Bearer admin-test-token"}).json()
    client.put(
        f"/admin/v1/tenants/{tenant_id[0]['id']}/quota",
        json={"max_adapters": 1},
        headers={"Authorization": "Bearer admin-test-token"},
    )
    assert upload(client, tenant, loose(peft_dir), name="one").status_code == 201
    response = upload(client, tenant, loose(peft_dir), name="two")
    assert response.status_code == 403 and "quota of 1 adapters" in response.json()["detail"]


def test_tenants_cannot_see_use_or_delete_each_others_adapters(
    client: TestClient, api: Api, tenant: dict[str, str], peft_dir: Path
) -> None:
    assert upload(client, tenant, loose(peft_dir), name="secret").status_code == 201
    _, other = api.tenant_with_key("other")
    assert client.get("/api/v1/adapters", headers=other).json() == []
    theirs = client.get("/api/v1/adapters/secret", headers=other)
    missing = client.get("/api/v1/adapters/absent", headers=other)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["detail"].replace("secret", "absent") == missing.json()["detail"]
    assert client.delete("/api/v1/adapters/secret", headers=other).status_code == 404
    assert "secret" not in json.dumps(client.get("/v1/models", headers=other).json())
    # The other tenant may use the same name: names are per tenant.
    assert upload(client, other, loose(peft_dir), name="secret").status_code == 201
    assert client.get("/api/v1/adapters/secret", headers=tenant).status_code == 200
