"""The S3 artifact store against a real S3-protocol server: moto's standalone server in its own process,
with IAM authentication on, so wrong credentials are refused the way AWS, MinIO or Ceph refuse them."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from loraplex.adapters import AdapterError, DigestMismatch, StoreUnavailable, adapter_digest, open_store
from loraplex.adapters.manifest import WEIGHTS_FILE
from loraplex.adapters.peft_config import CONFIG_FILE
from loraplex.adapters.s3_store import S3ArtifactStore

BUCKET = "loraplex-artifacts"
REGION = "us-east-1"
# moto answers the first requests without authentication: the ones that make the IAM user and its key.
SETUP_REQUESTS = 3


@dataclass(frozen=True)
class S3Server:
    url: str
    access_key: str
    secret_key: str

    def client(self) -> object:
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}),
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(SETUP_REQUESTS))
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"moto server did not start (see {log.name})") from None
                time.sleep(0.1)
        iam = boto3.client(
            "iam", endpoint_url=url, region_name=REGION, aws_access_key_id="setup", aws_secret_access_key="x"
        )
        iam.create_user(UserName="loraplex")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="loraplex", PolicyName="artifacts", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="loraplex")["AccessKey"]
        server = S3Server(url, key["AccessKeyId"], key["SecretAccessKey"])
        server.client().create_bucket(Bucket=BUCKET)  # type: ignore[attr-defined]
        yield server
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


@pytest.fixture
def aws_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The standard AWS variables, as a pod gets them from its Secret."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_REGION", REGION)
    return s3_server


@pytest.fixture
def store(aws_env: S3Server, tmp_path: Path, request: pytest.FixtureRequest) -> S3ArtifactStore:
    prefix = f"t/{request.node.name}".replace("[", "-").replace("]", "")
    made = open_store(f"s3://{BUCKET}/{prefix}", endpoint_url=aws_env.url, cache_dir=tmp_path / "cache")
    assert isinstance(made, S3ArtifactStore)
    return made


@pytest.fixture
def adapter(peft_adapters: dict[str, tuple[Path, object]]) -> tuple[Path, str]:
    source = peft_adapters["qv-r8"][0]
    return source, adapter_digest(source)


def keys_under(server: S3Server, prefix: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)  # type: ignore[attr-defined]
    return sorted(item["Key"] for item in listed.get("Contents", []))


def test_put_then_fetch_round_trips(
    aws_env: S3Server, store: S3ArtifactStore, adapter: tuple[Path, str], tmp_path: Path
) -> None:
    source, digest = adapter
    store.check()
    uri = store.put(source, digest)
    assert uri == f"s3://{BUCKET}/{store.prefix}/{digest}" == store.uri_of(digest)
    folder = f"{store.prefix}/{digest}"
    assert keys_under(aws_env, store.prefix) == [f"{folder}/{CONFIG_FILE}", f"{folder}/{WEIGHTS_FILE}"]
    assert store.put(source, digest) == uri  # idempotent
    fetched = store.fetch(uri, digest)
    assert fetched == tmp_path / "cache" / digest
    for name in (CONFIG_FILE, WEIGHTS_FILE):  # byte for byte what was uploaded
        assert (fetched / name).read_bytes() == (source / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [digest]  # no staging left over


def test_every_fetch_checks_the_digest(
    aws_env: S3Server, store: S3ArtifactStore, adapter: tuple[Path, str], tmp_path: Path
) -> None:
    source, digest = adapter
    uri = store.put(source, digest)
    cached = store.fetch(uri, digest)
    # A damaged local copy is not served: it is fetched again from the store.
    (cached / WEIGHTS_FILE).write_bytes(b"garbage")
    assert store.fetch(uri, digest) == cached
    assert (cached / WEIGHTS_FILE).read_bytes() == (source / WEIGHTS_FILE).read_bytes()
    # Content replaced in the bucket is refused, and nothing of it is kept in the cache.
    aws_env.client().put_object(  # type: ignore[attr-defined]
        Bucket=BUCKET, Key=f"{store.prefix}/{digest}/{CONFIG_FILE}", Body=b'{"r": 64}'
    )
    shutil.rmtree(cached)
    with pytest.raises(DigestMismatch, match="refusing it"):
        store.fetch(uri, digest)
    assert list((tmp_path / "cache").iterdir()) == []


def test_put_rewrites_a_damaged_object(
    aws_env: S3Server, store: S3ArtifactStore, adapter: tuple[Path, str]
) -> None:
    """An identical adapter uploaded again is not written twice, unless what the bucket holds is no longer
    it: same key, same size, other bytes (compared through the checksum the service keeps)."""
    source, digest = adapter
    uri = store.put(source, digest)
    key = f"{store.prefix}/{digest}/{WEIGHTS_FILE}"
    client = aws_env.client()
    written = client.head_object(Bucket=BUCKET, Key=key)["LastModified"]  # type: ignore[attr-defined]
    assert store.put(source, digest) == uri
    assert client.head_object(Bucket=BUCKET, Key=key)["LastModified"] == written  # type: ignore[attr-defined]
    damaged = bytearray((source / WEIGHTS_FILE).read_bytes())
    damaged[-1] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(damaged))  # type: ignore[attr-defined]
    assert store.put(source, digest) == uri
    assert store.fetch(uri, digest).is_dir()  # repaired by the second upload


def test_put_refuses_a_digest_that_does_not_describe_the_files(
    aws_env: S3Server, store: S3ArtifactStore, adapter: tuple[Path, str]
) -> None:
    source, digest = adapter
    with pytest.raises(DigestMismatch):
        store.put(source, digest[::-1])
    assert keys_under(aws_env, store.prefix) == []


def test_delete_removes_both_objects(
    aws_env: S3Server, store: S3ArtifactStore, adapter: tuple[Path, str]
) -> None:
    source, digest = adapter
    uri = store.put(source, digest)
    store.delete(uri)
    assert keys_under(aws_env, store.prefix) == []
    store.delete(uri)  # gone already: fine
    with pytest.raises(AdapterError, match="no adapter at"):
        store.fetch(uri, digest)


def test_uris_outside_the_store_are_refused(store: S3ArtifactStore, adapter: tuple[Path, str]) -> None:
    _, digest = adapter
    for uri in (
        f"s3://other-bucket/{store.prefix}/{digest}",
        f"s3://{BUCKET}/elsewhere/{digest}",
        f"s3://{BUCKET}/{store.prefix}/../elsewhere/{digest}",
        f"s3://{BUCKET}/{store.prefix}",
        f"file:///tmp/{digest}",
    ):
        with pytest.raises(AdapterError, match="outside the artifact store"):
            store.fetch(uri, digest)
        with pytest.raises(AdapterError, match="outside the artifact store"):
            store.delete(uri)


def test_wrong_credentials_are_a_store_error_that_says_so(
    s3_server: S3Server, adapter: tuple[Path, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source, digest = adapter
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setenv("AWS_REGION", REGION)
    store = open_store(f"s3://{BUCKET}/creds", endpoint_url=s3_server.url, cache_dir=tmp_path)
    with pytest.raises(StoreUnavailable, match=f"s3://{BUCKET}/creds.*refused our credentials"):
        store.check()
    with pytest.raises(StoreUnavailable, match="refused our credentials"):
        store.put(source, digest)
    with pytest.raises(StoreUnavailable, match="refused our credentials"):  # not the adapter's fault
        store.fetch(f"s3://{BUCKET}/creds/{digest}", digest)
    with pytest.raises(StoreUnavailable, match="refused our credentials"):
        store.delete(f"s3://{BUCKET}/creds/{digest}")


def test_a_missing_bucket_is_a_store_error(aws_env: S3Server, tmp_path: Path) -> None:
    store = open_store("s3://no-such-bucket/x", endpoint_url=aws_env.url, cache_dir=tmp_path)
    with pytest.raises(StoreUnavailable, match="no such bucket"):
        store.check()


def test_an_unreachable_endpoint_is_a_store_error(
    aws_env: S3Server, adapter: tuple[Path, str], tmp_path: Path
) -> None:
    source, digest = adapter
    closed = f"http://127.0.0.1:{_free_port()}"
    store = open_store(f"s3://{BUCKET}/x", endpoint_url=closed, cache_dir=tmp_path)
    started = time.monotonic()
    with pytest.raises(
        StoreUnavailable, match=f"cannot reach the artifact store s3://{BUCKET}/x at {closed}"
    ):
        store.check()
    with pytest.raises(StoreUnavailable, match="cannot store"):
        store.put(source, digest)
    with pytest.raises(StoreUnavailable, match="cannot read from"):
        store.fetch(f"s3://{BUCKET}/x/{digest}", digest)
    assert time.monotonic() - started < 30  # bounded retries, not a hang


def test_the_engine_fetches_through_the_same_store(
    aws_env: S3Server, store: S3ArtifactStore, adapter: tuple[Path, str], tmp_path: Path
) -> None:
    from loraplex.engine.lora.sources import AdapterFetcher

    source, digest = adapter
    uri = store.put(source, digest)  # the control plane writes...
    where = f"s3://{BUCKET}/{store.prefix}"
    fetcher = AdapterFetcher.configure(where, tmp_path / "engine-cache", aws_env.url)  # ...the engine reads
    fetched = fetcher.fetch(uri, digest)
    assert fetched == tmp_path / "engine-cache" / digest
    assert fetcher.fetch(uri, None) == fetched  # a content-addressed URI names its own digest
    with pytest.raises(AdapterError, match="outside the artifact store"):
        fetcher.fetch(f"s3://{BUCKET}/elsewhere/{digest}", digest)
    with pytest.raises(AdapterError, match="outside the artifact store"):
        fetcher.fetch(source.as_uri(), digest)  # a local path is not in an s3:// store
