"""`ledger redact`: an event's payload and salt erased from the ledger and its published copy, while
every per-stream proof, every signed checkpoint and every public log entry stays as it was.

Attacked: redact twice, an unknown id, SIGKILL before and after the redaction's commit point, the
same spool ingested again after it, an event sharing its files with others, a forged marker."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from runledger.cli import ledger_cmd, merkle_cmd, redact_cmd
from runledger.ingest.spool import SpoolWriter
from runledger.ledger import verifier
from runledger.ledger.duck import connect
from runledger.ledger.integrity import prove_consistency, prove_inclusion, verify_ledger
from runledger.ledger.publish import publish
from runledger.ledger.query import QueryError, Reader
from runledger.ledger.redaction import entry_digest, entry_matches, is_redacted, redact
from runledger.ledger.store import Ledger, LedgerError, SourceRecord
from runledger.ledger.stored_files import lake_file_list
from runledger.ledger.stream_checkpoints import sign_checkpoints
from runledger.ledger.tiles import entries_path, tile_path, walk_entries
from runledger.schemas import payloads as p
from runledger.schemas.canonical import config_hash
from runledger.schemas.note import write_keypair
from tests.support.factory import RunBuilder

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-token-0451"  # what a person wrote by mistake into a note
runner = CliRunner()

# The commands as cli/main.py registers them (redact included), on an app of this test's own.
app = typer.Typer()
app.command("redact")(redact_cmd.redact)
app.command("history")(ledger_cmd.history)
app.command("state")(ledger_cmd.state)
app.command("verify")(merkle_cmd.verify)


def invoke(*args: str | Path) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def _story() -> RunBuilder:
    run = RunBuilder()
    run.start()
    for step in range(1, 21):
        run.step(step)
        if step == 10:
            run._emit(p.Annotation(author="bob", text=f"debugging with token {SECRET}"), step)
    run.checkpoint(20)
    return run


class Site:
    """A ledger of one run, its log key pair and a DEST folder."""

    def __init__(self, tmp: Path) -> None:
        self.root, self.dest = tmp / "ledger", tmp / "site"
        self.ledger = Ledger.create(self.root, ledger_id="redact-test")
        private, public = write_keypair(tmp / "keys", "runledger-log")
        self.key_file, self.pub_file = private, public
        self.skey, self.vkey = private.read_text().strip(), public.read_text().strip()
        self.run = _story()
        self.ledger.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(self.run.events)])

    def note_id(self) -> str:
        rows = Reader(self.root).sql("SELECT id FROM events WHERE type = 'runledger.annotation'").rows
        return str(rows[0][0])

    def redact(self, event_id: str, reason: str = "a token in a note") -> Any:
        return redact(self.root, event_id, reason=reason, actor="alice", private_key=self.skey)

    def entries(self) -> list[dict[str, Any]]:
        cp = verifier.verify_checkpoint(
            (self.dest / "checkpoint").read_text(), self.vkey, "runledger/redact-test"
        )

        def tile(level: int, index: int, width: int) -> bytes:
            return (self.dest / tile_path(level, index, width)).read_bytes()

        def bundle(index: int, width: int) -> bytes:
            return (self.dest / entries_path(index, width)).read_bytes()

        return [json.loads(e) for e in walk_entries(tile, bundle, cp.size, cp.root)]

    def stream_checkpoint(self) -> verifier.Checkpoint:
        note = (self.root / "_checkpoints" / "run-a.txt").read_text()
        return verifier.verify_checkpoint(note, self.vkey, "runledger/redact-test/run-a")


def _strings_of(paths: list[Path]) -> str:
    """Every string and binary value of the Parquet files ``paths``, read back."""
    out: list[str] = []
    for path in paths:
        for column in pq.read_table(path).columns:
            out.extend(repr(v) for v in column.to_pylist() if isinstance(v, str | bytes | list))
    return "\n".join(out)


def _strings_in(folder: Path) -> str:
    """Every string and binary value of every Parquet file under ``folder`` (listed by the lake's
    catalog or not: erased bytes must be gone from the disk, not only from the newest snapshot)."""
    return _strings_of(sorted(folder.rglob("*.parquet")))


def _table_files(root: Path, table: str) -> list[Path]:
    """The data files of ``table`` in the ledger's newest snapshot, as its catalog lists them."""
    with Ledger.open(root) as ledger:
        assert ledger.lake is not None
        with ledger.lake.reader() as con:
            return [Path(data) for data, _ in lake_file_list(con, table)]


