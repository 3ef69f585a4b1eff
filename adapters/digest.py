"""An adapter's identity: one sha256 over its config bytes and its weights bytes, as stored.

The two files are framed (a domain tag, then each file's length before its bytes), so no two different
(config, weights) pairs hash the same way: moving bytes from the end of the config to the start of the
weights changes the lengths, hence the digest. Hashing the config too is what keeps two tenants who upload
the same weights with different configs (another alpha, other target modules) on two different artifacts.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import BinaryIO

from .errors import AdapterError
from .peft_config import CONFIG_FILE

WEIGHTS_FILE = "adapter_model.safetensors"  # as in manifest.py, which imports this module
# Bumped if the framing ever changes, so an old digest can never verify new content by accident.
DOMAIN = b"loraplex-adapter-v1\x00"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_DIGEST = re.compile(r"[0-9a-f]{64}")
_BLOCK = 1 << 20


class DigestMismatch(AdapterError):
    """The bytes found are not the adapter the digest names (changed, truncated or replaced)."""


def is_digest(value: str) -> bool:
    """A lowercase sha256 hex string (64 characters), the only form the store and the database use."""
    return _DIGEST.fullmatch(value) is not None


def digest_of_bytes(config: bytes, weights: bytes) -> str:
    digest = hashlib.sha256(DOMAIN)
    for data in (config, weights):
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def adapter_digest(directory: Path) -> str:
    """The digest of the adapter in `directory` (adapter_config.json + adapter_model.safetensors),
    read in blocks so a large adapter costs no more memory than a block."""
    directory = Path(directory)
    digest = hashlib.sha256(DOMAIN)
    for name in ADAPTER_FILES:
        path = directory / name
        try:
            with path.open("rb") as stream:
                _update_framed(digest, stream, path)
        except FileNotFoundError:
            raise AdapterError(f"{name} is missing from {directory}") from None
    return digest.hexdigest()


def check_digest(directory: Path, expected: str) -> None:
    """Raise DigestMismatch unless the adapter in `directory` has the digest `expected`."""
    actual = adapter_digest(directory)
    if actual != expected.lower():
        raise DigestMismatch(
            f"adapter at {directory} has sha256 digest {actual}, expected {expected}: refusing it"
        )


def _update_framed(digest: hashlib._Hash, stream: BinaryIO, path: Path) -> None:
    # The length goes first, so take it from the open file and then read exactly that much: a file
    # that grows or shrinks while it is hashed is refused rather than hashed as something in between.
    size = os.fstat(stream.fileno()).st_size
    digest.update(size.to_bytes(8, "big"))
    remaining = size
    while remaining:
        block = stream.read(min(_BLOCK, remaining))
        if not block:
            raise AdapterError(f"{path.name} changed while it was being read; try again")
        digest.update(block)
        remaining -= len(block)
    if stream.read(1):
        raise AdapterError(f"{path.name} changed while it was being read; try again")
