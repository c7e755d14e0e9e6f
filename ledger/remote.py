"""A published copy of the ledger (``ledger publish``), checked and read by anyone who has only its URL.

* ``verify_remote``: ``ledger verify --remote URL``. The monitor's check (``ledger.monitor.check_log``
  with ``entries``): the checkpoint's signature and cosignature quorum, its consistency with the last
  checkpoint verified from here, every entry new since then against the signed root, and each data
  file of the signed manifest not verified before. One tile, one bundle and one 1 MiB block of a data
  file in memory at a time; the state (the last verified checkpoint, the files checked) is on disk.
* ``tlog-proof``: an offline proof (C2SP tlog-proof@v1) that an event's entry is in the published
  whole-ledger log: the entry itself as the ``extra`` line, its index, the RFC 6962 audit path and
  the checkpoint verbatim. ``verify_tlog_proof`` needs only the proof and the log's key.
* ``fetch_copy`` + ``RemoteCopy.sql``: ``ledger query --remote URL``. A verified download, not HTTP
  range reads: DuckDB's httpfs extension cannot be installed or loaded here (and the read-only walls
  of ``ledger.sql_guard`` forbid loading extensions), so the Parquet files the signed manifest names
  are downloaded into a local cache, each checked against its SHA-256, and queried through the same
  locked views a local ledger gets.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb

from ledger.log_checkpoint import Checkpoint, parse_and_verify_checkpoint
from ledger.merkle import HASH_SIZE, ProofError, leaf_hash, verify_inclusion
from ledger.monitor import MonitorReport, check_log
from ledger.parquet_schemas import tables_of
from ledger.publish import load_published
from ledger.query import QueryError, Result
from ledger.sql_guard import RefusedStatement, lock_connection, read_only_statement
from ledger.store import COMMITS, Ledger
from ledger.tiles import (
    TILE_WIDTH,
    decode_bundle,
    entries_path,
    inclusion_proof_from_tiles,
    tile_path,
    tile_width,
)
from ledger.views import connect
from schemas.durable import write_durably
from schemas.note import CheckpointError, decode_canonical_base64, open_note

__all__ = [
    "TLOG_PROOF_HEADER",
    "ProvenEntry",
    "RemoteCopy",
    "RemoteError",
    "default_state_path",
    "fetch_copy",
    "format_tlog_proof",
    "prove_published",
    "verify_remote",
    "verify_tlog_proof",
]

TLOG_PROOF_HEADER = "c2sp.org/tlog-proof@v1"
_DECIMAL = re.compile(r"0|[1-9][0-9]*")
_TIMEOUT_S = 10
_MAX_SMALL_BYTES = 16 << 20  # a manifest or its signature: far smaller
_BLOCK_BYTES = 1 << 20


class RemoteError(ValueError):
    """A published copy or a proof that does not check out, said in one line."""


def _base(url: str) -> str:
    return url if url.endswith("/") else url + "/"


def default_state_path(url: str, under: Path = Path(".runledger/remote-verify")) -> Path:
    """Where ``verify --remote`` keeps the last checkpoint it verified of the copy at ``url``."""
    return under / (hashlib.sha256(_base(url).encode()).hexdigest()[:16] + ".json")


def verify_remote(
    url: str, log_key: str, state: Path, *, witnesses: Sequence[str] = (), quorum: int = 0
) -> MonitorReport:
    """Check what is new in the copy at ``url`` since the last checkpoint verified (state in ``state``).
    MonitorError (with its kind) on anything that does not match the signed log."""
    return check_log(url, log_key, state, witnesses=witnesses, quorum=quorum, entries=True)


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


def prove_published(root: Path, dest: Path, event_id: str, source: str | None = None) -> str:
    """The tlog-proof of event ``event_id``'s entry in the log last published from ``root`` to the
    folder ``dest``, at its published checkpoint (the entry is the proof's ``extra``)."""
    from ledger.query import Reader

    Ledger.open(root)
    where, params = "id = ?", [event_id]
    if source:
        where, params = where + " AND source = ?", [event_id, source]
    found = Reader(root).sql(f"SELECT stream, stream_seq FROM events WHERE {where}", params).rows
    if len(found) != 1:
        raise RemoteError(
            f"no event with id {event_id!r}"
            if not found
            else f"{len(found)} events have id {event_id!r}; name one with --source"
        )
    (stream, seq), published = found[0], load_published(root, dest)
    index = published.leaf_of(stream, seq)
    if index is None or not published.checkpoint:
        raise RemoteError(f"event {event_id} is not in the log published to {dest}: run `ledger publish`")

    def read_tile(level: int, n: int, width: int) -> bytes:
        return (dest / tile_path(level, n, width)).read_bytes()

    size = published.size
    width = tile_width(0, index // TILE_WIDTH, size)
    entry = decode_bundle((dest / entries_path(index // TILE_WIDTH, width)).read_bytes(), width)[
        index % TILE_WIDTH
    ]
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


# ------------------------------------------------------------------------------- query --remote


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            data: bytes = response.read(_MAX_SMALL_BYTES + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise RemoteError(f"unreachable: {url}: {exc}") from None
    if len(data) > _MAX_SMALL_BYTES:
        raise RemoteError(f"{url} is larger than {_MAX_SMALL_BYTES} bytes")
    return data


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(url: str, target: Path, sha256: str) -> None:
    """``url`` into ``target``, kept only if its bytes have the signed SHA-256."""
    part = target.with_name(target.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response, part.open("wb") as out:
            for block in iter(lambda: response.read(_BLOCK_BYTES), b""):
                digest.update(block)
                out.write(block)
    except (urllib.error.URLError, OSError) as exc:
        part.unlink(missing_ok=True)
        raise RemoteError(f"unreachable: {url}: {exc}") from None
    if digest.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise RemoteError(f"{url} does not match its SHA-256 in the signed manifest")
    part.replace(target)


@dataclass
class RemoteCopy:
    """A verified local copy of a published ledger's data files, as of ``checkpoint``."""

    folder: Path
    checkpoint: Checkpoint
    manifest_log_size: int
    downloaded: int  # files fetched this time (the rest were in the cache, their digests rechecked)

    def sql(self, statement: str) -> Result:
        """One read-only statement over the copy, through the views and walls of a local ledger."""
        con = connect(self.folder)
        try:
            lock_connection(con, [self.folder / name for name in tables_of(self.folder)])
            try:
                query = read_only_statement(con, statement)
            except RefusedStatement as exc:
                raise QueryError(str(exc)) from None
            try:
                rel = con.execute(query)
                return Result([d[0] for d in rel.description or []], rel.fetchall())
            except duckdb.Error as exc:  # outside the copy's folders included: one line, as locally
                raise QueryError(str(exc).splitlines()[0]) from None
        finally:
            con.close()


def _signed_manifest(base: str, log_key: str) -> tuple[Checkpoint, int, dict]:
    try:
        checkpoint = parse_and_verify_checkpoint(_fetch(base + "checkpoint"), log_key)
        signed = open_note(_fetch(base + "manifest.sig"), log_key).split("\n")
    except CheckpointError as exc:
        raise RemoteError(f"bad signature: {exc}") from None
    manifest = _fetch(base + "manifest.json")
    digest = base64.b64encode(hashlib.sha256(manifest).digest()).decode()
    if signed[0] != checkpoint.origin + "/manifest" or signed[2] != digest:
        raise RemoteError("manifest.json is not the manifest signed in manifest.sig for this log")
    if not _DECIMAL.fullmatch(signed[1]) or int(signed[1]) > checkpoint.size:
        raise RemoteError("manifest.sig names a log size beyond the signed checkpoint")
    return checkpoint, int(signed[1]), json.loads(manifest)


def fetch_copy(url: str, log_key: str, cache: Path) -> RemoteCopy:
    """Download (into ``cache``, only what it lacks) every data file the signed manifest of the copy
    at ``url`` names, each checked against its SHA-256; files no longer named are removed from the
    cache, so the views see exactly the published snapshot."""
    base = _base(url)
    checkpoint, manifest_size, manifest = _signed_manifest(base, log_key)
    if manifest.get("origin") != checkpoint.origin:
        raise RemoteError("manifest.json names another log's origin")
    folder = cache / hashlib.sha256(base.encode()).hexdigest()[:16]
    wanted: dict[Path, str] = {}
    for item in manifest["files"]:
        rel = str(item["path"])
        if not rel.startswith("data/") or ".." in Path(rel).parts:
            raise RemoteError(f"manifest path {rel!r} is not under data/")
        wanted[folder / rel.removeprefix("data/")] = str(item["sha256"])
    downloaded = 0
    for target, sha256 in wanted.items():
        if _sha256(target) != sha256:
            _download(base + "data/" + str(target.relative_to(folder)), target, sha256)
            downloaded += 1
    for old in folder.rglob("*.parquet"):
        if old not in wanted:
            old.unlink()  # merged away by a compaction: its rows are in a file still named
    tables = sorted({str(t.relative_to(folder)).split("/", 1)[0] for t in wanted})
    write_durably(folder / "LEDGER.json", json.dumps({"tables": tables, "origin": checkpoint.origin}))
    (folder / COMMITS).mkdir(exist_ok=True)  # none: so a ``Reader`` opens the copy (no merge to wait for)
    return RemoteCopy(folder, checkpoint, manifest_size, downloaded)
