"""`ledger publish DEST`: the whole ledger as one public C2SP tlog-tiles log, plus its Parquet files.

DEST is a folder any static HTTP server can serve, or ``s3://bucket/prefix`` on an S3-compatible
server (``runledger.ledger.publish_dest``: endpoint and credentials from the AWS_* variables); either holds::

    checkpoint                          signed note (origin ``runledger/<ledger id>``, size, root)
    tile/<L>/<N>[.p/<W>]                hash tiles (``runledger.ledger.tiles``)
    tile/entries/<N>[.p/<W>]            entry bundles
    data/<table>/<partition>/part-*.parquet   the ledger's live Parquet files, byte for byte
    manifest.json, manifest.sig         those files (path, bytes, SHA-256, leaf range), and a signed
                                        note over the manifest's SHA-256 at the log size it is as of

**One log for the whole ledger.** Its entries, in ledger order (commit by commit; in a commit, by
stream then stream position), are compact JSON records (sorted keys, at most 64 KiB):

* ``{"t": "event", ...}`` for each event: commit, stream, stream_seq, source, id, type, the
  producer's key_id and sig, and ``salted_sha256``: SHA-256 of the event's random 16-byte salt
  (``data/salts/``) followed by its canonical bytes (the payload stays in Parquet). An event stored
  before the ledger drew salts has ``sha256`` of its canonical bytes instead (unsalted). An event
  redacted before its first publish gets the entry it would have had (its redaction marker keeps
  the digest, key id and signature), so ``ledger redact`` never changes what a log says;
* ``{"t": "commit", ...}`` after each commit's events: the files it added and removed, and the
  (size, root) of each stream tree it moved, so the per-stream checkpoints signed before stay
  checkable against the one log;
* ``{"t": "snapshot", ...}`` at the end of each publish: the SHA-256 of the manifest, so the table
  snapshot is named by a leaf (never by a checkpoint extension line).

**Write order (Sunlight's).** The trusted state (the last published checkpoint) lives beside the
ledger in ``<ledger>/_publish/<dest id>/``, not in DEST. A publish stages every new file there,
checks that the new tree extends the published one (the old root recomputed from the new tiles,
and an RFC 6962 consistency proof verified), then swaps the signed checkpoint in the state file
(the commit point), then uploads the staged files, the checkpoint last. Killed before the swap, the
staging is thrown away and done again; killed after, the next publish finishes the upload first.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from runledger.ledger.lake import fetch_object, is_s3
from runledger.ledger.log_checkpoint import parse_checkpoint, sign_checkpoint
from runledger.ledger.merkle import EMPTY_ROOT, CompactRange, leaf_hash, verify_consistency
from runledger.ledger.parquet_footer import FooterError, copy_without_trailing_columns
from runledger.ledger.parquet_schemas import SIDE_TABLES, tables_of
from runledger.ledger.publish_dest import Dest, FolderDest, open_dest
from runledger.ledger.records import commit_record_paths
from runledger.ledger.redaction import entry_digest, is_redacted, read_marker
from runledger.ledger.store import SALTS, Ledger
from runledger.ledger.stored_files import lake_file_list, recorded_sha256
from runledger.ledger.tiles import (
    MAX_ENTRY_BYTES,
    TILE_WIDTH,
    TileError,
    check_bundle,
    consistency_proof_from_tiles,
    encode_bundle,
    entries_path,
    grow_tiles,
    root_from_tiles,
    root_of_prefix,
    tile_path,
)
from runledger.ledger.views import files_or_empty, named_views
from runledger.ledger.witness import collect_cosignatures, load_policy
from runledger.schemas.durable import write_durably
from runledger.schemas.note import NoteSigner, open_note, parse_private_key, sign_note

__all__ = ["PublishError", "PublishResult", "load_published", "log_origin", "publish"]

STATE_DIR = "_publish"
CHECKPOINT = "checkpoint"
MANIFEST = "manifest.json"
MANIFEST_SIG = "manifest.sig"
DATA = "data"
LAKE_COPIES = "lake-files"  # under _publish/: merged lake files without DuckLake's own columns
LAKE_INTERNAL = "_ducklake_internal_"
EVENTS_PER_PASS = 50_000  # events read, built into entries and staged at a time (~100 MB at 2 KB each)


class PublishError(ValueError):
    """The publish cannot go on without risking a wrong or inconsistent public log."""


def log_origin(ledger_id: str) -> str:
    """The origin line of a ledger's one public log (per-stream checkpoints add ``/<stream>``)."""
    return f"runledger/{ledger_id}"


