"""`ledger monitor URL`: follow a published tile log and refuse any checkpoint that rewrites history.

Each check fetches ``<URL>/checkpoint``, verifies its signature with the log's key, and compares it
with the last checkpoint this monitor accepted (kept in a small JSON state file):

* a smaller size is a **rollback**; the same size with another root, or a bigger tree whose tiles do
  not give back the old root, is a **fork** (two histories signed by one key);
* a bigger tree is accepted only when its tiles give its signed root, the first ``old size`` leaves
  give the old root, and the RFC 6962 consistency proof built from those tiles verifies.

With witness keys and a quorum, that many valid cosignatures are required. With ``entries``, each
look also walks the entries new since the last accepted checkpoint and hashes the data files of
the signed manifest not verified before: a remote verifier of what is new only.

The log is read over HTTP from its base URL, or through any ``LogFiles`` (``files=``: e.g.
``runledger.ledger.remote``'s reader of an S3 bucket).

Only an accepted checkpoint is written to the state file, so a refused one is refused again; a look
that finds nothing new leaves the file as it was (no rewrite, no fsync).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlsplit

from runledger.ledger.log_checkpoint import parse_and_verify_checkpoint
from runledger.ledger.merkle import ProofError, verify_consistency
from runledger.ledger.parquet_schemas import SIDE_TABLES, TABLES
from runledger.ledger.tiles import (
    TileError,
    TileReader,
    consistency_proof_from_tiles,
    entries_path,
    root_from_tiles,
    root_of_prefix,
    tile_path,
    walk_new_entries,
)
from runledger.ledger.witness import parse_cosignature_key, verify_cosignatures
from runledger.schemas.durable import write_durably
from runledger.schemas.note import CheckpointError, open_note

__all__ = [
    "DEFAULT_DEADLINE_S",
    "Deadline",
    "LogFiles",
    "ManifestFile",
    "MonitorError",
    "MonitorReport",
    "check_checkpoint",
    "check_log",
    "check_manifest_path",
    "http_blocks",
    "manifest_entries",
    "open_within",
    "parse_manifest",
]

_MAX_FETCH_BYTES = 1 << 20  # a checkpoint or a tile is far smaller
_READ_TIMEOUT_S = 10.0  # one socket read at most; never more than what is left of the deadline
_BLOCK_BYTES = 1 << 20
DEFAULT_DEADLINE_S = 300.0  # one whole remote command (a look, a download of the copy)


class MonitorError(ValueError):
    """The log showed a fork, a rollback or a bad signature (``kind`` says which), or was unreachable."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class MonitorReport:
    origin: str
    old_size: int | None  # None: the first checkpoint this monitor saw
    size: int
    entries: int = 0  # entries walked and checked (with ``entries``)
    files: int = 0  # data files fetched and checked against the signed manifest


class Deadline:
    """The time one remote command may take in all: every connection and socket read is given at
    most what is left of it, and it is checked again between blocks, so a server that drips a byte
    every few seconds is cut off at the deadline (MonitorError ``unreachable``, naming the URL)."""

    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"a deadline must be more than 0 seconds, not {seconds}")
        self.seconds = seconds
        self._ends_at = time.monotonic() + seconds

    def left_s(self, url: str) -> float:
        """Seconds left; MonitorError once there are none."""
        left = self._ends_at - time.monotonic()
        if left <= 0:
            raise MonitorError("unreachable", f"{url}: not done within the {self.seconds:g} s deadline")
        return left

    def read_timeout_s(self, url: str) -> float:
        return min(_READ_TIMEOUT_S, self.left_s(url))


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    try:
        port = parts.port or default
    except ValueError:  # a port that is not a number: no origin matches it
        port = -1
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to the origin (scheme, host, port) asked: a copy's files never come
    from another server than the one the reader named."""

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        if _origin(newurl) != _origin(req.full_url):
            fp.close()
            raise MonitorError("redirect", f"{req.full_url} redirects to another origin ({newurl}): refused")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_SameOriginRedirects)


def _set_read_timeout(response: Any, seconds: float) -> None:
    """Shorten the socket's per-read timeout to what is left (http.client keeps the socket inside
    the response's reader; a file:// response has none)."""
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    if sock is not None:
        sock.settimeout(seconds)


