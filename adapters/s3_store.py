"""Adapters in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, ...), through boto3.

`s3://bucket/prefix` holds `prefix/<digest>/adapter_config.json` and `.../adapter_model.safetensors`.
Credentials and region come from boto3's usual sources (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
a profile, an instance role); LORAPLEX_S3_ENDPOINT_URL points it at a service other than AWS. Fetches land
in a local cache directory, one folder per digest, renamed into place only once verified.

Errors keep two kinds apart: StoreUnavailable (cannot connect, credentials refused, no such bucket: the
adapter is not at fault, try later) and AdapterError (nothing at that key, or content that is not the digest).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .digest import ADAPTER_FILES, DigestMismatch, check_digest, is_digest
from .errors import AdapterError
from .store import OutsideStore, StoreUnavailable

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
else:
    S3Client = Any

# S3 error codes that mean "this store, as configured, cannot be used" rather than "no such adapter".
_STORE_CODES = {
    "AccessDenied": "refused our credentials (access denied)",
    "InvalidAccessKeyId": "refused our credentials (unknown access key)",
    "SignatureDoesNotMatch": "refused our credentials (wrong secret key)",
    "ExpiredToken": "refused our credentials (expired token)",
    "InvalidToken": "refused our credentials (invalid token)",
    "NoSuchBucket": "has no such bucket",
    "403": "refused our credentials (403)",
}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_CHUNK = 1 << 20


class S3ArtifactStore:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        cache_dir: Path | None = None,
        client: S3Client | None = None,
    ):
        if not bucket:
            raise ValueError("an S3 artifact store needs a bucket: s3://bucket/prefix")
        segments = [s for s in prefix.split("/") if s]
        if any(s in (".", "..") for s in segments):
            raise ValueError(f"S3 prefix {prefix!r} may not contain '.' or '..' segments")
        self.bucket = bucket
        self.prefix = "/".join(segments)
        self.endpoint_url = endpoint_url
        self._cache_dir = cache_dir
        self._client = client
        self._lock = threading.Lock()

    @classmethod
    def from_uri(
        cls, uri: str, *, endpoint_url: str | None = None, cache_dir: Path | None = None
    ) -> S3ArtifactStore:
        parsed = urlparse(uri)
        if parsed.scheme != "s3":
            raise ValueError(f"{uri!r} is not an s3://bucket/prefix URI")
        if parsed.query or parsed.fragment:
            raise ValueError(f"{uri!r}: an S3 store URI takes no query or fragment")
        return cls(parsed.netloc, parsed.path, endpoint_url=endpoint_url, cache_dir=cache_dir)

    @property
    def location(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{where} at {self.endpoint_url}" if self.endpoint_url else where

    # -- the protocol ---------------------------------------------------------------------------------------

    def uri_of(self, digest: str) -> str:
        if not is_digest(digest):
            raise AdapterError(f"{digest!r} is not an adapter digest (64 lowercase hex characters)")
        return f"s3://{self.bucket}/{self._key(digest)}"

    def put(self, directory: Path, digest: str) -> str:
        if not is_digest(digest):
            raise AdapterError(f"{digest!r} is not an adapter digest (64 lowercase hex characters)")
        check_digest(Path(directory), digest)  # a digest that does not describe the files never names them
        folder = self._key(digest)
        if not self._holds(folder, Path(directory)):
            # Weights first, config last: fetch needs both, so a put cut short is never half-served.
            for name in reversed(ADAPTER_FILES):
                with (Path(directory) / name).open("rb") as body:
                    self._call(
                        "store",
                        self.client.put_object,
                        Bucket=self.bucket,
                        Key=f"{folder}/{name}",
                        Body=body,
                        # The service checks the bytes it received and keeps the checksum (see _holds).
                        ChecksumAlgorithm="SHA256",
                    )
        return self.uri_of(digest)

    def fetch(self, uri: str, digest: str) -> Path:
        if not is_digest(digest):
            raise AdapterError(f"{digest!r} is not an adapter digest (64 lowercase hex characters)")
        folder = self._folder_of(uri)
        target = self.cache_dir / digest
        if target.is_dir():
            try:
                check_digest(target, digest)
                return target
            except AdapterError:  # the local copy was damaged: fetch it again
                shutil.rmtree(target, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=self.cache_dir))
        try:
            for name in ADAPTER_FILES:
                self._download(f"{folder}/{name}", staging / name, uri)
            try:
                check_digest(staging, digest)
            except DigestMismatch:
                raise DigestMismatch(
                    f"adapter at {uri} does not have digest {digest} (changed in the store): refusing it"
                ) from None
            try:
                staging.rename(target)
            except OSError:
                if not target.is_dir():  # not a concurrent fetch of the same digest that won the rename
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def delete(self, uri: str) -> None:
        folder = self._folder_of(uri)
        for name in ADAPTER_FILES:  # deleting a missing key succeeds in S3: deletes are idempotent
            self._call("delete from", self.client.delete_object, Bucket=self.bucket, Key=f"{folder}/{name}")

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _code(exc) in _MISSING_CODES:  # HEAD answers have no body: a bare 404 is the bucket
                raise StoreUnavailable(f"the artifact store {self.location} has no such bucket") from exc
            raise self._unavailable("reach", exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("reach", exc) from exc

    # -- helpers --------------------------------------------------------------------------------------------

    @property
    def client(self) -> S3Client:
        """Made on first use, so building the store (at start-up) needs neither network nor credentials."""
        with self._lock:
            if self._client is None:
                import boto3

                config = Config(
                    connect_timeout=5,
                    read_timeout=60,
                    retries={"max_attempts": 3, "mode": "standard"},
                    # MinIO and most self-hosted services only serve path-style addressing.
                    s3={"addressing_style": "path"} if self.endpoint_url else None,
                )
                # A session of its own: boto3's default session caches the credentials it first found.
                self._client = boto3.session.Session().client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
                    config=config,
                )
            return self._client

    @property
    def cache_dir(self) -> Path:
        with self._lock:
            if self._cache_dir is None:  # private to this process unless one is configured
                self._cache_dir = Path(tempfile.mkdtemp(prefix="loraplex-adapter-cache-"))
            self._cache_dir.mkdir(parents=True, exist_ok=True)
            return self._cache_dir

    def _key(self, digest: str) -> str:
        return f"{self.prefix}/{digest}" if self.prefix else digest

    def _folder_of(self, uri: str) -> str:
        """The key prefix `uri` names, refused unless it lies in this store's bucket under its prefix."""
        parsed = urlparse(uri)
        segments = parsed.path.split("/")[1:]
        outside = (
            parsed.scheme != "s3"
            or parsed.netloc != self.bucket
            or parsed.query
            or parsed.fragment
            or not segments
            or any(s in ("", ".", "..") for s in segments)
        )
        folder = "/".join(segments)
        if outside or (self.prefix and not folder.startswith(self.prefix + "/")):
            raise OutsideStore(f"{uri} is outside the artifact store {self.location}: refusing it")
        return folder

    def _holds(self, folder: str, directory: Path) -> bool:
        """Whether both objects are there already, byte for byte the files (the put is then a no-op): the
        SHA-256 checksum the service computed when they were written, against the files'. An object
        without one, or with another, is written again."""
        for name in ADAPTER_FILES:
            try:
                head = self.client.head_object(
                    Bucket=self.bucket, Key=f"{folder}/{name}", ChecksumMode="ENABLED"
                )
            except ClientError as exc:
                if _code(exc) in _MISSING_CODES:
                    return False
                raise self._unavailable("store", exc) from exc
            except BotoCoreError as exc:
                raise self._unavailable("store", exc) from exc
            if head.get("ChecksumSHA256") != _checksum(directory / name):
                return False
        return True

    def _download(self, key: str, path: Path, uri: str) -> None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            with path.open("wb") as out:
                for chunk in response["Body"].iter_chunks(_CHUNK):
                    out.write(chunk)
        except ClientError as exc:
            if _code(exc) in _MISSING_CODES:
                raise AdapterError(
                    f"no adapter at {uri}: {key.rsplit('/', 1)[-1]} is not in the store"
                ) from None
            raise self._unavailable("read from", exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable("read from", exc) from exc

    def _call(self, verb: str, method: Any, **kwargs: Any) -> Any:
        try:
            return method(**kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise self._unavailable(verb, exc) from exc

    def _unavailable(self, verb: str, exc: Exception) -> StoreUnavailable:
        if isinstance(exc, ClientError):
            code = _code(exc)
            reason = (
                _STORE_CODES.get(code)
                or f"answered {code}: {exc.response.get('Error', {}).get('Message', '')}"
            )
            return StoreUnavailable(f"cannot {verb} the artifact store {self.location}: it {reason}")
        return StoreUnavailable(f"cannot {verb} the artifact store {self.location}: {exc}")


def _checksum(path: Path) -> str:
    """S3's ChecksumSHA256 of a file: the base64 of its sha256."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(_CHUNK), b""):
            digest.update(block)
    return base64.b64encode(digest.digest()).decode()


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
