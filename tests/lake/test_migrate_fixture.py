"""`ledger migrate` on the committed ledger of part files (tests/fixtures/part-files-ledger, made by
tests/fixtures/make_part_files_ledger.py while the old writer existed): two runs and a repo stream,
config changes, a crash and resume, quarantined records, a compaction, a redaction, signed
checkpoints. Migrated into SQLite and PostgreSQL catalogs: identical rows, Merkle roots and sizes,
the signed checkpoints verify, `state`/`history` answer the same; a used target or a damaged ledger
is one line, exit 1, and no folder claiming to be a ledger."""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.spool import SpoolWriter
from runledger.ledger.integrity import recorded_streams
from runledger.ledger.lake import LAKE_MARKER, LakeFolder, LakeTables
from runledger.ledger.lake_migrate import MigrateError, migrate_into
from runledger.ledger.merkle import CompactRange, root_from_leaf_hashes
from runledger.ledger.parquet_schemas import SALTS, TABLES
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, LedgerError, SourceRecord
from tests.lake.support import Postgres
from tests.support.factory import RunBuilder

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "part-files-ledger"
MAX_FIXTURE_BYTES = 2 * 1024 * 1024
RUNS = ("run-a", "run-b")
REPO = "octo-org/hello-world"
runner = CliRunner()


# ----------------------------------------------------------------- helpers
def _invoke(*args: str | Path) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args], env={"RUNLEDGER_PROGRESS_S": "off"})
    return result.exit_code, result.output


def _ok(*args: str | Path) -> str:
    code, out = _invoke(*args)
    assert code == 0, out
    return out


