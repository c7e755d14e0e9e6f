"""`ledger redact` on a ledger whose tables are in a DuckLake, on every catalog backend.

On a lake a redaction is one engine transaction (the event's rows deleted, its events row added
again marked, its salt deleted, its signed record appended) and then the bytes leave the disk: the
files holding the rows are rewritten, every snapshot that named them expired, the old files deleted,
the catalog's statistics taken again and its storage compacted. Checked here by reading every data
file and every catalog row (and a file catalog's raw bytes) for the secret.

Attacked: SIGKILL between the commit and the erasure and in the middle of the erasure (the next
maintenance finishes it), redacting twice and unknown ids, a config secret that later rows carry,
time travel to a snapshot that held it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runledger.ledger.integrity import prove_inclusion, verify_ledger
from runledger.ledger.lake import ALIAS, LakeTables
from runledger.ledger.publish import publish
from runledger.ledger.query import QueryError, Reader
from runledger.ledger.redaction import is_redacted, redact, salt_of
from runledger.ledger.store import Ledger, LedgerError, SourceRecord
from runledger.ledger.stream_checkpoints import sign_checkpoints
from runledger.schemas.note import write_keypair
from tests.lake.conftest import Backend
from tests.merkle.test_redaction import SECRET, _config_story, _story, _strings_in, app, invoke
from tests.support.factory import RunBuilder

ROOT = Path(__file__).resolve().parents[2]


class LakeSite:
    """A ledger on the backend's lake holding one run with a secret in a note, and a log key pair."""

    def __init__(self, tmp: Path, backend: Backend, run: RunBuilder | None = None) -> None:
        self.backend = backend
        self.root = tmp / "ledger"
        private, public = write_keypair(tmp / "keys", "runledger-log")
        self.key_file, self.skey, self.vkey = private, private.read_text().strip(), public.read_text().strip()
        self.run = run or _story()
        with Ledger.create_on_lake(self.root, backend.catalog, backend.data, ledger_id="redact-test") as led:
            led.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(self.run.events)])

    def reader(self) -> Reader:
        return Reader(self.root)

    def one(self, sql: str, params: list[object] | None = None) -> object:
        reader = self.reader()
        try:
            return reader.sql(sql, params or []).rows[0][0]
        finally:
            reader.close()

    def redact(self, event_id: str, reason: str = "a token in a note") -> object:
        return redact(self.root, event_id, reason=reason, actor="alice", private_key=self.skey)

    def secret_in_catalog(self, secret: str = SECRET) -> list[str]:
        """Where the secret still is in the catalog: its tables' rows (every backend), and a file
        catalog's raw bytes (free pages and blocks included) with its WAL."""
        found = []
        with LakeTables(self.backend.catalog, self.backend.data, create=False) as lake:
            meta = f"__ducklake_metadata_{ALIAS}"
            listed = lake.con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [meta]
            ).fetchall()  # (a PostgreSQL catalog's are not listed there: the two with values are named)
            names = {n for (n,) in listed} | {"ducklake_file_column_stats", "ducklake_table_column_stats"}
            for name in sorted(names):
                row = lake.con.execute(
                    f'SELECT count(*) FROM {meta}."{name}" AS t WHERE CAST(t AS VARCHAR) LIKE ?',
                    [f"%{secret}%"],
                ).fetchone()
                if row and row[0]:
                    found.append(f"rows of {name}")
        if self.backend.kind != "postgres":
            target = Path(self.backend.catalog.split(":", 1)[1])
            for path in target.parent.glob(target.name + "*"):
                if secret.encode() in path.read_bytes():
                    found.append(f"bytes of {path.name}")
        return found


def _note(site: LakeSite) -> str:
    return str(site.one("SELECT id FROM events WHERE type = 'runledger.annotation'"))