def _strings_of_table(root: Path, table: str) -> str:
    """Every string and binary value of ``table``'s files in the ledger's newest snapshot."""
    return _strings_of(_table_files(root, table))


def _salts_by_seq(paths: list[Path]) -> dict[tuple[str, int], bytes]:
    """(stream, stream_seq) -> salt, from salt files (the ledger's, or a published copy's)."""
    salts: dict[tuple[str, int], bytes] = {}
    for path in paths:
        t = pq.read_table(path)
        keys = zip(t["stream"].to_pylist(), t["stream_seq"].to_pylist(), strict=True)
        salts |= dict(zip(keys, t["salt"].to_pylist(), strict=True))
    return salts


def test_redaction_keeps_every_proof_and_erases_the_payload(tmp_path: Path) -> None:
    site = Site(tmp_path)
    sign_checkpoints(site.root, site.skey)  # a per-stream checkpoint signed before the redaction
    note = site.note_id()
    before = prove_inclusion(site.root, note)
    neighbour = prove_inclusion(site.root, f"run-a-{int(note.split('-')[-1]) + 1}")
    publish(site.root, site.dest, site.skey)
    bundles_before = {
        p.relative_to(site.dest): p.read_bytes() for p in (site.dest / "tile").rglob("*") if p.is_file()
    }
    assert SECRET in _strings_in(site.root) and SECRET in _strings_in(site.dest)

    done = site.redact(note)
    assert done.salted and done.rewritten >= 3  # events, annotations, state_events (and its salt)

    # The payload and its salt are gone from every table; the others' rows are untouched.
    assert SECRET not in _strings_in(site.root)
    reader = Reader(site.root)
    (canonical,) = reader.sql("SELECT canonical FROM events WHERE id = ?", [note]).rows[0]
    assert is_redacted(canonical) and json.loads(canonical)["redacted"]["reason"] == "a token in a note"
    assert reader.sql("SELECT count(*) FROM annotations").rows == [(0,)]
    assert reader.sql("SELECT count(*) FROM metrics WHERE name = 'loss'").rows == [(20,)]
    assert reader.sql("SELECT count(*) FROM events").rows == [(len(site.run.events) + 1,)]

    # verify passes and names the redaction with its reason; the old checkpoint still checks.
    report = verify_ledger(site.root, site.vkey)
    assert report.ok, [pr.line() for pr in report.problems]
    assert report.checkpoints == 1
    assert [(r["event_id"], r["reason"], r["actor"]) for r in report.redactions] == [
        (note, "a token in a note", "alice")
    ]
    assert report.redactions[0]["signed_by"].startswith("runledger-log+")

    # Per-stream proofs: the same leaf and path as before, and they verify; consistency too.
    after = prove_inclusion(site.root, note)
    assert after["redacted"] == "a token in a note"
    assert (after["leaf_hash"], after["audit_path"]) == (before["leaf_hash"], before["audit_path"])
    old = site.stream_checkpoint()
    for doc in (after, neighbour):
        assert "is leaf" in verifier.verify_inclusion_document(doc, old)
    assert "the proof says the event was redacted (a token in a note)" in verifier.verify_inclusion_document(
        after, old
    )
    sign_checkpoints(site.root, site.skey)  # the stream grew by the redaction record
    new = site.stream_checkpoint()
    assert new.size == old.size + 1
    cons = prove_consistency(site.root, "run-a", old.size, new.size)
    assert "is a prefix" in verifier.verify_consistency_document(cons, new, (old.size, old.root))
    assert verify_ledger(site.root, site.vkey).ok

    # The next publish: the old files leave DEST, the log's existing tiles and entries are unchanged.
    publish(site.root, site.dest, site.skey)
    assert SECRET not in _strings_in(site.dest)
    for rel, data in bundles_before.items():
        if ".p" not in rel.parts:  # a partial tile/bundle grows; a full one never changes
            assert (site.dest / rel).read_bytes() == data, rel
    entries = site.entries()
    erased = [e for e in entries if e.get("id") == note]
    assert len(erased) == 1 and "salted_sha256" in erased[0]
    records = [e for e in entries if e.get("type") == "ledger.redaction"]
    assert len(records) == 1 and records[0]["key_id"].startswith("runledger-log+")


