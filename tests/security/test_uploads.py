"""Uploads that cannot be used as weapons (issue 14, items 4 and 5).

Each attack is reproduced as it was found and the refusal asserted with its bound: peak memory (tracemalloc),
bytes written (the kernel's count of this process's writes, /proc/self/io), body chunks pulled from the
client (an ASGI `receive` that counts), temporary files left.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import tarfile
import tempfile
import tracemalloc
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.web.services.errors import Invalid, TooLarge
from loraplex.web.services.multipart import FORM_OVERHEAD_BYTES
from loraplex.web.services.uploads import LIMITS, UploadedFile, unpack
from tests.web.conftest import (  # noqa: F401  (fixtures)
    ADMIN,
    SHAPE,
    Api,
    app_factory,
    loose,
    peft_dir,
    sqlite_template,
    sqlite_url,
)
from tests.web.console_client import csrf_of, make_user, sign_in

MiB = 1024 * 1024
CONFIG = b'{"peft_type": "LORA"}'


# -- measuring --------------------------------------------------------------------------------------


def written_bytes() -> int:
    """Bytes this process has passed to write(2) so far, as the kernel counts them."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def measured(action: Callable[[], object]) -> tuple[BaseException | None, int, int]:
    """(what `action` raised, its peak traced memory, the bytes it wrote)."""
    before = written_bytes()
    tracemalloc.start()
    try:
        action()
        raised = None
    except (Invalid, TooLarge) as exc:
        raised = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return raised, peak, written_bytes() - before


def unpack_one(filename: str, data: bytes, target: Path, limit: int) -> Callable[[], None]:
    return lambda: unpack([UploadedFile(filename, io.BytesIO(data))], target, limit)


def files_in(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()]


# -- archive bombs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def million_entry_tgz() -> bytes:
    """A .tar.gz of a million empty entries in about 2 MB (tarfile's getmembers() took 400 MB on it).

    Built as a thousand identical gzip members of a thousand headers each (a valid multi-member gzip),
    which is fast to make and the same thing to a reader.
    """
    header = tarfile.TarInfo("adapter_config.json").tobuf(format=tarfile.USTAR_FORMAT)
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    member = compressor.compress(header * 1000) + compressor.flush()
    return member * 1000


def test_a_million_entry_tar_is_refused_at_the_entry_limit_in_bounded_memory(
    million_entry_tgz: bytes, tmp_path: Path
) -> None:
    assert len(million_entry_tgz) < 5 * MiB
    raised, peak, wrote = measured(unpack_one("a.tar.gz", million_entry_tgz, tmp_path, 512 * MiB))
    assert isinstance(raised, Invalid) and f"more than {LIMITS.max_entries} entries" in raised.message
    assert peak < 4 * MiB, f"peak {peak} bytes"
    assert wrote < 64 * 1024 and files_in(tmp_path) == []


@pytest.fixture(scope="module")
def zip_of_300_mib_of_zeros() -> bytes:
    """A 299 KiB zip whose one entry inflates to 300 MiB (it used to be written whole to temp)."""
    buffer = io.BytesIO()
    with (
        zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open("adapter_model.safetensors", "w") as entry,
    ):
        zeros = bytes(MiB)
        for _ in range(300):
            entry.write(zeros)
    return buffer.getvalue()


def test_a_zip_bomb_is_refused_by_its_declared_size_before_a_byte_is_written(
    zip_of_300_mib_of_zeros: bytes, tmp_path: Path
) -> None:
    assert len(zip_of_300_mib_of_zeros) < 320 * 1024
    raised, peak, wrote = measured(unpack_one("a.zip", zip_of_300_mib_of_zeros, tmp_path, 10 * MiB))
    assert isinstance(raised, TooLarge) and "10485760-byte limit" in raised.message
    assert wrote < 64 * 1024, f"{wrote} bytes written"
    assert peak < 4 * MiB and files_in(tmp_path) == []


