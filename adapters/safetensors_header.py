"""Read a safetensors file's header (names, dtypes, shapes) without torch, and spot pickles."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import AdapterError

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = ("F32", "F16", "BF16")
_MAX_HEADER = 64 * 2**20
# torch.save writes a zip archive; plain pickle starts with the PROTO opcode.
_PICKLE_MAGICS = (b"PK\x03\x04", b"\x80")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def looks_pickled(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4)
    return any(head.startswith(magic) for magic in _PICKLE_MAGICS)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> dtype and shape; every offset is checked against the file's size."""
    size = path.stat().st_size
    name = path.name
    if looks_pickled(path):
        raise AdapterError(f"{name} is a pickle, not safetensors: pickled weights are refused")
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise AdapterError(f"{name} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER, size - 8):
            raise AdapterError(f"{name} is not a safetensors file (header length {header_len} is impossible)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{name} has a corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{name} has a corrupt safetensors header (not an object)")
    data_size = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterError(f"{name}: tensor {key} has a malformed header entry") from exc
        if dtype not in DTYPE_BYTES:
            raise AdapterError(f"{name}: tensor {key} has unknown dtype {dtype!r}")
        expected = math.prod(shape) * DTYPE_BYTES[dtype]
        if not (0 <= begin <= end <= data_size) or end - begin != expected:
            raise AdapterError(f"{name}: tensor {key} has data offsets that do not fit its shape or the file")
        tensors[key] = TensorInfo(dtype, shape)
    return tensors