@contextlib.contextmanager
def open_within(request: str | urllib.request.Request, deadline: Deadline) -> Iterator[Any]:
    """The response to ``request`` (a URL or a Request): connected within what is left of
    ``deadline``, redirected only to the same origin; its failures are one-line MonitorErrors."""
    url = request if isinstance(request, str) else request.full_url
    try:
        with _OPENER.open(request, timeout=deadline.read_timeout_s(url)) as response:
            yield response
    except MonitorError:
        raise
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        deadline.left_s(url)  # a read cut short by the deadline is said as that
        raise MonitorError("unreachable", f"{url}: {exc}") from None
    except ValueError:
        raise _no_scheme(url) from None


def http_blocks(url: str, deadline: Deadline, max_bytes: int | None = None) -> Iterator[bytes]:
    """The body at ``url`` in blocks as they arrive, within ``deadline``: MonitorError ``unreachable``
    (a network failure, the deadline), ``redirect`` (to another origin) or ``too-large`` (more than
    ``max_bytes``: stopped before the block that goes past it is handed on)."""
    total = 0
    with open_within(url, deadline) as response:
        while True:
            # Each read is one socket read (read1), bounded by what is left of the deadline.
            _set_read_timeout(response, deadline.read_timeout_s(url))
            block = response.read1(_BLOCK_BYTES)
            if not block:
                return
            total += len(block)
            if max_bytes is not None and total > max_bytes:
                raise MonitorError("too-large", f"{url} is longer than {max_bytes} bytes")
            yield block


# ------------------------------------------------------------------------------- the manifest's shape

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# A partition value as the ledger names its folder: a plain name, or percent escapes (runledger.ledger.lake).
_PARTITION_VALUE = re.compile(r"(?:[A-Za-z0-9._-]|%[0-9A-F]{2}){1,200}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.parquet")
_PATH_CHARS = re.compile(r"[A-Za-z0-9._=%/-]*")
_GLOB_CHARS = frozenset("*?[]{}")
_LAYOUT = "data/<table>/<column>=<value>/<file>.parquet"


@dataclass(frozen=True)
class ManifestFile:
    """One data file a published manifest names: where, its SHA-256 (hex) and its size."""

    path: str
    sha256: str
    size_bytes: int


def _path_refusal(rel: str) -> str | None:
    """Why ``rel`` is not a data file path the ledger publishes (an allow-list), or None."""
    if rel.startswith("/") or "\\" in rel:
        return "is not under data/ (absolute, or a backslash)"
    segments = rel.split("/")
    if ".." in segments or "." in segments:
        return "is not under data/ (a '.' or '..' segment)"
    if "" in segments:
        return "has an empty segment"
    if segments[0] != "data":
        return "is not under data/"
    if not _PATH_CHARS.fullmatch(rel):
        odd = sorted({c for c in rel if not _PATH_CHARS.fullmatch(c)})
        what = "a glob character" if _GLOB_CHARS & set(odd) else "a character"
        return f"has {what} outside [A-Za-z0-9._=%/-]: {''.join(odd)!r}"
    if len(segments) != 4:
        return f"is not {_LAYOUT}"
    table, partition, name = segments[1:]
    known = TABLES.get(table) or SIDE_TABLES.get(table)
    if known is None:
        return f"names a table this runledger does not know ({table!r})"
    column, eq, value = partition.partition("=")
    if not eq or column != known.partition or not _PARTITION_VALUE.fullmatch(value):
        return f"is not {_LAYOUT} (table {table} is partitioned by {known.partition})"
    if not _FILE_NAME.fullmatch(name):
        return f"is not {_LAYOUT} (the file name)"
    return None


