"""Where ``ledger publish`` writes, and where a published copy is read from: a folder or an S3 bucket.

A destination holds files named by paths relative to it (``checkpoint``, ``tile/0/000``,
``data/events/...``). ``Dest`` is the small interface the publisher needs: ``read``, ``exists``,
``put`` (bytes), ``put_file`` (a staged file, streamed) and ``delete``; each write is whole or not at
all, so a reader never sees half a tile:

* ``FolderDest``: a folder any static HTTP server can serve (write to a temporary name, then rename);
* ``S3Dest``: ``s3://bucket/prefix`` on any S3-compatible server, through ``pyarrow.fs.S3FileSystem``
  (already a dependency, C++ AWS SDK, multipart uploads for big files; an object appears only when
  its upload completes). Endpoint and credentials come from the usual variables: ``AWS_ENDPOINT_URL``,
  ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``; with no
  key the bucket is read anonymously (a public bucket).

Every failure of the store (wrong credentials, a missing bucket, a server that is down) is a
``DestError`` with one line that says which.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

__all__ = ["Dest", "DestError", "FolderDest", "S3Config", "S3Dest", "open_dest"]

_BLOCK_BYTES = 1 << 20
_CONNECT_TIMEOUT_S = 3.0
_REQUEST_TIMEOUT_S = 30.0
_MAX_ATTEMPTS = 2  # a dead server is said quickly; a publish is re-run, not retried for minutes


class DestError(ValueError):
    """The destination cannot be read or written: one line that says why."""


def _checked(rel: str) -> str:
    """A relative path inside the destination (never absolute, never ``..``)."""
    parts = PurePosixPath(rel).parts
    if not rel or rel.startswith("/") or ".." in parts or "\\" in rel:
        raise DestError(f"{rel!r} is not a path inside the destination")
    return "/".join(parts)


class Dest(ABC):
    """A published copy's files, by path relative to its root."""

    @property
    @abstractmethod
    def name(self) -> str:
        """How messages name it (a folder path, or ``s3://bucket/prefix``)."""

    @property
    @abstractmethod
    def key(self) -> str:
        """What tells two destinations apart (the publisher keeps one trusted state per key)."""

    @abstractmethod
    def read(self, rel: str) -> bytes:
        """The whole file; FileNotFoundError when there is none."""

    @abstractmethod
    def stream(self, rel: str) -> Iterator[bytes]:
        """The file in blocks of at most 1 MiB; FileNotFoundError when there is none."""

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def put_file(self, rel: str, source: Path) -> None:
        """``source``'s bytes as ``rel``: whole or not at all."""

    @abstractmethod
    def put(self, rel: str, data: bytes) -> None:
        """``data`` as ``rel``: whole or not at all."""

    @abstractmethod
    def delete(self, rel: str) -> None:
        """Remove ``rel`` (nothing happens when it is not there)."""


# ------------------------------------------------------------------------------------------ folder