@dataclass
class PublishState:
    """What was last published to one DEST: the trusted side of the write order."""

    size: int = 0
    root: bytes = EMPTY_ROOT
    checkpoint: str = ""
    commit: int = -1  # the last ledger commit in the log
    segments: dict[str, list[list[int]]] = field(default_factory=dict)  # stream -> [first seq, first leaf, n]
    commit_leaves: dict[str, list[int]] = field(
        default_factory=dict
    )  # commit -> [first leaf, its record's leaf]
    live: list[str] = field(default_factory=list)  # the ledger's live files as of ``commit``
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # rel path -> bytes, sha256, leaf_range
    pending: bool = False  # swapped, upload not finished
    removed: list[str] = field(default_factory=list)  # data files to delete from DEST after the upload
    witness_sizes: dict[str, int] = field(default_factory=dict)  # the size each witness last cosigned

    def to_json(self) -> dict[str, Any]:
        doc = dict(self.__dict__)
        doc["root"] = base64.b64encode(self.root).decode()
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PublishState:
        known = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        return cls(**(known | {"root": base64.b64decode(doc["root"])}))

    def leaf_of(self, stream: str, seq: int) -> int | None:
        """The log leaf of event ``seq`` of ``stream`` (None: not published yet)."""
        return _leaf_of(self.segments, stream, seq)


@dataclass
class PublishResult:
    size: int
    old_size: int
    entries: int  # entries this publish added
    events: int
    files_copied: int
    repaired: bool  # an interrupted upload was finished first
    checkpoint: str
    witnesses: dict[str, str] = field(default_factory=dict)  # witness -> what it answered


# -------------------------------------------------------------------------------------------- files


@dataclass(frozen=True)
class _Stored:
    """The ledger's live Parquet files, each named as DEST names it under ``data/``:
    ``<table>/<column>=<value>/<file>.parquet``. Part files are that path under the ledger folder; a
    ledger on DuckLake is read at one snapshot (``lake``: name -> the file DuckLake lists), its files
    holding their partition column themselves (so they are read without hive partitioning)."""

    root: Path
    lake: dict[str, Path] | None = None
    snapshot: int | None = None  # the lake snapshot ``lake`` lists: records up to it are published
    kept: tuple[str, ...] = ()  # the ledger's tables (a lake's, from its marker; else LEDGER.json's)

    def path(self, rel: str) -> Path:
        return self.root / rel if self.lake is None else self.lake[rel]

    @property
    def partitioning(self) -> str | None:
        return "hive" if self.lake is None else None

    def live_after(self, live: Sequence[str], records: Iterable[dict[str, Any]]) -> list[str]:
        return _live_files(self.root, live, records) if self.lake is None else sorted(self.lake)

    @property
    def tables(self) -> list[str]:
        """Every table the copy publishes, those without rows (so without files) included: readers
        answer such a table as empty, with its schema, rather than as missing."""
        kept = self.kept or tuple(tables_of(self.root))
        return [*kept, *(name for name in SIDE_TABLES if name not in kept)]


def _lake_name(table: str, path: str) -> str:
    """``<table>/<column>=<value>/<file>`` of a lake's data file (``…/main/<table>/<col>=<v>/<file>``)."""
    parts = PurePosixPath(path).parts
    at = [i for i, part in enumerate(parts) if part == table]
    rel = parts[at[-1] :] if at else ()
    if len(rel) != 3 or "=" not in rel[1]:
        raise PublishError(f"lake file {path} is not under <table>/<column>=<value>/ (table {table})")
    return "/".join(rel)


def _lake_stored(ledger: Ledger) -> _Stored:
    """The lake's files at its newest snapshot (pinned first: the records are synced after it, so
    every file listed has its commit's record here). Objects of an ``s3://`` data path are fetched
    once into ``_publish/lake-files/`` and each checked against the SHA-256 its record names."""
    assert ledger.lake is not None and ledger.lake_folder is not None
    copies = ledger.root / STATE_DIR / LAKE_COPIES
    listed: list[tuple[str, str, str]] = []  # (table, data file, its name under data/)
    with ledger.lake.reader() as con:
        for table in [*ledger.lake_folder.tables, *SIDE_TABLES]:
            for data_file, delete_file in lake_file_list(con, table):
                if delete_file:  # a raw reader would count the deleted rows: the ledger never deletes
                    raise PublishError(
                        f"lake file {data_file} has deleted rows ({delete_file}): not publishable"
                    )
                listed.append((table, data_file, _lake_name(table, data_file)))
        snapshot = con.snapshot
    ledger.sync_lake_records()
    remote = is_s3(ledger.lake.data_path)
    recorded = recorded_sha256(ledger) if remote else {}
    files: dict[str, Path] = {}
    for table, data_file, rel in listed:
        copy = copies / rel
        if not remote:
            files[rel] = _without_lake_columns(Path(data_file), copy)
        elif copy.exists():  # fetched by an earlier publish (object names are fresh UUIDs, never rewritten)
            files[rel] = copy
        else:
            want = recorded.get((table, PurePosixPath(data_file).name))
            fetched = _fetched(data_file, copy.with_name(copy.name + ".fetched"), want)
            files[rel] = _without_lake_columns(fetched, copy, move=True)
    return _Stored(ledger.root, files, snapshot, ledger.lake_folder.tables)