def check_manifest_path(rel: str) -> None:
    """MonitorError ``bad-manifest`` unless ``rel`` is ``data/<known table>/<its partition column>=
    <value>/<name>.parquet`` in plain segments of the allowed alphabet: no absolute path, no ``..``,
    no backslash, no empty segment. The one check every reader of a manifest makes."""
    why = _path_refusal(rel)
    if why is not None:
        raise MonitorError("bad-manifest", f"manifest path {rel!r} {why}")


def _entry_of(n: int, item: object) -> ManifestFile:
    if not isinstance(item, dict):
        raise MonitorError("bad-manifest", f"manifest file {n} is not an object")
    path, sha256, size = item.get("path"), item.get("sha256"), item.get("bytes")
    if not isinstance(path, str):
        raise MonitorError("bad-manifest", f"manifest file {n}: path is not a string")
    if not isinstance(sha256, str) or not _SHA256_HEX.fullmatch(sha256):
        raise MonitorError("bad-manifest", f"manifest file {path!r}: sha256 is not 64 lowercase hex digits")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise MonitorError("bad-manifest", f"manifest file {path!r}: bytes is not a whole number >= 0")
    check_manifest_path(path)
    return ManifestFile(path, sha256, size)


def manifest_entries(doc: object) -> list[ManifestFile]:
    """The files a parsed manifest names, its shape checked (an object whose ``files`` is a list of
    {path, sha256, bytes}, each path by ``check_manifest_path``, none twice): MonitorError
    ``bad-manifest`` in one line otherwise."""
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        raise MonitorError("bad-manifest", "manifest.json is not an object with a list of files")
    entries = [_entry_of(n, item) for n, item in enumerate(files, 1)]
    seen: set[str] = set()
    for entry in entries:
        if entry.path in seen:
            raise MonitorError("bad-manifest", f"manifest path {entry.path!r} is named twice")
        seen.add(entry.path)
    return entries


def parse_manifest(manifest: bytes) -> tuple[dict[str, Any], list[ManifestFile]]:
    """manifest.json's bytes as (its object, its files): MonitorError ``bad-manifest`` if not JSON
    or not of the manifest's shape."""
    try:
        doc = json.loads(manifest)
    except ValueError as exc:  # not UTF-8, not JSON
        raise MonitorError("bad-manifest", f"manifest.json is not JSON: {exc}") from None
    entries = manifest_entries(doc)
    return doc, entries


def _no_scheme(url: str) -> MonitorError:
    """A path given where a URL is wanted (urllib raises ValueError: not a traceback for the user)."""
    return MonitorError(
        "unreachable", f"{url}: not a URL: give http://, https://, file:///path or s3://bucket/prefix"
    )


def _fetch(url: str, deadline: Deadline, max_bytes: int = _MAX_FETCH_BYTES) -> bytes:
    try:
        return b"".join(http_blocks(url, deadline, max_bytes))
    except MonitorError as exc:
        if exc.kind == "too-large":
            raise MonitorError("malformed", f"{url} is larger than {max_bytes} bytes") from None
        raise


class LogFiles(Protocol):
    """A published log's files by path relative to its root (failures are MonitorError)."""

    name: str

    def read(self, rel: str) -> bytes: ...

    def sha256(self, rel: str, max_bytes: int) -> str:
        """The file's SHA-256 (hex), read in blocks; MonitorError past ``max_bytes``."""
        ...


class _HttpFiles:
    """The log served under a base URL, every read within one deadline."""

    def __init__(self, base: str, deadline: Deadline) -> None:
        self.name = base
        self.deadline = deadline

    def read(self, rel: str) -> bytes:
        return _fetch(self.name + rel, self.deadline)

    def sha256(self, rel: str, max_bytes: int) -> str:
        digest = hashlib.sha256()
        for block in http_blocks(self.name + rel, self.deadline, max_bytes):
            digest.update(block)
        return digest.hexdigest()


def _tile_reader(files: LogFiles) -> TileReader:
    def read(level: int, index: int, width: int) -> bytes:
        return files.read(tile_path(level, index, width))

    return read


