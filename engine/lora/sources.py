"""Where a registered adapter's weights come from when the host cache needs them.

A source knows its manifest up front (validated at registration, so a bad adapter is refused before any
request names it) and reads its A and B matrices only when asked: registering a thousand adapters costs
a thousand manifests, not a thousand sets of weights in memory.

Every read is verified: `load` hashes the very bytes it parses and refuses them unless they are the
adapter registered (its whole-adapter digest), so a file replaced or damaged after registration never
reaches the pool. `AdapterFetcher` is how the server gets a local directory for an adapter URI: through
its configured artifact store only (LORAPLEX_ADAPTER_STORE), fetched into a local cache and verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import torch
from safetensors.torch import load as load_safetensors

from loraplex.adapters import (
    AdapterError,
    AdapterManifest,
    ArtifactStore,
    BaseShape,
    DigestMismatch,
    LocalArtifactStore,
    fetch_local,
    inspect_adapter,
    is_digest,
    local_path,
    open_store,
)
from loraplex.adapters.digest import digest_of_bytes
from loraplex.adapters.manifest import WEIGHTS_FILE, parse_tensor_name
from loraplex.adapters.peft_config import CONFIG_FILE
from loraplex.adapters.store import OutsideStore

# (layer, module) -> (A [rank, in], B [out, rank])
LoraWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class DoraWeights(dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]):
    """The LoraWeights of a DoRA adapter, with its magnitude vectors: (layer, module) -> m [out], in
    float32 whatever dtype A and B were read in (the scale the engine derives from them is float32)."""

    def __init__(self, pairs: LoraWeights, magnitudes: dict[tuple[int, str], torch.Tensor]):
        super().__init__(pairs)
        self.magnitudes = magnitudes


def magnitudes_of(weights: LoraWeights) -> dict[tuple[int, str], torch.Tensor]:
    """A DoRA adapter's magnitude vectors ({} for a plain LoRA adapter)."""
    return weights.magnitudes if isinstance(weights, DoraWeights) else {}


class AdapterSource(Protocol):
    @property
    def manifest(self) -> AdapterManifest: ...

    def load(self, dtype: torch.dtype) -> LoraWeights:
        """Read the weights; raise AdapterError if they are gone or no longer what was registered."""
        ...


@dataclass(frozen=True)
class DirectorySource:
    """A PEFT directory on a local filesystem (a plain path or a file:// URI)."""

    path: Path
    manifest: AdapterManifest

    @classmethod
    def open(cls, uri: str | Path, base: BaseShape, sha256: str | None = None) -> DirectorySource:
        """Validate the adapter at `uri` for `base`; with `sha256`, refuse an adapter with another digest."""
        directory = local_path(str(uri))
        manifest = inspect_adapter(directory, base)  # names the first problem; computes the digest once
        if sha256 is not None and manifest.sha256 != sha256.lower():
            raise DigestMismatch(
                f"adapter at {uri} has sha256 digest {manifest.sha256}, expected {sha256}: refusing it"
            )
        return cls(directory, manifest)

    def load(self, dtype: torch.dtype) -> LoraWeights:
        config, weights = self._read()
        # The bytes hashed are the bytes parsed: nothing can change between the check and the load.
        if digest_of_bytes(config, weights) != self.manifest.sha256:
            raise DigestMismatch(
                f"cannot read the adapter at {self.path}: it changed since it was registered (its digest "
                f"is no longer {self.manifest.sha256}), refusing it"
            )
        try:
            tensors = load_safetensors(weights)
        except Exception as error:  # safetensors raises its own error types
            raise AdapterError(f"cannot read the adapter weights at {self.path}: {error}") from error
        return _pairs(tensors, self.manifest, dtype)

    def _read(self) -> tuple[bytes, bytes]:
        try:
            return (self.path / CONFIG_FILE).read_bytes(), (self.path / WEIGHTS_FILE).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as error:
            # Gone (deleted with its last adapter) is a verdict; other OSErrors are a store that did not
            # answer and propagate as such (the host cache tries those again later).
            raise AdapterError(f"cannot read the adapter at {self.path}: it is gone ({error})") from error


def _pairs(tensors: dict[str, torch.Tensor], manifest: AdapterManifest, dtype: torch.dtype) -> LoraWeights:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        key = parse_tensor_name(name)
        if key is None:  # the digest matched, so inspect_adapter accepted these very names
            raise AdapterError(f"{WEIGHTS_FILE}: unexpected tensor {name[:200]!r}")
        layer, module, part = key
        pairs.setdefault((layer, module), {})[part] = tensor.to(torch.float32 if part == "M" else dtype)
    weights = {
        (m.layer, m.module): (pairs[(m.layer, m.module)]["A"], pairs[(m.layer, m.module)]["B"])
        for m in manifest.modules
    }
    if not manifest.dora:
        return weights
    magnitudes = {(m.layer, m.module): pairs[(m.layer, m.module)]["M"] for m in manifest.modules}
    return DoraWeights(weights, magnitudes)


class AdapterFetcher:
    """Local directories for adapter URIs. With a store configured, only URIs inside it are fetched (an
    s3:// store downloads into `cache_dir/<digest>`, verified, then renamed into place) and every fetch
    checks the digest; without one, local paths and file:// URIs are read where they are."""

    def __init__(self, store: ArtifactStore | None):
        self.store = store

    @classmethod
    def configure(
        cls, store_uri: str | None, cache_dir: Path | None = None, endpoint_url: str | None = None
    ) -> AdapterFetcher:
        if not store_uri:
            return cls(None)
        return cls(open_store(store_uri, endpoint_url=endpoint_url, cache_dir=cache_dir))

    def fetch(self, uri: str, digest: str | None) -> Path:
        """AdapterError (DigestMismatch among them): nothing usable there, outside the store, or not the
        adapter named; StoreUnavailable: the store did not answer (not the adapter's fault)."""
        if digest is not None:
            digest = digest.lower()
            if not is_digest(digest):
                raise AdapterError(f"{digest[:80]!r} is not an adapter digest (64 hex characters)")
        if self.store is None:
            if urlparse(uri).scheme == "s3":
                raise OutsideStore(
                    f"{uri[:200]}: s3:// adapters need LORAPLEX_ADAPTER_STORE set to their store"
                )
            return fetch_local(uri, digest)
        digest = digest or _digest_named_by(uri)
        if digest is not None:
            return self.store.fetch(uri, digest)
        if isinstance(self.store, LocalArtifactStore):  # verified at registration and at every load
            return fetch_local(self.store.path_of(uri).as_uri())
        raise AdapterError(f"{uri[:200]}: an adapter fetched from {self.store.location} needs its digest")


def _digest_named_by(uri: str) -> str | None:
    """The digest a content-addressed URI ends with (`<store>/<digest>`), if it does."""
    last = urlparse(uri).path.rstrip("/").rsplit("/", 1)[-1].lower()
    return last if is_digest(last) else None
