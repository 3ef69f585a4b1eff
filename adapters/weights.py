"""An adapter's weights: checked finite without torch (control plane and engine), loaded as tensors
(the engine; torch is imported only there)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import AdapterError
from .safetensors_header import TensorInfo, read_header

if TYPE_CHECKING:
    import torch

    from .manifest import AdapterManifest

# Read this much at a time: checking a weights file of any size holds about three chunks in memory.
CHUNK_BYTES = 4 << 20
# A float is NaN or ±Inf exactly when all its exponent bits are set; testing the bits covers BF16, which
# numpy has no type for, and needs no float conversion.
_EXPONENT_MASKS: dict[str, tuple[np.dtype, int]] = {
    "F64": (np.dtype("<u8"), 0x7FF0_0000_0000_0000),
    "F32": (np.dtype("<u4"), 0x7F80_0000),
    "F16": (np.dtype("<u2"), 0x7C00),
    "BF16": (np.dtype("<u2"), 0x7F80),
}


def check_finite(path: Path, tensors: Mapping[str, TensorInfo] | None = None) -> None:
    """Raise AdapterError naming the first float tensor of the safetensors file at `path` that holds a
    NaN or an infinity. Streams the file in chunks (memory bounded whatever its size); `tensors` is its
    read_header() when the caller already has it."""
    path = Path(path)
    layout = read_header(path) if tensors is None else tensors
    buffer = bytearray(CHUNK_BYTES)
    with path.open("rb") as f:
        for name, info in layout.items():
            if info.dtype not in _EXPONENT_MASKS:
                continue
            word, mask = _EXPONENT_MASKS[info.dtype]
            f.seek(info.begin)
            remaining = info.end - info.begin
            while remaining:
                count = f.readinto(memoryview(buffer)[: min(CHUNK_BYTES, remaining)])
                if not count:
                    raise AdapterError(f"{path.name} changed while it was being read; try again")
                remaining -= count
                words = np.frombuffer(buffer, dtype=word, count=count // word.itemsize)
                if np.any((words & word.type(mask)) == mask):
                    raise AdapterError(
                        f"{path.name}: tensor {name} holds NaN or infinite values; "
                        "an adapter's weights must all be finite numbers"
                    )


def load_lora_weights(
    directory: Path, manifest: AdapterManifest, dtype: torch.dtype | None = None
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [rank, in], B [out, rank]) for every module the manifest lists (float32 when
    `dtype` is None)."""
    import torch
    from safetensors.torch import load_file

    from .manifest import WEIGHTS_FILE, parse_tensor_name

    target = torch.float32 if dtype is None else dtype
    tensors = load_file(str(Path(directory) / WEIGHTS_FILE))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        key = parse_tensor_name(name)
        assert key is not None, name  # inspect_adapter accepted every name
        layer, module, part = key
        pairs.setdefault((layer, module), {})[part] = tensor.to(target)
    return {
        (m.layer, m.module): (pairs[(m.layer, m.module)]["A"], pairs[(m.layer, m.module)]["B"])
        for m in manifest.modules
    }
