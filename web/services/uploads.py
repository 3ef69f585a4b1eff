"""Turn an upload (loose PEFT files, or one .zip / .tar.gz of a PEFT directory) into a flat directory.

Refuses, naming the entry: path traversal, links and other non-regular entries, nested folders, names that
are not .json or .safetensors (pickled weights with their own message), duplicates, and more bytes than
`limit`. Nothing here trusts a size an archive declares: every copy counts what it writes.
"""

from __future__ import annotations

import shutil
import stat
import tarfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from loraplex.adapters.manifest import PICKLED_SUFFIXES

from .errors import Invalid, TooLarge

ACCEPTED_SUFFIXES = (".json", ".safetensors")
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")


@dataclass
class UploadedFile:
    filename: str
    stream: IO[bytes]


def is_archive(filename: str) -> bool:
    return filename.lower().endswith(ARCHIVE_SUFFIXES)


def unpack(files: list[UploadedFile], target: Path, limit: int) -> None:
    """Write the upload's files flat into `target` (an empty directory)."""
    if not files:
        raise Invalid("no files uploaded: send the PEFT files as `files`, or one .zip or .tar.gz")
    budget = _Budget(limit)
    if len(files) == 1 and is_archive(files[0].filename):
        archive = files[0]
        if archive.filename.lower().endswith(".zip"):
            _unzip(archive.stream, target, budget)
        else:
            _untar(archive.stream, target, budget)
        return
    for upload in files:
        if is_archive(upload.filename):
            raise Invalid(f"{upload.filename}: send one archive alone, not mixed with other files")
        name = _flat_name(upload.filename)
        _write(target, name, upload.stream, budget)


class _Budget:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int, name: str) -> None:
        self.used += n
        if self.used > self.limit:
            raise TooLarge(f"{name}: the upload is larger than the {self.limit}-byte limit")


def _flat_name(raw: str) -> str:
    """The checked file name of one uploaded or archived file (after any one folder is stripped)."""
    if not raw or "\x00" in raw:
        raise Invalid("a file has an empty or invalid name")
    parts = PurePosixPath(raw.replace("\\", "/")).parts
    if raw.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
        raise Invalid(f"{raw}: path traversal is refused; names must stay inside the adapter folder")
    if len(parts) != 1:
        raise Invalid(f"{raw}: nested folders are refused; the PEFT files must sit in one folder")
    name = parts[0]
    suffix = PurePosixPath(name).suffix.lower()
    if suffix in PICKLED_SUFFIXES:
        raise Invalid(f"{name} is refused: weights must be safetensors, never pickled")
    if suffix not in ACCEPTED_SUFFIXES:
        raise Invalid(f"{name}: unexpected file; only .json and .safetensors files are accepted")
    return name


def _strip_folder(names: Iterable[str]) -> dict[str, str]:
    """Archive path -> flat name, allowing every file to sit under one top folder (`tar czf a.tgz dir/`)."""
    names = list(names)
    for raw in names:  # traversal first, so it is named as such even inside a folder
        parts = PurePosixPath(raw.replace("\\", "/")).parts
        if raw.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
            raise Invalid(f"{raw}: path traversal is refused; names must stay inside the adapter folder")
    split = [PurePosixPath(n.replace("\\", "/")).parts for n in names]
    tops = {p[0] for p in split if len(p) == 2}
    if len(tops) == 1 and all(len(p) == 2 for p in split):
        return {raw: _flat_name(p[1]) for raw, p in zip(names, split, strict=True)}
    return {raw: _flat_name(raw) for raw in names}


def _write(target: Path, name: str, stream: IO[bytes], budget: _Budget) -> None:
    path = target / name
    if path.exists():
        raise Invalid(f"{name} appears twice in the upload")
    with path.open("wb") as out:
        while block := stream.read(1 << 20):
            budget.take(len(block), name)
            out.write(block)


def _untar(stream: IO[bytes], target: Path, budget: _Budget) -> None:
    try:
        with tarfile.open(fileobj=stream, mode="r:*") as archive:
            members = archive.getmembers()
            for member in members:
                if member.issym() or member.islnk():
                    raise Invalid(f"{member.name}: links are refused in adapter archives")
                if not (member.isfile() or member.isdir()):
                    raise Invalid(f"{member.name}: only regular files are accepted in adapter archives")
            files = [m for m in members if m.isfile()]
            names = _strip_folder(m.name for m in files)
            for member in files:
                budget.take(0, member.name)
                extracted = archive.extractfile(member)
                assert extracted is not None  # a regular file
                _write(target, names[member.name], extracted, budget)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise Invalid(f"the archive is not a readable .tar.gz: {exc}") from None


def _unzip(stream: IO[bytes], target: Path, budget: _Budget) -> None:
    try:
        with zipfile.ZipFile(stream) as archive:
            infos = archive.infolist()
            for info in infos:
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    raise Invalid(f"{info.filename}: links are refused in adapter archives")
                if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise Invalid(f"{info.filename}: only regular files are accepted in adapter archives")
            files = [i for i in infos if not i.is_dir()]
            names = _strip_folder(i.filename for i in files)
            for info in files:
                with archive.open(info) as extracted:
                    _write(target, names[info.filename], extracted, budget)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as exc:
        raise Invalid(f"the archive is not a readable .zip: {exc}") from None


def clear(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
