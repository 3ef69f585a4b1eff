"""The whole-adapter digest and the local artifact store: content-addressed put, a digest check on every
fetch, deletes, reachability checks, and URIs that stay inside the store."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from loraplex.adapters import (
    AdapterError,
    DigestMismatch,
    LocalArtifactStore,
    StoreUnavailable,
    adapter_digest,
    fetch_local,
    inspect_adapter,
    local_path,
    open_store,
)
from loraplex.adapters.digest import DOMAIN, digest_of_bytes
from loraplex.adapters.manifest import WEIGHTS_FILE
from loraplex.adapters.peft_config import CONFIG_FILE
from loraplex.adapters.s3_store import S3ArtifactStore

from .conftest import TINY_SHAPE


def adapter_files(directory: Path, config: bytes, weights: bytes) -> Path:
    directory.mkdir(parents=True)
    (directory / CONFIG_FILE).write_bytes(config)
    (directory / WEIGHTS_FILE).write_bytes(weights)
    return directory


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# -- the digest ------------------------------------------------------------------------------------------


def test_digest_is_the_framed_sha256_of_config_and_weights(tmp_path: Path) -> None:
    directory = adapter_files(tmp_path / "a", b'{"r": 8}', b"weights")
    framed = DOMAIN + (8).to_bytes(8, "big") + b'{"r": 8}' + (7).to_bytes(8, "big") + b"weights"
    assert adapter_digest(directory) == hashlib.sha256(framed).hexdigest()
    assert adapter_digest(directory) == digest_of_bytes(b'{"r": 8}', b"weights")


def test_no_two_different_adapters_share_a_digest(tmp_path: Path) -> None:
    base = adapter_digest(adapter_files(tmp_path / "a", b"{}ab", b"cd"))
    # The same bytes split differently between the files: plain concatenation would collide here.
    assert adapter_digest(adapter_files(tmp_path / "b", b"{}a", b"bcd")) != base
    assert adapter_digest(adapter_files(tmp_path / "c", b"{} ab", b"cd")) != base  # another config
    assert adapter_digest(adapter_files(tmp_path / "d", b"{}ab", b"ce")) != base  # other weights


def test_manifest_identity_is_the_whole_adapter_digest(peft_adapters, tmp_path: Path) -> None:
    source = peft_adapters["qv-r8"][0]
    manifest = inspect_adapter(source, TINY_SHAPE)
    assert manifest.sha256 == adapter_digest(source)
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    config = (copy / CONFIG_FILE).read_bytes()
    (copy / CONFIG_FILE).write_bytes(config.replace(b"{", b"{ ", 1))  # same meaning, other bytes
    assert inspect_adapter(copy, TINY_SHAPE).sha256 != manifest.sha256


def test_digest_of_a_directory_without_the_files_names_the_file(tmp_path: Path) -> None:
    (tmp_path / CONFIG_FILE).write_text("{}")
    with pytest.raises(AdapterError, match=f"{WEIGHTS_FILE} is missing"):
        adapter_digest(tmp_path)


# -- the local store ---------------------------------------------------------------------------------------


def test_put_then_fetch_round_trips(peft_adapters, tmp_path: Path) -> None:
    source = peft_adapters["qv-r8"][0]
    digest = adapter_digest(source)
    store = LocalArtifactStore(tmp_path / "store")
    uri = store.put(source, digest)
    assert uri == store.uri_of(digest) and uri.startswith("file://") and uri.endswith(digest)
    assert store.put(source, digest) == uri  # idempotent
    fetched = store.fetch(uri, digest)
    assert fetched == (tmp_path / "store" / digest).resolve()
    assert inspect_adapter(fetched, TINY_SHAPE).sha256 == digest
    assert store.fetch(str(fetched), digest) == fetched  # a plain path works too
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [digest]  # no staging left over


@pytest.mark.parametrize("damaged", [WEIGHTS_FILE, CONFIG_FILE])
def test_every_fetch_checks_the_digest(peft_adapters, tmp_path: Path, damaged: str) -> None:
    source = peft_adapters["qv-r8"][0]
    digest = adapter_digest(source)
    store = LocalArtifactStore(tmp_path / "store")
    uri = store.put(source, digest)
    store.fetch(uri, digest)  # fine once...
    flip_last_byte(local_path(uri) / damaged)
    with pytest.raises(DigestMismatch, match="refusing it"):  # ...and refused after the file changed
        store.fetch(uri, digest)
    with pytest.raises(DigestMismatch):
        fetch_local(uri, digest)


def test_put_refuses_a_digest_that_does_not_describe_the_files(peft_adapters, tmp_path: Path) -> None:
    source = peft_adapters["qv-r8"][0]
    other = adapter_digest(peft_adapters["layer1-only"][0])
    store = LocalArtifactStore(tmp_path / "store")
    with pytest.raises(DigestMismatch):
        store.put(source, other)  # a poisoner naming someone else's digest
    assert list((tmp_path / "store").iterdir()) == []
    with pytest.raises(AdapterError, match="not an adapter digest"):
        store.put(source, "../../etc")


def test_put_replaces_a_damaged_copy(peft_adapters, tmp_path: Path) -> None:
    source = peft_adapters["qv-r8"][0]
    digest = adapter_digest(source)
    store = LocalArtifactStore(tmp_path / "store")
    uri = store.put(source, digest)
    flip_last_byte(local_path(uri) / WEIGHTS_FILE)
    assert store.put(source, digest) == uri
    assert store.fetch(uri, digest) == local_path(uri)


def test_delete_removes_and_is_idempotent(peft_adapters, tmp_path: Path) -> None:
    source = peft_adapters["qv-r8"][0]
    digest = adapter_digest(source)
    store = LocalArtifactStore(tmp_path / "store")
    uri = store.put(source, digest)
    store.delete(uri)
    assert list((tmp_path / "store").iterdir()) == []
    store.delete(uri)  # gone already: fine
    with pytest.raises(AdapterError, match="no adapter at"):
        store.fetch(uri, digest)


def test_uris_outside_the_store_are_refused(peft_adapters, tmp_path: Path) -> None:
    source = peft_adapters["qv-r8"][0]
    digest = adapter_digest(source)
    store = LocalArtifactStore(tmp_path / "store")
    store.put(source, digest)
    outside = tmp_path / "elsewhere"
    shutil.copytree(source, outside)
    (tmp_path / "store" / "link").symlink_to(outside)
    for uri in (
        outside.as_uri(),
        f"{tmp_path}/store/../elsewhere",
        (tmp_path / "store" / "link").as_uri(),  # a symlink out of the store
        (tmp_path / "store").as_uri(),  # the root itself
    ):
        with pytest.raises(AdapterError, match="outside the artifact store"):
            store.fetch(uri, digest)
        with pytest.raises(AdapterError, match="outside the artifact store"):
            store.delete(uri)
    assert outside.is_dir() and (outside / WEIGHTS_FILE).is_file()


def test_check_names_a_store_that_cannot_be_written(tmp_path: Path) -> None:
    LocalArtifactStore(tmp_path / "new" / "store").check()  # made on demand
    (tmp_path / "file").write_text("not a directory")
    store = LocalArtifactStore(tmp_path / "file" / "store")
    with pytest.raises(StoreUnavailable, match=f"artifact store {tmp_path / 'file' / 'store'}"):
        store.check()
    with pytest.raises(StoreUnavailable):
        store.put(tmp_path, "0" * 64)


def test_open_store_picks_the_implementation_from_the_uri(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalArtifactStore)
    local = open_store(tmp_path.as_uri())
    assert isinstance(local, LocalArtifactStore) and local.root == tmp_path
    s3 = open_store("s3://bucket/some/prefix/", endpoint_url="http://minio:9000")
    assert isinstance(s3, S3ArtifactStore) and (s3.bucket, s3.prefix) == ("bucket", "some/prefix")
    assert s3.uri_of("a" * 64) == f"s3://bucket/some/prefix/{'a' * 64}"
    with pytest.raises(ValueError, match="needs a bucket"):
        open_store("s3:///prefix")
    with pytest.raises(ValueError, match=r"'\.\.'"):
        open_store("s3://bucket/a/../b")
    with pytest.raises(AdapterError, match="scheme 'gs' is not supported"):
        open_store("gs://bucket/prefix")


def test_bad_uris(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="scheme 's3' is not supported"):
        fetch_local("s3://bucket/adapter")
    with pytest.raises(AdapterError, match="names host"):
        fetch_local("file://otherhost/adapter")
    with pytest.raises(AdapterError, match="no adapter at"):
        fetch_local((tmp_path / "missing").as_uri())
