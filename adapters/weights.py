"""Load an inspected adapter's A and B matrices as tensors (the engine's side; needs torch)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from .manifest import WEIGHTS_FILE, AdapterManifest, parse_tensor_name


def load_lora_weights(
    directory: Path, manifest: AdapterManifest, dtype: torch.dtype = torch.float32
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [rank, in], B [out, rank]) for every module the manifest lists."""
    tensors = load_file(str(Path(directory) / WEIGHTS_FILE))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        key = parse_tensor_name(name)
        assert key is not None, name  # inspect_adapter accepted every name
        layer, module, part = key
        pairs.setdefault((layer, module), {})[part] = tensor.to(dtype)
    return {
        (m.layer, m.module): (pairs[(m.layer, m.module)]["A"], pairs[(m.layer, m.module)]["B"])
        for m in manifest.modules
    }
