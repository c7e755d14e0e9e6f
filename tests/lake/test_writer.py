"""The ledger's writer on DuckLake: `ledger init --catalog` + `ledger ingest spool` commit each batch as
one lake transaction, each event once, verified and published; SIGKILLed at random it lands every
event once; writers in separate folders (separate spools, or racing copies of one) share nothing but
the catalog and the data files, and land each event once; a ledger of the old format is refused."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.spool import SpoolWriter, spool_id
from runledger.ledger.lake import LakeFolder, LakeTables
from runledger.ledger.log_key import KEYS_DIR, recorded_log_key
from runledger.ledger.manifest import open_published
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, LedgerError, SourceRecord
from runledger.schemas.note import write_keypair
from tests.lake.conftest import Backend
from tests.support.factory import RunBuilder

runner = CliRunner()
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "200"}
ROOT = Path(__file__).resolve().parents[2]
OLD_FIXTURE = ROOT / "tests" / "fixtures" / "part-files-ledger" / "ledger"  # (copied, never written)


def _cli(*args: str | Path, code: int = 0) -> str:
    result = runner.invoke(app, [str(a) for a in args], env=ENV)
    assert result.exit_code == code, result.output
    return result.stdout


def _spool(folder: Path, run_id: str, steps: int) -> int:
    """A spool of one run's events (a launch, ``steps`` steps, a config change); their count."""
    run = RunBuilder(run_id=run_id)
    run.start()
    for s in range(1, steps + 1):
        run.step(s)
        if s == steps // 2:
            run.change(s, "lr", 0.0005)
    with SpoolWriter(folder) as w:
        for raw in run.events:
            w.append(raw)
    return len(run.events)


def _ingest_cmd(spool: Path, ledger: Path, batch: int = 50) -> list[str]:
    return [
        sys.executable,
        "-m",
        "runledger.cli.main",
        "ingest",
        "spool",
        "--spool",
        str(spool),
        "--ledger",
        str(ledger),
        "--batch-size",
        str(batch),
    ]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, **ENV}
    )
    assert done.returncode == 0, done.stderr


def _dense(reader: Reader, n: int, stream: str) -> None:
    """Every event of the stream once, seqs 0..n-1."""
    assert reader.sql(
        "SELECT count(*), count(DISTINCT id), min(stream_seq), max(stream_seq) FROM events WHERE stream = ?",
        [stream],
    ).rows == [(n, n, 0, n - 1)]


def test_a_ledger_on_the_lake_holds_each_event_once_and_publishes_it(tmp_path: Path) -> None:
    n = _spool(tmp_path / "spool", "run-a", 300)
    lake, keys, unsigned = tmp_path / "lake", tmp_path / "keys", "--allow-unsigned=*"
    out = _cli(
        "init", "--ledger", lake, "--keys", keys, unsigned, "--catalog", f"sqlite:{tmp_path / 'cat.sqlite'}"
    )
    assert out.startswith(f"created ledger {lake} (id ")
    _cli("ingest", "spool", "--spool", tmp_path / "spool", "--ledger", lake, "--batch-size", "40")
    with Ledger.open(lake) as on_lake:
        assert on_lake.lake is not None
        head = on_lake.stream_heads()["run-a"]
        assert head.size == n and head.tree.size == n
        assert on_lake.positions()[f"spool:{spool_id(tmp_path / 'spool')}"] == n
    reader = Reader(lake)
    _dense(reader, n, "run-a")
    assert _cli("state", "run-a", "--ledger", lake).startswith("run-a at step 300 (attempt 1)")
    # each commit record names the lake snapshot it made and its data files with their SHA-256
    record = json.loads(sorted((lake / "_commits").glob("*.json"))[-1].read_bytes())
    assert record["lake"]["snapshot"] == reader.snapshot
    assert record["lake_files"] and all(len(f["sha256"]) == 64 for f in record["lake_files"])
    # a replay lands nothing; the lake verifies
    assert "ingested 0 events" in _cli("ingest", "spool", "--spool", tmp_path / "spool", "--ledger", lake)
    assert _cli("verify", "--ledger", lake).startswith("OK: ")
    # published as one tile log with the lake snapshot's files: the remote check walks every entry
    # and file; the files hold each event once; one entry per event and per commit
    vkey = (keys / "runledger.pub").read_text().strip()
    pub = tmp_path / "pub"
    assert _cli("publish", pub, "--keys", keys, "--ledger", lake).startswith("published ")
    checked = _cli("verify", "--remote", f"file://{pub}", "--log-key", vkey)
    published = open_published(pub, vkey)
    stored = reader.sql("SELECT count(*) AS n FROM events").records()[0]["n"]
    assert pq.read_table(published.paths("events"), columns=["stream"], partitioning=None).num_rows == stored
    with Ledger.open(lake) as opened:
        size = stored + opened.last_commit + 2
    assert checked.startswith("OK ") and f"size {size}; {size} new entries" in checked, checked


