"""Compression bombs under the byte limit (issue 29, item 9).

A 299 KiB zip holding 300 MiB of zeros passed every check of the upload's byte limit (512 MiB by default)
and was unpacked whole before the adapter was refused: 300 MiB written, the temp and data directories
+289 MiB at peak, per upload. Now an archive may write at most `max_expansion_ratio` times what was read of
it (plus `expansion_allowance_bytes`), per entry and in total, checked while it streams. Measured here:
the bytes this process wrote (the kernel's count, /proc/self/io), and the target directory left empty.
"""

from __future__ import annotations

import functools
import io
import random
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest

from loraplex.web.services.errors import TooLarge
from loraplex.web.services.uploads import LIMITS, UploadedFile, unpack
from tests.security.test_uploads import written_bytes

MiB = 1024 * 1024
LIMIT = 512 * MiB  # LORAPLEX_MAX_UPLOAD_BYTES's default: the bombs all fit under it
ZEROS = 300 * MiB
CONFIG = b'{"peft_type": "LORA"}'


def deflated_zeros(prefix: bytes, zeros: int, suffix: bytes = b"") -> tuple[bytes, int]:
    """(raw deflate, crc32) of prefix + `zeros` zero bytes + suffix, made in milliseconds: each MiB of
    zeros is one block after a full flush (the same bytes every time, as zlib resets between them), so
    the bomb costs one MiB's compression, not 300 (the zeros' CRC is still computed, about 0.5 s)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = compressor.compress(prefix) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(bytes(MiB)) + compressor.flush(zlib.Z_FULL_FLUSH)
    tail = compressor.compress(suffix) + compressor.flush()
    crc = zlib.crc32(prefix)
    for _ in range(zeros // MiB):
        crc = zlib.crc32(bytes(MiB), crc)
    return head + block * (zeros // MiB) + tail, zlib.crc32(suffix, crc)


def one_entry_zip(name: bytes, deflate: bytes, crc: int, size: int) -> bytes:
    """A zip of one deflated entry, written by hand (zipfile would compress the 300 MiB itself)."""
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, crc, len(deflate), size, len(name), 0)
    central = struct.pack(
        "<IHHHHHHIIIHHHHHII",
        0x02014B50,
        20,
        20,
        0,
        8,
        0,
        0,
        crc,
        len(deflate),
        size,
        len(name),
        0,
        0,
        0,
        0,
        0,
        0,
    )
    entry = local + name + deflate
    directory = central + name
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(directory), len(entry), 0)
    return entry + directory + end


@functools.cache
def zip_bomb() -> bytes:
    """The review's zip: one entry of 300 MiB of zeros in about 300 KiB."""
    deflate, crc = deflated_zeros(b"", ZEROS)
    data = one_entry_zip(b"adapter_model.safetensors", deflate, crc, ZEROS)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:  # a zip zipfile reads as such
        assert archive.infolist()[0].file_size == ZEROS
    return data


def overstated_zip_bomb() -> bytes:
    """The same zip claiming its entry's compressed size is half its real size: the declared ratio (2:1)
    passes, so only counting what is really read while it inflates can stop it."""
    data = bytearray(zip_bomb())
    claimed = ZEROS // 2
    struct.pack_into("<L", data, 18, claimed)  # the local header's compressed size
    struct.pack_into("<L", data, data.rfind(b"PK\x01\x02") + 20, claimed)  # the central directory's
    return bytes(data)


def gzip_of(deflate: bytes, crc: int, size: int) -> bytes:
    header = b"\x1f\x8b\x08\x00" + bytes(4) + b"\x00\xff"  # deflate, no name, no time, unknown OS
    return header + deflate + struct.pack("<II", crc, size % 2**32)


def tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def tgz_bomb() -> bytes:
    """A tar.gz whose one member is 300 MiB of zeros: a tar's sizes say nothing of its compression."""
    header = tar_header("adapter_model.safetensors", ZEROS)
    deflate, crc = deflated_zeros(header, ZEROS, bytes(1024))  # then the end-of-archive blocks
    return gzip_of(deflate, crc, len(header) + ZEROS + 1024)


BOMBS = {"a.zip": zip_bomb, "overstated.zip": overstated_zip_bomb, "a.tar.gz": tgz_bomb}


@pytest.mark.parametrize("filename", list(BOMBS))
def test_a_bomb_under_the_byte_limit_writes_a_small_multiple_of_its_size(
    filename: str, tmp_path: Path
) -> None:
    bomb = BOMBS[filename]()
    assert len(bomb) < 320 * 1024  # about 1000:1
    before = written_bytes()
    try:
        unpack([UploadedFile(filename, io.BytesIO(bomb))], tmp_path, LIMIT)
        refused = None
    except TooLarge as exc:
        refused = exc
    wrote = written_bytes() - before
    assert wrote < ZEROS // 40, f"{wrote} bytes written"  # far below what the bomb holds
    bound = LIMITS.max_expansion_ratio * len(bomb) + LIMITS.expansion_allowance_bytes
    assert wrote <= bound + 64 * 1024, f"{wrote} bytes written; the ratio allows {bound}"
    if filename == "a.zip":  # an honest zip's sizes say it all: refused before a byte is inflated
        assert wrote < 64 * 1024, wrote
    assert refused is not None and f"more than {LIMITS.max_expansion_ratio} times its size" in refused.message
    assert list(tmp_path.iterdir()) == []


def weights(size: int, seed: int = 0) -> bytes:
    """Adapter-like weights: a random half (lora_A), a zero half (an untrained lora_B)."""
    noise = random.Random(seed).randbytes(size // 2)
    return noise + bytes(size - len(noise))


def test_real_adapters_stay_far_below_the_ratio(tmp_path: Path) -> None:
    files = [("adapter_config.json", CONFIG * 50), ("adapter_model.safetensors", weights(8 * MiB))]
    zip_buffer, tar_buffer = io.BytesIO(), io.BytesIO()
    with zipfile.ZipFile(zip_buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in files:
            archive.writestr(name, content)
    with tarfile.open(fileobj=tar_buffer, mode="w:gz") as archive:
        for name, content in files:
            info = tarfile.TarInfo(f"folder/{name}")
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    for filename, archive_bytes in (("a.zip", zip_buffer.getvalue()), ("a.tgz", tar_buffer.getvalue())):
        target = tmp_path / filename
        target.mkdir()
        unpack([UploadedFile(filename, io.BytesIO(archive_bytes))], target, LIMIT)
        assert {p.name: p.read_bytes() for p in target.iterdir()} == dict(files)


def test_each_entry_is_held_to_the_ratio_not_only_the_whole(tmp_path: Path) -> None:
    """Incompressible padding first cannot buy a later entry the right to explode."""
    padding = random.Random(1).randbytes(4 * MiB)  # read 4 MiB: the whole may write 80 MiB + 1 MiB
    prefix = tar_header("adapter_config.json", len(padding)) + padding + tar_header("w.safetensors", 40 * MiB)
    deflate, crc = deflated_zeros(prefix, 40 * MiB, bytes(1024))
    archive = gzip_of(deflate, crc, len(prefix) + 40 * MiB + 1024)
    before = written_bytes()
    with pytest.raises(TooLarge) as refused:
        unpack([UploadedFile("a.tgz", io.BytesIO(archive))], tmp_path, LIMIT)
    assert refused.value.message.startswith("w.safetensors:")
    assert written_bytes() - before < len(padding) + 4 * MiB  # the padding, and a few MiB of zeros
    assert list(tmp_path.iterdir()) == []
