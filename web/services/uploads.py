"""Turn an upload (loose PEFT files, or one .zip / .tar.gz of a PEFT directory) into a flat directory.

Refuses, naming the entry: path traversal, links and other non-regular entries, nested folders, names that
are not .json or .safetensors (pickled weights with their own message), duplicates, and more bytes than
`limit`. An archive is a bomb until proven otherwise, so neither memory nor disk may grow with what it
declares or contains beyond the limits:

- a tar is read as a stream, one member at a time (never `getmembers()`), through a decompressor that
  yields at most what is asked; extended headers (pax, GNU long names) are size-capped before tarfile
  reads them, sparse members are refused, and the whole decompressed stream is capped;
- a zip's end-of-central-directory record is read first: too many entries or too large a central
  directory is refused before zipfile parses it; declared sizes are checked before anything is
  decompressed, and only stored or deflated entries (bounded decompression) are accepted;
- an archive may write at most `max_expansion_ratio` times what was read of it (plus a small allowance),
  per entry and in total, counted while it streams: a zip's declared sizes are held to it before anything
  is inflated, and a tar.gz (whose sizes say nothing of its compression) is cut off as it inflates, so a
  bomb under the byte limit writes no more than a small multiple of its own size;
- every copy counts the bytes it really writes against the budget, and a refused upload leaves nothing.
"""

from __future__ import annotations

import gzip
import io
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from loraplex.adapters.manifest import PICKLED_SUFFIXES

from .errors import Invalid, TooLarge

ACCEPTED_SUFFIXES = (".json", ".safetensors")
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
COPY_BLOCK = 1 << 20  # bytes read and written at a time: the most an unpack holds in memory per file


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on an upload's shape; its bytes are bounded by the `limit` given to `unpack`."""

    # Files and folders together (an adapter is 2 or 3 files, perhaps in one folder); loose files too.
    max_entries: int = 16
    # A whole entry path ("my-adapter/adapter_model.safetensors"), in characters.
    max_name_chars: int = 255
    # One pax extended header or GNU long-name record; real ones hold a path and a few numbers. Small, so
    # tarfile's pax record parsing (quadratic on hostile input in older Pythons) stays cheap.
    max_extension_header_bytes: int = 8 * 1024
    # A zip's central directory: about 100 bytes per entry in real archives.
    max_zip_directory_bytes: int = 64 * 1024
    # Bytes an archive may write per byte of it read, per entry and in total. Weights compress little
    # (random mantissas): a trained PEFT adapter deflates about 1.1:1, an untrained one (lora_B all
    # zeros) 2.3:1 in bfloat16 and 3.4:1 as float32 rounded from bfloat16 (docs/security.md). Deflate
    # reaches about 1000:1 on zeros.
    max_expansion_ratio: int = 20
    # Written beyond the ratio, per entry and in total: a small config deflates further than weights, and
    # gzip reads up to 128 KiB of input ahead of what it has inflated.
    expansion_allowance_bytes: int = 1024 * 1024

    def tar_overhead(self) -> int:
        """Decompressed tar bytes allowed beyond the files' own: headers, padding, the end blocks."""
        per_entry = 3 * 512 + 2 * self.max_extension_header_bytes  # header, padding, pax + long name
        return self.max_entries * per_entry + 20 * 512  # tar pads the end to a 10 KiB record


LIMITS = ArchiveLimits()


@dataclass
class UploadedFile:
    filename: str
    stream: IO[bytes]


class ByteBudget:
    """Bytes an upload may put on disk; `used` counts what was really written."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int, name: str) -> None:
        if self.used + n > self.limit:
            raise TooLarge(f"{name}: the upload is larger than the {self.limit}-byte limit")
        self.used += n

    def check_declared(self, size: int, name: str) -> None:
        """Refuse an entry whose declared size alone would not fit, before a byte of it is read."""
        if size > self.limit - self.used:
            raise TooLarge(f"{name}: the upload is larger than the {self.limit}-byte limit")


class _Counted:
    """An archive's upload as its readers see it, counting the bytes they read (re-reads included)."""

    def __init__(self, stream: IO[bytes]):
        self.stream = stream
        self.count = 0
        self.size = stream.seek(0, io.SEEK_END)
        stream.seek(0)

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.count += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.stream.seek(offset, whence)

    def tell(self) -> int:
        return self.stream.tell()

    def seekable(self) -> bool:
        return True