def test_redaction_on_a_lake_erases_the_payload_from_every_file_and_the_catalog(
    tmp_path: Path, backend: Backend
) -> None:
    site = LakeSite(tmp_path, backend)
    sign_checkpoints(site.root, site.skey)
    note = _note(site)
    before = prove_inclusion(site.root, note)
    reader = site.reader()
    old_snapshot = reader.snapshot
    reader.close()
    assert SECRET in _strings_in(backend.data) and site.secret_in_catalog()

    done = site.redact(note)
    assert done.salted and done.rewritten >= 2  # type: ignore[attr-defined]

    # The bytes are gone: from every data file on disk, from the catalog's rows and its files.
    assert SECRET not in _strings_in(backend.data)
    assert site.secret_in_catalog() == []
    reader = site.reader()
    try:
        (canonical,) = reader.sql("SELECT canonical FROM events WHERE id = ?", [note]).rows[0]
        assert is_redacted(canonical)
        assert reader.sql("SELECT count(*) FROM annotations").rows == [(0,)]
        assert reader.sql("SELECT count(*) FROM metrics WHERE name = 'loss'").rows == [(20,)]
        assert reader.sql("SELECT count(*) FROM events").rows == [(len(site.run.events) + 1,)]
    finally:
        reader.close()
    with LakeTables(backend.catalog, backend.data, create=False) as lake:
        assert salt_of(lake, "run-a", 11) is None and salt_of(lake, "run-a", 12) is not None

    # verify: no file with deletions, every file named; the redaction reported with its reason.
    report = verify_ledger(site.root, site.vkey)
    assert report.ok, [pr.line() for pr in report.problems]
    assert [(r["event_id"], r["reason"]) for r in report.redactions] == [(note, "a token in a note")]
    after = prove_inclusion(site.root, note)
    assert (after["leaf_hash"], after["audit_path"]) == (before["leaf_hash"], before["audit_path"])

    # Another host's folder, opened after the redaction expired the snapshots before it, takes
    # every commit record (the redaction's own included) and verifies the same.
    with Ledger.create_on_lake(tmp_path / "host-b", backend.catalog, backend.data, ledger_id="redact-test"):
        pass
    report_b = verify_ledger(tmp_path / "host-b", site.vkey)
    assert report_b.ok and len(report_b.redactions) == 1, [pr.line() for pr in report_b.problems]

    # A snapshot that held the bytes is expired: time travel to it says so in one line.
    with pytest.raises(QueryError, match=rf"snapshot {old_snapshot} has expired"):
        Reader(site.root, snapshot=old_snapshot)

    # The published copy holds no trace either.
    publish(site.root, tmp_path / "site", site.skey)
    assert SECRET not in _strings_in(tmp_path / "site")
    assert "hunter2" not in "".join(
        p.read_text(errors="replace") for p in (tmp_path / "site").rglob("*") if p.is_file()
    )


def test_cli_redact_history_state_verify_on_a_lake(tmp_path: Path, backend: Backend) -> None:
    if backend.kind == "postgres":
        pytest.skip("the CLI is the same on every catalog; the postgres run is the test above")
    site = LakeSite(tmp_path, backend)
    note = _note(site)
    args = ("--reason", "leak", "--actor", "alice", "--key", site.key_file, "--ledger", site.root)
    code, out = invoke("redact", note, *args)
    assert code == 0, out
    assert out.startswith(f"redacted runledger.annotation {note} (stream run-a #11) in commit 1: ")
    assert (invoke("redact", note, *args)) == (1, f"error: event {note} is redacted already (leak)\n")
    code, out = invoke("redact", "no-such-event", *args)
    assert (code, out) == (1, "error: no event with id 'no-such-event' in this ledger\n")
    code, out = invoke("history", "run-a", "--all", "--ledger", site.root, "--format", "csv")
    assert code == 0 and f"REDACTED runledger.annotation {note} (#11) by alice: leak" in out
    assert SECRET not in out
    code, out = invoke("verify", "--ledger", site.root, "--public-key", site.key_file.with_suffix(".pub"))
    assert code == 0, out
    assert f"redacted: stream run-a event {note} (#11, runledger.annotation) by alice at " in out
    assert app is not None