def _lie_about_sizes(zip_bytes: bytes, size: int) -> bytes:
    """The zip with its one entry's uncompressed size rewritten to `size`, in both of its headers."""
    data = bytearray(zip_bytes)
    struct.pack_into("<L", data, 22, size)  # the local header comes first; its size field is at 22
    struct.pack_into("<L", data, data.rfind(b"PK\x01\x02") + 24, size)  # the central directory's
    return bytes(data)


def test_a_zip_that_lies_about_its_size_writes_no_more_than_it_declared(
    zip_of_300_mib_of_zeros: bytes, tmp_path: Path
) -> None:
    liar = _lie_about_sizes(zip_of_300_mib_of_zeros, 1000)
    with zipfile.ZipFile(io.BytesIO(liar)) as archive:
        assert archive.infolist()[0].file_size == 1000
    raised, peak, wrote = measured(unpack_one("a.zip", liar, tmp_path, 10 * MiB))
    assert isinstance(raised, Invalid) and "not a readable .zip" in raised.message  # the CRC fails
    assert wrote < 64 * 1024, f"{wrote} bytes written"
    assert peak < 4 * MiB and files_in(tmp_path) == []


def test_a_zip_of_many_entries_is_refused_by_its_end_record_before_its_directory_is_parsed(
    tmp_path: Path,
) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for index in range(20_000):
            archive.writestr(f"{index}.json", b"")
    raised, peak, _ = measured(unpack_one("a.zip", buffer.getvalue(), tmp_path, 512 * MiB))
    assert isinstance(raised, Invalid) and "20000 entries" in raised.message
    assert peak < 1 * MiB, f"peak {peak} bytes"  # zipfile would have made 20,000 ZipInfo objects


def test_a_huge_extended_tar_header_is_refused_before_tarfile_reads_it(tmp_path: Path) -> None:
    """A GNU long name of 200 MB compresses to 200 KB; tarfile reads such a header in one call."""
    info = tarfile.TarInfo("././@LongLink")
    info.type = tarfile.GNUTYPE_LONGNAME
    info.size = 200 * MiB
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [compressor.compress(info.tobuf(format=tarfile.GNU_FORMAT))]
    zeros = bytes(MiB)
    parts += [compressor.compress(zeros) for _ in range(200)]
    bomb = b"".join(parts) + compressor.flush()
    raised, peak, _ = measured(unpack_one("a.tgz", bomb, tmp_path, 512 * MiB))
    assert isinstance(raised, Invalid) and "extended header" in raised.message
    assert peak < 4 * MiB, f"peak {peak} bytes"


def test_a_chain_of_extended_headers_is_refused_not_recursed_into(tmp_path: Path) -> None:
    """tarfile follows each pax header into the next by recursion: thousands would crash it."""
    record = b"20 comment=xxxxxxxx\n"
    pax = tarfile.TarInfo("pax")
    pax.type = tarfile.XHDTYPE
    pax.size = len(record)
    block = pax.tobuf(format=tarfile.USTAR_FORMAT) + record.ljust(512, b"\0")
    raised, _, _ = measured(unpack_one("a.tar.gz", block * 5000, tmp_path, 512 * MiB))
    assert isinstance(raised, Invalid) and "too many extended headers" in raised.message


def test_sparse_tar_members_are_refused(tmp_path: Path) -> None:
    info = tarfile.TarInfo("adapter_model.safetensors")
    info.type = tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[482] = 1  # "isextended": tarfile would read extension blocks for as long as they say so
    struct.pack_into("8s", header, 148, b" " * 8)
    struct.pack_into("7s", header, 148, b"%06o\0" % sum(header))
    raised, _, _ = measured(unpack_one("a.tar.gz", bytes(header) + bytes([1]) * 512 * 2000, tmp_path, MiB))
    assert isinstance(raised, Invalid) and "sparse" in raised.message