class Expansion:
    """Holds what an archive writes to `max_expansion_ratio` times what was read of it (plus the
    allowance): each entry against the archive bytes read since the previous entry ended (its header and
    its compressed data), the whole against all read so far, never more than the archive itself."""

    def __init__(self, source: _Counted, limits: ArchiveLimits):
        self.source = source
        self.ratio = limits.max_expansion_ratio
        self.allowance = limits.expansion_allowance_bytes
        self.written = 0
        self.entry_written = 0
        self.entry_start = 0  # the source's count where the current entry's bytes began

    def next_entry(self) -> None:
        """What is read from here on belongs to the next entry."""
        self.entry_start = self.source.count
        self.entry_written = 0

    def check_declared(self, size: int, compressed: int, name: str) -> None:
        """Refuse an entry whose declared sizes already say it expands too much, before it is read."""
        if size > self.ratio * compressed + self.allowance:
            raise self._refusal(name)

    def take(self, n: int, name: str) -> None:
        """Count `n` bytes about to be written for entry `name`; refuse them if they break the ratio."""
        self.written += n
        self.entry_written += n
        read = self.source.count
        entry_read = read - self.entry_start
        if (
            self.entry_written > self.ratio * entry_read + self.allowance
            or self.written > self.ratio * min(read, self.source.size) + self.allowance
        ):
            raise self._refusal(name)

    def _refusal(self, name: str) -> TooLarge:
        return TooLarge(
            f"{name}: the archive unpacks to more than {self.ratio} times its size (plus "
            f"{self.allowance} bytes), which adapters never do; upload the files themselves instead"
        )


def is_archive(filename: str) -> bool:
    return filename.lower().endswith(ARCHIVE_SUFFIXES)


def unpack(files: list[UploadedFile], target: Path, limit: int, limits: ArchiveLimits = LIMITS) -> None:
    """Write the upload's files flat into `target` (an empty directory); on refusal it is left empty.

    Archive streams must be seekable (a zip's directory is at its end; spooled uploads are files).
    """
    budget = ByteBudget(limit)
    try:
        _unpack(files, target, budget, limits)
    except BaseException:
        _empty(target)
        raise


def _unpack(files: list[UploadedFile], target: Path, budget: ByteBudget, limits: ArchiveLimits) -> None:
    if not files:
        raise Invalid("no files uploaded: send the PEFT files as `files`, or one .zip or .tar.gz")
    if len(files) > limits.max_entries:
        raise Invalid(f"{len(files)} files uploaded; an adapter has at most {limits.max_entries}")
    if len(files) == 1 and is_archive(files[0].filename):
        archive = files[0]
        if archive.filename.lower().endswith(".zip"):
            _unzip(archive.stream, target, budget, limits)
        else:
            _untar(archive.stream, target, budget, limits)
        return
    for upload in files:
        if is_archive(upload.filename):
            raise Invalid(f"{upload.filename}: send one archive alone, not mixed with other files")
        _check_length(upload.filename, limits)
        name = _flat_name(upload.filename)
        _write(target / name, name, upload.stream, budget)


def _empty(directory: Path) -> None:
    for path in directory.iterdir():
        path.unlink(missing_ok=True)


# -- names ----------------------------------------------------------------------------------------


def _check_length(raw: str, limits: ArchiveLimits) -> None:
    if len(raw) > limits.max_name_chars:
        raise Invalid(f"{raw[:40]}…: names longer than {limits.max_name_chars} characters are refused")


def _parts(raw: str) -> tuple[str, ...]:
    """The path's parts, refusing traversal (absolute paths, `..`, drive letters)."""
    parts = PurePosixPath(raw.replace("\\", "/")).parts
    if raw.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
        raise Invalid(f"{raw}: path traversal is refused; names must stay inside the adapter folder")
    return parts


def _flat_name(raw: str) -> str:
    """The checked file name of one uploaded or archived file (after any one folder is stripped)."""
    if not raw or "\x00" in raw:
        raise Invalid("a file has an empty or invalid name")
    parts = _parts(raw)
    if len(parts) != 1:
        raise Invalid(f"{raw}: nested folders are refused; the PEFT files must sit in one folder")
    name = parts[0]
    if not name.isprintable():  # control characters, and undecodable bytes (surrogates) from archives
        raise Invalid(f"{name!r}: file names must be printable text")
    suffix = PurePosixPath(name).suffix.lower()
    if suffix in PICKLED_SUFFIXES:
        raise Invalid(f"{name} is refused: weights must be safetensors, never pickled")
    if suffix not in ACCEPTED_SUFFIXES:
        raise Invalid(f"{name}: unexpected file; only .json and .safetensors files are accepted")
    return name


def _check_entry(raw: str) -> None:
    """What can be known of one archived file's path alone, checked before any of its bytes are read."""
    if not raw or "\x00" in raw:
        raise Invalid("a file has an empty or invalid name")
    parts = _parts(raw)
    if len(parts) > 2:
        raise Invalid(f"{raw}: nested folders are refused; the PEFT files must sit in one folder")
    if parts:
        _flat_name(parts[-1])