def test_a_config_secret_is_erased_from_every_later_config_row_on_a_lake(
    tmp_path: Path, backend: Backend
) -> None:
    if backend.kind == "postgres":
        pytest.skip("the refold is the same on every catalog")
    site = LakeSite(tmp_path, backend, _config_story())
    secret_changes = (
        site.reader()
        .sql(
            "SELECT id FROM events WHERE type = 'runledger.config.changed' AND canonical LIKE ? ORDER BY stream_seq",
            [f'%"{SECRET}"%'],
        )
        .rows
    )
    site.redact(secret_changes[0][0], reason="token in config")
    reader = site.reader()
    try:
        assert [r[0] for r in reader.sql("SELECT cause FROM configs ORDER BY stream_seq").rows] == [
            "start",
            "file_edit",
            "file_edit",
        ]
        state = reader.state("run-a")
        assert state.config == {"lr": 0.5, "token": "none"}
    finally:
        reader.close()
    report = verify_ledger(site.root, site.vkey)
    assert report.ok, [pr.line() for pr in report.problems]
    site.redact(secret_changes[1][0], reason="token in config")  # the `test` op still named it
    assert SECRET not in _strings_in(backend.data) and site.secret_in_catalog() == []
    with Ledger.open(site.root) as led:
        led.compact()  # the lake's merge afterwards: verify still passes
    assert verify_ledger(site.root, site.vkey).ok


_KILLER = """
import os, signal, sys
import runledger.ledger.lake as lake
from ledger.redaction import redact
where = sys.argv[2]
if where == "before-erasure":  # the erasure after the commit (the writer's first one, as it takes
    # its turn, finishes an earlier redaction's: nothing here)
    erase, calls = lake.LakeTables.erase_deleted, []
    def erase_then_die(self):
        calls.append(self)
        if len(calls) == 1:
            return erase(self)
        os.kill(os.getpid(), signal.SIGKILL)
    lake.LakeTables.erase_deleted = erase_then_die
else:  # after the files are rewritten, before any snapshot is expired
    lake._restat_text_columns = lambda con, tables: os.kill(os.getpid(), signal.SIGKILL)
redact(sys.argv[1], sys.argv[3], reason="leak", actor="alice", private_key=open(sys.argv[4]).read())
"""


@pytest.mark.parametrize("where", ["before-erasure", "mid-erasure"])
def test_sigkill_after_the_commit_is_finished_by_the_next_maintenance(
    tmp_path: Path, backend: Backend, where: str
) -> None:
    if backend.kind == "postgres":
        pytest.skip("the recovery is the lake's own on every catalog")
    site = LakeSite(tmp_path, backend)
    note = _note(site)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, str(site.root), where, note, str(site.key_file)],
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # Committed: readers see the marker; but the old bytes are still on disk, and verify says so.
    assert is_redacted(str(site.one("SELECT canonical FROM events WHERE id = ?", [note])))
    assert SECRET in _strings_in(backend.data)
    report = verify_ledger(site.root, site.vkey)
    if where == "before-erasure":  # the raw files still hold the rows DuckDB hides: verify says so
        assert "rows deleted from the lake's table" in report.problems[0].line()
        assert "its payload is still stored" in "\n".join(pr.line() for pr in report.problems)
    else:  # the newest snapshot's files are rewritten; older snapshots still name the old files
        assert report.ok, [pr.line() for pr in report.problems]
    with Ledger.open(site.root) as led:
        stats = led.compact()
    assert stats["files_erased"] >= 1
    assert SECRET not in _strings_in(backend.data) and site.secret_in_catalog() == []
    report = verify_ledger(site.root, site.vkey)
    assert report.ok, [pr.line() for pr in report.problems]
    assert len(report.redactions) == 1


_WRITER = """
import sys
from runledger.ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder
run = RunBuilder(run_id="run-b")
run.start()
for step in range(1, 300):
    run.step(step)
with Ledger.create_on_lake(sys.argv[1], sys.argv[2], sys.argv[3], ledger_id="redact-test") as led:
    print("started", flush=True)
    for i in range(0, len(run.events), 10):
        led.commit([SourceRecord("spool:b", j, run.events[j]) for j in range(i, min(i + 10, len(run.events)))])
"""