def test_published_entry_is_salted_and_checkable_with_its_salt(tmp_path: Path) -> None:
    site = Site(tmp_path)
    publish(site.root, site.dest, site.skey)
    salts = _salts_by_seq(sorted((site.dest / "data" / "salts").rglob("*.parquet")))
    stored = dict(
        ((s, q), c)
        for s, q, c in Reader(site.root).sql("SELECT stream, stream_seq, canonical FROM events").rows
    )
    events = [e for e in site.entries() if e["t"] == "event"]
    assert len(events) == len(stored) and all("sha256" not in e for e in events)
    for e in events:
        key = (e["stream"], e["stream_seq"])
        assert len(salts[key]) == 16
        assert e["salted_sha256"] == hashlib.sha256(salts[key] + stored[key].encode()).hexdigest()
        # Without the salt the digest says nothing about the bytes.
        assert e["salted_sha256"] != hashlib.sha256(stored[key].encode()).hexdigest()
    assert len({bytes(s) for s in salts.values()}) == len(salts)  # a fresh salt per event


def test_redacted_before_its_first_publish_gets_the_entry_it_would_have_had(tmp_path: Path) -> None:
    site = Site(tmp_path)
    note = site.note_id()
    salt = _salts_by_seq(_table_files(site.root, "salts"))[("run-a", 11)]
    canonical = Reader(site.root).sql("SELECT canonical FROM events WHERE id = ?", [note]).rows[0][0]
    want = entry_digest(canonical.encode(), salt)
    site.redact(note)
    publish(site.root, site.dest, site.skey)
    (entry,) = [e for e in site.entries() if e.get("id") == note]
    assert (
        entry["salted_sha256"] == want and entry["key_id"] is None and entry["type"] == "runledger.annotation"
    )
    assert SECRET not in _strings_in(site.dest)


def test_history_and_state_mark_it_and_verify_prints_the_reason(tmp_path: Path) -> None:
    site = Site(tmp_path)
    note = site.note_id()
    code, out = invoke(
        "redact",
        note,
        "--reason",
        "a token in a note",
        "--actor",
        "alice",
        "--key",
        site.key_file,
        "--ledger",
        site.root,
    )
    assert code == 0, out
    assert out.startswith(f"redacted runledger.annotation {note} (stream run-a #11) in commit 1: ")
    code, out = invoke("history", "run-a", "--all", "--ledger", site.root, "--format", "csv")
    assert code == 0, out
    assert f"ledger.redaction,REDACTED runledger.annotation {note} (#11) by alice: a token in a note" in out
    assert SECRET not in out
    code, out = invoke("state", "run-a", "--ledger", site.root)
    assert code == 0, out
    assert (
        f"incident: 1 event redacted (trainer/run-a/rank0): runledger.annotation {note} redacted by alice: a token in a note"
        in out
    )
    code, out = invoke("verify", "--ledger", site.root, "--public-key", site.pub_file)
    assert code == 0, out
    assert f"redacted: stream run-a event {note} (#11, runledger.annotation) by alice at " in out


def test_redact_twice_and_unknown_ids_are_one_line_errors(tmp_path: Path) -> None:
    site = Site(tmp_path)
    note = site.note_id()
    args = ("--reason", "leak", "--actor", "alice", "--key", site.key_file, "--ledger", site.root)
    assert invoke("redact", note, *args)[0] == 0
    code, out = invoke("redact", note, *args)
    assert (code, out) == (1, f"error: event {note} is redacted already (leak)\n")
    code, out = invoke("redact", "no-such-event", *args)
    assert (code, out) == (1, "error: no event with id 'no-such-event' in this ledger\n")
    record = Reader(site.root).sql("SELECT id FROM events WHERE type = 'ledger.redaction'").rows[0][0]
    code, out = invoke("redact", record, *args)
    assert (code, out) == (
        1,
        f"error: event {record} is the ledger's own record (ledger.redaction): it cannot be redacted\n",
    )
    code, out = invoke(
        "redact",
        "run-a-3",
        "--reason",
        " ",
        "--actor",
        "alice",
        "--key",
        site.key_file,
        "--ledger",
        site.root,
    )
    assert (code, out) == (1, "error: a redaction needs a --reason and an --actor (both non-empty)\n")
    assert len(site.ledger.commit_paths()) == 2  # the refused ones wrote nothing
    assert verify_ledger(site.root, site.vkey).ok