def _strip_folder(names: Iterable[str]) -> dict[str, str]:
    """Archive path -> flat name, allowing every file to sit under one top folder (`tar czf a.tgz dir/`)."""
    names = list(names)
    for raw in names:  # traversal first, so it is named as such even inside a folder
        _parts(raw)
    split = [PurePosixPath(n.replace("\\", "/")).parts for n in names]
    tops = {p[0] for p in split if len(p) == 2}
    if len(tops) == 1 and all(len(p) == 2 for p in split):
        return {raw: _flat_name(p[1]) for raw, p in zip(names, split, strict=True)}
    return {raw: _flat_name(raw) for raw in names}


# -- copying --------------------------------------------------------------------------------------


def _write(
    path: Path, name: str, stream: IO[bytes], budget: ByteBudget, expansion: Expansion | None = None
) -> None:
    """Copy `stream` to `path`, each block counted (against the budget, and the archive's expansion)
    before it is written."""
    if path.exists():
        raise Invalid(f"{name} appears twice in the upload")
    with path.open("wb") as out:
        # Never ask for more than the budget has left (plus one byte, to notice the excess).
        while block := stream.read(min(COPY_BLOCK, budget.limit - budget.used + 1)):
            budget.take(len(block), name)
            if expansion is not None:
                expansion.take(len(block), name)
            out.write(block)


# What tarfile, zipfile and their decompressors raise on hostile bytes, beyond their own error classes:
# numbers, text and extra fields they fail to decode, versions and methods they do not support (each
# one found by tests/security/test_fuzz_archives.py). All mean "not a readable archive".
_UNREADABLE = (
    tarfile.TarError,
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    OSError,
    zlib.error,
    ValueError,
    IndexError,
    OverflowError,
    struct.error,
    NotImplementedError,
)

# -- tar ------------------------------------------------------------------------------------------

_EXTENSION_TYPES = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)


def _bounded_tarinfo(limits: ArchiveLimits) -> type[tarfile.TarInfo]:
    """A TarInfo whose header processing refuses what would make tarfile read without bound.

    tarfile reads an extended header's whole body in one call, chains headers by recursion, and reads
    GNU sparse maps of any length; these hooks (tarfile's documented way to add `_proc_*` handling) stop
    each of those before it happens. One class per archive, so the header count is per archive.
    """
    seen = {"extension headers": 0}

    class BoundedTarInfo(tarfile.TarInfo):
        def _proc_member(self, archive: tarfile.TarFile) -> Any:
            if self.type in _EXTENSION_TYPES:
                seen["extension headers"] += 1
                if seen["extension headers"] > 2 * limits.max_entries:
                    raise Invalid("the archive has too many extended headers for an adapter")
                if self.size > limits.max_extension_header_bytes:
                    raise Invalid(
                        f"the archive has a {self.size}-byte extended header; at most "
                        f"{limits.max_extension_header_bytes} bytes are accepted"
                    )
            elif self.type == tarfile.GNUTYPE_SPARSE:
                raise Invalid(f"{self.name}: sparse files are refused in adapter archives")
            return super()._proc_member(archive)  # type: ignore[misc]

        def _proc_gnusparse_10(self, *args: Any) -> None:
            raise Invalid("sparse files are refused in adapter archives")

    return BoundedTarInfo


class _CappedReader:
    """Reads at most `cap` bytes from `source`, then refuses: tarfile skips and reads through this."""

    def __init__(self, source: IO[bytes] | gzip.GzipFile, cap: int, limit: int):
        self.source = source
        self.cap = cap
        self.limit = limit
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = COPY_BLOCK
        data = self.source.read(min(size, self.cap - self.count + 1))
        self.count += len(data)
        if self.count > self.cap:
            raise TooLarge(f"the archive unpacks to more than the {self.limit}-byte limit")
        return data


