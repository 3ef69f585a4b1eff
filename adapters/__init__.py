"""PEFT adapter parsing, validation and the artifact store, shared by the engine and the control plane.

Everything here but `weights` is torch-free: the control plane validates uploads without torch.
"""

from .digest import DigestMismatch, adapter_digest, check_digest, is_digest
from .errors import AdapterError
from .manifest import AdapterManifest, ModuleLora, inspect_adapter, sha256_of
from .peft_config import LoraConfig, parse_config
from .shapes import MODULES, BaseShape
from .store import (
    ArtifactStore,
    LocalArtifactStore,
    StoreUnavailable,
    fetch_local,
    local_path,
    open_store,
)

__all__ = [
    "MODULES",
    "AdapterError",
    "AdapterManifest",
    "ArtifactStore",
    "BaseShape",
    "DigestMismatch",
    "LocalArtifactStore",
    "LoraConfig",
    "ModuleLora",
    "StoreUnavailable",
    "adapter_digest",
    "check_digest",
    "fetch_local",
    "inspect_adapter",
    "is_digest",
    "local_path",
    "open_store",
    "parse_config",
    "sha256_of",
]