# A redaction killed before its commit point (inside the lake's transaction: its deletes run and its
# new data files added, not yet committed) or just after it (the catalog committed; neither the
# folder's copy of the commit record written nor the erased rows' bytes taken off the disk).
_KILLER = """
import os, signal, sys
import runledger.ledger.lake as lake
import runledger.ledger.store as store
from ledger.redaction import redact
real_insert, real_write = lake._insert_rows, store.write_durably
def insert(con, table, rows):
    if sys.argv[2] == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real_insert(con, table, rows)
def write(path, data, **kw):
    if sys.argv[2] == "after" and "_commits" in str(path):
        os.kill(os.getpid(), signal.SIGKILL)
    real_write(path, data, **kw)
lake._insert_rows, store.write_durably = insert, write
redact(sys.argv[1], sys.argv[3], reason="leak", actor="alice", private_key=open(sys.argv[4]).read())
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_sigkill_around_the_commit_point(tmp_path: Path, when: str) -> None:
    site = Site(tmp_path)
    note = site.note_id()
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, str(site.root), when, note, str(site.key_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert SECRET in _strings_in(site.root)  # it died with the payload's bytes still on the disk
    ledger = Ledger.open(site.root)
    ledger.commit([])  # the next writer: nothing to finish (before) or finishes the redaction (after)
    canonical = Reader(site.root).sql("SELECT canonical FROM events WHERE id = ?", [note]).rows[0][0]
    assert is_redacted(canonical) == (when == "after")
    report = verify_ledger(site.root, site.vkey)
    assert report.ok, [pr.line() for pr in report.problems]
    assert len(report.redactions) == (when == "after")
    if when == "before":  # nothing happened: it can be done again
        site.redact(note)
    assert SECRET not in _strings_in(site.root)
    assert verify_ledger(site.root, site.vkey).ok


def test_the_same_spool_ingested_again_never_brings_it_back(tmp_path: Path) -> None:
    site_keys = write_keypair(tmp_path / "keys", "runledger-log")
    run = _story()
    for name in ("spool", "copy"):  # the same records under a second spool id too
        with SpoolWriter(tmp_path / name) as w:
            for raw in run.events:
                w.append(raw)
    root = tmp_path / "ledger"
    from runledger.cli.main import app as cli

    result = runner.invoke(
        cli, ["ingest", "spool", "--spool", str(tmp_path / "spool"), "--ledger", str(root)]
    )
    assert result.exit_code == 0, result.output
    note = Reader(root).sql("SELECT id FROM events WHERE type = 'runledger.annotation'").rows[0][0]
    redact(root, note, reason="leak", actor="alice", private_key=site_keys[0].read_text())
    for name in ("spool", "copy"):
        result = runner.invoke(
            cli, ["ingest", "spool", "--spool", str(tmp_path / name), "--ledger", str(root)]
        )
        assert result.exit_code == 0, result.output
    reader = Reader(root)
    assert reader.sql("SELECT count(*) FROM events WHERE id = ?", [note]).rows == [(1,)]
    assert reader.sql("SELECT count(*) FROM annotations").rows == [(0,)]
    assert SECRET not in _strings_in(root)
    assert verify_ledger(root, site_keys[1].read_text()).ok


def _stock_lake(root: Path) -> duckdb.DuckDBPyConnection:
    """Stock DuckDB with the ledger's lake attached for writing: what anyone holding write access to
    the catalog can do by hand, beside the ledger's writer."""
    con = connect(extensions=["ducklake", "sqlite_scanner"])
    con.execute(f"ATTACH 'ducklake:sqlite:{root / 'catalog.sqlite'}' AS hand")
    return con


