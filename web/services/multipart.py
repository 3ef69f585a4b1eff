"""Parse a multipart/form-data upload as it streams in, into a temporary directory, within a byte budget.

FastAPI parses `File`/`Form` parameters (spooling every byte to disk) before any dependency runs, so a
route that took them would let anyone without a key make the server write a whole body. Upload routes
instead authenticate and check quotas first, then call `receive_form`: python-multipart's streaming
parser (the one Starlette uses) feeds each file part straight to its own file, counting bytes as they
arrive, and stops at the first byte over the budget. Nothing touches the disk before the first file part.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from .errors import Invalid, ServiceError, TooLarge
from .uploads import LIMITS, UploadedFile

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

# Bytes a body may carry beyond its files: boundaries, part headers, the text fields.
FORM_OVERHEAD_BYTES = 64 * 1024


class UnsupportedMediaType(ServiceError):
    status_code = 415


@dataclass(frozen=True)
class FormLimits:
    max_file_bytes: int  # all file parts together: the tenant's byte limit
    max_files: int = LIMITS.max_entries
    max_field_bytes: int = 1024  # each text field; only the named ones are accepted, each once
    max_header_bytes: int = 4096  # one part header line (Content-Disposition with its file name)
    max_headers: int = 6  # per part (clients send 1 to 3)
    max_filename_chars: int = LIMITS.max_name_chars

    def max_body_bytes(self) -> int:
        return self.max_file_bytes + FORM_OVERHEAD_BYTES


@dataclass
class ReceivedForm:
    fields: dict[str, str]
    files: list[UploadedFile]


def check_content_length(request: Request, limits: FormLimits) -> None:
    """Refuse a body whose declared length is over the limit, before reading a byte of it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes():
        raise TooLarge(
            f"the upload ({declared} bytes) is larger than the {limits.max_file_bytes}-byte limit "
            "for this tenant's adapters"
        )


@asynccontextmanager
async def receive_form(
    request: Request,
    limits: FormLimits,
    fields: Collection[str],
    file_field: str = "files",
    before_files: Callable[[dict[str, str]], None] | None = None,
) -> AsyncIterator[ReceivedForm]:
    """The form's text fields and its files (open streams over spooled copies), removed on exit.

    `fields` names the text fields accepted; `before_files` (e.g. a CSRF check) runs on the text
    fields seen so far when the first file part starts, or at the end if there is none.
    """
    parse = _FormParse(limits, set(fields), file_field, before_files)
    try:
        boundary = _boundary(request)
    except ServiceError:
        parse.gate()  # a body we will not parse has no fields: the gate (CSRF) decides first
        raise
    parser = MultipartParser(boundary, parse.callbacks())
    try:
        async for chunk in request.stream():
            parse.received += len(chunk)
            if parse.received > limits.max_body_bytes():
                raise TooLarge(f"the upload is larger than the {limits.max_file_bytes}-byte limit")
            _feed(parser.write, chunk)
            if parse.pending:
                await run_in_threadpool(parse.flush)
        _feed(lambda _: parser.finalize(), b"")
        if not parse.ended:
            raise Invalid("the multipart body ended before its closing boundary")
        parse.gate()
        await run_in_threadpool(parse.flush)
        files = await run_in_threadpool(parse.uploaded)
        yield ReceivedForm(fields=dict(parse.values), files=files)
    finally:
        await run_in_threadpool(parse.discard)


def _feed(step: Callable[[bytes], object], chunk: bytes) -> None:
    try:
        step(chunk)
    except FormParserError as exc:
        raise Invalid(f"the body is not valid multipart/form-data: {exc}") from None


def _boundary(request: Request) -> bytes:
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data":
        raise UnsupportedMediaType("send the upload as multipart/form-data")
    boundary = options.get(b"boundary", b"")
    if not 1 <= len(boundary) <= 70:  # RFC 2046
        raise Invalid("the multipart/form-data body needs a boundary of 1 to 70 characters")
    return boundary


@dataclass
class _FilePart:
    filename: str
    index: int
    stream: IO[bytes] | None = None


