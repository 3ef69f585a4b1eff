"""Fuzzing the archive unpacker: random and mutated zip / tar / tar.gz bytes give either a clean refusal
(Invalid or TooLarge, i.e. a 4xx) or a flat directory of accepted files within the byte limit, never
another exception, and never more than the limit on disk.

Bounded for CI (each test well under 30 s). For a longer run:
    LORAPLEX_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/security/test_fuzz_archives.py
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.web.services.errors import Invalid, TooLarge
from loraplex.web.services.uploads import ACCEPTED_SUFFIXES, UploadedFile, unpack
from tests.security.test_uploads import written_bytes

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "250"))
LIMIT = 64 * 1024
# Generated zips may repeat a name on purpose (the unpacker refuses duplicates); zipfile warns.
pytestmark = pytest.mark.filterwarnings("ignore:Duplicate name:UserWarning")
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

NAMES = st.sampled_from(
    [
        "adapter_config.json",
        "adapter_model.safetensors",
        "folder/adapter_config.json",
        "folder/adapter_model.safetensors",
        "folder/",
        "a/b/c.json",
        "../escape.json",
        "/abs.json",
        "C:x.json",
        "weights.bin",
        "run.sh",
        "x" * 300 + ".json",
        "bad\x01name.json",
        "dup.json",
    ]
)
CONTENT = st.binary(max_size=2048) | st.builds(bytes, st.integers(0, 2 * LIMIT))
MEMBERS = st.lists(st.tuples(NAMES, CONTENT), min_size=0, max_size=5)


def build_tar(members: list[tuple[str, bytes]], gzipped: bool, form: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gzipped else "w", format=form) as archive:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
                continue
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def build_zip(members: list[tuple[str, bytes]], method: int) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, content in members:
            archive.writestr(name, content)
    return buffer.getvalue()


@st.composite
def archives(draw: st.DrawFn) -> tuple[str, bytes]:
    members = draw(MEMBERS)
    kind = draw(st.sampled_from(["zip-deflated", "zip-stored", "tar", "tar.gz"]))
    if kind.startswith("zip"):
        method = zipfile.ZIP_DEFLATED if kind == "zip-deflated" else zipfile.ZIP_STORED
        return "upload.zip", build_zip(members, method)
    form = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    if form == tarfile.USTAR_FORMAT and any(len(name) > 100 for name, _ in members):
        form = tarfile.GNU_FORMAT  # ustar cannot hold the long name; GNU writes a long-name header
    filename = draw(st.sampled_from(["upload.tar.gz", "upload.tgz"]))
    return filename, build_tar(members, gzipped=kind == "tar.gz", form=form)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid archive with a few byte-level mutations: flips, overwrites, truncation, insertions."""
    filename, data = draw(archives())
    raw = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        if not raw:
            break
        at = draw(st.integers(0, len(raw) - 1))
        operation = draw(st.sampled_from(["flip", "overwrite", "truncate", "insert", "delete", "big number"]))
        if operation == "flip":
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif operation == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=16))
            raw[at : at + len(chunk)] = chunk
        elif operation == "truncate":
            del raw[at:]
        elif operation == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif operation == "delete":
            del raw[at : at + draw(st.integers(1, 64))]
        else:  # sizes and counts are where archives lie: octal digits for tar, 0xff for zip
            raw[at : at + 8] = draw(st.sampled_from([b"77777777", b"\xff" * 8, b"9" * 8]))
    return filename, bytes(raw)


def check_unpack(filename: str, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as work:
        target = Path(work)
        before = written_bytes()
        try:
            unpack([UploadedFile(filename, io.BytesIO(data))], target, LIMIT)
        except (Invalid, TooLarge) as exc:
            assert 400 <= exc.status_code < 500 and exc.message
            assert list(target.iterdir()) == []  # a refusal leaves nothing behind
        else:
            written = list(target.iterdir())
            assert all(p.is_file() and p.suffix in ACCEPTED_SUFFIXES for p in written), written
            assert sum(p.stat().st_size for p in written) <= LIMIT
        # Whatever happened, no more than the limit went to disk (plus slack for this process's logs).
        assert written_bytes() - before <= LIMIT + 16 * 1024


@FUZZ
@given(filename=st.sampled_from(["upload.zip", "upload.tar.gz", "upload.tgz"]), data=st.binary(max_size=4096))
def test_random_bytes_are_refused_cleanly(filename: str, data: bytes) -> None:
    check_unpack(filename, data)


@FUZZ
@given(archive=archives())
def test_generated_archives_unpack_or_are_refused_cleanly(archive: tuple[str, bytes]) -> None:
    check_unpack(*archive)


@FUZZ
@given(archive=mutated())
def test_mutated_archives_unpack_or_are_refused_cleanly(archive: tuple[str, bytes]) -> None:
    check_unpack(*archive)
