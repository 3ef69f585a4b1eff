"""The local artifact store: content-addressed put, hash-checked fetch, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapters import AdapterError, LocalArtifactStore, inspect_adapter, local_path
from loraplex.adapters.manifest import WEIGHTS_FILE

from .conftest import TINY_SHAPE


def test_put_then_fetch_round_trips(peft_adapters, tmp_path: Path) -> None:
    source = peft_adapters["qv-r8"][0]
    manifest = inspect_adapter(source, TINY_SHAPE)
    store = LocalArtifactStore(tmp_path / "store")
    uri = store.put(source, manifest.sha256)
    assert uri.startswith("file://") and manifest.sha256 in uri
    assert store.put(source, manifest.sha256) == uri  # idempotent
    fetched = store.fetch(uri, manifest.sha256)
    assert inspect_adapter(fetched, TINY_SHAPE).sha256 == manifest.sha256
    assert store.fetch(str(fetched)) == fetched  # a plain path works too


def test_fetch_refuses_a_changed_artifact(peft_adapters, tmp_path: Path) -> None:
    source = peft_adapters["qv-r8"][0]
    manifest = inspect_adapter(source, TINY_SHAPE)
    store = LocalArtifactStore(tmp_path / "store")
    path = local_path(store.put(source, manifest.sha256))
    data = bytearray((path / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (path / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(AdapterError, match="refusing it"):
        store.fetch(path.as_uri(), manifest.sha256)


def test_bad_uris(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    with pytest.raises(AdapterError, match="scheme 's3' is not supported"):
        store.fetch("s3://bucket/adapter")
    with pytest.raises(AdapterError, match="names host"):
        store.fetch("file://otherhost/adapter")
    with pytest.raises(AdapterError, match="no adapter at"):
        store.fetch((tmp_path / "missing").as_uri())