def test_a_redaction_while_another_host_ingests_loses_nothing(tmp_path: Path, backend: Backend) -> None:
    """A writer in another process and folder commits in small batches while the redaction runs:
    both land (the redaction redone on the writer's commits where it raced one), every event is
    there once, and both folders verify."""
    if not backend.many_processes:
        pytest.skip("a DuckDB-file catalog belongs to one process")
    site = LakeSite(tmp_path, backend)
    note = _note(site)
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path / "host-b"), backend.catalog, str(backend.data)],
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None and writer.stdout.readline().strip() == "started"
    site.redact(note)
    _out, err = writer.communicate(timeout=300)
    assert writer.returncode == 0, err[-2000:]
    counts = (
        site.reader()
        .sql("SELECT stream, count(*), count(DISTINCT stream_seq) FROM events GROUP BY 1 ORDER BY 1")
        .rows
    )
    assert counts == [("run-a", 24, 24), ("run-b", 300, 300)]
    assert SECRET not in _strings_in(backend.data) and site.secret_in_catalog() == []
    for root in (site.root, tmp_path / "host-b"):
        report = verify_ledger(root, site.vkey)
        assert report.ok and len(report.redactions) == 1, [pr.line() for pr in report.problems]


def _checkpointed(catalog: Path) -> None:
    """Everything of a SQLite catalog in its main file (its WAL emptied), so damage to it is damage."""
    if catalog.suffix == ".sqlite":
        import sqlite3

        with sqlite3.connect(catalog) as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