def _fetched(url: str, target: Path, want: str | None) -> Path:
    """An object of the lake's ``s3://`` data path downloaded to ``target``, its bytes the ones its
    commit record names."""
    got = fetch_object(url, target)
    if want is not None and got != want:
        target.unlink(missing_ok=True)
        raise PublishError(f"lake object {url} is not the bytes its commit recorded (SHA-256 {got[:16]}…)")
    return target


def _drop_old_copies(folder: Path, live: set[Path]) -> None:
    """Delete the copies of files the lake merged away since (a publish staged them as links)."""
    for path in folder.rglob("*.parquet") if folder.exists() else ():
        if path not in live:
            path.unlink(missing_ok=True)


def _without_lake_columns(path: Path, copy: Path, *, move: bool = False) -> Path:
    """The file as outside engines should read it. DuckLake's merge keeps each row's lineage in
    columns of its own (``_ducklake_internal_row_id``, ...) that a raw reader would take for the
    table's: such a file is published as a copy without them (written once to ``copy``, a row group
    at a time); every other file is published as it is, byte for byte. ``move``: ``path`` is a
    download of the publish's own, moved to ``copy`` (or deleted once copied)."""
    if copy.exists():  # lake file names are fresh UUIDs and never rewritten: a copy made once holds
        return copy
    copy.parent.mkdir(parents=True, exist_ok=True)
    try:  # DuckLake's lineage columns come last: a footer that no longer names them hides them
        hidden = copy_without_trailing_columns(path, copy, LAKE_INTERNAL)
    except FooterError:
        hidden = _reencoded_without_lake_columns(path, copy)
    if not hidden:
        return path.replace(copy) if move else path
    if move:
        path.unlink()
    return copy


def _reencoded_without_lake_columns(path: Path, copy: Path) -> bool:
    """``_without_lake_columns`` for a footer ``runledger.ledger.parquet_footer`` does not rewrite:
    the file read and written again without the lineage columns (False, nothing written: none)."""
    source = pq.ParquetFile(path)
    names = source.schema_arrow.names
    keep = [n for n in names if not n.startswith(LAKE_INTERNAL)]
    if len(keep) == len(names):
        return False
    tmp = copy.with_name(copy.name + ".tmp")
    schema = pa.schema([source.schema_arrow.field(n) for n in keep])
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for group in range(source.num_row_groups):
            writer.write_table(source.read_row_group(group, columns=keep))
    os.replace(tmp, copy)
    return True


# -------------------------------------------------------------------------------------------- entries


class _Signed(msgspec.Struct):
    key_id: str | None = None
    signature: str | None = None


_decode_signed = msgspec.json.Decoder(_Signed)


def _entry(doc: dict[str, Any]) -> bytes:
    """Compact JSON, keys sorted, UTF-8: one byte string per record."""
    return msgspec.json.encode(doc, order="sorted")


def _event_entry(row: dict[str, Any], salt: bytes | None = None) -> bytes:
    """An event's entry: its digest salted when it has a salt (``salted_sha256``), else ``sha256``."""
    text: str = row["canonical"]
    if is_redacted(text):  # erased before this publish: the digest and signature its marker kept
        marked = read_marker(text)
        key_id, sig = marked.get("key_id"), marked.get("sig")
        digest: dict[str, Any] = {k: marked[k] for k in ("salted_sha256", "sha256") if k in marked}
    else:
        canonical = text.encode()
        signed = _decode_signed.decode(canonical)
        key_id, sig = signed.key_id, signed.signature
        field = "salted_sha256" if salt is not None else "sha256"
        digest = {field: entry_digest(canonical, salt)}  # one of the two fields, never both
    return _entry(
        {
            "t": "event",
            "commit": row["commit"],
            "stream": row["stream"],
            "stream_seq": row["stream_seq"],
            "source": row["source"],
            "id": row["id"],
            "type": row["type"],
            "key_id": key_id,
            "sig": sig,
            **digest,
        }
    )