class FolderDest(Dest):
    """A folder: each file written under a temporary name, then renamed into place."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise DestError(f"{self.folder} is not a folder: DEST is the folder the log is published in")

    @property
    def name(self) -> str:
        return str(self.folder)

    @property
    def key(self) -> str:
        return str(self.folder.resolve())

    def _path(self, rel: str) -> Path:
        return self.folder / _checked(rel)

    def read(self, rel: str) -> bytes:
        return self._path(rel).read_bytes()

    def stream(self, rel: str) -> Iterator[bytes]:
        with self._path(rel).open("rb") as handle:
            yield from iter(lambda: handle.read(_BLOCK_BYTES), b"")

    def exists(self, rel: str) -> bool:
        return self._path(rel).is_file()

    def _replace(self, rel: str, write: object) -> None:
        target = self._path(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".publish-tmp")
        if isinstance(write, Path):
            shutil.copyfile(write, tmp)
        else:
            assert isinstance(write, bytes)
            tmp.write_bytes(write)
        os.replace(tmp, target)

    def put_file(self, rel: str, source: Path) -> None:
        self._replace(rel, source)

    def put(self, rel: str, data: bytes) -> None:
        self._replace(rel, data)

    def delete(self, rel: str) -> None:
        self._path(rel).unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ S3


@dataclass(frozen=True)
class S3Config:
    """How to reach an S3-compatible server (from the AWS_* variables)."""

    endpoint: str  # "" for AWS itself
    access_key: str
    secret_key: str
    session_token: str
    region: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Config:
        env = os.environ if env is None else env
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL", "")
        if endpoint and urlsplit(endpoint).scheme not in ("http", "https"):
            raise DestError(f"AWS_ENDPOINT_URL {endpoint!r}: give an http:// or https:// URL")
        return cls(
            endpoint=endpoint.rstrip("/"),
            access_key=env.get("AWS_ACCESS_KEY_ID", ""),
            secret_key=env.get("AWS_SECRET_ACCESS_KEY", ""),
            session_token=env.get("AWS_SESSION_TOKEN", ""),
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
        )

    def filesystem(self, *, allow_bucket_creation: bool = False) -> object:
        """A ``pyarrow.fs.S3FileSystem`` for this server (path-style addressing, bounded retries;
        a bucket is made only when asked: publishing to a missing one is an error)."""
        from pyarrow import fs

        options: dict[str, object] = {
            "allow_bucket_creation": allow_bucket_creation,
            "region": self.region,
            "connect_timeout": _CONNECT_TIMEOUT_S,
            "request_timeout": _REQUEST_TIMEOUT_S,
            "retry_strategy": fs.AwsStandardS3RetryStrategy(max_attempts=_MAX_ATTEMPTS),
            "force_virtual_addressing": False,
            "check_directory_existence_before_creation": False,
        }
        if self.endpoint:
            parts = urlsplit(self.endpoint)
            options |= {"endpoint_override": parts.netloc, "scheme": parts.scheme}
        if self.access_key:
            options |= {"access_key": self.access_key, "secret_key": self.secret_key}
            if self.session_token:
                options["session_token"] = self.session_token
        else:
            options["anonymous"] = True
        return fs.S3FileSystem(**options)


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://bucket/prefix`` (the prefix without slashes at either end)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise DestError(f"{url!r}: give s3://bucket/prefix")
    prefix = parts.path.strip("/")
    if prefix:
        _checked(prefix)
    return parts.netloc, prefix


# How S3 servers say the key is unknown or the signature wrong (AWS, the SDK's codes, versitygw's).
_CREDENTIAL_WORDS = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "SIGNATURE_DOES_NOT_MATCH",
    "ACCESS_DENIED",
    "AccessDenied",
    "UserNotFound",
)


def _s3_message(exc: OSError, where: str, config: S3Config) -> str:
    """The one line that says what went wrong with the S3 server (its own words last)."""
    text = str(exc)
    first = " ".join(text.split())[:300]
    server = config.endpoint or "AWS S3"
    if any(k in text for k in _CREDENTIAL_WORDS):
        return (
            f"{where}: {server} refused the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY): {first}"
        )
    if "NoSuchBucket" in text or "NO_SUCH_BUCKET" in text or "bucket does not exist" in text.lower():
        return f"{where}: no such bucket at {server}"
    if any(
        k in text for k in ("curlCode: 7", "Couldn't connect", "Connection refused", "NETWORK_CONNECTION")
    ):
        return f"{where}: {server} is unreachable ({first})"
    return f"{where}: {first}"


class S3Dest(Dest):
    """``s3://bucket/prefix`` on an S3-compatible server: one object per file."""

    def __init__(self, url: str, config: S3Config | None = None) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.config = config or S3Config.from_env()
        self.fs = self.config.filesystem()
        self._check_bucket()

    @property
    def name(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    @property
    def key(self) -> str:
        return f"{self.config.endpoint or 's3'}/{self.bucket}/{self.prefix}"

    def url_of(self, rel: str) -> str:
        """``s3://bucket/prefix/rel`` (what DuckDB's httpfs reads)."""
        return f"{self.name}/{_checked(rel)}"

    def _object(self, rel: str) -> str:
        rel = _checked(rel)
        return f"{self.bucket}/{self.prefix}/{rel}" if self.prefix else f"{self.bucket}/{rel}"

    def _fail(self, exc: OSError, rel: str = "") -> DestError:
        where = f"{self.name}/{rel}" if rel else self.name
        return DestError(_s3_message(exc, where, self.config))

    def _check_bucket(self) -> None:
        from pyarrow import fs

        try:
            info = self.fs.get_file_info(self.bucket)  # type: ignore[attr-defined]
        except OSError as exc:
            raise self._fail(exc) from None
        if info.type == fs.FileType.NotFound:
            # A server may answer HeadBucket with 404 for an unknown key too: listing the buckets
            # tells a refused key from a missing bucket.
            try:
                self.fs.get_file_info(fs.FileSelector(""))  # type: ignore[attr-defined]
            except OSError as exc:
                raise self._fail(exc) from None
            raise DestError(f"{self.name}: no such bucket at {self.config.endpoint or 'AWS S3'}")

    def read(self, rel: str) -> bytes:
        return b"".join(self.stream(rel))

    def stream(self, rel: str) -> Iterator[bytes]:
        try:
            handle = self.fs.open_input_stream(self._object(rel))  # type: ignore[attr-defined]
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._fail(exc, rel) from None
        with handle:
            while True:
                try:
                    block = handle.read(_BLOCK_BYTES)
                except OSError as exc:
                    raise self._fail(exc, rel) from None
                if not block:
                    return
                yield bytes(block)

    def exists(self, rel: str) -> bool:
        from pyarrow import fs

        try:
            info = self.fs.get_file_info(self._object(rel))  # type: ignore[attr-defined]
        except OSError as exc:
            raise self._fail(exc, rel) from None
        return bool(info.type == fs.FileType.File)

    def put_file(self, rel: str, source: Path) -> None:
        try:
            with (
                source.open("rb") as handle,
                self.fs.open_output_stream(self._object(rel)) as out,  # type: ignore[attr-defined]
            ):
                for block in iter(lambda: handle.read(_BLOCK_BYTES), b""):
                    out.write(block)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and not source.exists():
                raise
            raise self._fail(exc, rel) from None

    def put(self, rel: str, data: bytes) -> None:
        try:
            with self.fs.open_output_stream(self._object(rel)) as out:  # type: ignore[attr-defined]
                out.write(data)
        except OSError as exc:
            raise self._fail(exc, rel) from None

    def delete(self, rel: str) -> None:
        try:
            self.fs.delete_file(self._object(rel))  # type: ignore[attr-defined]
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._fail(exc, rel) from None


def open_dest(dest: str | Path | Dest) -> Dest:
    """``s3://bucket/prefix`` (server and credentials from AWS_*), or a folder."""
    if isinstance(dest, Dest):
        return dest
    text = str(dest)
    if text.startswith("s3://"):
        return S3Dest(text)
    if "://" in text:
        raise DestError(f"{text!r}: DEST is a folder or s3://bucket/prefix")
    return FolderDest(Path(text))


def create_bucket(url: str, config: S3Config | None = None) -> bool:
    """Make the bucket of ``s3://bucket[/prefix]`` on the server ``config`` names (default: the AWS_*
    variables): True when made, False when it was there. ``publish`` and a lake on S3 never make
    one (a typo would become a new bucket); this is the one deliberate way. Failures: ``DestError``."""
    from pyarrow import fs

    bucket, _ = parse_s3_url(url)
    config = config or S3Config.from_env()
    s3 = config.filesystem(allow_bucket_creation=True)
    # Look first: a server answers CreateBucket on a bucket that is there in its own way.
    try:
        if s3.get_file_info(bucket).type != fs.FileType.NotFound:  # type: ignore[attr-defined]
            return False
        s3.create_dir(bucket)  # type: ignore[attr-defined]
    except OSError as exc:
        raise DestError(_s3_message(exc, f"s3://{bucket}", config)) from None
    return True
