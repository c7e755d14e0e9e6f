"""`ledger verify` names every kind of tampering; proofs check out with the stand-alone verifier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder


def run_verifier(
    kind: str, proof: Path, checkpoint: Path, public_key: Path
) -> subprocess.CompletedProcess[str]:
    """The stand-alone verifier as an auditor runs it: ``python -m runledger.ledger.verifier``."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "runledger.ledger.verifier",
            kind,
            "--proof",
            str(proof),
            "--checkpoint",
            str(checkpoint),
            "--public-key",
            str(public_key),
        ],
        capture_output=True,
        text=True,
    )


runner = CliRunner()


@pytest.fixture
def signed(tmp_path: Path) -> Path:
    run = RunBuilder()
    run.start()
    for s in range(1, 41):
        run.step(s)
    run.change(20, "lr", 0.5)
    ledger = Ledger.create(tmp_path / "l")
    records = [SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)]
    ledger.commit(records[:20])
    ledger.commit(records[20:])
    keys = tmp_path / "keys"
    assert runner.invoke(app, ["keys", "init", "--keys", str(keys)]).exit_code == 0
    assert (keys / "runledger.key").stat().st_mode & 0o777 == 0o600
    result = runner.invoke(app, ["checkpoint", "--ledger", str(tmp_path / "l"), "--keys", str(keys)])
    assert result.exit_code == 0, result.output
    return tmp_path


def _verify(tmp: Path) -> tuple[int, str]:
    result = runner.invoke(app, ["verify", "--ledger", str(tmp / "l"), "--keys", str(tmp / "keys")])
    return result.exit_code, result.output


def _commit_file(tmp: Path, table: str) -> Path:
    """The data file of ``table`` that the ledger's second commit (events #20 on) added to the lake."""
    record = json.loads((tmp / "l" / "_commits" / "0000000001.json").read_bytes())
    assert record["covers"] == {"spool:t": [20, 41]}, record["covers"]
    [path] = [Path(f["path"]) for f in record["lake_files"] if f["table"] == table]
    return path


def _events_file(tmp: Path) -> Path:
    return _commit_file(tmp, "events")


def test_clean_ledger_verifies(signed: Path) -> None:
    code, out = _verify(signed)
    assert code == 0, out
    assert "OK: 1 stream, 42 events, 1 signed checkpoint checked" in out


def test_edited_byte_is_detected(signed: Path) -> None:
    path = _events_file(signed)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    code, out = _verify(signed)
    assert code == 1
    # the file named: its bytes against the SHA-256 its commit record keeps (or, unreadable, its rows)
    assert f"{path.name}: its bytes are not the SHA-256 its commit record names" in out or "unreadable" in out


def test_modified_event_is_named(signed: Path) -> None:
    path = _events_file(signed)
    table = pq.read_table(path)
    canon = table.column("canonical").to_pylist()
    canon[3] = canon[3].replace('"loss":1.0', '"loss":0.5')
    pq.write_table(
        table.set_column(table.schema.get_field_index("canonical"), "canonical", pa.array(canon)), path
    )
    code, out = _verify(signed)
    assert code == 1
    assert "modified: stream run-a event run-a-23 (#23)" in out


def test_deleted_row_is_named(signed: Path) -> None:
    path = _events_file(signed)
    table = pq.read_table(path)
    pq.write_table(pa.concat_tables([table.slice(0, 5), table.slice(6)]), path)
    code, out = _verify(signed)
    assert code == 1
    assert "removed: stream run-a event run-a-25 (#25)" in out


def test_swapped_rows_are_named(signed: Path) -> None:
    path = _events_file(signed)
    table = pq.read_table(path)
    order = list(range(table.num_rows))
    order[7], order[8] = order[8], order[7]
    pq.write_table(table.take(order), path)
    code, out = _verify(signed)
    assert code == 1  # (a lake keeps no stream order within a file: the file's SHA-256 names it)
    assert f"/{path.name}: its bytes are not the SHA-256 its commit record names" in out
    assert out.startswith("modified: stream ?: main/events/") and "FAILED (1 problem)" in out