def test_sigkill_at_random_points_lands_every_event_once(tmp_path: Path) -> None:
    n = _spool(tmp_path / "spool", "run-k", 4000)
    ledger = tmp_path / "ledger"
    Ledger.create_on_lake(ledger, f"sqlite:{tmp_path / 'cat.sqlite'}").close()
    cmd = _ingest_cmd(tmp_path / "spool", ledger)
    rng = random.Random(26)
    kills = 0
    for _ in range(12):  # killed at random instants until it finishes on its own
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(1.5, 3.5))  # past the interpreter's start: inside commits
        if proc.poll() is not None:
            break
        os.kill(proc.pid, signal.SIGKILL)
        kills += 1
        proc.wait()
    assert kills >= 3
    _run(cmd)
    reader = Reader(ledger)
    _dense(reader, n, "run-k")
    assert reader.sql("SELECT count(*) FROM metrics WHERE name = 'loss'").rows == [(4000,)]
    # the folder's records are exactly the lake's commits, numbered without a gap
    opened = Ledger.open(ledger)
    numbers = [int(p.stem) for p in opened.commit_paths()]
    assert numbers == list(range(len(numbers)))
    opened.close()


def _backend_catalog(backend: Backend) -> str:
    if not backend.many_processes:
        pytest.skip("a DuckDB-file catalog is held by one process")
    return backend.catalog