def _commit_entry(record: dict[str, Any]) -> bytes:
    moved = record.get("appended", {})
    streams = {
        s: [h["size"], base64.b64encode(CompactRange.from_json(h["tree"]).root()).decode()]
        for s, h in record["streams"].items()
        if s in moved
    }
    doc = {
        "t": "commit",
        "commit": record["commit"],
        "files": record["files"],
        "removed": record.get("removed", []),
        "streams": streams,
    }
    data = _entry(doc)
    if len(data) > MAX_ENTRY_BYTES:  # a huge compaction: name its file lists by digest
        for key in ("files", "removed", "streams"):
            doc[key + "_sha256"] = hashlib.sha256(_entry({key: doc.pop(key)})).hexdigest()
        data = _entry(doc)
    return data


def _new_event_entries(
    stored: _Stored, live: Sequence[str], after_commit: int, last_commit: int
) -> list[tuple[int, str, int, bytes]]:
    """(commit, stream, stream_seq, entry) of the events of commits (``after_commit``, ``last_commit``],
    in ledger order (commit, stream, stream_seq); a commit made meanwhile waits for the next publish.

    Each row becomes its ~250-byte entry as it is read, a batch at a time, and only the entries are
    sorted: the canonical JSON (an expert-count event is ~100 KB) is never held for a whole group."""
    files = [str(stored.path(rel)) for rel in live if rel.startswith("events/")]
    if not files:
        return []
    salts = _new_salts(stored, live, after_commit, last_commit)
    dataset = ds.dataset(files, format="parquet", partitioning=stored.partitioning)
    columns = ["commit", "stream", "stream_seq", "source", "id", "type", "canonical"]
    wanted = (ds.field("commit") > after_commit) & (ds.field("commit") <= last_commit)
    keyed = []
    # One batch of one file read ahead: Arrow's default (16 batches from 4 files) held ~300 MB of JSON.
    for batch in dataset.to_batches(
        columns=columns, filter=wanted, batch_size=1024, batch_readahead=1, fragment_readahead=1
    ):
        for row in batch.to_pylist():
            data = _event_entry(row, salts.get((row["stream"], row["stream_seq"])))
            if len(data) > MAX_ENTRY_BYTES:
                raise PublishError(f"event {row['source']} {row['id']}: its log entry exceeds 64 KiB")
            keyed.append((row["commit"], row["stream"], row["stream_seq"], data))
    keyed.sort(key=lambda k: k[:3])
    return keyed


def _new_salts(
    stored: _Stored, live: Sequence[str], after_commit: int, last_commit: int
) -> dict[tuple[str, int], bytes]:
    """(stream, stream_seq) -> salt, of the events of commits (``after_commit``, ``last_commit``]."""
    files = [str(stored.path(rel)) for rel in live if rel.startswith(f"{SALTS.name}/")]
    if not files:
        return {}
    wanted = (ds.field("commit") > after_commit) & (ds.field("commit") <= last_commit)
    table = ds.dataset(files, format="parquet", partitioning=stored.partitioning).to_table(
        columns=["stream", "stream_seq", "salt"], filter=wanted
    )
    columns = (table[c].to_pylist() for c in ("stream", "stream_seq", "salt"))
    return {(stream, seq): salt for stream, seq, salt in zip(*columns, strict=True) if salt is not None}


class _Appended(msgspec.Struct):
    leaves: str = ""  # base64 of the appended leaves' hashes, 32 bytes each


class _CommitRecord(msgspec.Struct):
    """What a publish reads of a commit record (its per-event ids, ~700 B an event, are skipped)."""

    commit: int
    files: list[str] = []
    removed: list[str] = []
    streams: dict[str, Any] = {}
    appended: dict[str, _Appended] = {}
    lake: dict[str, Any] | None = None  # a ledger on DuckLake: the snapshot the commit made
    lake_files: list[dict[str, Any]] = []  # ... and the data files it added (table, path, sha256)


_decode_record = msgspec.json.Decoder(_CommitRecord)