def _tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` -> its SHA-256 (what "left unchanged" means here)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _old_rows(old: Path, name: str) -> list[str]:
    """A table's rows read straight from the old files with pyarrow (not the migration's own reader),
    each as canonical JSON, sorted: the data columns, not the partition folder's."""
    files = sorted(str(p) for p in (old / name).glob("*=*/*.parquet"))
    if not files:
        return []
    table = ds.dataset(files, format="parquet").to_table()
    return sorted(json.dumps(row, sort_keys=True, default=str) for row in table.to_pylist())


def _new_rows(lake: LakeTables, name: str, columns: list[str]) -> list[str]:
    """The lake's rows of a table, the same columns (the partition column is the lake's own)."""
    if not columns:
        return []
    listed = ", ".join(f'"{c}"' for c in columns)
    with lake.reader() as con:
        table = con.execute(f'SELECT {listed} FROM "{name}"').to_arrow_table()
    return sorted(json.dumps(row, sort_keys=True, default=str) for row in table.to_pylist())


def _columns(old: Path, name: str) -> list[str]:
    files = sorted((old / name).glob("*=*/*.parquet"))
    return ds.dataset([str(f) for f in files], format="parquet").schema.names if files else []


def _lake_of(folder: Path) -> LakeTables:
    marker = json.loads((folder / LAKE_MARKER).read_text())
    catalog = marker["catalog"]
    if catalog.startswith("sqlite:") and not Path(catalog[len("sqlite:") :]).is_absolute():
        catalog = f"sqlite:{folder / catalog[len('sqlite:') :]}"
    return LakeTables(catalog, folder / marker["data_path"], create=False)


def _newest_record(old: Path) -> dict[str, Any]:
    return json.loads(sorted((old / "_commits").glob("*.json"))[-1].read_text())


@pytest.fixture
def old(tmp_path: Path) -> Path:
    """A copy of the committed fixture: the tests never touch the committed files."""
    assert (FIXTURE / "ledger" / "LEDGER.json").exists(), f"{FIXTURE} is missing: it is committed"
    shutil.copytree(FIXTURE / "ledger", tmp_path / "old")
    return tmp_path / "old"


@dataclass(frozen=True)
class Migrated:
    old: Path  # the copy of the fixture it was migrated from
    new: Path  # the migrated ledger's folder


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def migrated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Migrated:
    """The fixture migrated once per catalog kind (SQLite in the new folder, a fresh PostgreSQL
    database) through the CLI; the tests that only read it share it. OLD is left byte for byte."""
    root = tmp_path_factory.mktemp(f"migrated-{request.param}")
    if request.param == "sqlite":
        catalog = f"sqlite:{root / 'new' / 'catalog.sqlite'}"
    else:
        server = request.getfixturevalue("postgres")
        if isinstance(server, str):
            pytest.skip(server)
        assert isinstance(server, Postgres)
        catalog = f"postgres:{server.database()}"
    shutil.copytree(FIXTURE / "ledger", root / "old")
    before = _tree_digest(root / "old")
    out = _ok("migrate", root / "old", root / "new", "--catalog", catalog)
    assert "rows, positions and stream heads identical" in out
    assert _tree_digest(root / "old") == before, "migrate wrote into the old ledger"
    return Migrated(root / "old", root / "new")


# ----------------------------------------------------------------- the fixture itself
def test_the_fixture_holds_every_case_and_is_small() -> None:
    size = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    assert size < MAX_FIXTURE_BYTES, size
    records = [json.loads(p.read_text()) for p in sorted((FIXTURE / "ledger" / "_commits").glob("*.json"))]
    assert [r["commit"] for r in records] == list(range(len(records)))
    writers = [r.get("writer") for r in records]
    assert "compact" in writers and "redact" in writers
    assert set(records[-1]["streams"]) == {*RUNS, REPO}
    assert sorted((FIXTURE / "ledger" / "_checkpoints").glob("*.txt")) and (FIXTURE / "log.pub").exists()
    assert not list(FIXTURE.rglob("*.key")), "only the log's public key is committed"
    old = FIXTURE / "ledger"
    assert len(_old_rows(old, "quarantine")) == 2
    assert len(_old_rows(old, "config_changes")) == 3
    assert 200 <= len(_old_rows(old, "events")) <= 1000


# ----------------------------------------------------------------- a migration that works
def test_every_table_keeps_its_rows(migrated: Migrated) -> None:
    with _lake_of(migrated.new) as lake:
        for name in [*TABLES, SALTS.name]:
            columns = _columns(migrated.old, name)
            assert _new_rows(lake, name, columns) == _old_rows(migrated.old, name), name


def test_every_stream_keeps_its_merkle_root_and_size(migrated: Migrated) -> None:
    """The old records' heads, the new lake's heads and the leaves the new folder's records hold
    (copied from the lake) all give the same size and root."""
    heads = {s: CompactRange.from_json(h["tree"]) for s, h in _newest_record(migrated.old)["streams"].items()}
    assert set(heads) == {*RUNS, REPO}
    with Ledger.open(migrated.new) as moved:
        assert {s: (h.size, h.tree.root()) for s, h in moved.stream_heads().items()} == {
            s: (t.size, t.root()) for s, t in heads.items()
        }
        leaves = {s: root_from_leaf_hashes(r.leaves) for s, r in recorded_streams(moved).items()}
    assert leaves == {s: t.root() for s, t in heads.items()}


def test_the_signed_checkpoints_verify_against_the_migrated_ledger(migrated: Migrated) -> None:
    code, verified = _invoke("verify", "--ledger", migrated.new, "--public-key", FIXTURE / "log.pub")
    assert code == 0, verified
    assert "3 signed checkpoints" in verified, verified


def test_state_and_history_answer_the_same_after(migrated: Migrated) -> None:
    """The migrated ledger answers as the old folder did through the old reader: the answers kept
    with the fixture (answers.json, asked by its generator), and asked again while that reader exists."""
    kept: dict[str, str] = json.loads((FIXTURE / "answers.json").read_text())
    assert len(kept) == 5 and "lr" in kept["state run-a --step 45"] and "REDACTED" in kept["history run-b"]
    after = {asked: _ok(*asked.split(), "--ledger", migrated.new) for asked in kept}
    assert after == kept


def test_migrating_twice_is_refused(migrated: Migrated) -> None:
    marker = (migrated.new / LAKE_MARKER).read_bytes()
    catalog = LakeFolder.read(migrated.new)
    assert catalog is not None
    code, out = _invoke("migrate", migrated.old, migrated.new, "--catalog", catalog.catalog)
    _one_line_refusal(code, out)
    assert "is a ledger already" in out
    assert (migrated.new / LAKE_MARKER).read_bytes() == marker
    with Ledger.open(migrated.new) as ledger:
        assert ledger.last_commit == _newest_record(migrated.old)["commit"]


def test_a_migrated_fixture_takes_new_commits(old: Path, tmp_path: Path) -> None:
    migrate_into(old, tmp_path / "new")
    newest = _newest_record(old)
    more = RunBuilder(run_id="run-c")
    more.start()
    more.step(1)
    with Ledger.open(tmp_path / "new") as ledger:
        positions = ledger.positions()
        source = "spool:fixture"
        first = positions[source]
        done = ledger.commit([SourceRecord(source, first + i, raw) for i, raw in enumerate(more.events)])
        assert done.commit == int(str(newest["commit"])) + 1 and done.accepted == 2
    runs = Reader(tmp_path / "new").sql("SELECT DISTINCT run_id FROM runs ORDER BY 1").rows
    assert runs == [("run-a",), ("run-b",), ("run-c",)]


def test_an_unfinished_rename_is_read_as_recovery_would_finish_it(old: Path, tmp_path: Path) -> None:
    """The old writer died after its commit point: a file of the newest commit is still *.tmp."""
    wanted = _old_rows(old, "events")
    newest = _newest_record(old)
    named = next(rel for rel in newest["files"] if str(rel).startswith("events/"))
    final = old / str(named)
    final.rename(final.with_name(final.name + ".tmp"))
    done = migrate_into(old, tmp_path / "new")
    assert done.mismatches == []
    with _lake_of(tmp_path / "new") as lake:
        assert _new_rows(lake, "events", _columns(FIXTURE / "ledger", "events")) == wanted
    assert final.with_name(final.name + ".tmp").exists() and not final.exists(), "OLD was changed"


def test_migrate_reads_the_old_ledger_without_its_writer() -> None:
    """lake_migrate takes nothing from runledger.ledger.store: the commit records are read through
    runledger.ledger.records (the one reader of them), and nothing of the part-file writer, its
    compaction, its recovery (all deleted) or its dedupe index is used."""
    import runledger.ledger.lake_migrate as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert not {name for mod, name in imported if mod == "runledger.ledger.store"}
    assert {"COMMITS", "commit_record_paths"} <= {
        name for mod, name in imported if mod == "runledger.ledger.records"
    }
    assert not {
        mod for mod, _ in imported if mod in {"runledger.ledger.compaction", "runledger.ledger.seen_index"}
    }


@pytest.mark.parametrize(
    "command",
    [
        ["open"],
        ["ingest", "spool", "--spool", "{spool}"],
        ["query", "SELECT count(*) FROM events"],
        ["query", "SELECT 1", "--snapshot", "1"],
        ["state", "run-a"],
        ["redact", "run-a-3", "--reason", "r", "--actor", "a"],
        ["compact"],
    ],
)
def test_the_old_format_is_one_line_naming_ledger_migrate(
    old: Path, tmp_path: Path, command: list[str]
) -> None:
    """Nothing opens a ledger of the old format now: the library, ingest, query and the rest each
    say so in one line with the exact `ledger migrate OLD NEW` command, and write nothing into it."""
    before = _tree_digest(old)
    line = f"{old} is a ledger of the old format (part files), which this version no longer opens or writes: "
    migrate = f"make it a lake with `ledger migrate {old} {old.with_name('old-lake')}`"
    if command == ["open"]:
        with pytest.raises(LedgerError) as raised:
            Ledger.open(old)
        said = f"error: {raised.value}\n"
    else:
        spool = tmp_path / "spool"
        run = RunBuilder(run_id="run-c")
        run.start()
        with SpoolWriter(spool) as writer:  # something to ingest: ingest reaches the ledger
            for raw in run.events:
                writer.append(raw)
        code, said = _invoke(*[a.format(spool=spool) for a in command], "--ledger", old)
        _one_line_refusal(code, said)
    assert said.startswith(f"error: {line}{migrate} (it is read, never changed)"), said
    assert _tree_digest(old) == before, "the old ledger was written"
    # and the command it names makes the lake
    assert _ok("migrate", old, old.with_name("old-lake")).startswith("migrated ")


# ----------------------------------------------------------------- refusals: one line, nothing left
def _one_line_refusal(code: int, out: str) -> None:
    assert code == 1, out
    assert out.count("\n") == 1, out
    assert "Traceback" not in out


def _no_ledger_at(new: Path) -> None:
    assert not (new / LAKE_MARKER).exists() and not (new / "LEDGER.json").exists()
    with pytest.raises(LedgerError, match="no ledger at"):
        Ledger.open(new)


def test_migrating_into_a_folder_that_holds_something_is_refused(old: Path, tmp_path: Path) -> None:
    new = tmp_path / "new"
    new.mkdir()
    (new / "notes.txt").write_text("mine\n")
    code, out = _invoke("migrate", old, new, "--catalog", f"sqlite:{new / 'catalog.sqlite'}")
    _one_line_refusal(code, out)
    assert "is not empty (notes.txt)" in out
    _no_ledger_at(new)
    assert (new / "notes.txt").read_text() == "mine\n"
    with pytest.raises(MigrateError, match="is not empty"):
        migrate_into(old, new)
    assert (new / "notes.txt").read_text() == "mine\n"


def _truncate_a_parquet_file(old: Path) -> str:
    path = sorted((old / "events").glob("*=*/*.parquet"), key=lambda p: p.stat().st_size)[-1]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "unreadable"


def _delete_a_middle_record(old: Path) -> str:
    (old / "_commits" / "0000000003.json").unlink()
    return "commit record 0000000003.json is missing"


def _delete_the_newest_record(old: Path) -> str:
    newest = sorted((old / "_commits").glob("*.json"))[-1]
    newest.unlink()
    return f"of commit {int(newest.stem)}, which has no commit record"


def _delete_a_named_file(old: Path) -> str:
    # a file of the first commit that every later commit kept (no recovery would have touched it)
    first = json.loads((old / "_commits" / "0000000000.json").read_text())
    (old / next(rel for rel in first["files"] if (old / rel).exists())).unlink()
    return "a committed part file is missing"


DAMAGE = {
    "truncated parquet": _truncate_a_parquet_file,
    "missing commit record": _delete_a_middle_record,
    "missing newest record": _delete_the_newest_record,
    "missing part file": _delete_a_named_file,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_ledger_is_one_line_and_leaves_no_ledger(old: Path, tmp_path: Path, damage: str) -> None:
    said = DAMAGE[damage](old)
    new = tmp_path / "new"
    spec = f"sqlite:{new / 'catalog.sqlite'}"
    code, out = _invoke("migrate", old, new, "--catalog", spec)
    _one_line_refusal(code, out)
    assert said in out, out
    _no_ledger_at(new)
    if new.exists():  # the command's lake was opened before the old ledger was read: it holds no commit
        with LakeTables(spec, new / "data", create=False) as lake:
            assert lake.positions() == {} and lake.state() == {}
    # the library's whole migration leaves no folder at all
    other = tmp_path / "other"
    with pytest.raises(MigrateError, match=said.split(":")[0]):
        migrate_into(old, other)
    assert not other.exists()
