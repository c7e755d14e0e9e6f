"""A published copy of the ledger (``ledger publish``), checked and read by anyone who has only its address.

The copy is read from a ``Source``: a base URL any static HTTP server answers (``HttpSource``), or
``s3://bucket/prefix`` on an S3-compatible server (``S3Source``, endpoint and credentials from the
usual AWS_* variables; ``runledger.ledger.publish_dest``).

* ``verify_remote``: ``ledger verify --remote URL``. The monitor's check (``runledger.ledger.monitor.check_log``
  with ``entries``): the checkpoint's signature and cosignature quorum, its consistency with the last
  checkpoint verified from here, every entry new since then against the signed root, and each data
  file of the signed manifest not verified before. One tile, one bundle and one 1 MiB block of a data
  file in memory at a time; the state (the last verified checkpoint, the files checked) is on disk.
* ``tlog-proof``: an offline proof (C2SP tlog-proof@v1) that an event's entry is in the published
  whole-ledger log: the entry itself as the ``extra`` line, its index, the RFC 6962 audit path and
  the checkpoint verbatim. ``verify_tlog_proof`` needs only the proof and the log's key.
* ``fetch_copy`` + ``RemoteCopy.sql``: ``ledger query --remote URL``, the default. A verified
  download: the Parquet files the signed manifest names are downloaded into a local cache, each
  checked against its SHA-256, and queried through the same locked views a local ledger gets.
* ``query_direct``: ``ledger query --remote URL --direct``. DuckDB's httpfs reads the published
  Parquet files by URL (the list from the verified, signed manifest: never a glob), only the byte
  ranges a query needs, nothing downloaded first. The checkpoint and manifest are verified; the data
  bytes are not (DuckDB cannot check what it reads against the manifest's SHA-256), which is why the
  download stays the default. Over HTTP the server must answer Range requests (nginx, caddy; not
  Python's http.server): that is checked first, and said in one line when it does not.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import duckdb

from runledger.ledger import duck
from runledger.ledger.duck_s3 import create_s3_secret
from runledger.ledger.log_checkpoint import Checkpoint, parse_and_verify_checkpoint
from runledger.ledger.merkle import HASH_SIZE, ProofError, leaf_hash, verify_inclusion
from runledger.ledger.monitor import (
    DEFAULT_DEADLINE_S,
    Deadline,
    ManifestFile,
    MonitorError,
    MonitorReport,
    check_checkpoint,
    check_log,
    http_blocks,
    manifest_entries,
    open_within,
    parse_manifest,
)
from runledger.ledger.parquet_schemas import ADDED_TABLES, TABLES, tables_of
from runledger.ledger.publish import load_published
from runledger.ledger.publish_dest import Dest, DestError, S3Dest, open_dest
from runledger.ledger.query import QueryError, Result
from runledger.ledger.sql_guard import (
    QueryLimits,
    RefusedStatement,
    StatementStopped,
    limit_error,
    limits_sql,
    lock_connection,
    read_only_statement,
    run_limited,
)
from runledger.ledger.store import COMMITS, Ledger
from runledger.ledger.tiles import (
    TILE_WIDTH,
    decode_bundle,
    entries_path,
    inclusion_proof_from_tiles,
    tile_path,
    tile_width,
)
from runledger.ledger.views import connect, files_or_empty, named_views
from runledger.schemas.durable import write_durably
from runledger.schemas.note import CheckpointError, decode_canonical_base64, open_note

__all__ = [
    "TLOG_PROOF_HEADER",
    "DirectAnswer",
    "HttpSource",
    "ProvenEntry",
    "RemoteCopy",
    "RemoteError",
    "S3Source",
    "Source",
    "default_state_path",
    "fetch_copy",
    "format_tlog_proof",
    "open_source",
    "prove_published",
    "query_direct",
    "verify_remote",
    "verify_tlog_proof",
]

TLOG_PROOF_HEADER = "c2sp.org/tlog-proof@v1"
_DECIMAL = re.compile(r"0|[1-9][0-9]*")
_MAX_SMALL_BYTES = 16 << 20  # a manifest or its signature: far smaller


class RemoteError(ValueError):
    """A published copy or a proof that does not check out, said in one line."""


def _base(url: str) -> str:
    return url if url.endswith("/") else url + "/"


def default_state_path(url: str, under: Path = Path(".runledger/remote-verify")) -> Path:
    """Where ``verify --remote`` keeps the last checkpoint it verified of the copy at ``url``."""
    return under / (hashlib.sha256(_base(url).encode()).hexdigest()[:16] + ".json")


def verify_remote(
    url: str,
    log_key: str,
    state: Path,
    *,
    witnesses: Sequence[str] = (),
    quorum: int = 0,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> MonitorReport:
    """Check what is new in the copy at ``url`` (HTTP or S3) since the last checkpoint verified
    (state in ``state``), all of it within ``deadline_s`` seconds. MonitorError (with its kind) on
    anything that does not match the signed log."""
    if urlsplit(url).scheme != "s3":
        return check_log(
            url, log_key, state, witnesses=witnesses, quorum=quorum, entries=True, deadline_s=deadline_s
        )
    try:
        files = _MonitorFiles(open_source(url, deadline_s=deadline_s))
    except RemoteError as exc:
        raise MonitorError("unreachable", str(exc)) from None
    return check_log(url, log_key, state, witnesses=witnesses, quorum=quorum, entries=True, files=files)


# ------------------------------------------------------------------------------------- tlog-proof


@dataclass(frozen=True)
class ProvenEntry:
    """What a checked tlog-proof shows: entry ``index`` of the log is ``entry`` at ``checkpoint``."""

    index: int
    entry: bytes
    checkpoint: Checkpoint


def format_tlog_proof(extra: bytes, index: int, proof: Sequence[bytes], checkpoint: str) -> str:
    """The C2SP tlog-proof@v1 text: header, extra, index, one hash a line, a blank line, the checkpoint."""
    lines = [TLOG_PROOF_HEADER, "extra " + base64.b64encode(extra).decode(), f"index {index}"]
    lines += [base64.b64encode(h).decode() for h in proof]
    return "\n".join(lines) + "\n\n" + checkpoint


def prove_published(root: Path, dest: Path | str | Dest, event_id: str, source: str | None = None) -> str:
    """The tlog-proof of event ``event_id``'s entry in the log last published from ``root`` to
    ``dest`` (a folder or ``s3://…``), at its published checkpoint (the entry is the proof's ``extra``)."""
    from runledger.ledger.query import Reader

    Ledger.open(root).close()  # (a folder that is no ledger: its one-line error)
    where, params = "id = ?", [event_id]
    if source:
        where, params = where + " AND source = ?", [event_id, source]
    with Reader(root) as reader:
        found = reader.sql(f"SELECT stream, stream_seq FROM events WHERE {where}", params).rows
    if len(found) != 1:
        raise RemoteError(
            f"no event with id {event_id!r}"
            if not found
            else f"{len(found)} events have id {event_id!r}; name one with --source"
        )
    load: Any = load_published  # takes any DEST once runledger.ledger.publish writes through runledger.ledger.publish_dest
    (stream, seq), published = found[0], load(root, dest)
    index = published.leaf_of(stream, seq)
    if index is None or not published.checkpoint:
        raise RemoteError(f"event {event_id} is not in the log published to {dest}: run `ledger publish`")
    try:
        files = open_dest(dest)
    except DestError as exc:
        raise RemoteError(str(exc)) from None

    def read(rel: str) -> bytes:
        try:
            return files.read(rel)
        except (FileNotFoundError, DestError) as exc:
            raise RemoteError(f"{files.name} lacks {rel}: {exc}") from None

    def read_tile(level: int, n: int, width: int) -> bytes:
        return read(tile_path(level, n, width))

    size = published.size
    width = tile_width(0, index // TILE_WIDTH, size)
    entry = decode_bundle(read(entries_path(index // TILE_WIDTH, width)), width)[index % TILE_WIDTH]
    proof = inclusion_proof_from_tiles(read_tile, index, size)
    verify_inclusion(leaf_hash(entry), index, size, proof, published.root)  # never hand out a bad proof
    return format_tlog_proof(entry, index, proof, published.checkpoint)


def _parse_tlog_proof(text: str) -> tuple[bytes, int, list[bytes], str]:
    head, sep, checkpoint = text.partition("\n\n")
    lines = head.split("\n")
    if not sep or lines[0] != TLOG_PROOF_HEADER:
        raise RemoteError(f"not a tlog-proof: the first line must be {TLOG_PROOF_HEADER}")
    if len(lines) < 3 or not lines[1].startswith("extra "):
        raise RemoteError("the proof has no extra line: the log entry it proves is needed")
    try:
        extra = decode_canonical_base64(lines[1].removeprefix("extra "), "extra")
    except CheckpointError as exc:
        raise RemoteError(f"bad extra line: {exc}") from None
    index_text = lines[2].removeprefix("index ")
    if not lines[2].startswith("index ") or not _DECIMAL.fullmatch(index_text):
        raise RemoteError("the third line must be `index N` (N a decimal with no leading zeros)")
    proof = []
    for n, line in enumerate(lines[3:], 1):
        try:
            node = decode_canonical_base64(line, "proof hash")
        except CheckpointError as exc:
            raise RemoteError(f"proof hash {n}: {exc}") from None
        if len(node) != HASH_SIZE:
            raise RemoteError(f"proof hash {n} has {len(node)} bytes, want {HASH_SIZE}")
        proof.append(node)
    return extra, int(index_text), proof, checkpoint


def verify_tlog_proof(text: str, log_key: str, origin: str | None = None) -> ProvenEntry:
    """Check a tlog-proof offline: the checkpoint's signature by ``log_key`` (and its origin, when
    given), then the entry in ``extra`` at ``index`` against the checkpoint's root."""
    extra, index, proof, note = _parse_tlog_proof(text)
    try:
        checkpoint = parse_and_verify_checkpoint(note, log_key, origin)
    except CheckpointError as exc:
        raise RemoteError(f"the proof's checkpoint: {exc}") from None
    try:
        verify_inclusion(leaf_hash(extra), index, checkpoint.size, proof, checkpoint.root)
    except ProofError as exc:
        raise RemoteError(
            f"entry {index} is not in the signed tree of size {checkpoint.size}: {exc}"
        ) from None
    return ProvenEntry(index, extra, checkpoint)


# ------------------------------------------------------------------------------- sources


class Source(ABC):
    """A published copy's files, read by path relative to its root: over HTTP(S) or from S3."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The copy's address as given (a base URL ending in ``/``, or ``s3://bucket/prefix``)."""

    @abstractmethod
    def stream(self, rel: str) -> Iterator[bytes]:
        """The file in blocks; RemoteError when it cannot be read."""

    @abstractmethod
    def url_of(self, rel: str) -> str:
        """The file's address for DuckDB's httpfs."""

    def read(self, rel: str, max_bytes: int = _MAX_SMALL_BYTES) -> bytes:
        """A small file whole (a checkpoint, a tile, the manifest): RemoteError past ``max_bytes``."""
        data = bytearray()
        for block in self.stream(rel):
            data += block
            if len(data) > max_bytes:
                raise RemoteError(f"{self.url_of(rel)} is larger than {max_bytes} bytes")
        return bytes(data)

    def sha256(self, rel: str, max_bytes: int | None = None) -> str:
        """The SHA-256 of a file, read in blocks (one in memory at a time); RemoteError past
        ``max_bytes`` (when given)."""
        digest = hashlib.sha256()
        for block in self.stream_at_most(rel, max_bytes):
            digest.update(block)
        return digest.hexdigest()

    def stream_at_most(self, rel: str, max_bytes: int | None) -> Iterator[bytes]:
        """``stream``, stopped with RemoteError before the block that would pass ``max_bytes``."""
        total = 0
        for block in self.stream(rel):
            total += len(block)
            if max_bytes is not None and total > max_bytes:
                raise RemoteError(f"{self.url_of(rel)} is longer than {max_bytes} bytes")
            yield block


class HttpSource(Source):
    """A copy served by any static HTTP server: every request within one deadline, redirects only
    to the same origin."""

    def __init__(self, url: str, deadline: Deadline | None = None) -> None:
        self.base = _base(url)
        self.deadline = deadline or Deadline(DEFAULT_DEADLINE_S)

    @property
    def name(self) -> str:
        return self.base

    def url_of(self, rel: str) -> str:
        return self.base + rel

    def stream(self, rel: str) -> Iterator[bytes]:
        return self.stream_at_most(rel, None)

    def stream_at_most(self, rel: str, max_bytes: int | None) -> Iterator[bytes]:
        try:
            yield from http_blocks(self.url_of(rel), self.deadline, max_bytes)
        except MonitorError as exc:
            raise RemoteError(str(exc)) from None

    def answers_ranges(self, rel: str) -> bool:
        """Whether the server answers a Range request with 206 and just those bytes."""
        url = self.url_of(rel)
        request = urllib.request.Request(url, headers={"Range": "bytes=0-3"})
        try:
            with open_within(request, self.deadline) as response:
                status, body = response.status, response.read(5)
        except MonitorError as exc:
            raise RemoteError(str(exc)) from None
        return bool(status == 206 and len(body) == 4)


class S3Source(Source):
    """A copy in ``s3://bucket/prefix`` (server and credentials from the AWS_* variables)."""

    def __init__(self, url: str, deadline: Deadline | None = None) -> None:
        try:
            self.dest = S3Dest(url)
        except DestError as exc:
            raise RemoteError(str(exc)) from None
        self.deadline = deadline or Deadline(DEFAULT_DEADLINE_S)

    @property
    def name(self) -> str:
        return self.dest.name

    def url_of(self, rel: str) -> str:
        return self.dest.url_of(rel)

    def stream(self, rel: str) -> Iterator[bytes]:
        try:
            self.deadline.left_s(self.url_of(rel))
            for block in self.dest.stream(rel):
                yield block
                self.deadline.left_s(self.url_of(rel))  # the S3 client's reads have their own timeouts
        except MonitorError as exc:
            raise RemoteError(str(exc)) from None
        except FileNotFoundError:
            raise RemoteError(f"{self.url_of(rel)}: no such object") from None
        except DestError as exc:
            raise RemoteError(str(exc)) from None


def open_source(url: str, *, deadline_s: float = DEFAULT_DEADLINE_S) -> Source:
    """The published copy at ``url``: ``http(s)://…`` or ``s3://bucket/prefix``, every read of it
    within ``deadline_s`` seconds from now."""
    scheme = urlsplit(url).scheme
    if scheme in ("http", "https"):
        return HttpSource(url, Deadline(deadline_s))
    if scheme == "s3":
        return S3Source(url, Deadline(deadline_s))
    raise RemoteError(f"--remote {url!r}: give an http://, https:// or s3://bucket/prefix address")


class _MonitorFiles:
    """A source as ``runledger.ledger.monitor.check_log`` reads it (its failures are ``unreachable``)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.name = source.name

    def read(self, rel: str) -> bytes:
        try:
            return self.source.read(rel, _MAX_SMALL_BYTES)
        except RemoteError as exc:
            raise MonitorError("unreachable", str(exc)) from None

    def sha256(self, rel: str, max_bytes: int) -> str:
        try:
            return self.source.sha256(rel, max_bytes)
        except RemoteError as exc:
            kind = "too-large" if "is longer than" in str(exc) else "unreachable"
            raise MonitorError(kind, str(exc)) from None


# ------------------------------------------------------------------------------- query --remote


def _download(source: Source, item: ManifestFile, target: Path) -> None:
    """The file ``item`` names into ``target``, hashed as it streams and never written past the
    manifest's byte count; kept only if its bytes have the signed SHA-256 (the ``.part`` file is
    removed on any failure)."""
    part = target.with_name(target.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    try:
        with part.open("wb") as out:
            for block in source.stream_at_most(item.path, item.size_bytes):
                digest.update(block)
                out.write(block)
                written += len(block)
    except RemoteError as exc:
        part.unlink(missing_ok=True)
        if "is longer than" in str(exc):
            raise RemoteError(
                f"{source.url_of(item.path)} is longer than its {item.size_bytes} bytes in the signed manifest"
            ) from None
        raise
    if written != item.size_bytes or digest.hexdigest() != item.sha256:
        part.unlink(missing_ok=True)
        raise RemoteError(f"{source.url_of(item.path)} does not match its SHA-256 in the signed manifest")
    part.replace(target)


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


@dataclass
class RemoteCopy:
    """A verified local copy of a published ledger's data files, as of ``checkpoint``."""

    folder: Path
    checkpoint: Checkpoint
    manifest_log_size: int
    downloaded: int  # files fetched this time (the rest were in the cache, their digests rechecked)

    def sql(self, statement: str, limits: QueryLimits | None = None) -> Result:
        """One read-only statement over the copy, through the views, walls and limits of a local
        ledger (``limits``: default ``QueryLimits()``; spills in ``<cache>/.spill``)."""
        from runledger.ledger.query import SPILL_AREA, spill_folder

        bounds = limits if limits is not None else QueryLimits()
        spill = spill_folder(self.folder.parent / SPILL_AREA)
        con = connect(self.folder)
        try:
            tables = [self.folder / name for name in tables_of(self.folder)]
            lock_connection(con, tables, limits=bounds, spill=spill.path)
            return _answer(con, statement, bounds)
        finally:
            con.close()
            spill.remove()


def _answer(con: duckdb.DuckDBPyConnection, statement: str, limits: QueryLimits | None = None) -> Result:
    """One read-only statement on a locked ``con``, stopped after ``limits``' timeout (its memory and
    spill limits are the connection's, set before its lock)."""
    bounds = limits if limits is not None else QueryLimits()
    try:
        query = read_only_statement(con, statement)
    except RefusedStatement as exc:
        raise QueryError(str(exc)) from None

    def rows() -> Result:
        rel = con.execute(query)
        return Result([d[0] for d in rel.description or []], rel.fetchall())

    try:
        return run_limited(con, bounds.timeout_s, rows)
    except StatementStopped as exc:
        raise QueryError(str(exc)) from None
    except duckdb.Error as exc:  # outside the copy's folders included: one line, as locally
        raise QueryError(limit_error(exc, bounds) or str(exc).splitlines()[0]) from None


def _signed_manifest(
    source: Source, log_key: str, checkpoint_text: bytes | None = None
) -> tuple[Checkpoint, int, dict[str, Any]]:
    """The verified checkpoint (``checkpoint_text``, or fetched), the log size the manifest is
    signed at, and the manifest (its shape and every path checked)."""
    text = source.read("checkpoint") if checkpoint_text is None else checkpoint_text
    try:
        checkpoint = parse_and_verify_checkpoint(text, log_key)
        signed = open_note(source.read("manifest.sig"), log_key).split("\n")
    except CheckpointError as exc:
        raise RemoteError(f"bad signature: {exc}") from None
    manifest = source.read("manifest.json")
    digest = base64.b64encode(hashlib.sha256(manifest).digest()).decode()
    if len(signed) < 3 or signed[0] != checkpoint.origin + "/manifest" or signed[2] != digest:
        raise RemoteError("manifest.json is not the manifest signed in manifest.sig for this log")
    if not _DECIMAL.fullmatch(signed[1]) or int(signed[1]) > checkpoint.size:
        raise RemoteError("manifest.sig names a log size beyond the signed checkpoint")
    try:
        doc, _ = parse_manifest(manifest)
    except MonitorError as exc:
        raise RemoteError(str(exc)) from None
    if doc.get("origin") != checkpoint.origin:
        raise RemoteError("manifest.json names another log's origin")
    return checkpoint, int(signed[1]), doc


def _manifest_entries(manifest: dict[str, Any]) -> list[ManifestFile]:
    """The files the manifest names, its shape and each path checked (``runledger.ledger.monitor``'s
    allow-list: ``data/<known table>/<column>=<value>/<name>.parquet``), RemoteError otherwise."""
    try:
        return manifest_entries(manifest)
    except MonitorError as exc:
        raise RemoteError(str(exc)) from None


def _manifest_files(manifest: dict[str, Any]) -> dict[str, str]:
    """path (``data/…``) -> SHA-256 of each file the manifest names, each path checked."""
    return {item.path: item.sha256 for item in _manifest_entries(manifest)}


def _target_in(folder: Path, rel: str) -> Path:
    """Where the file ``rel`` (``data/…``) goes in the copy's cache ``folder``: RemoteError unless
    that resolves inside the folder (checked before anything is opened, symlinks followed)."""
    target = folder / rel.removeprefix("data/")
    if not target.resolve().is_relative_to(folder.resolve()):
        raise RemoteError(f"manifest path {rel!r} is not a file inside the cache {folder}")
    return target


def _cache_key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


TRUSTED_STATE = ".trusted-checkpoint.json"  # in a copy's cache folder: the last checkpoint taken


def _check_trusted(source: Source, log_key: str, folder: Path, text: bytes) -> None:
    """The checkpoint ``text`` against the last one this cache took from the copy (the monitor's
    rollback, fork and consistency checks, ``runledger.ledger.monitor.check_checkpoint``); saved once taken."""
    try:
        check_checkpoint(_MonitorFiles(source), log_key, folder / TRUSTED_STATE, text)
    except MonitorError as exc:
        raise RemoteError(f"{exc} (against the checkpoint this cache last took from {source.name})") from None


def fetch_copy(url: str, log_key: str, cache: Path, *, deadline_s: float = DEFAULT_DEADLINE_S) -> RemoteCopy:
    """Download (into ``cache``, only what it lacks) every data file the signed manifest of the copy
    at ``url`` (HTTP or S3) names, each checked against its size and SHA-256; files no longer named
    are removed from the cache, so the views see exactly the published snapshot. A checkpoint that
    rolls back or forks the one this cache last took is refused; all within ``deadline_s`` seconds."""
    source = open_source(url, deadline_s=deadline_s)
    text = source.read("checkpoint")
    checkpoint, manifest_size, manifest = _signed_manifest(source, log_key, text)
    folder = cache / _cache_key(source.name)
    # Every target is checked to be inside the cache before any file is opened.
    wanted = {_target_in(folder, item.path): item for item in _manifest_entries(manifest)}
    folder.mkdir(parents=True, exist_ok=True)
    _check_trusted(source, log_key, folder, text)
    downloaded = 0
    for target, item in wanted.items():
        if _sha256(target) != item.sha256:
            _download(source, item, target)
            downloaded += 1
    for old in folder.rglob("*.parquet"):
        if old not in wanted:
            old.unlink()  # merged away by a compaction: its rows are in a file still named
    # The tables the copy has, those without rows included: the views answer those as empty.
    tables = _published_tables(manifest)
    write_durably(folder / "LEDGER.json", json.dumps({"tables": tables, "origin": checkpoint.origin}))
    (folder / COMMITS).mkdir(exist_ok=True)  # none: so a ``Reader`` opens the copy (no merge to wait for)
    return RemoteCopy(folder, checkpoint, manifest_size, downloaded)


def _published_tables(manifest: dict[str, Any]) -> list[str]:
    """The tables a (verified) manifest publishes: those it names in ``tables`` (a table without
    rows has no file) and those its files are under (a manifest written before it named tables)."""
    named = manifest.get("tables", [])
    if not isinstance(named, list) or not all(isinstance(name, str) for name in named):
        raise RemoteError("manifest.json: tables is not a list of table names")
    with_files = {item.path.split("/")[1] for item in _manifest_entries(manifest)}
    return sorted(set(named) | with_files)


def _views_of_tables(tables: Sequence[str]) -> list[str]:
    """The ledger tables a copy of ``tables`` has views of (``tables_of``'s rule: every table, but a
    table added later only where the copy names it); a name this runledger does not know has none."""
    return [name for name in TABLES if name not in ADDED_TABLES or name in tables]


# ------------------------------------------------------------------------------- query --remote --direct

# A manifest path DuckDB reads by URL as it is: no glob characters, nothing to percent-encode.
_PLAIN_PATH = re.compile(r"data/[A-Za-z0-9._=/-]+\.parquet")


@dataclass
class DirectAnswer:
    """An answer read by DuckDB straight from the published files, as of ``checkpoint``."""

    result: Result
    checkpoint: Checkpoint
    manifest_log_size: int
    files: int  # data files the views name


def _direct_views(source: Source, manifest: dict[str, Any], files: Sequence[str]) -> str:
    """The local ledger's views (``runledger.ledger.views.named_views``) over the manifest's files by URL (a
    list, never a glob: DuckDB cannot glob over HTTP, and a glob would read files the manifest does
    not name); a table without files is empty."""
    by_table: dict[str, list[str]] = {name: [] for name in _views_of_tables(_published_tables(manifest))}
    for rel in files:
        if not _PLAIN_PATH.fullmatch(rel):
            raise RemoteError(f"manifest path {rel!r} cannot be read by URL as it is: query without --direct")
        table = rel.split("/")[1]
        if table in by_table:  # (a table this runledger does not know, or a side table: no view)
            by_table[table].append(source.url_of(rel))
    return named_views({name: files_or_empty(name, urls) for name, urls in by_table.items()})


def query_direct(
    url: str,
    log_key: str,
    statement: str,
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    limits: QueryLimits | None = None,
) -> DirectAnswer:
    """One read-only statement run by DuckDB (httpfs) on the published Parquet files by URL, no
    download. The checkpoint and manifest are verified (fetched within ``deadline_s`` seconds); the
    data bytes are not (DuckDB reads only the ranges it needs and cannot check them against the
    manifest's SHA-256). ``limits``: the statement's timeout and memory limit (nothing spills: no
    local folder is allowed)."""
    bounds = limits if limits is not None else QueryLimits()
    source = open_source(url, deadline_s=deadline_s)
    checkpoint, manifest_size, manifest = _signed_manifest(source, log_key)
    files = sorted(_manifest_files(manifest))
    if not files:
        raise RemoteError("the signed manifest names no data files")
    if isinstance(source, HttpSource) and not source.answers_ranges(files[0]):
        raise RemoteError(
            f"{source.name} does not answer Range requests (DuckDB needs them to read Parquet by URL): "
            "query without --direct, or serve the copy with a server that does (scripts/http.sh)"
        )
    views = _direct_views(source, manifest, files)
    try:
        con = duck.connect(extensions=["httpfs"])
    except duck.ExtensionMissing as exc:
        raise RemoteError(f"--direct needs DuckDB's httpfs: {exc}") from None
    try:
        if isinstance(source, S3Source):
            create_s3_secret(con, source.dest.config, "runledger_copy")
        con.execute("SET TimeZone = 'UTC'")
        con.execute(views)
        con.execute(limits_sql(bounds, None) + "SET temp_directory = '';\n")
        con.execute(_lock_to([source.url_of(rel) for rel in files]))
        return DirectAnswer(_answer(con, statement, bounds), checkpoint, manifest_size, len(files))
    finally:
        con.close()


def _lock_to(urls: Sequence[str]) -> str:
    """``runledger.ledger.sql_guard``'s lock, with the manifest's files the only ones DuckDB may read: exact
    paths, not a URL prefix (a prefix would let ``…/copy/../elsewhere`` through to the server)."""
    quoted = ", ".join("'" + u.replace("'", "''") + "'" for u in urls)
    return (
        f"SET allowed_paths = [{quoted}];\n"
        "SET enable_external_access = false;\n"
        "SET autoinstall_known_extensions = false;\n"
        "SET autoload_known_extensions = false;\n"
        "SET allow_community_extensions = false;\n"
        "SET lock_configuration = true;\n"
    )
