"""The read side on DuckLake: a ledger answers at one snapshot per reader (``--snapshot N``,
``--at-checkpoint FILE``), and a commit killed before it finished is not there."""

from __future__ import annotations

import base64
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.lake import LOCK_WAIT_S, LakeFolder, LakeTables, open_snapshot
from runledger.ledger.log_checkpoint import sign_checkpoint
from runledger.ledger.merkle import CompactRange
from runledger.ledger.query import QueryError, Reader
from runledger.ledger.store import Ledger
from runledger.schemas.note import generate_keypair
from tests.lake.support import batch, spawn

runner = CliRunner()
SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "200"}
# Every name an analyst reads: the stored tables and the derived views.
VIEWS = [
    "events",
    "attempts",
    "launches",
    "metrics",
    "metrics_all",
    "metrics_recorded",
    "moe_layer_stats",
    "configs",
    "config_changes",
    "checkpoints",
    "incidents",
    "crashes",
    "run_ends",
    "annotations",
    "github",
    "github_all",
    "quarantine",
    "runs",
    "github_pull_requests",
    "attempt_commits",
]


def _cli(*args: str | Path, code: int = 0) -> tuple[str, str]:
    result = runner.invoke(app, [str(a) for a in args], env=ENV)
    assert result.exit_code == code, result.output
    return result.stdout, result.stderr


@pytest.fixture(scope="module")
def ledgers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int]]:
    """A ledger (a lake with a SQLite catalog in its folder: many readers beside a writer) ingested
    in 250-event commits; the folder it was made in, the ledger, and the lake snapshot of each commit."""
    root = tmp_path_factory.mktemp("lake-reader")
    _cli("simulate", "reference-535b", "--spool", root / "spool", *SMALL)
    _cli("ingest", "spool", "--spool", root / "spool", "--ledger", root / "lake", "--batch-size", "250")
    snapshots = [int(r["lake"]["snapshot"]) for r in _records(root / "lake")]
    assert len(snapshots) >= 3
    return root, root / "lake", snapshots


def _records(lake: Path) -> list[dict[str, Any]]:
    """The ledger's commit records, in commit order (the folder's copy of the lake's)."""
    with Ledger.open(lake) as ledger:
        return [json.loads(p.read_bytes()) for p in ledger.commit_paths()]


def _rows(reader: Reader, view: str) -> list[str]:
    """Every row of a view, order-free: each row as JSON text, sorted."""
    result = reader.sql(f"SELECT * FROM {view}")
    return sorted(json.dumps(r, default=str, sort_keys=True) for r in result.records())


def test_snapshot_answers_as_of_each_commit(ledgers: tuple[Path, Path, list[int]]) -> None:
    _, lake, snapshots = ledgers
    records = _records(lake)
    assert len(records) == len(snapshots)
    newest = Reader(lake)  # each commit's events as the newest snapshot tells them
    for record, snapshot in zip(records, snapshots, strict=True):
        want = newest.sql('SELECT count(*) FROM events WHERE "commit" <= ?', [record["commit"]]).rows
        out, err = _cli(
            "query", "SELECT count(*) AS n FROM events", "-f", "csv", "--ledger", lake, "--snapshot", snapshot
        )
        assert out == f"n\n{want[0][0]}\n"
        assert err == f"as of lake snapshot {snapshot}\n"
    # before the first commit: the tables exist and are empty
    assert (
        _cli("query", "SELECT count(*) AS n FROM metrics", "-f", "csv", "--ledger", lake, "--snapshot", 1)[0]
        == "n\n0\n"
    )


def test_snapshot_out_of_range_is_one_line(ledgers: tuple[Path, Path, list[int]]) -> None:
    _, lake, snapshots = ledgers
    out, _ = _cli("query", "SELECT 1", "--ledger", lake, "--snapshot", snapshots[-1] + 1, code=1)
    assert out == ""
    result = runner.invoke(app, ["query", "SELECT 1", "--ledger", str(lake), "--snapshot", "999"], env=ENV)
    assert result.stderr == f"error: snapshot 999: the lake's snapshots are 0-{snapshots[-1]}\n"