def _read_commits(stored: _Stored, after: int) -> list[dict[str, Any]]:
    """The commit records after ``after`` (on a lake, up to its snapshot), each with what a publish
    reads: its files, removed files, stream heads, and per appended stream the count of its events."""
    records = []
    for path in commit_record_paths(stored.root):
        if int(path.stem) > after:
            r = _decode_record.decode(path.read_bytes())
            files = r.files
            if stored.snapshot is not None:
                if r.lake is None or int(r.lake["snapshot"]) > stored.snapshot:
                    break  # committed after the snapshot publish reads: the next publish's
                files = [_lake_name(f["table"], f["path"]) for f in r.lake_files]
            appended = {s: {"events": len(base64.b64decode(a.leaves)) // 32} for s, a in r.appended.items()}
            records.append(
                {
                    "commit": r.commit,
                    "files": files,
                    "removed": r.removed,
                    "streams": r.streams,
                    "appended": appended,
                }
            )
    return records


def _live_files(root: Path, live: Sequence[str], records: Iterable[dict[str, Any]]) -> list[str]:
    """The ledger's live Parquet files after ``records``: each commit's files in, its removed out
    (the empty file every table starts with is not in any commit)."""
    files = set(live) or {str(p.relative_to(root)) for p in root.glob("*/*=_/part-0000000000-000.parquet")}
    for record in records:
        files.difference_update(record.get("removed", []))
        files.update(record["files"])
    return sorted(files)


def _build_entries(
    stored: _Stored, state: PublishState, records: list[dict[str, Any]], live_after: list[str]
) -> tuple[list[bytes], int]:
    """The entries of ``records`` (their events, then a commit entry each), updating the state's
    stream segments and commit leaf ranges. Returns (entries, events)."""
    entries: list[bytes] = []
    by_commit: dict[int, list[tuple[int, str, int, bytes]]] = {}
    for keyed in _new_event_entries(stored, live_after, state.commit, records[-1]["commit"]):
        by_commit.setdefault(keyed[0], []).append(keyed)
    events = 0
    for record in records:
        first_leaf = state.size + len(entries)
        for _commit, stream, seq, data in by_commit.pop(record["commit"], []):
            _note_leaf(state.segments, stream, seq, state.size + len(entries))
            entries.append(data)
            events += 1
        entries.append(_commit_entry(record))
        state.commit_leaves[str(record["commit"])] = [first_leaf, state.size + len(entries) - 1]
    return entries, events


def _note_leaf(segments: dict[str, list[list[int]]], stream: str, seq: int, leaf: int) -> None:
    runs = segments.setdefault(stream, [])
    if runs and runs[-1][0] + runs[-1][2] == seq and runs[-1][1] + runs[-1][2] == leaf:
        runs[-1][2] += 1
    else:
        runs.append([seq, leaf, 1])


def _leaf_of(segments: dict[str, list[list[int]]], stream: str, seq: int) -> int | None:
    for first_seq, first_leaf, count in segments.get(stream, []):
        if first_seq <= seq < first_seq + count:
            return first_leaf + seq - first_seq
    return None


# -------------------------------------------------------------------------------------------- manifest


def _leaf_range(path: Path, state: PublishState) -> list[int] | None:
    """[first, last] log leaf that the rows of a Parquet file come from (None: no rows)."""
    table = pq.read_table(
        path, columns=[c for c in ("stream", "stream_seq", "commit") if c in _columns(path)]
    )
    if table.num_rows == 0:
        return None
    leaves: list[int] = []
    if "stream_seq" in table.column_names:
        spans = table.group_by("stream").aggregate([("stream_seq", "min"), ("stream_seq", "max")])
        for stream, lo, hi in zip(
            *(spans.column(c).to_pylist() for c in ("stream", "stream_seq_min", "stream_seq_max")),
            strict=True,
        ):
            leaves += [
                x
                for x in (_leaf_of(state.segments, stream, lo), _leaf_of(state.segments, stream, hi))
                if x is not None
            ]
    elif "commit" in table.column_names:  # quarantine: the commit's span of the log
        for commit in (min(table.column("commit").to_pylist()), max(table.column("commit").to_pylist())):
            leaves += state.commit_leaves.get(str(commit), [])
    return [min(leaves), max(leaves)] if leaves else None


def _columns(path: Path) -> list[str]:
    return list(pq.read_schema(path).names)


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _manifest(stored: _Stored, state: PublishState, live: list[str], origin: str, log_size: int) -> bytes:
    """The manifest of the live files (each described once: files never change once named)."""
    files: dict[str, dict[str, Any]] = {}
    for rel in live:
        path = stored.path(rel)
        known = state.files.get(rel)
        if known is None:
            if not path.exists():
                raise PublishError(
                    f"{rel} was removed while publishing (a compaction ran?); run publish again"
                )
            known = {
                "bytes": path.stat().st_size,
                "sha256": _sha256_file(path),
                "leaf_range": _leaf_range(path, state),
            }
        files[rel] = known
    state.files = files
    doc = {
        "origin": origin,
        "log_size": log_size,
        "commit": state.commit,
        "tables": stored.tables,  # a table named here without files has no rows
        "files": [
            {"path": f"{DATA}/{rel}", "table": rel.split("/", 1)[0], **meta}
            for rel, meta in sorted(files.items())
        ],
    }
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


def _views_sql(tables: Sequence[str], live: Sequence[str]) -> bytes:
    """``views.sql``: the names ``ledger query`` answers with, one meaning each (``runledger.ledger.views.
    named_views``: the stored rows as ``_metrics`` and ``lake.metrics``, the de-duplicated ones as
    ``metrics``), over the published files (paths relative to DEST: ``cd DEST && duckdb -init
    views.sql``, or prefix them with the base URL for httpfs); a table without files is empty."""
    by_table: dict[str, list[str]] = {name: [] for name in tables}
    for rel in live:
        by_table.setdefault(rel.split("/", 1)[0], []).append(f"{DATA}/{rel}")
    stored = {name: files_or_empty(name, paths) for name, paths in by_table.items()}
    header = "-- runledger views over a published copy: run duckdb from this folder: duckdb -init views.sql\n"
    return (header + named_views(stored) + "\n").encode()


def _manifest_note(origin: str, log_size: int, manifest: bytes, signer: NoteSigner) -> str:
    digest = base64.b64encode(hashlib.sha256(manifest).digest()).decode()
    return sign_note(f"{origin}/manifest\n{log_size}\n{digest}\n", signer)


# -------------------------------------------------------------------------------------------- staging


class _Files:
    """DEST as a reader, with the staged files laid over it."""

    def __init__(self, dest: Dest, staged: Path) -> None:
        self.dest, self.staged = dest, staged

    def read(self, rel: str) -> bytes:
        with contextlib.suppress(FileNotFoundError):
            return (self.staged / rel).read_bytes()
        with contextlib.suppress(FileNotFoundError):
            return self.dest.read(rel)
        raise PublishError(f"{self.dest.name} lacks {rel}: it is not the log published from this ledger")

    def read_tile(self, level: int, index: int, width: int) -> bytes:
        return self.read(tile_path(level, index, width))

    def put(self, rel: str, data: bytes) -> None:
        path = self.staged / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _commit_groups(records: list[dict[str, Any]], max_events: int) -> Iterator[list[dict[str, Any]]]:
    """``records`` in consecutive groups of at most ``max_events`` events each (a bigger commit alone):
    a publish reads, builds and stages one group at a time, so its memory does not grow with the log."""
    group: list[dict[str, Any]] = []
    count = 0
    for record in records:
        n = sum(a["events"] for a in record.get("appended", {}).values())
        if group and count + n > max_events:
            yield group
            group, count = [], 0
        group.append(record)
        count += n
    if group:
        yield group


def _stage_growth(files: _Files, old_size: int, entries: list[bytes]) -> None:
    """The tiles and bundles of a tree of ``old_size`` leaves grown by ``entries`` (the old partial
    tiles and bundle read from the staged files first, then DEST)."""
    for tile in grow_tiles(old_size, [leaf_hash(e) for e in entries], files.read_tile):
        files.put(tile.path, tile.data)
    _stage_bundles(files, old_size, entries)


def _drop_passing_partials(staged: Path, size: int) -> None:
    """Staged partial tiles and bundles of the sizes a publish passed through between its groups: only
    the partials of the size it checkpoints are published (C2SP keeps one per checkpointed size)."""
    keep = {entries_path(size // TILE_WIDTH, size % TILE_WIDTH)} if size % TILE_WIDTH else set()
    level, count = 0, size
    while count:
        if count % TILE_WIDTH:
            keep.add(tile_path(level, count // TILE_WIDTH, count % TILE_WIDTH))
        level, count = level + 1, count // TILE_WIDTH
    for path in (staged / "tile").rglob("*"):
        partial = path.is_file() and path.parent.name.endswith(".p")
        if partial and path.relative_to(staged).as_posix() not in keep:
            path.unlink()


def _stage_bundles(files: _Files, old_size: int, entries: list[bytes]) -> None:
    """The entry bundles the new entries fill or extend (the old partial bundle's entries first,
    checked against the old tree's level-0 tile)."""
    first = old_size // TILE_WIDTH
    kept = old_size % TILE_WIDTH
    pending = []
    if kept:
        try:
            pending = check_bundle(
                files.read(entries_path(first, kept)), first, kept, files.read_tile, old_size
            )
        except TileError as exc:
            raise PublishError(
                f"DEST's partial bundle does not match its tiles: {exc}; nothing was published"
            ) from exc
    pending += entries
    for start in range(0, len(pending), TILE_WIDTH):
        chunk = pending[start : start + TILE_WIDTH]
        files.put(entries_path(first + start // TILE_WIDTH, len(chunk)), encode_bundle(chunk))


def _check_extends(files: _Files, old: PublishState, new: PublishState) -> None:
    """Refuse a new tree that is not an extension of the published one: the old root recomputed
    from the new tiles, and the consistency proof between them verified (RFC 9162)."""
    try:
        if root_of_prefix(files.read_tile, new.size, old.size) != old.root:
            raise PublishError(
                f"the new tree does not extend the published checkpoint (size {old.size}): "
                "DEST's tiles or bundles were changed; nothing was published"
            )
        proof = consistency_proof_from_tiles(files.read_tile, old.size, new.size)
        verify_consistency(old.size, new.size, old.root, new.root, proof)
    except (TileError, ValueError) as exc:
        if isinstance(exc, PublishError):
            raise
        raise PublishError(f"the new tree is not consistent with the published one: {exc}") from exc


def _stage_data(stored: _Stored, files: _Files, new_files: Iterable[str]) -> int:
    """Hard links (or copies) of the new Parquet files: immutable, and kept if a compaction
    removes them from the ledger before the upload."""
    count = 0
    for rel in new_files:
        target = files.staged / DATA / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(stored.path(rel), target)
        except OSError:
            shutil.copyfile(stored.path(rel), target)
        count += 1
    return count


def _stage(
    stored: _Stored, files: _Files, state: PublishState, signer: NoteSigner, origin: str
) -> tuple[PublishState, int, int, int] | None:
    """Everything a publish will upload, in the staging folder; the new state (not yet swapped in).
    Returns (new state, entries added, events added, data files staged), or None: nothing new."""
    records = _read_commits(stored, state.commit)
    # No new commit: nothing to publish, but on a lake whose merge replaced files (no ledger commit
    # there), a new manifest and its snapshot entry name the files it reads now.
    if not records and (stored.lake is None or sorted(stored.lake) == state.live):
        return None
    shutil.rmtree(files.staged, ignore_errors=True)  # an earlier publish killed before its swap
    files.staged.mkdir(parents=True)
    new = PublishState.from_json(json.loads(json.dumps(state.to_json())))
    new.live = stored.live_after(state.live, records)
    events = 0
    for group in _commit_groups(records, EVENTS_PER_PASS):  # bounded memory: a pass per group
        entries, group_events = _build_entries(stored, new, group, new.live)
        _stage_growth(files, new.size, entries)
        new.size += len(entries)
        new.commit = group[-1]["commit"]  # the next group's events are those after it
        events += group_events
    log_size = new.size
    manifest = _manifest(stored, new, new.live, origin, log_size)
    digest = hashlib.sha256(manifest).hexdigest()
    snapshot = _entry(
        {"t": "snapshot", "commit": new.commit, "log_size": log_size, "manifest_sha256": digest}
    )
    _stage_growth(files, new.size, [snapshot])
    new.size += 1
    _drop_passing_partials(files.staged, new.size)
    new.root = root_from_tiles(files.read_tile, new.size)
    _check_extends(files, state, new)
    copied = _stage_data(stored, files, [rel for rel in new.live if rel not in state.files])
    files.put(MANIFEST, manifest)
    files.put("views.sql", _views_sql(stored.tables, new.live))
    files.put(MANIFEST_SIG, _manifest_note(origin, log_size, manifest, signer).encode())
    new.checkpoint = sign_checkpoint(origin, new.size, new.root, signer)
    files.put(CHECKPOINT, new.checkpoint.encode())
    new.removed = [rel for rel in state.live if rel not in set(new.live)]
    new.pending = True
    return new, new.size - state.size, events, copied


# -------------------------------------------------------------------------------------------- upload


def _upload(staged: Path, dest: Dest, state: PublishState) -> None:
    """The staged files into DEST, each whole or not at all (a reader never sees half a tile):
    tiles, bundles, data and manifest, then the checkpoint last."""
    for path in sorted(p for p in staged.rglob("*") if p.is_file()):
        rel = path.relative_to(staged).as_posix()
        if rel != CHECKPOINT:
            dest.put_file(rel, path)
    for gone in state.removed:
        dest.delete(f"{DATA}/{gone}")
    dest.put_file(CHECKPOINT, staged / CHECKPOINT)


# -------------------------------------------------------------------------------------------- state


def state_dir(root: Path, dest: str | Path | Dest) -> Path:
    """Where the trusted state of publishing ``root`` to ``dest`` lives (beside the ledger; a
    folder's key is its resolved path, as before S3 destinations existed)."""
    key = hashlib.sha256(open_dest(dest).key.encode()).hexdigest()[:16]
    return root / STATE_DIR / key


def _load_state(directory: Path) -> PublishState:
    path = directory / "state.json"
    if not path.exists():
        return PublishState()
    return PublishState.from_json(json.loads(path.read_bytes()))


def load_published(root: Path, dest: str | Path | Dest) -> PublishState:
    """What was last published from the ledger at ``root`` to ``dest`` (for proofs; read-only)."""
    return _load_state(state_dir(root, dest))


def _save_state(directory: Path, state: PublishState, dest: Dest) -> None:
    write_durably(directory / "state.json", json.dumps({"dest": dest.key} | state.to_json()))


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PublishError(
                f"another publish to this DEST is running (lock {directory / 'lock'})"
            ) from None
        yield


def _check_dest(dest: Dest, state: PublishState) -> None:
    """DEST must hold what was last published from here (nothing, the first time)."""
    published = dest.read(CHECKPOINT).decode() if dest.exists(CHECKPOINT) else ""
    if published != state.checkpoint:
        if not state.checkpoint:
            raise PublishError(
                f"{dest.name} already holds a log this ledger did not publish; choose an empty DEST"
            )
        raise PublishError(f"{dest.name}/checkpoint is not the checkpoint last published from this ledger")


def publish(root: str | Path | Ledger, dest: str | Path | Dest, private_key: str) -> PublishResult:
    """Publish the ledger at ``root`` (its folder, or the ledger open already) to ``dest`` (a folder,
    ``s3://bucket/prefix`` or a ``Dest``): only what is new, safe to kill."""
    if isinstance(root, Ledger):
        return _publish(root, dest, private_key)
    with Ledger.open(Path(root)) as ledger:
        return _publish(ledger, dest, private_key)


def _publish(ledger: Ledger, dest: str | Path | Dest, private_key: str) -> PublishResult:
    root = ledger.root
    signer = parse_private_key(private_key)
    origin = log_origin(ledger.ledger_id)
    dest = open_dest(dest)  # DestError (one line) for a file, a bad URL, a missing bucket, bad credentials
    if isinstance(dest, FolderDest):
        dest.folder.mkdir(parents=True, exist_ok=True)
    directory = state_dir(root, dest)
    with _locked(directory):
        state = _load_state(directory)
        repaired = state.pending
        if state.pending:  # killed after the swap: finish that upload first
            _upload(directory / "staged", dest, state)
            state.pending = False
            _save_state(directory, state, dest)
        _check_dest(dest, state)
        if state.checkpoint:
            parse_checkpoint(open_note(state.checkpoint, _verifier_of(signer)))
        stored = _Stored(root) if ledger.lake is None else _lake_stored(ledger)
        staged = _stage(stored, _Files(dest, directory / "staged"), state, signer, origin)
        if staged is None:
            return PublishResult(state.size, state.size, 0, 0, 0, repaired, state.checkpoint)
        new, added, events, copied = staged
        outcome = _cosign(root, _Files(dest, directory / "staged"), new)
        _save_state(directory, new, dest)  # the swap: from here on, this is the published checkpoint
        _upload(directory / "staged", dest, new)
        new.pending = False
        _save_state(directory, new, dest)
        shutil.rmtree(directory / "staged", ignore_errors=True)
        if stored.lake is not None:
            _drop_old_copies(root / STATE_DIR / LAKE_COPIES, set(stored.lake.values()))
    return PublishResult(new.size, state.size, added, events, copied, repaired, new.checkpoint, outcome)


def _cosign(root: Path, files: _Files, new: PublishState) -> dict[str, str]:
    """The witnesses' cosignatures on the staged checkpoint (``runledger.ledger.witness``), before the swap:
    a 422 or a missed quorum stops the publish with nothing published."""
    policy = load_policy(root)
    if not policy.witnesses:
        return {}

    def prove(old_size: int) -> list[bytes]:
        return consistency_proof_from_tiles(files.read_tile, old_size, new.size)

    new.checkpoint, outcome = collect_cosignatures(policy, new.checkpoint, new.size, new.witness_sizes, prove)
    files.put(CHECKPOINT, new.checkpoint.encode())
    return outcome


def _verifier_of(signer: NoteSigner) -> str:
    """The vkey of a signer (to check the state's own checkpoint before extending it)."""
    from cryptography.hazmat.primitives import serialization

    public = signer.private_key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    blob = base64.b64encode(b"\x01" + public).decode()
    return f"{signer.name}+{signer.key_hash:08x}+{blob}"
