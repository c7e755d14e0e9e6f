"""Where a ledger's tables are stored, file by file, for the readers of raw Parquet (``verify``).

A ledger of part files keeps each table under ``ROOT/<table>/<partition>=<value>/*.parquet``, the
partition's value in the directory's name only. A ledger on a lake (``runledger.ledger.lake``) keeps them where
its catalog says, at one snapshot: the files of the newest snapshot are listed by DuckLake
(``ducklake_list_files``), never globbed (a folder also holds the files of expired snapshots and of
killed transactions), and each file holds its partition column itself.

On a lake this also checks what a raw reader cannot see: every listed file must be the bytes the
commit record that added it names (SHA-256), and no file may carry deletions (the ledger never
deletes a row: a delete file hides rows from DuckDB that a raw reader would still count).
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from runledger.ledger.lake import MERGED_PREFIX, LakeError, fetch_object, is_s3, plain_file_under
from runledger.ledger.parquet_schemas import SIDE_TABLES, TABLES, tables_of

if TYPE_CHECKING:
    from runledger.ledger.lake import LakeReader
    from runledger.ledger.store import Ledger


@dataclass(frozen=True)
class StoredFile:
    path: Path  # what pyarrow opens
    shown: str  # as problems name it: relative to the ledger folder, or to the lake's data path
    partition: str | None  # the directory's value (part files); None: the file's own column (a lake)


@dataclass
class LakeFileCheck:
    """What the listing of a lake snapshot found: files whose bytes are not what a commit recorded,
    files carrying deletions, and files no commit record names (the lake's maintenance merged them:
    their rows are checked like every other file's, their bytes are named by nobody)."""

    snapshot: int = 0
    files: int = 0
    altered: list[str] = field(default_factory=list)
    deletions: list[str] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)  # catalog rows naming a file off the data path: not read


class StoredFiles:
    """Each table's files, part files or a lake snapshot's (see the module's docstring)."""

    def __init__(self, ledger: Ledger) -> None:
        self.root = ledger.root
        self.lake: LakeFileCheck | None = None
        self._lake_files: dict[str, list[StoredFile]] = {}
        self._fetched: Path | None = None
        if ledger.lake is not None:
            assert ledger.lake_folder is not None
            self.tables = list(ledger.lake_folder.tables)
            self._list_lake(ledger)
        else:
            self.tables = tables_of(self.root)

    def of(self, table: str) -> list[StoredFile]:
        """The table's files in a fixed order (by path)."""
        if self.lake is not None:
            return self._lake_files.get(table, [])
        spec = TABLES[table] if table in TABLES else SIDE_TABLES[table]
        return [
            StoredFile(path, str(path.relative_to(self.root)), path.parent.name.split("=", 1)[1])
            for path in sorted((self.root / table).glob(f"{spec.partition}=*/*.parquet"))
        ]

    def _list_lake(self, ledger: Ledger) -> None:
        assert ledger.lake is not None
        lake = ledger.lake
        remote = "://" in lake.data_path
        if remote and not is_s3(lake.data_path):
            from runledger.ledger.store import LedgerError

            raise LedgerError(f"the lake's files are at {lake.data_path}: give a local folder or s3://")
        check = self.lake = LakeFileCheck()
        recorded = recorded_sha256(ledger)
        fetched = Path(tempfile.mkdtemp(prefix="runledger-verify-")) if remote else None
        self._fetched = fetched  # each object fetched once into a folder of its own, hashed as it arrives
        try:
            self._check_lake_files(ledger, check, recorded, fetched)
        except BaseException:
            self.close()
            raise

    def _check_lake_files(
        self, ledger: Ledger, check: LakeFileCheck, recorded: dict[tuple[str, str], str], fetched: Path | None
    ) -> None:
        assert ledger.lake is not None
        lake = ledger.lake
        remote = fetched is not None
        prefix = lake.data_path.rstrip("/") + "/"

        def shown_as(path: str) -> str:
            return path.removeprefix(prefix) if remote else _shown(Path(path), Path(lake.data_path))

        with lake.reader() as con:
            check.snapshot = con.snapshot
            for table in [*self.tables, *SIDE_TABLES]:
                files = self._lake_files[table] = []
                for data_file, delete_file in lake_file_list(con, table):
                    strays = [
                        p for p in (data_file, delete_file) if p and not plain_file_under(lake.data_path, p)
                    ]
                    if strays:  # the catalog's operator is not trusted: such a file is named, never read
                        check.outside += [f"{table}: {p!r}" for p in strays]
                        continue
                    name = PurePosixPath(data_file).name
                    shown = shown_as(data_file)
                    if fetched is not None:
                        path = fetched / table / name
                        try:
                            digest: str | None = fetch_object(data_file, path)
                        except LakeError:  # gone from the server: "altered", and unreadable below
                            digest = None
                    else:
                        path = Path(data_file)
                        digest = _sha256(path)
                    files.append(StoredFile(path, shown, None))
                    check.files += 1
                    if delete_file:
                        check.deletions.append(f"{shown} (deletions in {shown_as(delete_file)})")
                    want = recorded.get((table, name))
                    if want is None:
                        check.unrecorded.append(shown)
                    elif digest != want:
                        check.altered.append(shown)

    def close(self) -> None:
        """Delete what was fetched of an S3 lake."""
        if self._fetched is not None:
            shutil.rmtree(self._fetched, ignore_errors=True)  # made here (mkdtemp), ours alone
            self._fetched = None

    def __enter__(self) -> StoredFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lake_file_list(con: LakeReader, table: str) -> list[tuple[str, str | None]]:
    """(data file, its delete file or None) of ``table`` at the snapshot ``con`` is pinned at, by path:
    DuckLake's own list (``ducklake_list_files``), never a glob."""
    rows = con.execute(
        "SELECT data_file, delete_file FROM ducklake_list_files(?, ?) ORDER BY data_file",
        ["snap", table],
    ).fetchall()
    return [(str(data_file), delete_file or None) for data_file, delete_file in rows]


def _shown(path: Path, base: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(base.resolve()))
    return str(path)


def recorded_sha256(ledger: Ledger) -> dict[tuple[str, str], str]:
    """(table, file name) -> the SHA-256 a commit record names for it. DuckLake names each file with
    a fresh UUID, so the name alone identifies it wherever the data path has moved since."""
    import json

    out: dict[tuple[str, str], str] = {}
    for path in ledger.commit_paths():
        for item in json.loads(path.read_bytes()).get("lake_files") or []:
            if item.get("sha256"):
                out[(item["table"], Path(item["path"]).name)] = item["sha256"]
    assert ledger.lake is not None
    for key, item in ledger.lake.state().items():  # files the lake's merge wrote (``maintain``)
        if key.startswith(MERGED_PREFIX) and isinstance(item, dict) and item.get("sha256"):
            out[(item["table"], key.removeprefix(MERGED_PREFIX))] = item["sha256"]
    return out


def _sha256(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None