def test_forged_event_is_named(signed: Path) -> None:
    path = _events_file(signed)
    table = pq.read_table(path)
    forged = table.slice(0, 1).to_pylist()[0] | {"stream_seq": 42, "id": "forged-1"}
    # (into a file the lake reads: one it does not list is no part of the ledger)
    pq.write_table(pa.concat_tables([table, pa.Table.from_pylist([forged], schema=table.schema)]), path)
    code, out = _verify(signed)
    assert code == 1
    assert "inserted: stream run-a event forged-1 (#42)" in out


def test_edited_metric_value_is_named(signed: Path) -> None:
    path = _commit_file(signed, "metrics")
    table = pq.read_table(path)
    values = table.column("value").to_pylist()
    values[0] = 123.0
    pq.write_table(table.set_column(table.schema.get_field_index("value"), "value", pa.array(values)), path)
    code, out = _verify(signed)
    assert code == 1
    assert "table-mismatch: stream run-a event run-a-20 (#20)" in out


@pytest.mark.parametrize("rows_per_pass", [1, 7])
def test_edited_metric_value_is_named_when_compared_in_passes(
    signed: Path, monkeypatch: pytest.MonkeyPatch, rows_per_pass: int
) -> None:
    """A big table is compared a stream_seq bucket at a time (bounded memory): every bucket is
    compared, so an edited row is named whichever bucket it is in, and nothing else is."""
    from runledger.ledger import integrity

    monkeypatch.setattr(integrity, "_ROWS_PER_PASS", rows_per_pass)
    assert _verify(signed)[0] == 0
    path = _commit_file(signed, "metrics")
    table = pq.read_table(path)
    values = table.column("value").to_pylist()
    values[-1] = 123.0
    pq.write_table(table.set_column(table.schema.get_field_index("value"), "value", pa.array(values)), path)
    code, out = _verify(signed)
    assert code == 1
    assert out.count("table-mismatch") == 1, out


def test_rewritten_history_fails_the_signed_checkpoint(signed: Path) -> None:
    # Rewrite data AND commit log consistently: only the signed checkpoint can tell.
    cp = next((signed / "l" / "_checkpoints").glob("*.txt"))
    other = signed / "l2"
    run = RunBuilder()
    run.start()
    for s in range(1, 41):
        run.step(s, loss=9.0)
    run.change(20, "lr", 0.5)
    same_id = json.loads((signed / "l" / "LAKE.json").read_bytes())["ledger_id"]
    ledger = Ledger.create(other, ledger_id=same_id)  # another history under the signed ledger's id
    ledger.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    (other / "_checkpoints").mkdir()
    (other / "_checkpoints" / cp.name).write_text(cp.read_text())
    result = runner.invoke(app, ["verify", "--ledger", str(other), "--keys", str(signed / "keys")])
    assert result.exit_code == 1
    assert "history was rewritten" in result.output


def test_proofs_verify_with_the_standalone_verifier(signed: Path) -> None:
    proof = signed / "proof.json"
    result = runner.invoke(
        app, ["prove", "inclusion", "run-a-17", "--ledger", str(signed / "l"), "-o", str(proof)]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(proof.read_text())
    assert doc["leaf_index"] == 17 and doc["tree_size"] == 42
    cp = next((signed / "l" / "_checkpoints").glob("*.txt"))
    pub = signed / "keys" / "runledger.pub"
    ok = run_verifier("inclusion", proof, cp, pub)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    doc["leaf_index"] = 16
    proof.write_text(json.dumps(doc))
    bad = run_verifier("inclusion", proof, cp, pub)
    assert bad.returncode == 1
    cons = signed / "cons.json"
    result = runner.invoke(
        app, ["prove", "consistency", "run-a", "--from", "20", "--ledger", str(signed / "l"), "-o", str(cons)]
    )
    assert result.exit_code == 0, result.output
    ok = run_verifier("consistency", cons, cp, pub)
    assert ok.returncode == 0, ok.stdout + ok.stderr