def test_writers_in_separate_folders_share_one_lake(backend: Backend, tmp_path: Path) -> None:
    """Two ingesters, each with its own folder and spool, committing at the same time."""
    catalog = _backend_catalog(backend)
    counts = {run: _spool(tmp_path / f"spool-{run}", run, 400) for run in ("run-x", "run-y")}
    first = Ledger.create_on_lake(tmp_path / "host-x", catalog, backend.data)
    first.close()
    marker = LakeFolder.read(tmp_path / "host-x")
    assert marker is not None
    out = _cli(
        "init",
        "--ledger",
        tmp_path / "host-y",
        "--keys",
        tmp_path / "keys",
        "--allow-unsigned=*",
        "--catalog",
        catalog,
        "--data",
        backend.data,
    )
    assert out.startswith("created ledger") or out.startswith("joined ledger")
    procs = [
        subprocess.Popen(
            _ingest_cmd(tmp_path / f"spool-{run}", tmp_path / f"host-{run[-1]}", batch=40),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run in counts
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    for host in ("host-x", "host-y"):
        reader = Reader(tmp_path / host)
        for run, n in counts.items():
            _dense(reader, n, run)
    # both folders follow the same commits, whoever made them
    x, y = Ledger.open(tmp_path / "host-x"), Ledger.open(tmp_path / "host-y")
    assert x.ledger_id == y.ledger_id and x.last_commit == y.last_commit
    assert x.read_commit(x.last_commit) == y.read_commit(y.last_commit)
    writers = {x.read_commit(i)["writer"] for i in range(x.last_commit + 1)}
    assert len({w for w in writers if w.startswith("spool")}) == 2
    x.close()
    y.close()


def test_racing_copies_of_one_ingester_land_each_record_once(backend: Backend, tmp_path: Path) -> None:
    """The same spool ingested from two folders at once (a failover that overlapped)."""
    catalog = _backend_catalog(backend)
    n = _spool(tmp_path / "spool", "run-r", 600)
    Ledger.create_on_lake(tmp_path / "a", catalog, backend.data).close()
    Ledger.create_on_lake(tmp_path / "b", catalog, backend.data).close()
    procs = [
        subprocess.Popen(
            _ingest_cmd(tmp_path / "spool", tmp_path / h, batch=30),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for h in ("a", "b")
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        outs.append(out)
    reader = Reader(tmp_path / "a")
    _dense(reader, n, "run-r")
    assert reader.sql("SELECT count(*) FROM quarantine").rows == [(0,)]
    landed = [int(o.split("ingested ", 1)[1].split(" ", 1)[0]) for o in outs]
    assert sum(landed) == n  # each copy counts only what it landed


def test_a_lake_of_another_ledger_or_a_ledger_of_the_old_format_is_refused(tmp_path: Path) -> None:
    catalog = f"sqlite:{tmp_path / 'cat.sqlite'}"
    made = Ledger.create_on_lake(tmp_path / "one", catalog, ledger_id="lab-a")
    made.close()
    with pytest.raises(LedgerError, match=r"the lake at .* is ledger lab-a, not lab-b"):
        Ledger.create_on_lake(tmp_path / "two", catalog, tmp_path / "one" / "data", ledger_id="lab-b")
    old = tmp_path / "old"
    shutil.copytree(OLD_FIXTURE, old)
    before = sorted((p, p.read_bytes()) for p in old.rglob("*") if p.is_file())
    with pytest.raises(LedgerError, match=r"is a ledger of the old format .* `ledger migrate "):
        Ledger.create_on_lake(old, catalog)
    with pytest.raises(LedgerError, match=r"is a ledger of the old format .* `ledger migrate "):
        Ledger.create(old)
    assert sorted((p, p.read_bytes()) for p in old.rglob("*") if p.is_file()) == before
    result = runner.invoke(app, ["init", "--ledger", str(tmp_path / "x"), "--catalog", "postgres:"], env=ENV)
    assert (
        result.exit_code == 1 and result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    )
    with LakeTables(catalog, tmp_path / "one" / "data") as lake:
        assert lake.state()["ledger_id"] == "lab-a"


CLI_INIT = [sys.executable, "-m", "runledger.cli.main", "init"]


def test_racing_creators_of_one_new_lake_agree_on_its_ledger_id(backend: Backend, tmp_path: Path) -> None:
    """Three `ledger init` at once on one new catalog, each from its own folder: one makes the tables
    and names the ledger in that transaction, the others find it made and take its name; one policy
    event starts the registry, and the folders whose own lost the race say they joined. Each folder
    brings the same log key (a joining host must bring the ledger's: ``test_join_host``), so the one
    that records it first records the key every folder holds."""
    catalog = _backend_catalog(backend)
    _, public = write_keypair(tmp_path / "key", "runledger")
    for i in range(3):
        shutil.copytree(tmp_path / "key", tmp_path / f"host-{i}" / KEYS_DIR)
    procs = [
        subprocess.Popen(
            [
                *CLI_INIT,
                "--ledger",
                str(tmp_path / f"host-{i}"),
                "--catalog",
                catalog,
                "--data",
                str(backend.data),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **ENV},
        )
        for i in range(3)
    ]
    said = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        said.append(out.split(" ledger ", 1)[0])
    assert said.count("created") == 1  # the others joined (a lake just made, or a policy that landed first)
    ids = {Ledger.open(tmp_path / f"host-{i}").ledger_id for i in range(3)}
    assert len(ids) == 1
    with contextlib.closing(Ledger.open(tmp_path / "host-0")) as joined:
        assert recorded_log_key(joined) == public.read_text().strip()
    with LakeTables(catalog, backend.data) as lake:
        assert lake.state()["ledger_id"] in ids
        named = lake.con.execute("SELECT count(*) FROM lake.ledger_state WHERE key = 'ledger_id'").fetchone()
        assert named == (1,)
    assert Reader(tmp_path / "host-0").sql(
        "SELECT count(*) FROM events WHERE type = 'ledger.policy.changed'"
    ).rows == [(1,)]


def _catalog_held_open(backend: Backend) -> str | None:
    """What of the catalog a connection holds open now (None: nothing). SQLite: a checkpoint of the
    WAL by another process, which a read transaction left open stops (busy). PostgreSQL: the
    sessions idle in a transaction on the catalog's database."""
    target = backend.catalog.split(":", 1)[1]
    if backend.kind == "sqlite":
        probe = (
            "import sqlite3, sys; db = sqlite3.connect(sys.argv[1], timeout=2); "
            "print(db.execute('PRAGMA wal_checkpoint(TRUNCATE)').fetchall()[0][0])"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe, target], capture_output=True, text=True, timeout=60, check=True
        )
        return None if out.stdout.strip() == "0" else "a read transaction stops the WAL's checkpoint"
    fields = dict(part.split("=", 1) for part in target.split())
    psql = sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))[-1]
    out = subprocess.run(
        [
            str(psql),
            *("-h", fields["host"], "-p", fields["port"], "-U", fields["user"], "-d", fields["dbname"]),
            "-tAc",
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state LIKE 'idle in transaction%'",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return None if out.stdout.strip() == "0" else f"{out.stdout.strip()} session(s) idle in a transaction"


def test_an_idle_ledger_holds_no_transaction_open_on_its_catalog(backend: Backend, tmp_path: Path) -> None:
    """A ledger opened, or one that has just committed, then idle (an ingester between batches)
    leaves no transaction open on the catalog: DuckDB's ``fetchone`` left its last read's result
    open, and with it a SQLite read transaction that no checkpoint could pass (its WAL grew while
    the writer idled; a redaction's VACUUM waited 60 s for each idle writer beside it)."""
    root = tmp_path / "ledger"
    run = RunBuilder(run_id="run-idle")
    run.start()
    run.step(1)
    with Ledger.create_on_lake(root, backend.catalog, backend.data, ledger_id="idle-test") as first:
        first.commit([SourceRecord("spool:a", i, raw) for i, raw in enumerate(run.events)])
        with Ledger.open(root) as second:  # opened: idle beside the first
            run.step(2)
            first.commit([SourceRecord("spool:a", len(run.events) - 1, run.events[-1])])
            assert _catalog_held_open(backend) is None
            run.step(3)
            second.commit([SourceRecord("spool:a", len(run.events) - 1, run.events[-1])])
            assert _catalog_held_open(backend) is None  # both idle, each after a commit
            with Reader(root) as reader:  # a reader kept open (the live page's) after its questions
                reader.state("run-idle")
                reader.sql("SELECT count(*) FROM events")
                run.step(4)
                first.commit([SourceRecord("spool:a", len(run.events) - 1, run.events[-1])])
                assert _catalog_held_open(backend) is None
            second.compact()  # (maintenance: DuckLake's merge, expiry and clean-up)
            run.step(5)
            first.commit([SourceRecord("spool:a", len(run.events) - 1, run.events[-1])])
            assert _catalog_held_open(backend) is None


def test_a_creator_that_looked_before_another_made_the_tables_joins_them(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window the racing creators above hit once in CI (PostgreSQL): a creator that found the
    tables missing, and whose BEGIN came after another's COMMIT made them, meets them at CREATE
    ("already exists"). It joins the lake the other made, as a creator that lost at COMMIT does."""
    with LakeTables(backend.catalog, backend.data, name_new="first") as first:
        assert first.named_now
    looks = {"n": 0}
    real_missing = LakeTables._missing

    def looked_early(self: LakeTables) -> list[str]:  # both looks before the other's COMMIT
        looks["n"] += 1
        return list(self._all_tables()) if looks["n"] <= 2 else real_missing(self)

    monkeypatch.setattr(LakeTables, "_missing", looked_early)
    with LakeTables(backend.catalog, backend.data, name_new="second") as second:
        assert looks["n"] >= 3 and not second.named_now
        assert second.stored_ledger_id() == "first"