def _check_growth(files: LogFiles, old: dict[str, object], size: int, root: bytes) -> None:
    read = _tile_reader(files)
    old_size = int(str(old["size"]))
    old_root = base64.b64decode(str(old["root"]))
    try:
        if root_from_tiles(read, size) != root:
            raise MonitorError("bad-tiles", f"the tiles of size {size} do not give the signed root")
        if root_of_prefix(read, size, old_size) != old_root:
            raise MonitorError(
                "fork", f"the tree of size {size} does not extend the one of size {old_size} seen before"
            )
        verify_consistency(old_size, size, old_root, root, consistency_proof_from_tiles(read, old_size, size))
    except (ProofError, TileError) as exc:
        raise MonitorError("fork", f"no valid consistency proof from {old_size} to {size}: {exc}") from exc


def check_quorum(text: bytes, witnesses: Sequence[str], quorum: int) -> None:
    keys = [parse_cosignature_key(w) for w in witnesses]
    good = verify_cosignatures(text.decode(), keys)
    if len(good) < quorum:
        raise MonitorError(
            "quorum", f"{len(good)} valid cosignatures of the {quorum} required ({', '.join(good) or 'none'})"
        )


def check_log(
    url: str,
    log_key: str,
    state_path: Path,
    *,
    witnesses: Sequence[str] = (),
    quorum: int = 0,
    entries: bool = False,
    files: LogFiles | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> MonitorReport:
    """One look at the log at ``url``: raises MonitorError on a fork, rollback, bad signature, or
    fewer than ``quorum`` valid cosignatures by ``witnesses``. With ``entries``, also walks every
    entry new since the last accepted checkpoint and checks the new data files against the signed
    manifest (only what is new: bounded by the growth, not the log). ``files``: read the log
    through it instead of over HTTP from ``url`` (its own deadline then applies); over HTTP the
    whole look has ``deadline_s`` seconds."""
    base = url if url.endswith("/") else url + "/"
    files = files or _HttpFiles(base, Deadline(deadline_s))
    return check_checkpoint(
        files,
        log_key,
        state_path,
        files.read("checkpoint"),
        witnesses=witnesses,
        quorum=quorum,
        entries=entries,
    )


def _load_state(state_path: Path) -> tuple[bytes | None, dict[str, Any] | None]:
    """The state file's bytes and its object (None, None: no state yet); one line if unreadable."""
    if not state_path.exists():
        return None, None
    saved = state_path.read_bytes()
    try:
        old = json.loads(saved)
        int(old["size"]), base64.b64decode(old["root"]), str(old["origin"])
    except (ValueError, TypeError, KeyError) as exc:
        raise MonitorError("bad-state", f"{state_path} is not a state this monitor wrote: {exc}") from None
    return saved, old


def check_checkpoint(
    files: LogFiles,
    log_key: str,
    state_path: Path,
    text: bytes,
    *,
    witnesses: Sequence[str] = (),
    quorum: int = 0,
    entries: bool = False,
) -> MonitorReport:
    """``check_log`` on a checkpoint already fetched (``text``): the same signature, quorum,
    rollback, fork and growth checks against the state in ``state_path``, saved once accepted."""
    saved, old = _load_state(state_path)
    try:
        checkpoint = parse_and_verify_checkpoint(text, log_key, old["origin"] if old else None)
    except CheckpointError as exc:
        raise MonitorError("bad-signature", f"{files.name}checkpoint: {exc}") from exc
    if quorum:
        check_quorum(text, witnesses, quorum)
    size, root = checkpoint.size, checkpoint.root
    if old is not None:
        old_size, old_root = old["size"], base64.b64decode(old["root"])
        if size < old_size:
            raise MonitorError("rollback", f"the log shrank from {old_size} to {size} entries")
        if size == old_size and root != old_root:
            raise MonitorError("fork", f"two different roots signed for size {size}")
        if size > old_size:
            _check_growth(files, old, size, root)
    verified = dict(old.get("files", {})) if old else {}
    counted = (0, 0)
    if entries and (old is None or size > old["size"]):  # the same checkpoint: nothing new to walk
        counted = _check_new_entries(
            files, checkpoint.origin, log_key, old["size"] if old else 0, size, root, verified
        )
    state = {
        "url": files.name,
        "origin": checkpoint.origin,
        "size": size,
        "root": base64.b64encode(root).decode(),
    }
    _save(state_path, saved, json.dumps(state | {"checkpoint": text.decode(), "files": verified}).encode())
    return MonitorReport(checkpoint.origin, None if old is None else old["size"], size, *counted)


def _save(state_path: Path, saved: bytes | None, state: bytes) -> None:
    """Write the state file only when it changes: a monitor polling a quiet log every few seconds
    would otherwise rewrite and fsync the same bytes each time."""
    if state == saved:
        return
    state_path.parent.mkdir(parents=True, exist_ok=True)
    write_durably(state_path, state)


def _check_new_entries(
    files: LogFiles,
    origin: str,
    log_key: str,
    old_size: int,
    size: int,
    root: bytes,
    verified: dict[str, str],
) -> tuple[int, int]:
    """Walk the entries [old_size, size) against the signed root, then the manifest the last
    snapshot entry names and each data file in it not verified before. Returns (entries, files)."""
    read = _tile_reader(files)

    def read_bundle(index: int, width: int) -> bytes:
        return files.read(entries_path(index, width))

    manifest_digest = None
    count = 0
    try:
        for _, entry in walk_new_entries(read, read_bundle, old_size, size, root):
            manifest_digest = _snapshot_digest(entry) or manifest_digest
            count += 1
    except (ProofError, TileError, ValueError) as exc:
        raise MonitorError(
            "bad-entries", f"an entry of {files.name} does not match the signed tree: {exc}"
        ) from exc
    if manifest_digest is None:
        return count, 0
    return count, _check_data(files, origin, log_key, manifest_digest, verified)


def _snapshot_digest(entry: bytes) -> str | None:
    """The manifest SHA-256 a snapshot entry names (None: not a snapshot entry); ValueError if bad."""
    doc = json.loads(entry)
    if not isinstance(doc, dict) or doc.get("t") != "snapshot":
        return None
    digest = doc.get("manifest_sha256")
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
        raise ValueError("a snapshot entry names no manifest SHA-256")
    return digest


def _check_data(files: LogFiles, origin: str, log_key: str, digest: str, verified: dict[str, str]) -> int:
    """The signed manifest the snapshot entry names, then each data file in it not verified
    before, hashed as it streams and never read past the bytes the manifest gives it."""
    manifest = files.read("manifest.json")
    if hashlib.sha256(manifest).hexdigest() != digest:
        raise MonitorError(
            "bad-manifest", "manifest.json is not the manifest the log's last snapshot entry names"
        )
    try:
        signed = open_note(files.read("manifest.sig"), log_key).split("\n")
    except CheckpointError as exc:
        raise MonitorError("bad-signature", f"manifest.sig: {exc}") from exc
    if len(signed) < 3 or signed[0] != f"{origin}/manifest" or _b64_hex(signed[2]) != digest:
        raise MonitorError("bad-manifest", "manifest.sig does not sign this manifest")
    _, listed = parse_manifest(manifest)  # every path checked before any is fetched
    checked = 0
    for item in listed:
        if verified.get(item.path) == item.sha256:
            continue  # verified on an earlier look: files never change once named
        try:
            got = files.sha256(item.path, item.size_bytes)
        except MonitorError as exc:
            if exc.kind != "too-large":
                raise
            raise MonitorError(
                "bad-data", f"{item.path} is longer than its {item.size_bytes} bytes in the signed manifest"
            ) from None
        if got != item.sha256:
            raise MonitorError("bad-data", f"{item.path} does not match its SHA-256 in the signed manifest")
        verified[item.path] = item.sha256
        checked += 1
    return checked


def _b64_hex(text: str) -> str | None:
    try:
        return base64.b64decode(text, validate=True).hex()
    except ValueError:
        return None