def _checkpoint(lake: Path, commit: int, stream: str, key: str) -> str:
    """A checkpoint signed of ``stream`` as ledger commit ``commit`` left it (read from the folder's
    commit record, apart from the lake's snapshots)."""
    with Ledger.open(lake) as ledger:
        head = ledger.read_commit(commit)["streams"][stream]
        origin = f"runledger/{ledger.ledger_id}/{stream}"
    root = CompactRange.from_json(head["tree"]).root()
    return sign_checkpoint(origin, head["size"], root, key)


def test_at_checkpoint_answers_as_of_the_snapshot_it_pins(
    ledgers: tuple[Path, Path, list[int]], tmp_path: Path
) -> None:
    _, lake, snapshots = ledgers
    key, _ = generate_keypair("runledger")
    stream = "moe-535b"
    records = _records(lake)
    for commit, snapshot in enumerate(snapshots):
        if stream not in records[commit]["streams"]:
            continue
        note = tmp_path / f"cp{commit}.txt"
        note.write_text(_checkpoint(lake, commit, stream, key))
        size = records[commit]["streams"][stream]["size"]
        out, err = _cli(
            "query", "SELECT count(*) AS n FROM events WHERE stream = 'moe-535b'", "-f", "csv",
            "--ledger", lake, "--at-checkpoint", note,
        )  # fmt: skip
        # the commit that brought the stream to the checkpoint's size, not a later one
        assert err == f"as of lake snapshot {snapshot}\n"
        assert out == f"n\n{size}\n"


def test_a_checkpoint_of_another_history_pins_nothing(
    ledgers: tuple[Path, Path, list[int]], tmp_path: Path
) -> None:
    _, lake, _ = ledgers
    key, _ = generate_keypair("runledger")
    good = _checkpoint(lake, 1, "moe-535b", key)
    origin, size, root, *rest = good.split("\n")
    forged = tmp_path / "forged.txt"  # the same size, another root
    flipped = bytearray(base64.b64decode(root))
    flipped[0] ^= 1
    forged.write_text("\n".join([origin, size, base64.b64encode(bytes(flipped)).decode(), *rest]))
    result = runner.invoke(
        app, ["query", "SELECT 1", "--ledger", str(lake), "--at-checkpoint", str(forged)], env=ENV
    )
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: checkpoint moe-535b at size {size}: its root is not the lake's at that size (another history)\n"
    )
    other = tmp_path / "other.txt"
    other.write_text(good.replace(origin, "runledger/someone-else/moe-535b", 1))
    result = runner.invoke(
        app, ["query", "SELECT 1", "--ledger", str(lake), "--at-checkpoint", str(other)], env=ENV
    )
    assert result.stderr.startswith(
        "error: checkpoint of 'runledger/someone-else/moe-535b': not a stream of ledger"
    )
    beyond = tmp_path / "beyond.txt"
    beyond.write_text("\n".join([origin, "999999", *good.split("\n")[2:]]))
    result = runner.invoke(
        app, ["query", "SELECT 1", "--ledger", str(lake), "--at-checkpoint", str(beyond)], env=ENV
    )
    assert result.stderr == "error: no snapshot of the lake has stream moe-535b at size 999999\n"
    for junk in ["", "not a checkpoint\n", "\x00" * 100, "a\n-1\nAAAA\n"]:
        bad = tmp_path / "junk.txt"
        bad.write_text(junk)
        result = runner.invoke(
            app, ["query", "SELECT 1", "--ledger", str(lake), "--at-checkpoint", str(bad)], env=ENV
        )
        assert result.exit_code == 1 and result.stderr.startswith("error: not a checkpoint:"), junk