@dataclass
class _FormParse:
    """python-multipart callbacks; file I/O is queued and done in `flush`, off the event loop."""

    limits: FormLimits
    accepted: set[str]
    file_field: str
    before_files: Callable[[dict[str, str]], None] | None
    received: int = 0
    file_bytes: int = 0
    ended: bool = False
    gated: bool = False
    values: dict[str, str] = field(default_factory=dict)
    parts: list[_FilePart] = field(default_factory=list)
    pending: list[tuple[_FilePart, bytes | None]] = field(default_factory=list)  # None: close it
    directory: Path | None = None
    _header_name: bytes = b""
    _header_value: bytes = b""
    _headers: int = 0
    _disposition: bytes = b""
    _field: str | None = None  # the text field being read, or None for a file part
    _data: bytearray = field(default_factory=bytearray)

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_end": self.on_end,
        }

    # Header lines and counts are bounded here, whatever bounds the installed parser applies itself.
    def on_part_begin(self) -> None:
        self._disposition = b""
        self._field = None
        self._data.clear()
        self._headers = 0

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]
        self._check_header()

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        self._check_header()

    def _check_header(self) -> None:
        if len(self._header_name) + len(self._header_value) > self.limits.max_header_bytes:
            raise Invalid(f"a multipart part header is longer than {self.limits.max_header_bytes} bytes")

    def on_header_end(self) -> None:
        self._headers += 1
        if self._headers > self.limits.max_headers:
            raise Invalid(f"a multipart part has more than {self.limits.max_headers} headers")
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = _text(options.get(b"name", b""), "a form field's name")
        if name not in self.accepted and name != self.file_field:
            shown = name[:64] or "(no name)"
            raise Invalid(
                f"unexpected form field {shown!r}: send {', '.join(sorted(self.accepted))} and files"
            )
        if name == self.file_field:
            if b"filename" not in options:
                raise Invalid(f"`{self.file_field}` must be sent as files, not as a text field")
            self._begin_file(_text(options[b"filename"], f"a file name in `{self.file_field}`"))
            return
        if b"filename" in options:
            raise Invalid(f"`{name}` must be a text field, not a file")
        if name in self.values:
            raise Invalid(f"the form field `{name}` is sent more than once")
        self._field = name

    def _begin_file(self, filename: str) -> None:
        if not self.gated:
            self.gate()
        if len(self.parts) >= self.limits.max_files:
            raise Invalid(f"more than {self.limits.max_files} files uploaded; an adapter has 2 or 3")
        if len(filename) > self.limits.max_filename_chars:
            raise Invalid(
                f"{filename[:40]}…: file names longer than {self.limits.max_filename_chars} characters "
                "are refused"
            )
        self.parts.append(_FilePart(filename=filename, index=len(self.parts)))

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._field is not None:
            if len(self._data) + end - start > self.limits.max_field_bytes:
                raise Invalid(
                    f"the form field `{self._field}` is longer than {self.limits.max_field_bytes} bytes"
                )
            self._data += data[start:end]
            return
        self.file_bytes += end - start
        if self.file_bytes > self.limits.max_file_bytes:
            raise TooLarge(f"the upload is larger than the {self.limits.max_file_bytes}-byte limit")
        self.pending.append((self.parts[-1], data[start:end]))

    def on_part_end(self) -> None:
        if self._field is not None:
            self.values[self._field] = _text(bytes(self._data), f"the form field `{self._field}`")
        elif self.parts:
            self.pending.append((self.parts[-1], None))

    def on_end(self) -> None:
        self.ended = True

    def gate(self) -> None:
        if not self.gated:
            self.gated = True
            if self.before_files is not None:
                self.before_files(dict(self.values))

    def flush(self) -> None:
        """Run the queued file writes (in a worker thread)."""
        for part, data in self.pending:
            if part.stream is None:
                part.stream = self._open(part)
            if data is None:
                part.stream.flush()
            else:
                part.stream.write(data)
        self.pending.clear()

    def _open(self, part: _FilePart) -> IO[bytes]:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="lpx-upload-"))
        # Stored under an index, never the client's name: the unpacker checks that name later.
        return (self.directory / f"part-{part.index}").open("w+b")

    def uploaded(self) -> list[UploadedFile]:
        """The file parts as streams from their start (in a worker thread)."""
        files = []
        for part in self.parts:
            if part.stream is None:  # an empty file part: nothing was written
                part.stream = self._open(part)
            part.stream.seek(0)
            files.append(UploadedFile(filename=part.filename, stream=part.stream))
        return files

    def discard(self) -> None:
        self.pending.clear()
        for part in self.parts:
            if part.stream is not None:
                part.stream.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Invalid(f"{what} is not UTF-8 text") from None