def _untar(stream: IO[bytes], target: Path, budget: ByteBudget, limits: ArchiveLimits) -> None:
    magic = stream.read(2)
    counted = _Counted(stream)
    expansion = Expansion(counted, limits)
    # GzipFile.read(n) decompresses at most n bytes per call, unlike tarfile's own "r|gz" stream.
    source: Any = gzip.GzipFile(fileobj=counted, mode="rb") if magic == b"\x1f\x8b" else counted
    reader = _CappedReader(source, budget.limit + limits.tar_overhead(), budget.limit)
    staged: list[tuple[str, Path]] = []  # names are flattened once every member is known
    try:
        with tarfile.open(
            fileobj=reader,  # type: ignore[call-overload]
            mode="r|",
            tarinfo=_bounded_tarinfo(limits),
        ) as archive:
            for index, member in enumerate(archive, start=1):
                if index > limits.max_entries:
                    raise Invalid(
                        f"the archive has more than {limits.max_entries} entries; an adapter has 2 or 3"
                    )
                _check_length(member.name, limits)
                if member.issym() or member.islnk():
                    raise Invalid(f"{member.name}: links are refused in adapter archives")
                if not (member.isfile() or member.isdir()):
                    raise Invalid(f"{member.name}: only regular files are accepted in adapter archives")
                if member.sparse is not None:
                    raise Invalid(f"{member.name}: sparse files are refused in adapter archives")
                budget.check_declared(member.size, member.name)
                if member.isdir():
                    continue
                _check_entry(member.name)
                extracted = archive.extractfile(member)
                assert extracted is not None  # a regular file
                part = target / f".entry-{index}"  # no accepted name ends this way
                _write(part, member.name, extracted, budget, expansion)
                expansion.next_entry()  # the next header, and what gzip reads ahead, is the next entry's
                staged.append((member.name, part))
    except _UNREADABLE as exc:
        raise Invalid(f"the archive is not a readable .tar.gz: {exc}") from None
    names = _strip_folder(raw for raw, _ in staged)
    for raw, part in staged:
        final = target / names[raw]
        if final.exists():
            raise Invalid(f"{names[raw]} appears twice in the upload")
        part.rename(final)


# -- zip ------------------------------------------------------------------------------------------

_READABLE_ZIP_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
_END_ENTRIES_TOTAL, _END_DIRECTORY_SIZE = 4, 5  # fields of zipfile's end record (its _ECD_* indexes)


def _check_zip_directory(stream: IO[bytes], limits: ArchiveLimits) -> None:
    """Refuse a zip by its end record alone, before zipfile reads its central directory into objects.

    zipfile parses the whole central directory, bounded only by its declared size; a million tiny
    entries fit in a few megabytes of zip and cost hundreds of megabytes as ZipInfo objects.
    """
    # The same end-record lookup (comment, zip64) that zipfile itself does next.
    end_record = zipfile._EndRecData(stream)  # type: ignore[attr-defined]
    if not end_record:
        raise Invalid("the archive is not a readable .zip: File is not a zip file")
    entries, directory_bytes = end_record[_END_ENTRIES_TOTAL], end_record[_END_DIRECTORY_SIZE]
    if entries > limits.max_entries:
        raise Invalid(
            f"the archive has {entries} entries; an adapter has 2 or 3 (at most {limits.max_entries})"
        )
    if directory_bytes > limits.max_zip_directory_bytes:
        raise Invalid(
            f"the archive's central directory is {directory_bytes} bytes; at most "
            f"{limits.max_zip_directory_bytes} are accepted"
        )


def _check_zip_entry(info: zipfile.ZipInfo, limits: ArchiveLimits) -> None:
    _check_length(info.filename, limits)
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise Invalid(f"{info.filename}: links are refused in adapter archives")
    if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise Invalid(f"{info.filename}: only regular files are accepted in adapter archives")
    if info.flag_bits & 0x1:
        raise Invalid(f"{info.filename}: encrypted entries are refused in adapter archives")
    if info.compress_type not in _READABLE_ZIP_METHODS:
        raise Invalid(f"{info.filename}: only stored or deflated entries are accepted (zip without options)")


def _unzip(stream: IO[bytes], target: Path, budget: ByteBudget, limits: ArchiveLimits) -> None:
    counted = _Counted(stream)
    expansion = Expansion(counted, limits)
    try:
        _check_zip_directory(stream, limits)
        with zipfile.ZipFile(counted) as archive:
            infos = archive.infolist()
            if len(infos) > limits.max_entries:
                raise Invalid(
                    f"the archive has {len(infos)} entries; at most {limits.max_entries} are accepted"
                )
            declared = 0
            for info in infos:
                _check_zip_entry(info, limits)
                declared += info.file_size
                budget.check_declared(declared, info.filename)
                # Before a byte is inflated: the entry against its compressed size, the whole against
                # the archive's (a zip that lies is still held to the ratio while it streams).
                expansion.check_declared(info.file_size, info.compress_size, info.filename)
                expansion.check_declared(declared, counted.size, info.filename)
            files = [i for i in infos if not i.is_dir()]
            names = _strip_folder(i.filename for i in files)
            for info in files:
                # zipfile stops at the declared size and checks the CRC, so a lying header fails too.
                expansion.next_entry()
                with archive.open(info) as extracted:
                    _write(target / names[info.filename], names[info.filename], extracted, budget, expansion)
    except _UNREADABLE as exc:
        raise Invalid(f"the archive is not a readable .zip: {exc}") from None