def test_a_damaged_or_misplaced_lake_folder_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "lake"
    folder.mkdir()
    cases = {
        "{": "unreadable",
        "[]": "no catalog named",
        json.dumps({"catalog": "sqlite:nowhere.sqlite"}): "no lake catalog at",
        json.dumps({"catalog": "postgres:"}): "nothing after postgres:",
    }
    for text, words in cases.items():
        (folder / "LAKE.json").write_text(text)
        result = runner.invoke(app, ["runs", "--ledger", str(folder)], env=ENV)
        assert result.exit_code == 1, text
        assert result.stderr.startswith("error: ") and words in result.stderr, (text, result.stderr)
        assert len(result.stderr.splitlines()) == 1


def test_a_copied_lake_folder_reads_its_own_files(
    ledgers: tuple[Path, Path, list[int]], tmp_path: Path
) -> None:
    import shutil

    _, lake, _ = ledgers
    marker = LakeFolder.read(lake)
    assert marker is not None
    # an embedded lake's marker names its catalog and files relative to the folder
    assert json.loads((lake / "LAKE.json").read_text())["catalog"] == "sqlite:catalog.sqlite"
    copy = tmp_path / "copy"
    shutil.copytree(lake, copy)
    assert _rows(Reader(copy), "metrics") == _rows(Reader(lake), "metrics")


def test_sql_on_the_lake_cannot_write_or_reach_outside(ledgers: tuple[Path, Path, list[int]]) -> None:
    _, lake, snapshots = ledgers
    reader = Reader(lake, snapshot=snapshots[0])
    catalog = lake / "catalog.sqlite"
    refused = [
        f"COPY (SELECT 1) TO '{lake / 'x.csv'}'",
        "SELECT * FROM read_csv('/etc/passwd')",
        f"ATTACH 'ducklake:sqlite:{catalog}' AS w",
        "INSERT INTO lake.events SELECT * FROM lake.events",
        "DETACH lake",
        "SET lock_configuration = false",
        f"SELECT * FROM sqlite_scan('{catalog}', 'ducklake_snapshot')",
        "SELECT * FROM sqlite_scan('/etc/hostname', 'x')",
        f"SELECT * FROM \"sqlite_query\"('{catalog}', 'SELECT 1')",
        "SELECT * FROM ducklake_snapshots('lake')",
        "CALL ducklake_expire_snapshots('lake', versions => [2])",
    ]
    for statement in refused:
        with pytest.raises(QueryError, match="refused"):
            reader.sql(statement)
    assert not (lake / "x.csv").exists()
    # naming the lake's own tables reaches the same snapshot as the views
    assert (
        reader.sql("SELECT count(*) FROM lake.events").rows == reader.sql("SELECT count(*) FROM events").rows
    )


def test_every_statement_sees_one_snapshot_while_a_writer_commits_and_maintains(
    ledgers: tuple[Path, Path, list[int]], tmp_path: Path
) -> None:
    import shutil

    _, lake, _ = ledgers
    folder = tmp_path / "busy"
    shutil.copytree(lake, folder)
    marker = LakeFolder.read(folder)
    assert marker is not None
    stop = threading.Event()
    committed: list[int] = []
    errors: list[BaseException] = []

    def write() -> None:  # another process would do; a thread shares nothing with the reader either
        try:
            with LakeTables(marker.catalog, marker.data_path) as writer:
                b = 0
                while not stop.is_set() and b < 40:
                    writer.commit(batch("w", b * 50, 50, b), {"w": (b * 50, (b + 1) * 50)}, {})
                    committed.append(b)
                    if b % 10 == 9:
                        writer.maintain(keep_s=3600)  # merges files under the readers
                    b += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    seen: set[int] = set()
    diffs: list[int] = []
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and (thread.is_alive() or len(seen) < 2):
            reader = Reader(folder)
            first = reader.sql("SELECT count(*) FROM events").rows[0][0]
            diffs.append(
                reader.sql("SELECT (SELECT count(*) FROM events) - (SELECT count(*) FROM events)").rows[0][0]
            )
            joined = reader.sql(
                "SELECT count(*) FROM metrics_recorded m JOIN events e USING (stream, stream_seq)"
            )
            assert joined.rows == reader.sql("SELECT count(*) FROM metrics_recorded").rows
            time.sleep(0.02)
            diffs.append(reader.sql("SELECT count(*) FROM events").rows[0][0] - first)
            seen.add(first)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not errors, errors
    assert committed and set(diffs) == {0}, diffs
    assert len(seen) >= 2  # the readers overlapped the writer
    final = Reader(folder).sql("SELECT count(*) FROM events WHERE stream = 'w'").rows[0][0]
    assert final == 50 * len(committed)