@pytest.mark.parametrize("damage", ["truncated", "schema page overwritten"])
def test_a_damaged_catalog_is_one_line_for_redact_state_and_verify_and_loses_nothing(
    tmp_path: Path, backend: Backend, damage: str
) -> None:
    if backend.kind == "postgres":
        pytest.skip("a server's catalog is not a file here to damage")
    site = LakeSite(tmp_path, backend)
    note = _note(site)
    events = site.one("SELECT count(*) FROM events")
    catalog = Path(backend.catalog.split(":", 1)[1])
    _checkpointed(catalog)
    good = catalog.read_bytes()
    if damage == "truncated":
        catalog.write_bytes(good[: len(good) // 2])
    else:  # page 1 after SQLite's 100-byte header: the schema (its text no longer UTF-8)
        catalog.write_bytes(good[:100] + b"\x95" * 3996 + good[4096:])
    pub = site.key_file.with_suffix(".pub")
    for args in (
        ("redact", note, "--reason", "leak", "--actor", "alice", "--key", site.key_file),
        ("state", "run-a"),
        ("verify", "--public-key", pub),
    ):
        code, out = invoke(*args, "--ledger", site.root)
        assert code == 1 and out.count("\n") == 1 and out.startswith("error: "), (args, out)
        assert str(catalog) in out, out  # the file to restore, named
    catalog.write_bytes(good)  # the catalog restored from a copy: every event is there, and redact works
    assert site.one("SELECT count(*) FROM events") == events
    code, out = invoke(
        "redact", note, "--reason", "leak", "--actor", "alice", "--key", site.key_file, "--ledger", site.root
    )
    assert code == 0, out


def test_threads_redacting_at_once_all_land_on_a_lake_that_takes_several_writers(
    tmp_path: Path, backend: Backend
) -> None:
    """Six threads of one process, each its own ``redact`` (its own ledger and lake connection), on
    six events: every redaction lands, each once, and the ledger verifies."""
    import threading

    site = LakeSite(tmp_path, backend)
    reader = site.reader()
    ids = [r[0] for r in reader.sql("SELECT id FROM events ORDER BY stream_seq LIMIT 6 OFFSET 1").rows]
    reader.close()
    errors: list[BaseException] = []

    def one(event_id: str) -> None:
        try:
            site.redact(event_id, reason=f"thread {event_id}")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(event_id,)) for event_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    reader = site.reader()
    rows = reader.sql("SELECT id, canonical FROM events").rows
    reader.close()
    assert sorted(i for i, canonical in rows if is_redacted(canonical)) == sorted(ids)
    assert verify_ledger(site.root, site.vkey).ok


_HOLD_A_READ = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN")
db.execute("SELECT count(*) FROM ducklake_file_column_stats").fetchall()
print("holding", flush=True)
time.sleep(300)
"""


def _hold_a_read(backend: Backend) -> subprocess.Popen[str]:
    """Another process in a read transaction on the catalog's statistics, until killed."""
    target = backend.catalog.split(":", 1)[1]
    if backend.kind == "sqlite":
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLD_A_READ, target], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        return holder
    fields = dict(part.split("=", 1) for part in target.split())
    psql = sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))[-1]
    holder = subprocess.Popen(
        [str(psql), "-h", fields["host"], "-p", fields["port"], "-U", fields["user"], "-d", fields["dbname"]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("BEGIN;\nSELECT 'holding' FROM ducklake_file_column_stats LIMIT 1;\n")
    holder.stdin.flush()
    said = [holder.stdout.readline().strip() for _ in range(3)]  # BEGIN, then the SELECT's header
    assert said[0] == "BEGIN" and said[1] == "?column?", said
    return holder


def _release(holder: subprocess.Popen[str]) -> None:
    """The reader's transaction ended, and the reader gone: psql rolls back before it reads the end
    of its input (so its session's locks are released when it exits); SQLite's end with the process."""
    if holder.stdin is not None and holder.poll() is None:
        holder.stdin.write("ROLLBACK;\n")
        holder.stdin.close()
    else:
        holder.kill()
    holder.wait(timeout=60)


def _vacuum_pending(backend: Backend) -> bool:
    from runledger.ledger.lake import VACUUM_OPTION

    with LakeTables(backend.catalog, backend.data, create=False) as lake:
        rows = lake.con.execute(
            f"SELECT count(*) FROM __ducklake_metadata_{ALIAS}.ducklake_metadata WHERE key = ?",
            [VACUUM_OPTION],
        ).fetchall()
    return bool(rows[0][0])


def test_a_reader_holding_the_catalog_is_told_of_and_the_erasure_finished_later(
    tmp_path: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader in another process holds a read transaction on the catalog's statistics while a
    redaction compacts the catalog's storage: SQLite's WAL cannot be emptied (the old pages, the
    secret among them, stay in its files), PostgreSQL's VACUUM FULL waits for the reader's lock
    (before: for as long as the reader stayed). Each waits a bounded time, the redaction says in one
    line that it is recorded and its erasure pending, and ``ledger compact`` once the reader is gone
    finishes it."""
    from typer.testing import CliRunner

    import runledger.ledger.lake as lake_module
    from runledger.cli.main import app as ledger_app

    monkeypatch.setattr(lake_module, "VACUUM_BUSY_S", 1.0)  # (a reader held past it; 30 s by default)
    site = LakeSite(tmp_path, backend)
    note = _note(site)
    holder = _hold_a_read(backend)
    try:
        with pytest.raises(LedgerError) as told:
            site.redact(note)
        line = str(told.value)
        assert "\n" not in line and "is recorded, but" in line, line
        assert "erased rows may still be in its storage" in line and "ledger compact" in line, line
        assert is_redacted(str(site.one("SELECT canonical FROM events WHERE id = ?", [note])))
        assert _vacuum_pending(backend)
        if backend.kind == "sqlite":
            assert site.secret_in_catalog()  # still in the catalog's files: the promise is not yet kept
    finally:
        _release(holder)
    compacted = CliRunner().invoke(ledger_app, ["compact", "--ledger", str(site.root)])
    assert compacted.exit_code == 0, compacted.output
    assert site.secret_in_catalog() == []
    assert not _vacuum_pending(backend)
    assert verify_ledger(site.root, site.vkey).ok
