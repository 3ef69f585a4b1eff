"""The artifact store: whole adapters addressed by their digest, behind one protocol.

Layout everywhere: `<root or s3 prefix>/<digest>/` holding adapter_config.json and
adapter_model.safetensors. The control plane puts and deletes; engines only fetch, and every fetch
re-checks the digest, so a replaced or corrupted artifact never reaches a model. `open_store` picks the
implementation from the URI of LORAPLEX_ADAPTER_STORE: a path or file:// (one machine) or s3://bucket/prefix
(any S3-compatible service).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

from .digest import ADAPTER_FILES, check_digest, is_digest
from .errors import AdapterError


class StoreUnavailable(RuntimeError):
    """The store could not be reached or refused our credentials: not the adapter's fault, retry later."""


class OutsideStore(AdapterError):
    """A URI this store does not hold (another directory, bucket or prefix, or another scheme): refused.
    For an engine handed such a URI by the control plane, the two are configured with different stores."""


class ArtifactStore(Protocol):
    @property
    def location(self) -> str:
        """Where the store is, for messages (no credentials in it)."""
        ...

    def uri_of(self, digest: str) -> str:
        """The URI an adapter with `digest` has (or will have) in this store."""
        ...

    def put(self, directory: Path, digest: str) -> str:
        """Store the adapter in `directory` under `digest` (checked first) and return its URI."""
        ...

    def fetch(self, uri: str, digest: str) -> Path:
        """A local directory holding the adapter at `uri`, verified to have `digest` (every time).
        AdapterError: nothing there, outside this store, or other content; StoreUnavailable: try later."""
        ...

    def delete(self, uri: str) -> None:
        """Remove the adapter at `uri`; removing one that is gone already is not an error."""
        ...

    def check(self) -> None:
        """Raise StoreUnavailable, saying why, unless the store can be reached and written now."""
        ...


def open_store(uri: str, *, endpoint_url: str | None = None, cache_dir: Path | None = None) -> ArtifactStore:
    """The store that `uri` names: a directory (path or file://) or an S3 bucket (s3://bucket/prefix).
    `cache_dir` is where an S3 store's fetches land (the engine's side); `endpoint_url` points boto3 at
    MinIO, Ceph or any other S3-compatible service."""
    scheme = urlparse(uri).scheme
    if scheme == "s3":
        from .s3_store import S3ArtifactStore  # boto3 is imported only by stores that need it

        return S3ArtifactStore.from_uri(uri, endpoint_url=endpoint_url, cache_dir=cache_dir)
    return LocalArtifactStore(local_path(uri))


def local_path(uri: str) -> Path:
    """The filesystem path of a plain path or a file:// URI."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise AdapterError(
                f"file URI {uri!r} names host {parsed.netloc!r}; only local files are supported"
            )
        return Path(unquote(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise AdapterError(
            f"artifact URI scheme {parsed.scheme!r} is not supported here (use a path, file:// or s3://)"
        )
    return Path(uri)


class LocalArtifactStore:
    """Adapters as directories under `root`, one per digest: root/<digest>/{config, weights}."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def location(self) -> str:
        return str(self.root)

    def uri_of(self, digest: str) -> str:
        _require_digest(digest)
        return (self.root / digest).resolve().as_uri()

    def put(self, directory: Path, digest: str) -> str:
        _require_digest(digest)
        target = self.root / digest
        if target.is_dir():
            try:
                check_digest(target, digest)
                return target.resolve().as_uri()
            except AdapterError:  # damaged since it was stored: replace it with the good copy below
                self._remove(target)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # Copy into a sibling, check the copy, then rename: a reader never sees half an adapter, and a
            # digest that does not describe `directory` never names an artifact.
            staging = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=self.root))
        except OSError as exc:
            raise StoreUnavailable(f"artifact store {self.root} cannot be written: {exc.strerror}") from exc
        try:
            for name in ADAPTER_FILES:
                shutil.copyfile(Path(directory) / name, staging / name)
            check_digest(staging, digest)
            staging.rename(target)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if not target.is_dir():  # a concurrent put of the same digest won the rename: that is fine
                raise StoreUnavailable(f"artifact store {self.root} cannot be written: {exc}") from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target.resolve().as_uri()

    def fetch(self, uri: str, digest: str) -> Path:
        path = self.path_of(uri)
        return fetch_local(path.as_uri(), digest)

    def delete(self, uri: str) -> None:
        path = self.path_of(uri)
        if path.is_dir():
            self._remove(path)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"artifact store {self.root} cannot be created: {exc.strerror}") from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreUnavailable(f"artifact store {self.root} is not writable by this process")

    def path_of(self, uri: str) -> Path:
        """The path `uri` names, refused unless it lies under the root (no `..` or symlink escapes)."""
        path = local_path(uri)
        root = self.root.resolve()
        resolved = path.resolve()
        if resolved == root or not resolved.is_relative_to(root):
            raise OutsideStore(f"{uri} is outside the artifact store {self.root}: refusing it")
        return resolved

    def _remove(self, path: Path) -> None:
        # Renamed away first, so no reader finds a half-deleted adapter under its digest.
        doomed = Path(tempfile.mkdtemp(prefix=".deleting.", dir=self.root))
        try:
            path.rename(doomed / "adapter")
        except FileNotFoundError:
            pass
        finally:
            shutil.rmtree(doomed, ignore_errors=True)


def fetch_local(uri: str, digest: str | None = None) -> Path:
    """The adapter directory at a path or file:// URI; with `digest`, only if its content has it."""
    path = local_path(uri)
    if not all((path / name).is_file() for name in ADAPTER_FILES):
        raise AdapterError(f"no adapter at {uri}: expected {' and '.join(ADAPTER_FILES)} there")
    if digest is not None:
        check_digest(path, digest)
    return path


def _require_digest(digest: str) -> None:
    if not is_digest(digest):
        raise AdapterError(f"{digest!r} is not an adapter digest (64 lowercase hex characters)")
