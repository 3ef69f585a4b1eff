"""PEFT adapter parsing, validation and the artifact store, shared by the engine and the control plane.

Everything here but `weights` is torch-free: the control plane validates uploads without torch.
"""

from .errors import AdapterError
from .manifest import AdapterManifest, ModuleLora, inspect_adapter, sha256_of
from .peft_config import LoraConfig, parse_config
from .shapes import MODULES, BaseShape
from .store import ArtifactStore, LocalArtifactStore, fetch_local, local_path

__all__ = [
    "MODULES",
    "AdapterError",
    "AdapterManifest",
    "ArtifactStore",
    "BaseShape",
    "LocalArtifactStore",
    "LoraConfig",
    "ModuleLora",
    "fetch_local",
    "inspect_adapter",
    "local_path",
    "parse_config",
    "sha256_of",
]