def test_a_forged_marker_is_tampering_and_a_stray_salt_is_named(tmp_path: Path) -> None:
    site = Site(tmp_path)
    with contextlib.closing(_stock_lake(site.root)) as con:
        kept = con.execute(
            "SELECT * FROM hand.salts WHERE stream = 'run-a' AND stream_seq = 11"
        ).to_arrow_table()
    assert kept.num_rows == 1
    # Someone blanks an event by hand, without a redaction record: "modified", as any edit.
    (path,) = [
        f for f in _table_files(site.root, "events") if 3 in pq.read_table(f)["stream_seq"].to_pylist()
    ]
    original = path.read_bytes()
    table = pq.read_table(path)
    texts = table["canonical"].to_pylist()
    texts[table["stream_seq"].to_pylist().index(3)] = '{"redacted":{"reason":"trust me","record":"x"}}'
    column = pa.array(texts, pa.string())
    pq.write_table(table.set_column(table.schema.get_field_index("canonical"), "canonical", column), path)
    report = verify_ledger(site.root, site.vkey)
    # (the file, whose bytes are not those its commit record names; then the row it holds)
    assert [(pr.kind, pr.stream_seq) for pr in report.problems] == [
        ("modified", None),
        ("modified", 3),
        ("table-mismatch", 3),
    ]
    assert report.redactions == []
    path.write_bytes(original)
    # A real redaction, then its salt put back (say, from a backup): named, since salt and a guess
    # would check against the public digest.
    site.redact(site.note_id())
    assert verify_ledger(site.root, site.vkey).ok
    with contextlib.closing(_stock_lake(site.root)) as con:
        con.register("kept", kept)
        con.execute("INSERT INTO hand.salts SELECT * FROM kept")
    report = verify_ledger(site.root, site.vkey)
    assert [(pr.kind, pr.stream_seq) for pr in report.problems] == [("redaction", 11)], [
        pr.line() for pr in report.problems
    ]


def test_a_record_signed_by_another_key_is_a_problem(tmp_path: Path) -> None:
    site = Site(tmp_path)
    other, _ = write_keypair(tmp_path / "other", "someone-else")
    redact(site.root, site.note_id(), reason="leak", actor="mallory", private_key=other.read_text())
    report = verify_ledger(site.root, site.vkey)
    assert [pr.kind for pr in report.problems] == ["redaction"]
    assert "not signed by a log key tried" in report.problems[0].detail
    assert verify_ledger(site.root).ok  # without a key: reported, signer named, not checked


def test_library_errors(tmp_path: Path) -> None:
    site = Site(tmp_path)
    with pytest.raises(LedgerError, match="no event with id 'x' from source 'y'"):
        redact(site.root, "x", reason="r", actor="a", private_key=site.skey, source="y")
    with pytest.raises(LedgerError, match="--reason is 2001 characters"):
        redact(site.root, "run-a-1", reason="r" * 2001, actor="a", private_key=site.skey)
    # What a holder of an entry, the bytes and (for a salted entry) the salt checks.
    salt, raw = b"\x01" * 16, b'{"id":"e"}'
    salted = {"salted_sha256": entry_digest(raw, salt)}
    assert entry_matches(salted, raw, salt) and not entry_matches(salted, raw, None)
    assert not entry_matches(salted, raw + b" ", salt)
    assert entry_matches({"sha256": hashlib.sha256(raw).hexdigest()}, raw, None)  # an older, unsalted entry


def _config_story() -> RunBuilder:
    """A run whose second config change puts a secret into the config; the later changes build on it
    (one with an RFC 6902 ``test`` of the secret, which cannot apply once it is erased)."""
    run = RunBuilder(config={"lr": 0.001, "token": "none"})
    run.start()
    for step in range(1, 7):
        run.step(step)
    run.change(2, "lr", 0.002)
    run.change(3, "token", SECRET)
    run.change(4, "lr", 0.5)
    tested = {**run.config, "lr": 0.7}
    run._emit(
        p.ConfigChanged(
            patch=[
                p.PatchOp(op="test", path="/token", value=SECRET),
                p.PatchOp(op="replace", path="/lr", value=0.7),
            ],
            previous_hash=config_hash(run.config),
            config_hash=config_hash(tested),
            cause=p.ChangeCause(kind="file_edit", detail="config.toml"),
        ),
        5,
    )
    run.config = tested
    return run