def tar_of(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, content in members:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def test_a_tar_member_over_the_limit_is_refused_by_its_declared_size(tmp_path: Path) -> None:
    archive = tar_of([("adapter_config.json", CONFIG), ("adapter_model.safetensors", bytes(2 * MiB))])
    raised, _, wrote = measured(unpack_one("a.tgz", archive, tmp_path, MiB))
    assert isinstance(raised, TooLarge) and "adapter_model.safetensors" in raised.message
    assert wrote < 64 * 1024 and files_in(tmp_path) == []


def test_archive_entry_count_and_name_limits(tmp_path: Path) -> None:
    many = tar_of([(f"{i}.json", b"{}") for i in range(LIMITS.max_entries + 1)])
    raised, _, _ = measured(unpack_one("a.tgz", many, tmp_path, MiB))
    assert isinstance(raised, Invalid) and "entries" in raised.message
    long_name = "a" * 300 + ".json"
    for archive, filename in (
        (tar_of([(long_name, b"{}")]), "a.tgz"),
        (zip_of([(long_name, b"{}")]), "a.zip"),
    ):
        raised, _, _ = measured(unpack_one(filename, archive, tmp_path, MiB))
        assert isinstance(raised, Invalid) and "longer than 255 characters" in raised.message
    loose_files = [UploadedFile(f"{i}.json", io.BytesIO(b"{}")) for i in range(LIMITS.max_entries + 1)]
    raised, _, _ = measured(lambda: unpack(loose_files, tmp_path, MiB))
    assert isinstance(raised, Invalid) and "at most 16" in raised.message
    assert files_in(tmp_path) == []


def zip_of(members: list[tuple[str, bytes]], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, content in members:
            archive.writestr(name, content)
    return buffer.getvalue()


def test_only_stored_or_deflated_zip_entries_are_read(tmp_path: Path) -> None:
    """bzip2 and lzma entries are inflated by zipfile without an output bound."""
    archive = zip_of([("adapter_config.json", CONFIG)], zipfile.ZIP_BZIP2)
    raised, _, _ = measured(unpack_one("a.zip", archive, tmp_path, MiB))
    assert isinstance(raised, Invalid) and "only stored or deflated" in raised.message


def test_kept_checks_and_a_good_archive_still_unpacks(tmp_path: Path) -> None:
    good = [("adapter_config.json", CONFIG), ("adapter_model.safetensors", b"w" * 1000)]
    for filename, archive in (
        ("a.zip", zip_of(good)),
        ("a.tgz", tar_of(good)),
        ("a.tar.gz", tar_of([(f"folder/{n}", c) for n, c in good])),
    ):
        target = tmp_path / filename
        target.mkdir()
        unpack([UploadedFile(filename, io.BytesIO(archive))], target, MiB)
        assert {p.name: p.read_bytes() for p in target.iterdir()} == dict(good)
    refusals = {
        "appears twice": tar_of([good[0], good[0]]),
        "nested folders": tar_of([("a/b/adapter_config.json", CONFIG)]),
        "traversal": tar_of([("../adapter_config.json", CONFIG)]),
        "never pickled": tar_of([("adapter_model.bin", b"\x80")]),
    }
    refused = tmp_path / "refused"
    refused.mkdir()
    for expected, archive in refusals.items():
        raised, _, _ = measured(unpack_one("a.tgz", archive, refused, MiB))
        assert isinstance(raised, Invalid) and expected in raised.message, (expected, raised)


# -- the upload routes: nothing read before authentication and quota --------------------------------


class CountingBody:
    """An ASGI `receive` serving a body in 64 KiB chunks, counting how many chunks were pulled."""

    def __init__(self, body: bytes | None = None, total: int = 0, chunk: int = 64 * 1024):
        self.body = body
        self.total = len(body) if body is not None else total
        self.chunk = chunk
        self.pulled = 0

    async def __call__(self) -> dict[str, Any]:
        start = self.pulled * self.chunk
        self.pulled += 1
        if start >= self.total:
            return {"type": "http.disconnect"}
        end = min(start + self.chunk, self.total)
        data = self.body[start:end] if self.body is not None else b"\0" * (end - start)
        return {"type": "http.request", "body": data, "more_body": end < self.total}


def call(
    app: FastAPI, path: str, headers: dict[str, str], receive: CountingBody, length: int | None
) -> tuple[int, bytes]:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if length is not None:
        raw.append((b"content-length", str(length).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
        "state": {},
    }
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


BOUNDARY = "lpxboundary"
MULTIPART = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


def form_body(fields: dict[str, str], files: list[tuple[str, bytes]]) -> bytes:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    for filename, content in files:
        head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="files"; filename="{filename}"\r\n\r\n'
        parts.append(head.encode() + content + b"\r\n")
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


@pytest.fixture
def spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the server's temporary files go during the test."""
    directory = tmp_path / "spool"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


@pytest.fixture
def platform(sqlite_url: str, app_factory: Callable[..., FastAPI]) -> Iterator[tuple[FastAPI, Api]]:  # noqa: F811
    app = app_factory(sqlite_url)
    with TestClient(app) as client:
        api = Api(client)
        api.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
        yield app, api


def set_quota(api: Api, tenant_id: object, **quota: int) -> None:
    response = api.client.put(f"/admin/v1/tenants/{tenant_id}/quota", json=quota, headers=ADMIN)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("length", [100 * MiB, None], ids=["content-length", "chunked"])
def test_an_unauthenticated_upload_reads_no_body_and_writes_nothing(
    platform: tuple[FastAPI, Api], spool: Path, length: int | None
) -> None:
    app, _ = platform
    for headers in ({}, {"authorization": "Bearer lpx_not_a_key"}):
        body = CountingBody(total=100 * MiB)
        status, _ = call(app, "/api/v1/adapters", {**MULTIPART, **headers}, body, length)
        assert status == 401 and body.pulled == 0
    assert list(spool.iterdir()) == []


def test_an_over_quota_upload_reads_no_body(platform: tuple[FastAPI, Api], spool: Path) -> None:
    app, api = platform
    tenant, key = api.tenant_with_key("acme")
    set_quota(api, tenant["id"], max_adapters=0)
    body = CountingBody(total=100 * MiB)
    status, response = call(app, "/api/v1/adapters", {**MULTIPART, **key}, body, None)
    assert status == 403 and b"quota of 0 adapters" in response and body.pulled == 0
    assert list(spool.iterdir()) == []


def test_a_full_storage_quota_reads_no_body(
    platform: tuple[FastAPI, Api],
    spool: Path,
    peft_dir: Path,  # noqa: F811
) -> None:
    app, api = platform
    tenant, key = api.tenant_with_key("acme")
    files = [("files", (n, c, "application/octet-stream")) for n, c in loose(peft_dir)]
    made = api.client.post(
        "/api/v1/adapters", data={"name": "a1", "deployment": "tiny"}, files=files, headers=key
    )
    assert made.status_code == 201, made.text
    set_quota(api, tenant["id"], max_storage_bytes=made.json()["bytes"])
    body = CountingBody(total=MiB)
    status, response = call(app, "/api/v1/adapters", {**MULTIPART, **key}, body, MiB)
    assert status == 403 and b"storage quota" in response and body.pulled == 0
    assert list(spool.iterdir()) == []


def test_a_declared_length_over_the_tenants_byte_limit_reads_no_body(
    platform: tuple[FastAPI, Api], spool: Path
) -> None:
    app, api = platform
    tenant, key = api.tenant_with_key("acme")
    set_quota(api, tenant["id"], max_adapter_bytes=MiB)
    body = CountingBody(total=2 * MiB)
    status, response = call(app, "/api/v1/adapters", {**MULTIPART, **key}, body, 2 * MiB)
    assert status == 413 and b"1048576-byte limit" in response and body.pulled == 0
    assert list(spool.iterdir()) == []


def test_an_undeclared_body_is_cut_off_at_the_tenants_byte_limit(
    platform: tuple[FastAPI, Api], spool: Path
) -> None:
    app, api = platform
    tenant, key = api.tenant_with_key("acme")
    set_quota(api, tenant["id"], max_adapter_bytes=MiB)
    endless = form_body(
        {"name": "a1", "deployment": "tiny"}, [("adapter_model.safetensors", bytes(64 * MiB))]
    )
    body = CountingBody(endless)
    status, response = call(app, "/api/v1/adapters", {**MULTIPART, **key}, body, None)
    assert status == 413 and b"1048576-byte limit" in response
    assert body.pulled * body.chunk <= MiB + FORM_OVERHEAD_BYTES + body.chunk  # the rest is never read
    assert list(spool.iterdir()) == []  # the spooled part is gone too


def console_member(app: FastAPI, api: Api) -> TestClient:
    make_user(app, "ada@acme.test", tenant="acme")
    browser = TestClient(app)
    assert sign_in(browser, "ada@acme.test").status_code == 303
    return browser


def test_a_console_upload_without_a_valid_csrf_token_reads_no_file(
    platform: tuple[FastAPI, Api], spool: Path
) -> None:
    app, api = platform
    browser = console_member(app, api)
    cookies = "; ".join(f"{k}={v}" for k, v in browser.cookies.items())
    token = csrf_of(browser.get("/console/adapters"))
    files = [("adapter_model.safetensors", bytes(8 * MiB))]
    cases = {
        "no token": ({}, {"name": "a1", "deployment": "tiny"}),
        "wrong form token": ({}, {"csrf_token": token[:-4] + "0000", "name": "a1", "deployment": "tiny"}),
        "wrong header": ({"x-csrf-token": "0" * 64}, {"name": "a1", "deployment": "tiny"}),
        "cross-site": (
            {"sec-fetch-site": "cross-site"},
            {"csrf_token": token, "name": "a1", "deployment": "tiny"},
        ),
    }
    for case, (headers, fields) in cases.items():
        body = CountingBody(form_body(fields, files))
        status, _ = call(app, "/console/adapters", {**MULTIPART, "cookie": cookies, **headers}, body, None)
        assert status == 403, case
        assert body.pulled <= 1, case  # the token is checked before the first file part is read
    assert list(spool.iterdir()) == []
    # An outsider without a session is sent to sign in, having sent nothing.
    body = CountingBody(total=8 * MiB)
    status, _ = call(app, "/console/adapters", MULTIPART, body, 8 * MiB)
    assert status == 303 and body.pulled == 0


def test_the_console_upload_works_with_the_token_in_the_form_or_header(
    platform: tuple[FastAPI, Api],
    peft_dir: Path,  # noqa: F811
) -> None:
    app, api = platform
    browser = console_member(app, api)
    token = csrf_of(browser.get("/console/adapters"))
    files = [("files", (n, c, "application/octet-stream")) for n, c in loose(peft_dir)]
    made = browser.post(
        "/console/adapters", data={"csrf_token": token, "name": "a1", "deployment": "tiny"}, files=files
    )
    assert made.status_code == 200 and "Adapter “a1” is ready" in made.text
    scripted = browser.post(
        "/console/adapters",
        data={"name": "a2", "deployment": "tiny"},
        files=files,
        headers={"X-CSRF-Token": token, "Accept": "application/json"},
    )
    assert scripted.status_code == 201 and scripted.json()["status"] == "ready"


# -- the multipart body itself is hostile ------------------------------------------------------------


def test_hostile_multipart_bodies_get_a_4xx_naming_what_is_wrong(
    platform: tuple[FastAPI, Api], spool: Path
) -> None:
    app, api = platform
    _, key = api.tenant_with_key("acme")
    good = {"name": "a1", "deployment": "tiny"}
    config = [("adapter_config.json", CONFIG)]
    part = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="name"\r\n'
    long_header = (part + "X-Pad: " + "p" * 4100 + "\r\n\r\na1\r\n").encode()
    many_headers = (part + "X-Pad: p\r\n" * 6 + "\r\na1\r\n").encode()
    cases: list[tuple[dict[str, str], bytes, int, str]] = [
        (MULTIPART, form_body({**good, "extra": "x"}, config), 422, "unexpected form field 'extra'"),
        (MULTIPART, form_body({**good, "name": "n" * 5000}, config), 422, "`name` is longer than 1024 bytes"),
        (MULTIPART, form_body(good, [(f"{i}.json", b"{}") for i in range(17)]), 422, "more than 16 files"),
        (MULTIPART, form_body(good, [("a" * 300 + ".json", b"{}")]), 422, "longer than 255 characters"),
        (MULTIPART, form_body(good, config)[:-10], 422, "ended before its closing boundary"),
        (MULTIPART, form_body({"name": "a1"}, config), 422, "deployment"),
        (MULTIPART, form_body({"name": "no spaces", "deployment": "tiny"}, config), 422, "name"),
        (MULTIPART, form_body(good, []), 422, "files"),
        (MULTIPART, long_header, 422, "part header is longer than 4096 bytes"),
        (MULTIPART, many_headers, 422, "more than 6 headers"),
        ({"content-type": "application/json"}, b"{}", 415, "multipart/form-data"),
        ({"content-type": "multipart/form-data"}, b"", 422, "boundary"),
    ]
    for headers, raw, status, expected in cases:
        code, response = call(app, "/api/v1/adapters", {**headers, **key}, CountingBody(raw), len(raw))
        assert code == status, (expected, response)
        assert expected in response.decode(), (expected, response)
    assert list(spool.iterdir()) == []


def test_the_openapi_document_still_describes_the_upload_form(platform: tuple[FastAPI, Api]) -> None:
    app, _ = platform
    operation = app.openapi()["paths"]["/api/v1/adapters"]["post"]
    schema = operation["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert schema["required"] == ["name", "deployment", "files"]
    assert schema["properties"]["files"] == {
        "type": "array",
        "items": {"type": "string", "format": "binary"},
        "maxItems": 16,
        "description": "adapter_config.json and adapter_model.safetensors, or one .zip / .tar.gz of them",
    }


def test_a_good_upload_through_the_api_is_stored(platform: tuple[FastAPI, Api], peft_dir: Path) -> None:  # noqa: F811
    _, api = platform
    _, key = api.tenant_with_key("acme")
    response = api.client.post(
        "/api/v1/adapters",
        data={"name": "a1", "deployment": "tiny"},
        files=[("files", (n, c, "application/octet-stream")) for n, c in loose(peft_dir)],
        headers=key,
    )
    assert response.status_code == 201, response.text
    assert json.loads(response.text)["status"] == "ready"


@st.composite
def mangled_forms(draw: st.DrawFn) -> bytes:
    """A form body with byte-level damage: boundaries, headers, names and lengths are all fair game."""
    files = [
        ("adapter_config.json", CONFIG),
        (draw(st.sampled_from(["a.zip", "a.tgz", "x.json"])), b"PK\x03\x04"),
    ]
    raw = bytearray(form_body({"name": "a1", "deployment": "tiny"}, files))
    for _ in range(draw(st.integers(1, 5))):
        at = draw(st.integers(0, max(0, len(raw) - 1)))
        kind = draw(st.sampled_from(["overwrite", "insert", "delete"]))
        chunk = draw(
            st.binary(min_size=1, max_size=24) | st.sampled_from([b"\r\n", b'"', b";", b"--", b"\r\n\r\n"])
        )
        if kind == "overwrite":
            raw[at : at + len(chunk)] = chunk
        elif kind == "insert":
            raw[at:at] = chunk
        else:
            del raw[at : at + len(chunk)]
    return bytes(raw)


def test_mangled_multipart_bodies_never_cause_a_server_error(
    platform: tuple[FastAPI, Api], spool: Path
) -> None:
    app, api = platform
    _, key = api.tenant_with_key("acme")

    @given(body=mangled_forms())
    @settings(
        max_examples=int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "60")),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(body: bytes) -> None:
        status, response = call(app, "/api/v1/adapters", {**MULTIPART, **key}, CountingBody(body), len(body))
        assert 400 <= status < 500, response  # the damaged adapter is never valid either
        assert list(spool.iterdir()) == []

    check()
