"""A bounded reader of a GGUF file's header: every count and length is checked against the bytes that
remain before anything is read or allocated from it, so a 49-byte file that claims an array of 2**62
items is refused at once (the `gguf` package's reader loops over such an array until memory runs out).

Layout (GGUF v2 and v3, little-endian): magic `GGUF`, u32 version, u64 tensor count, u64 key count; each
key-value as a string key, a u32 value type and the value; each tensor as a string name, u32 n_dims, n_dims
u64 dimensions (fastest first), u32 ggml type and a u64 offset into the data section, which starts at the
next multiple of `general.alignment` (32). A string is a u64 byte count and that many UTF-8 bytes; an
array is a u32 item type, a u64 item count and the items. Values come out as plain Python values (str,
int, float, bool, lists of them), as the `gguf` package's `ReaderField.contents()` gives them.

Every malformed header is a ModelLoadError that names the key or tensor and what is wrong; the memory a
parse takes is a small multiple of the header's bytes, at most limits.MAX_GGUF_HEADER_BYTES of them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import ModelLoadError
from .limits import (
    MAX_GGUF_ALIGNMENT,
    MAX_GGUF_DIMS,
    MAX_GGUF_HEADER_BYTES,
    MAX_GGUF_KEY_BYTES,
    MAX_GGUF_KEYS,
    MAX_GGUF_TENSOR_NAME_BYTES,
    MAX_GGUF_TENSORS,
)

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# Value type -> little-endian dtype of a scalar of that type (GGUF's own numbering).
_SCALARS: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),  # bool: one byte, anything but 0 is true
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_BOOL = 7
# The fewest bytes one item of each kind takes in the file: what a claimed count is checked against.
_MIN_KEY_VALUE_BYTES = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dimension, type, offset
_MIN_STRING_BYTES = 8
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SHOWN = 120  # characters of a file's key or name quoted in an error


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order: fastest-varying first
    offset: int  # from the start of the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The dimensions slowest first, as numpy and torch order them."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    alignment: int
    data_offset: int  # where the data section starts


def shown(text: str) -> str:
    """A key or name from the file, quoted for an error message: ASCII only and cut short."""
    quoted = ascii(text)
    return quoted if len(quoted) <= _SHOWN else f"{quoted[: _SHOWN - 4]}...'"


def parse_gguf_header(data: Any, source: str = "GGUF file") -> GGUFHeader:
    """The header of the GGUF file whose bytes are `data` (bytes, a memoryview or a memory map).

    Raises ModelLoadError, naming `source` and the key or tensor at fault, for anything malformed: a count
    or length beyond the bytes left, an unknown value or tensor type, a nested array, a string that is not
    UTF-8, a duplicate key or tensor name, a tensor outside the data section or overlapping another."""
    reader = _Reader(memoryview(data).cast("B"), source)
    if reader.size < 4 or bytes(reader.view[:4]) != MAGIC:
        raise ModelLoadError(f"{source}: not a readable GGUF file (it does not start with the GGUF magic)")
    reader.pos = 4
    version = reader.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        detail = "big-endian GGUF files are not supported" if swapped in SUPPORTED_VERSIONS else ""
        raise ModelLoadError(
            f"{source}: GGUF version {version} is not supported (only {SUPPORTED_VERSIONS}){detail and '; '}"
            f"{detail}"
        )
    tensor_count = reader.u64("the tensor count")
    key_count = reader.u64("the key-value count")
    reader.check_count(key_count, _MIN_KEY_VALUE_BYTES, MAX_GGUF_KEYS, "key-values")
    metadata: dict[str, Any] = {}
    for index in range(key_count):
        key = reader.string(f"the name of key-value {index}", MAX_GGUF_KEY_BYTES)
        if key in metadata:
            raise ModelLoadError(f"{source}: GGUF key {shown(key)} appears twice")
        metadata[key] = reader.value(reader.u32(f"the type of {shown(key)}"), shown(key))
    reader.check_count(tensor_count, _MIN_TENSOR_INFO_BYTES, MAX_GGUF_TENSORS, "tensors")
    infos = []
    names: set[str] = set()
    for index in range(tensor_count):
        info = reader.tensor_info(index)
        if info[0] in names:
            raise ModelLoadError(f"{source}: GGUF tensor {shown(info[0])} appears twice")
        names.add(info[0])
        infos.append(info)
    alignment = _alignment(metadata, source)
    data_offset = -(-reader.pos // alignment) * alignment
    for name, _, _, offset, _ in infos:
        if offset % alignment:
            raise ModelLoadError(
                f"{source}: GGUF tensor {shown(name)}: its offset {offset} is not a multiple of the "
                f"alignment {alignment}"
            )
    tensors = tuple(
        GGUFTensorInfo(name, ggml_type, dims, data_offset + offset, n_bytes)
        for name, ggml_type, dims, offset, n_bytes in infos
    )
    _check_layout(tensors, reader.size, source)
    return GGUFHeader(version, metadata, tensors, alignment, data_offset)


def _alignment(metadata: dict[str, Any], source: str) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 0 < value <= MAX_GGUF_ALIGNMENT
        or value & (value - 1)
    ):
        raise ModelLoadError(
            f"{source}: GGUF general.alignment must be a power of two up to {MAX_GGUF_ALIGNMENT}, "
            f"got {value!r:.40}"
        )
    return value


def _check_layout(tensors: tuple[GGUFTensorInfo, ...], size: int, source: str) -> None:
    """Each tensor's bytes lie inside the file and overlap no other's."""
    end_of_previous, previous = 0, ""
    for tensor in sorted(tensors, key=lambda t: t.offset):
        what = f"{source}: GGUF tensor {shown(tensor.name)}"
        if tensor.offset + tensor.n_bytes > size:
            raise ModelLoadError(
                f"{what}: its {tensor.n_bytes} bytes at offset {tensor.offset} run past the end of the "
                f"file ({size} bytes)"
            )
        if tensor.offset < end_of_previous:
            raise ModelLoadError(f"{what}: its bytes overlap those of tensor {shown(previous)}")
        end_of_previous, previous = tensor.offset + tensor.n_bytes, tensor.name


class _Reader:
    """A position in the header; every read checks the bytes it needs against those left."""

    def __init__(self, view: memoryview, source: str):
        self.view = view
        self.size = len(view)
        self.limit = min(self.size, MAX_GGUF_HEADER_BYTES)
        self.pos = 0
        self.source = source

    def fail(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: GGUF {message}")

    def take(self, n: int, what: str) -> int:
        """The offset of the next `n` bytes, which `what` needs; moves past them."""
        if n > self.limit - self.pos:
            if self.limit < self.size and n <= self.size - self.pos:
                raise self.fail(f"header is over {MAX_GGUF_HEADER_BYTES} bytes (at {what})")
            raise self.fail(
                f"{what} needs {n} bytes at offset {self.pos}, but the file has {self.size - self.pos} left"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return int(_U32.unpack_from(self.view, self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack_from(self.view, self.take(8, what))[0])

    def check_count(self, count: int, min_bytes: int, maximum: int, what: str) -> None:
        if count > maximum:
            raise self.fail(f"header declares {count} {what}; at most {maximum} are allowed")
        if count * min_bytes > self.limit - self.pos:
            raise self.fail(
                f"header declares {count} {what}, which need at least {count * min_bytes} bytes, but "
                f"{self.limit - self.pos} are left"
            )

    def string(self, what: str, max_bytes: int | None = None) -> str:
        length = self.u64(f"the length of {what}")
        if max_bytes is not None and length > max_bytes:
            raise self.fail(f"{what} is {length} bytes long; at most {max_bytes} are allowed")
        start = self.take(length, what)
        return self._decode(start, length, what)

    def _decode(self, start: int, length: int, what: str) -> str:
        try:
            return str(self.view[start : start + length], "utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8 (byte {exc.start})") from None

    def value(self, value_type: int, key: str) -> Any:
        if value_type == _STRING:
            return self.string(f"the value of {key}")
        if value_type == _ARRAY:
            return self.array(key)
        dtype = _SCALARS.get(value_type)
        if dtype is None:
            raise self.fail(f"key {key} has unknown value type {value_type}")
        item = np.frombuffer(self.view, dtype, 1, self.take(dtype.itemsize, f"the value of {key}"))
        return bool(item[0]) if value_type == _BOOL else item[0].item()

    def array(self, key: str) -> list[Any]:
        item_type = self.u32(f"the item type of array {key}")
        count = self.u64(f"the item count of array {key}")
        if item_type == _ARRAY:
            raise self.fail(f"array {key} holds arrays; nested arrays are not supported")
        if item_type == _STRING:
            return self.strings(count, key)
        dtype = _SCALARS.get(item_type)
        if dtype is None:
            raise self.fail(f"array {key} has unknown item type {item_type}")
        start = self.take(count * dtype.itemsize, f"the {count} items of array {key}")
        if count == 0:
            return []
        items = np.frombuffer(self.view, dtype, count, start)
        return (items != 0).tolist() if item_type == _BOOL else items.tolist()

    def strings(self, count: int, key: str) -> list[str]:
        if count * _MIN_STRING_BYTES > self.limit - self.pos:
            raise self.fail(
                f"array {key} declares {count} strings, which need at least {count * _MIN_STRING_BYTES} "
                f"bytes, but {self.limit - self.pos} are left"
            )
        # The hot loop of a real file (about 100K tokens and merges): plain locals, no method calls.
        view, pos, limit, unpack = self.view, self.pos, self.limit, _U64.unpack_from
        items: list[str] = []
        for index in range(count):
            if pos + 8 > limit:
                self.pos = pos
                self.take(8, f"the length of item {index} of array {key}")
            length = unpack(view, pos)[0]
            pos += 8
            if length > limit - pos:
                self.pos = pos
                self.take(length, f"item {index} of array {key}")
            try:
                items.append(str(view[pos : pos + length], "utf-8"))
            except UnicodeDecodeError as exc:
                raise self.fail(f"item {index} of array {key} is not UTF-8 (byte {exc.start})") from None
            pos += length
        self.pos = pos
        return items

    def tensor_info(self, index: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int, int]:
        """(name, type, dimensions, offset in the data section, bytes) of the next tensor."""
        name = self.string(f"the name of tensor {index}", MAX_GGUF_TENSOR_NAME_BYTES)
        what = f"tensor {shown(name)}"
        n_dims = self.u32(f"the dimension count of {what}")
        if not 1 <= n_dims <= MAX_GGUF_DIMS:
            raise self.fail(f"{what} has {n_dims} dimensions; 1 to {MAX_GGUF_DIMS} are allowed")
        dims = tuple(self.u64(f"dimension {d} of {what}") for d in range(n_dims))
        raw_type = self.u32(f"the type of {what}")
        offset = self.u64(f"the data offset of {what}")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block, type_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise self.fail(f"{what} has unknown tensor type {raw_type}") from None
        if dims[0] % block:
            raise self.fail(
                f"{what}: its rows of {dims[0]} values are not whole {ggml_type.name} blocks of {block}"
            )
        elements = 1
        for d in dims:
            elements *= d
        return name, ggml_type, dims, offset, elements // block * type_bytes
