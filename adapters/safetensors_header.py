"""Read a safetensors file's header (names, dtypes, shapes, byte ranges) without torch, and spot pickles.

The header is the tenant's JSON: every field is type-checked and bounded here, so that what passes is
exactly what the safetensors loader in the engine will read, byte for byte, and nothing else.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import AdapterError
from .strict_json import loads_strict, shown

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
# A LoRA of every projection of a 100-layer model has 1400 tensors and a header of about 170 KB; the
# header is parsed into Python objects (several times its size), so it is kept well short of the file.
MAX_HEADER_BYTES = 4 << 20
MAX_TENSORS = 16384
MAX_NAME_CHARS = 1024
MAX_DIMS = 8
# The header is {name: {"dtype", "shape": [...], "data_offsets": [...]}}: nothing deeper is valid.
MAX_HEADER_DEPTH = 3
# torch.save writes a zip archive; plain pickle starts with the PROTO opcode.
_PICKLE_MAGICS = (b"PK\x03\x04", b"\x80")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # the tensor's bytes are [begin, end) in the file (data section offsets + its start)
    end: int


def looks_pickled(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4)
    return any(head.startswith(magic) for magic in _PICKLE_MAGICS)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> dtype, shape and byte range, in file order; raise AdapterError naming the field.

    Accepted only if the tensors tile the data section exactly: sorted, without gaps or overlaps, each
    range as long as its shape and dtype need, so no two names can alias the same bytes.
    """
    size = path.stat().st_size
    name = path.name
    if looks_pickled(path):
        raise AdapterError(f"{name} is a pickle, not safetensors: pickled weights are refused")
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise AdapterError(f"{name} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise AdapterError(f"{name} is not a safetensors file (header length {header_len} is impossible)")
        header_bytes = f.read(header_len)
    if len(header_bytes) != header_len:
        raise AdapterError(f"{name} changed while it was being read; try again")
    header = loads_strict(header_bytes, f"{name} header", MAX_HEADER_DEPTH)
    if not isinstance(header, dict):
        raise AdapterError(f"{name} has a corrupt safetensors header (not an object)")
    _check_metadata(header.get("__metadata__"), name)
    entries = [(key, entry) for key, entry in header.items() if key != "__metadata__"]
    if len(entries) > MAX_TENSORS:
        raise AdapterError(f"{name} lists {len(entries)} tensors; at most {MAX_TENSORS} are allowed")
    data_start = 8 + header_len
    tensors = {key: _tensor_info(key, entry, name, size - data_start) for key, entry in entries}
    _check_tiling(tensors, name, size - data_start)
    ordered = sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end))
    return {
        key: TensorInfo(info.dtype, info.shape, data_start + info.begin, data_start + info.end)
        for key, info in ordered
    }


def _check_metadata(metadata: Any, name: str) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AdapterError(f"{name}: __metadata__ must map strings to strings")


def _tensor_info(key: str, entry: Any, name: str, data_size: int) -> TensorInfo:
    """One header entry, its offsets relative to the data section."""
    where = f"{name}: tensor {shown(key)}"
    if not key or len(key) > MAX_NAME_CHARS:
        raise AdapterError(f"{name}: a tensor name is empty or longer than {MAX_NAME_CHARS} characters")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise AdapterError(f"{where} must be an object with exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise AdapterError(f"{where}: dtype {shown(dtype)} is not one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise AdapterError(f"{where}: shape must be a list of at most {MAX_DIMS} non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise AdapterError(f"{where}: data_offsets must be two non-negative integers [begin, end]")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise AdapterError(
            f"{where}: data_offsets [{begin}, {end}] fall outside the {data_size}-byte data section"
        )
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise AdapterError(
            f"{where}: data_offsets span {end - begin} bytes, its shape {shape} of {dtype} needs {expected}"
        )
    return TensorInfo(dtype, tuple(shape), begin, end)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _check_tiling(tensors: dict[str, TensorInfo], name: str, data_size: int) -> None:
    """Byte ranges sorted end to end from 0 to the data section's end: no gap, no overlap, no alias."""
    position = 0
    for key, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != position:
            problem = "overlaps the tensor before it" if info.begin < position else "leaves a gap before it"
            raise AdapterError(
                f"{name}: tensor {shown(key)} at byte {info.begin} {problem} (ends at {position})"
            )
        position = info.end
    if position != data_size:
        raise AdapterError(f"{name}: {data_size - position} bytes after the last tensor belong to no tensor")
