"""A ledger on DuckLake on a full disk: the lake's data folder, or its DuckDB-file catalog (the WAL a
commit writes), on a real small tmpfs (``tests.support.small_fs``) filled by the test up to its last
32 KB. ``ledger ingest spool`` says so in one line naming that place, and once the space is back the
same command lands every event exactly once (as a ledger of part files from the same spool holds
them) and verify passes. Each command runs in a process of its own, as a user runs it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.small_fs import SmallFs

pytest_plugins = ("tests.support.small_fs",)  # the small_fs fixture

ROOT = Path(__file__).resolve().parents[2]
DISK_FULL = re.compile(
    r"^error: no space left on device writing (?P<path>\S+) \([\d,.]+ [KMG]?B free of [\d,.]+ [KMG]?B\): "
    r"free some space there \(or point the command at a larger disk\) and run it again; what was "
    r"stored before the disk filled is kept\n$"
)
SAME = "SELECT count(*), sum(stream_seq), count(DISTINCT stream) FROM events WHERE source NOT LIKE 'ledger/%'"


def _invoke(*args: str | Path) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "runledger.cli.main", *map(str, args)],
        env=os.environ | {"RUNLEDGER_PROGRESS_S": "off", "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout, done.stderr


def _fill(disk: Path, leave_kb: int) -> Path:
    """A file of the test's own taking all but ``leave_kb`` of ``disk``'s free space."""
    filler = disk / "filler"
    st = os.statvfs(disk)
    size = max(st.f_bavail * st.f_frsize - leave_kb * 1024, 0)
    with open(filler, "wb") as f:
        for _ in range(size // (1 << 20)):
            f.write(b"\0" * (1 << 20))
        f.write(b"\0" * (size % (1 << 20)))
    return filler


@pytest.mark.parametrize("full", ["data folder", "catalog", "catalog after commits"])
def test_a_full_disk_under_a_lake_ingest_is_one_line_and_a_rerun_lands_everything(
    tmp_path: Path, small_fs: SmallFs, full: str
) -> None:
    spool = tmp_path / "spool"
    code, _, err = _invoke("simulate", "reference-535b", "--spool", spool, "--steps", "300")
    assert code == 0, err
    disk = small_fs(8 * 1024)
    ledger, part, keys = tmp_path / "ledger", tmp_path / "part", tmp_path / "keys"
    if full == "data folder":
        catalog, data = f"sqlite:{tmp_path / 'catalog.sqlite'}", disk / "data"
    else:
        catalog, data = f"sqlite:{disk / 'catalog.sqlite'}", tmp_path / "data"
    code, _, err = _invoke(
        "init",
        "--ledger",
        ledger,
        "--keys",
        keys,
        "--allow-unsigned",
        "*",
        "--catalog",
        catalog,
        "--data",
        data,
    )
    assert code == 0, err
    earlier = tmp_path / "earlier"  # commits before the disk fills: the writer's tables are inlined by then
    if full == "catalog after commits":
        code, _, err = _invoke(
            "simulate", "reference-535b", "--spool", earlier, "--steps", "200", "--run-id", "first"
        )
        assert code == 0, err
        assert (
            _invoke("ingest", "spool", "--spool", earlier, "--ledger", ledger, "--batch-size", "100")[0] == 0
        )
    filler = _fill(disk, 32)
    ingest = ("ingest", "spool", "--spool", spool, "--ledger", ledger, "--batch-size", "400")
    code, _, err = _invoke(*ingest)
    assert code == 1, err
    found = DISK_FULL.match(err)
    assert found, err
    assert Path(found["path"]).is_relative_to(disk), err  # the place that is full, not the ledger folder

    filler.unlink()  # the space is back
    code, _, err = _invoke(*ingest)
    assert code == 0, err
    assert _invoke("init", "--ledger", part, "--keys", keys, "--allow-unsigned", "*")[0] == 0
    if earlier.exists():
        assert _invoke("ingest", "spool", "--spool", earlier, "--ledger", part)[0] == 0
    assert _invoke("ingest", "spool", "--spool", spool, "--ledger", part)[0] == 0
    on_lake = _invoke("query", SAME, "--ledger", ledger, "-f", "csv")
    on_parts = _invoke("query", SAME, "--ledger", part, "-f", "csv")
    assert on_lake == on_parts and on_lake[0] == 0
    code, out, err = _invoke("verify", "--ledger", ledger)
    assert code == 0 and out.startswith("OK: "), out + err
    assert not list(disk.rglob("*.tmp"))


@pytest.mark.parametrize(
    ("full", "kind"), [("data folder", "sqlite"), ("data folder", "postgres"), ("catalog", "sqlite")]
)
def test_a_redaction_on_a_filling_disk_is_refused_or_recorded_and_compact_finishes_its_erasure(
    tmp_path: Path, small_fs: SmallFs, full: str, kind: str, request: pytest.FixtureRequest
) -> None:
    """A secret's redaction while the disk holding the lake's data folder (or its SQLite catalog)
    has almost no room: tried with 4 KB more free each time until it lands. Each try before that
    fails on the full disk with nothing recorded; the one that lands either erases the old bytes or
    is recorded and says in one line that its erasure stopped, where, and that `ledger compact`
    finishes it once there is room (a second redaction would be refused: it is recorded). While
    the disk is still full, compact is the full-disk line; with the space back it erases every byte
    of the secret, and verify reports the one redaction."""
    from runledger.ledger.integrity import verify_ledger
    from runledger.ledger.lake import ORPHAN_MIN_AGE_S
    from runledger.ledger.redaction import is_redacted
    from runledger.ledger.store import LedgerError
    from runledger.schemas.durable import disk_full
    from tests.lake.conftest import Backend
    from tests.lake.test_redact import SECRET, LakeSite, _note, _vacuum_pending
    from tests.merkle.test_redaction import _strings_of

    disk = small_fs(8 * 1024)
    on_disk = full == "data folder"
    backend = Backend(
        "sqlite",
        f"sqlite:{(tmp_path if on_disk else disk) / 'catalog.sqlite'}",
        (disk if on_disk else tmp_path) / "data",
    )
    site = LakeSite(tmp_path, backend)
    note = _note(site)
    filler = _fill(disk, 0)
    size = filler.stat().st_size
    stopped = None
    for room_kb in range(0, 2048, 4):
        os.truncate(filler, max(size - room_kb * 1024, 0))
        try:
            site.redact(note)
        except Exception as exc:
            if "is recorded" not in str(exc):  # refused before its commit: the full disk, nothing recorded
                assert disk_full(exc) is not None, repr(exc)
                assert not is_redacted(str(site.one("SELECT canonical FROM events WHERE id = ?", [note])))
                continue
            stopped = str(exc)
        break
    assert stopped is not None, "the redaction erased its bytes as soon as it could commit: no window tried"
    assert isinstance(stopped, str) and "\n" not in stopped
    found = re.fullmatch(
        r"commit 1 is recorded, but its erasure stopped: no space left on device writing (?P<path>\S+): "
        r"free some space there and run `ledger compact` to finish it \(until then the erased rows may "
        r"still be in the lake's files\)",
        stopped,
    )
    assert found, stopped
    assert Path(found["path"]).is_relative_to(disk), stopped
    assert is_redacted(str(site.one("SELECT canonical FROM events WHERE id = ?", [note])))

    os.truncate(filler, size)  # the disk full again: compact says so, and loses nothing
    code, _, err = _invoke("compact", "--ledger", site.root)
    assert code == 1 and DISK_FULL.match(err), err
    filler.unlink()
    code, out, err = _invoke("compact", "--ledger", site.root)
    assert code == 0, out + err
    # DuckDB's own writes that met the full disk (delete files, fences) left empty files that no
    # snapshot names: they hold no byte, and maintenance deletes them once an hour old (not sooner:
    # another writer's file is empty, and named by no snapshot, while DuckDB writes it).
    files = sorted(backend.data.rglob("*.parquet"))
    empty = [path for path in files if path.stat().st_size == 0]
    assert SECRET not in _strings_of([path for path in files if path not in empty])
    assert site.secret_in_catalog() == []
    assert not _vacuum_pending(backend)
    hour_ago = time.time() - ORPHAN_MIN_AGE_S - 60
    for path in empty:
        os.utime(path, (hour_ago, hour_ago))
    code, out, err = _invoke("compact", "--ledger", site.root)
    assert code == 0, out + err
    assert [path for path in empty if path.exists()] == []
    with pytest.raises(LedgerError, match="is redacted already"):
        site.redact(note)
    report = verify_ledger(site.root, site.vkey)
    assert report.ok, [p.line() for p in report.problems]
    assert [r["event_id"] for r in report.redactions] == [note]


def test_a_publish_to_a_full_destination_names_it_and_a_rerun_finishes_the_upload(
    tmp_path: Path, small_fs: SmallFs
) -> None:
    """DEST on a full disk (the ledger's own disk has room): the line names a file under DEST and
    DEST's free space, not the ledger's staging folder that the copy reads from (Python's copy
    names its source first); once there is room the same command finishes, leaves no temporary
    file, and an outside verifier checks the copy against the log key."""
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    assert _invoke("simulate", "reference-535b", "--spool", spool, "--steps", "300")[0] == 0
    assert _invoke("init", "--ledger", ledger, "--allow-unsigned", "*")[0] == 0
    assert _invoke("ingest", "spool", "--spool", spool, "--ledger", ledger)[0] == 0
    disk = small_fs(16 * 1024)
    dest = disk / "site"
    filler = _fill(disk, 0)
    code, _, err = _invoke("publish", dest, "--ledger", ledger)
    assert code == 1, err
    found = DISK_FULL.match(err)
    assert found and Path(found["path"]).is_relative_to(dest), err
    assert "(0 B free of 16.0 MB)" in err, err

    filler.unlink()
    code, out, err = _invoke("publish", dest, "--ledger", ledger)
    assert code == 0, out + err
    assert not [p for p in dest.rglob("*") if "tmp" in p.name], "a temporary file was left in DEST"
    log_key = ledger / ".keys" / "runledger.pub"
    code, out, err = _invoke("verify", "--remote", f"file://{dest}", "--log-key", log_key)
    assert code == 0, out + err


def test_a_ledger_on_a_full_disk_is_one_line_for_checkpoint_and_query_and_both_work_once_there_is_room(
    tmp_path: Path, small_fs: SmallFs
) -> None:
    """The whole ledger on a disk with no room: SQLite cannot make the catalog's shared-memory file
    (its error is "disk I/O error", no errno), so even a read is refused: each command says so as
    the full disk it is, naming the ledger's disk and its free space, and signs and answers once
    there is room."""
    spool = tmp_path / "spool"
    assert _invoke("simulate", "reference-535b", "--spool", spool, "--steps", "300")[0] == 0
    disk = small_fs(16 * 1024)
    ledger = disk / "ledger"
    assert _invoke("init", "--ledger", ledger, "--allow-unsigned", "*")[0] == 0
    assert _invoke("ingest", "spool", "--spool", spool, "--ledger", ledger)[0] == 0
    filler = _fill(disk, 0)
    for command in (("checkpoint",), ("query", "SELECT count(*) FROM events")):
        code, _, err = _invoke(*command, "--ledger", ledger)
        assert code == 1, err
        found = DISK_FULL.match(err)
        assert found and Path(found["path"]).is_relative_to(disk) and "(0 B free of 16.0 MB)" in err, err

    filler.unlink()
    code, out, err = _invoke("checkpoint", "--ledger", ledger)
    assert code == 0 and out.startswith("signed 3 stream checkpoints"), out + err
    code, out, err = _invoke("verify", "--ledger", ledger)
    assert code == 0 and out.startswith("OK: "), out + err


def test_a_migration_onto_a_full_disk_is_one_line_leaves_nothing_and_a_rerun_migrates(
    tmp_path: Path, small_fs: SmallFs
) -> None:
    """``ledger migrate`` of the old-format fixture into a folder on a disk with less room than the
    lake needs, at several sizes: each try is the full-disk line naming that disk (before: DuckDB's
    "Failed to commit DuckLake transaction." or SQLite's words), and leaves no NEW behind; with room,
    the same command migrates and the copy verifies against the fixture's log key."""
    old = tmp_path / "old"
    shutil.copytree(ROOT / "tests" / "fixtures" / "part-files-ledger" / "ledger", old)
    disk = small_fs(16 * 1024)
    new = disk / "new"
    filler = _fill(disk, 0)
    size = filler.stat().st_size
    for room_kb in (0, 64, 256, 512):
        os.truncate(filler, size - room_kb * 1024)
        code, _, err = _invoke("migrate", old, new)
        assert code == 1, err
        found = DISK_FULL.match(err)
        assert found and Path(found["path"]).is_relative_to(disk), err
        assert not new.exists()

    filler.unlink()
    code, out, err = _invoke("migrate", old, new)
    assert code == 0 and out.startswith("migrated 8 commits (1511 rows)"), out + err
    log_key = ROOT / "tests" / "fixtures" / "part-files-ledger" / "log.pub"
    code, out, err = _invoke("verify", "--ledger", new, "--public-key", log_key)
    assert code == 0, out + err
