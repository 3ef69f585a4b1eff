"""The artifact store: where adapter directories live, addressed by URI.

`put` stores a validated adapter under its sha256 and returns its URI; `fetch` returns a local directory
for a URI and re-checks the weights' hash, so a replaced or corrupted artifact never reaches a model.
Local paths and file:// URIs today; an S3 implementation plugs in behind the same protocol.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

from .errors import AdapterError
from .manifest import WEIGHTS_FILE, sha256_of
from .peft_config import CONFIG_FILE


class ArtifactStore(Protocol):
    def put(self, directory: Path, sha256: str) -> str: ...

    def fetch(self, uri: str, sha256: str | None = None) -> Path: ...


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
        raise AdapterError(f"artifact URI scheme {parsed.scheme!r} is not supported (use a path or file://)")
    return Path(uri)


class LocalArtifactStore:
    """Adapters as directories under `root`, one per sha256: root/<sha256>/{config, weights}."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def put(self, directory: Path, sha256: str) -> str:
        target = self.root / sha256
        if not target.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            # Copy into a sibling first and rename: a reader never sees half an adapter.
            staging = Path(tempfile.mkdtemp(prefix=f".{sha256}.", dir=self.root))
            try:
                for name in (CONFIG_FILE, WEIGHTS_FILE):
                    shutil.copyfile(directory / name, staging / name)
                staging.rename(target)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
                if not target.is_dir():
                    raise
        return target.resolve().as_uri()

    def fetch(self, uri: str, sha256: str | None = None) -> Path:
        return fetch_local(uri, sha256)


def fetch_local(uri: str, sha256: str | None = None) -> Path:
    path = local_path(uri)
    if not (path / WEIGHTS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise AdapterError(f"no adapter at {uri}: expected {CONFIG_FILE} and {WEIGHTS_FILE} there")
    if sha256 is not None:
        actual = sha256_of(path / WEIGHTS_FILE)
        if actual != sha256.lower():
            raise AdapterError(f"adapter at {uri} has sha256 {actual}, expected {sha256}: refusing it")
    return path
