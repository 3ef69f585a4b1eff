"""Where a registered adapter's weights come from when the host cache needs them.

A source knows its manifest up front (validated at registration, so a bad adapter is refused before any
request names it) and reads its A and B matrices only when asked: registering a thousand adapters costs
a thousand manifests, not a thousand sets of weights in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from loraplex.adapters import AdapterError, AdapterManifest, BaseShape, inspect_adapter, local_path
from loraplex.adapters.weights import load_lora_weights

# (layer, module) -> (A [rank, in], B [out, rank])
LoraWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


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
        """Validate the adapter at `uri` for `base`; with `sha256`, refuse weights with another hash."""
        directory = local_path(str(uri))
        manifest = inspect_adapter(directory, base)  # names the first problem; hashes the weights once
        if sha256 is not None and manifest.sha256 != sha256.lower():
            raise AdapterError(
                f"adapter at {uri} has sha256 {manifest.sha256}, expected {sha256}: refusing it"
            )
        return cls(directory, manifest)

    def load(self, dtype: torch.dtype) -> LoraWeights:
        try:
            return load_lora_weights(self.path, self.manifest, dtype)
        # Deleted, truncated or rewritten since registration; safetensors raises its own error type.
        except Exception as error:
            raise AdapterError(f"cannot read the adapter weights at {self.path}: {error}") from error