def test_this_process_opens_a_sqlite_catalog_only_through_duckdbs_sqlite(
    ledgers: tuple[Path, Path, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's sqlite3 is a second SQLite library: closing the catalog file drops every POSIX lock
    the process holds on it, DuckDB's SQLite's included (SQLite's "multiple copies" hazard: a
    reader's snapshot lookup beside a writer's commit ended in "disk I/O error" or SIGBUS)."""
    import shutil
    import sqlite3
    import urllib.parse

    _, lake, _ = ledgers
    folder = tmp_path / "one-sqlite"
    shutil.copytree(lake, folder)
    marker = LakeFolder.read(folder)
    assert marker is not None and marker.catalog.startswith("sqlite:")
    catalog = Path(marker.catalog.removeprefix("sqlite:")).resolve()
    opened: list[str] = []
    connect = sqlite3.connect

    def watched(database: str, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        path = urllib.parse.unquote(str(database).removeprefix("file:").split("?")[0])
        if Path(path).resolve() == catalog:
            opened.append(str(database))
        return connect(database, *args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", watched)
    with LakeTables(marker.catalog, marker.data_path) as writer:
        before = Reader(folder).sql("SELECT count(*) FROM events").rows[0][0]
        writer.commit(batch("w", 0, 50, 0), {"w": (0, 50)}, {})
        writer.maintain(keep_s=3600)
        after = Reader(folder).sql("SELECT count(*) FROM events").rows[0][0]
    assert after == before + 50
    assert opened == []


def test_a_commit_killed_before_it_finished_is_not_there(
    ledgers: tuple[Path, Path, list[int]], tmp_path: Path
) -> None:
    import shutil

    _, lake, _ = ledgers
    folder = tmp_path / "killed"
    shutil.copytree(lake, folder)
    marker = LakeFolder.read(folder)
    assert marker is not None
    before = {v: _rows(Reader(folder), v) for v in ["events", "metrics"]}
    state_before = _cli("state", "latest", "-f", "json", "--ledger", folder)[0]
    data_files = {p for p in Path(marker.data_path).rglob("*.parquet")}
    child = spawn("hold", marker.catalog, marker.data_path, "killed", "2000")
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == "holding\n", child.stderr.read() if child.stderr else line
        assert {p for p in Path(marker.data_path).rglob("*.parquet")} > data_files  # written, uncommitted
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    # nothing waits, nothing is missing, and nothing of the killed commit shows
    started = time.monotonic()
    reader = Reader(folder)
    assert {v: _rows(reader, v) for v in ["events", "metrics"]} == before
    assert reader.sql("SELECT count(*) FROM events WHERE stream = 'killed'").rows == [(0,)]
    # (no lock of the killed writer is waited for: that wait would be LOCK_WAIT_S, 600 s; the bound is
    # far from any reader's own time on a loaded machine)
    assert time.monotonic() - started < LOCK_WAIT_S / 10
    assert _cli("state", "latest", "-f", "json", "--ledger", folder)[0] == state_before
    # and the next writer commits as if nothing happened
    with LakeTables(marker.catalog, marker.data_path) as writer:
        assert writer.commit(batch("next", 0, 10, 0), {"next": (0, 10)}, {}).ok
    assert Reader(folder).sql("SELECT count(*) FROM events").rows[0][0] == len(before["events"]) + 10


def test_views_sql_and_the_shell_init_read_the_lake(
    ledgers: tuple[Path, Path, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ledger views`` writes a views.sql a plain DuckDB reads the lake with (from the folder: its
    catalog and files named relatively); ``ledger shell``'s init file adds the lock."""
    import duckdb

    from runledger.cli.shell_cmd import init_sql
    from runledger.ledger import duck

    _, lake, _ = ledgers
    assert _cli("views", "--ledger", lake)[0].startswith("wrote ")
    want = _rows(Reader(lake), "metrics")
    monkeypatch.chdir(lake)
    con = duck.connect(extensions=["ducklake", "sqlite_scanner"])  # as `INSTALL`ed in a user's DuckDB
    con.execute((lake / "views.sql").read_text())
    got = sorted(json.dumps(r, default=str) for r in con.execute("SELECT * FROM metrics").fetchall())
    assert len(got) == len(want) > 0
    shell = duck.connect(extensions=["ducklake", "sqlite_scanner"])
    shell.execute(init_sql(lake))
    assert shell.execute("SELECT count(*) FROM metrics").fetchone() == (len(want),)
    with pytest.raises(duckdb.Error, match=r"(?i)permission|disabled|not allowed"):
        shell.execute("SELECT * FROM read_text('/etc/passwd')").fetchall()


def test_a_filter_on_the_partition_opens_only_its_files_and_odd_values_read_as_stored(tmp_path: Path) -> None:
    """Two runs in one lake: a statement about one run reads none of the other's files (the run id is
    taken from the folder names, as over part files), and a run named NULL, which a folder name
    cannot carry (DuckDB reads `run_id=NULL` as NULL), is read from the files' own column."""
    lake = tmp_path / "lake"
    Ledger.create_on_lake(lake, f"sqlite:{tmp_path / 'catalog.sqlite'}").close()
    for run in ("moe-a", "moe-b"):
        _cli("simulate", "reference-535b", "--spool", tmp_path / run, "--run-id", run, *SMALL)
        _cli("ingest", "spool", "--spool", tmp_path / run, "--ledger", lake)
    each = dict(Reader(lake).sql("SELECT run_id, count(*) FROM _metrics GROUP BY 1").rows)
    assert set(each) == {"moe-a", "moe-b"}
    other = {path: path.read_bytes() for path in (lake / "data").glob("**/metrics/run_id=moe-b/*.parquet")}
    assert other
    for path in other:  # damaged: a statement that opened them would fail
        path.write_bytes(b"not parquet")
    try:
        reader = Reader(lake)
        assert reader.sql("SELECT count(*) FROM _metrics WHERE run_id = 'moe-a'").rows[0][0] == each["moe-a"]
        with pytest.raises(QueryError):
            reader.sql("SELECT count(*) FROM _metrics")
    finally:
        for path, data in other.items():
            path.write_bytes(data)
    _cli("simulate", "reference-535b", "--spool", tmp_path / "null", "--run-id", "NULL", *SMALL)
    _cli("ingest", "spool", "--spool", tmp_path / "null", "--ledger", lake)
    runs = Reader(lake).sql("SELECT run_id, count(*) FROM _metrics GROUP BY 1 ORDER BY 1").rows
    assert runs == [("NULL", each["moe-a"]), ("moe-a", each["moe-a"]), ("moe-b", each["moe-b"])]
    folder = LakeFolder.read(lake)
    assert folder is not None
    con, _ = open_snapshot(folder.catalog, folder.data_path)
    try:  # DuckLake's own scan too (it takes the value from the catalog, which takes it from the path)
        assert con.execute("SELECT count(*) FROM lake.metrics WHERE run_id = 'NULL'").fetchall() == [
            (runs[0][1],)
        ]
    finally:
        con.close()
    assert _cli("state", "NULL", "--ledger", lake)[0].startswith("NULL at step")
