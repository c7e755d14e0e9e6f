"""The writer's dedupe index on disk (runledger.ledger.seen_index): it answers like the commit log it is
derived from, whatever happened to its file, and its size does not follow the writer's memory."""

from __future__ import annotations

import gc
import json
import logging
import shutil
import sqlite3
from pathlib import Path

import pytest

from runledger.ledger.seen_index import INDEX_DIR, INDEX_FILE, SeenIndex, record_key, seen_key
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas.codec import CONFLICT
from tests.support.factory import RunBuilder


def _events(n: int, run_id: str = "r1") -> list[bytes]:
    run = RunBuilder(run_id=run_id)
    run.start()
    for step in range(1, n):
        run.step(step, loss=2.0 - step * 0.01)
    return run.events


def _forged(raw: bytes) -> bytes:
    value = json.loads(raw)
    value["data"]["loss"] = 0.01
    return json.dumps(value).encode()


def _commit(ledger: Ledger, source: str, raws: list[bytes], first: int = 0):  # type: ignore[no-untyped-def]
    return ledger.commit([SourceRecord(source, first + i, raw) for i, raw in enumerate(raws)])


def _index_path(root: Path) -> Path:
    return root / INDEX_DIR / INDEX_FILE


def _index_rows(root: Path) -> int:
    with sqlite3.connect(_index_path(root)) as db:
        return db.execute("SELECT count(*) FROM seen").fetchone()[0]


def _assert_all_known(root: Path, raws: list[bytes]) -> None:
    """A fresh writer finds every event stored: each is a duplicate, one forged copy a conflict."""
    result = _commit(Ledger.open(root), "spool:again", [*raws, _forged(raws[1])])
    assert result.duplicates == len(raws) and result.accepted == 0
    [(_record, q)] = result.quarantined
    assert q.code == CONFLICT


def _through(root: Path) -> int:
    with sqlite3.connect(_index_path(root)) as db:
        return int(db.execute("SELECT value FROM meta WHERE name = 'through'").fetchone()[0])


def test_the_index_is_kept_on_disk_and_follows_every_commit(tmp_path: Path) -> None:
    root = tmp_path / "l"
    raws = _events(40)
    _commit(Ledger.create(root), "spool:a", raws[:25])
    ledger = Ledger.open(root)
    _commit(ledger, "spool:a", raws[25:], first=25)
    assert _index_rows(root) == 40
    assert _through(root) == ledger.last_commit  # every commit, the newest included
    _assert_all_known(root, raws)


def test_a_closed_writer_has_let_go_of_its_index(tmp_path: Path) -> None:
    """``Ledger.close`` closes the index's SQLite file too: left to the collector, its WAL would be
    checkpointed (its files rewritten) whenever that runs, long after the writer was done."""
    root = tmp_path / "l"
    ledger = Ledger.create(root)
    _commit(ledger, "spool:a", _events(5))
    ledger.close()

    def files() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted((root / INDEX_DIR).iterdir())}

    before = files()
    del ledger
    gc.collect()
    assert files() == before
    assert not (root / INDEX_DIR / f"{INDEX_FILE}-wal").exists()  # checkpointed by the close itself