def test_a_config_secret_leaves_every_later_config_row_too(tmp_path: Path) -> None:
    """Each ``configs`` row is a whole config: erasing the change that set a secret projects the
    attempt's later rows again without it (as verify projects them), and the state still folds."""
    site = Site(tmp_path)
    run = _config_story()
    root = tmp_path / "config-ledger"
    ledger = Ledger.create(root)
    ledger.commit([SourceRecord("spool:c", i, raw) for i, raw in enumerate(run.events)])
    assert SECRET in _strings_in(root)
    secret_change = (
        Reader(root)
        .sql(
            "SELECT id FROM events WHERE type = 'runledger.config.changed' AND canonical LIKE ? ORDER BY stream_seq",
            [f'%"{SECRET}"%'],
        )
        .rows
    )
    first = secret_change[0][0]  # the change that set it (the later one only tests it)
    redact(root, first, reason="token in config", actor="alice", private_key=site.skey)
    assert SECRET not in _strings_of_table(root, "configs")  # every later whole config, projected again
    reader = Reader(root)
    assert [r[0] for r in reader.sql("SELECT cause FROM configs ORDER BY stream_seq").rows] == [
        "start",
        "file_edit",
        "file_edit",  # the lr change after it, on a config without the secret
    ]
    state = reader.state("run-a")
    assert state.config == {"lr": 0.5, "token": "none"}  # the `test` of the erased value no longer applies
    assert [f["kind"] for f in state.incidents] == ["redacted"]
    report = verify_ledger(root, site.vkey)
    assert report.ok, [pr.line() for pr in report.problems]
    # The test-op change is still stored, its patch naming the value: redact it as well.
    second = secret_change[1][0]
    redact(root, second, reason="token in config", actor="alice", private_key=site.skey)
    assert SECRET not in _strings_in(root)
    assert verify_ledger(root, site.vkey).ok
    Ledger.open(root).compact()  # merged afterwards: rows stay in stream order, verify still passes
    assert verify_ledger(root, site.vkey).ok


def test_redacting_a_launch_erases_its_config_and_verify_passes(tmp_path: Path) -> None:
    site = Site(tmp_path)
    redact(site.root, "run-a-0", reason="secret in config", actor="alice", private_key=site.skey)
    reader = Reader(site.root)
    assert reader.sql("SELECT count(*) FROM launches").rows == [(0,)]
    assert reader.sql("SELECT count(*) FROM configs").rows == [(0,)]
    report = verify_ledger(site.root, site.vkey)
    assert report.ok and [r["event_type"] for r in report.redactions] == ["runledger.run.started"]
    with pytest.raises(QueryError, match=r"^run 'run-a': its launch was redacted \(secret in config\)$"):
        reader.require_run("run-a")


def test_changes_ingested_after_a_redaction_build_on_the_erased_config(tmp_path: Path) -> None:
    """A writer that keeps ingesting (its configs cached) after another process redacted a config
    change projects its next changes from the config without the secret, as verify does."""
    site = Site(tmp_path)
    run = _config_story()
    root = tmp_path / "config-ledger"
    writer = Ledger.create(root)
    records = [SourceRecord("spool:c", i, raw) for i, raw in enumerate(run.events)]
    writer.commit(records[:10])  # up to the lr change that follows the secret (stream_seq 9)
    secret = Reader(root).sql("SELECT id FROM events WHERE stream_seq = 8").rows[0][0]
    redact(root, secret, reason="token in config", actor="alice", private_key=site.skey)
    run.change(6, "lr", 0.9)
    writer.commit([records[10], SourceRecord("spool:c", 11, run.events[11])])  # the test op, then lr
    configs = _strings_of_table(root, "configs")
    assert SECRET not in configs and '{"lr":0.9,"token":"none"}' in configs
    assert verify_ledger(root, site.vkey).ok


def test_a_github_comment_body_is_erased_from_its_repo_stream(tmp_path: Path) -> None:
    from runledger.schemas import github as gh
    from runledger.schemas.codec import encode_event, make_event

    site = Site(tmp_path)
    GH_SECRET = "sekrit-gh-9931"
    comments = [
        make_event(
            gh.GitHubComment(
                action="created", repo="acme/model", number=7, comment_id=i, author="eve", body=body
            ),
            source="github:acme/model",
            stream="acme/model",
            seq=i,
            id=f"comment-{i}",
        )
        for i, body in enumerate(["looks good", f"my password is {GH_SECRET}", "merged"])
    ]
    site.ledger.commit([SourceRecord("spool:gh", i, encode_event(env)) for i, env in enumerate(comments)])
    assert GH_SECRET in _strings_of_table(site.root, "github")
    done = site.redact("comment-1", reason="a password in a comment")
    assert done.target.stream == "acme/model" and done.salted
    reader = Reader(site.root)
    assert [r[0] for r in reader.sql("SELECT body FROM github ORDER BY stream_seq").rows] == [
        "looks good",
        "merged",
    ]
    assert GH_SECRET not in _strings_in(site.root)
    report = verify_ledger(site.root, site.vkey)
    assert report.ok, [pr.line() for pr in report.problems]
    assert [(r["stream"], r["event_id"]) for r in report.redactions] == [("acme/model", "comment-1")]