@pytest.mark.parametrize("damage", ["deleted", "garbage", "foreign", "ahead of the log"])
def test_a_lost_or_wrong_index_is_rebuilt_from_the_commit_log(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "l"
    raws = _events(30)
    ledger = Ledger.create(root)
    _commit(ledger, "spool:a", raws[:20])
    ledger._index.close()
    backup = tmp_path / "backup"
    shutil.copytree(root, backup)  # commit 1 only
    _commit(ledger, "spool:a", raws[20:], first=20)
    ledger._index.close()
    path = _index_path(root)
    if damage == "deleted":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(b"not a database\x00" * 100)
    elif damage == "foreign":  # another ledger's index, with the same commit numbers
        theirs = Ledger.create(tmp_path / "other")
        _commit(theirs, "spool:a", _events(20, run_id="r9"))
        _commit(theirs, "spool:a", _events(10, run_id="r8"))
        theirs._index.close()
        shutil.copy(_index_path(tmp_path / "other"), path)
    else:  # the ledger restored from its backup (commit 1), beside the newer index (commit 2)
        shutil.copy(path, tmp_path / "newer.sqlite")
        shutil.rmtree(root)
        shutil.copytree(backup, root)
        shutil.copy(tmp_path / "newer.sqlite", path)
    known = raws[:20] if damage == "ahead of the log" else raws
    with caplog.at_level(logging.WARNING, logger="runledger.ledger.seen_index"):
        _assert_all_known(root, known)
    if damage != "deleted":
        assert "rebuilding it from the commit log" in caplog.text
    assert _index_rows(root) == len(known)
    if damage == "ahead of the log":  # the events of the commit this log never had are new here
        assert _commit(Ledger.open(root), "spool:b", raws[20:]).accepted == 10


def test_an_index_left_behind_by_a_crash_after_the_commit_point_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "l"
    raws = _events(30)
    ledger = Ledger.create(root)
    _commit(ledger, "spool:a", raws[:10])

    def crash(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(SeenIndex, "add", crash)
    result = _commit(ledger, "spool:a", raws[10:], first=10)  # durable: only the index missed it
    assert result.accepted == 20
    monkeypatch.undo()
    assert _index_rows(root) == 10
    # The same writer's next commit adds commit 2's events from its record before looking anything up.
    again = _commit(ledger, "spool:b", raws[10:15])
    assert again.duplicates == 5 and again.accepted == 0
    assert _index_rows(root) == 30
    _assert_all_known(root, raws)


def test_two_writers_share_one_index(tmp_path: Path) -> None:
    root = tmp_path / "l"
    raws = _events(30)
    first, second = Ledger.create(root), Ledger.open(root)
    _commit(first, "spool:a", raws[:10])
    assert _commit(second, "spool:b", raws[:15]).duplicates == 10  # sees the other's events
    assert _commit(first, "spool:c", raws[:30]).duplicates == 15
    assert _index_rows(root) == 30


def test_an_add_that_fails_midway_leaves_nothing_of_it(tmp_path: Path) -> None:
    index = SeenIndex(tmp_path)
    index.catch_up(-1, lambda n: None)
    index.add(0, b"d" * 16, [(b"a" * 16, b"h" * 32)])
    with pytest.raises(sqlite3.Error):  # the second entry cannot be stored: the first must not stay
        index.add(1, b"e" * 16, [(b"b" * 16, b"h" * 32), (b"c" * 16, object())])  # type: ignore[list-item]
    assert index.through == 0
    assert index.get(b"b" * 16) is None and index.get(b"a" * 16) == b"h" * 32
    index.close()
    with sqlite3.connect(tmp_path / INDEX_DIR / INDEX_FILE) as db:
        assert db.execute("SELECT count(*) FROM seen").fetchone()[0] == 1
        assert db.execute("SELECT value FROM meta WHERE name = 'through'").fetchone()[0] == 0


def test_a_commit_looks_its_records_up_in_a_few_queries_and_still_finds_each(tmp_path: Path) -> None:
    """A commit fetches the stored leaves of its whole batch ahead (500 keys a query); every
    duplicate and conflict across those chunks is still found, and a record whose identity the
    glance could not read is looked up on its own."""
    root = tmp_path / "l"
    raws = _events(1200)
    _commit(Ledger.create(root), "spool:a", raws)
    ledger = Ledger.open(root)
    lookups: list[str] = []
    ledger.commit([])  # opens the index
    ledger._index._db.set_trace_callback(lambda sql: lookups.append(sql) if "FROM seen" in sql else None)  # type: ignore[union-attr]
    more = _events(1210)[1200:]
    forged = _forged(raws[700])
    batch = [*raws, *more, forged, b"not json", b"[" * 5000]
    result = _commit(ledger, "spool:again", batch)
    assert (result.duplicates, result.accepted) == (1200, 10)
    assert sorted(q.code for _record, q in result.quarantined) == sorted([CONFLICT, "decode", "too-deep"])
    assert len(lookups) == 3  # 1,211 keys in chunks of 500: not one query per record


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[" * 100_000, b'{"id": "x"}', b'{"source": 1, "id": "x"}', b"\xff\xfe{}", b"null"],
    ids=["empty", "not json", "deep", "no source", "source not a string", "not utf-8", "null"],
)
def test_a_glance_at_a_hostile_record_names_no_key(raw: bytes) -> None:
    assert record_key(raw) is None


def test_a_glance_names_the_key_the_full_decode_does() -> None:
    raw = _events(2)[1]
    value = json.loads(raw)
    assert record_key(raw) == seen_key(value["source"], value["id"])


def test_a_new_ledgers_first_batch_is_not_glanced_at_yet_its_repeats_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty index holds no key: the first batch skips fetching them (``record_key`` on every
    record), and still drops a repeat inside it and refuses a forged copy; the next batch asks."""
    import runledger.ledger.store as store

    glanced: list[bytes] = []

    def counted(raw: bytes) -> bytes | None:
        glanced.append(raw)
        return record_key(raw)

    monkeypatch.setattr(store, "record_key", counted)
    raws = _events(4)
    ledger = Ledger.create(tmp_path / "ledger")
    first = _commit(ledger, "spool:a", [*raws, raws[2], _forged(raws[1])])
    assert (first.accepted, first.duplicates) == (len(raws), 1)
    [(_record, q)] = first.quarantined
    assert q.code == CONFLICT
    assert glanced == []
    second = _commit(ledger, "spool:b", raws)
    assert (second.accepted, second.duplicates) == (0, len(raws))
    assert len(glanced) == len(raws)
