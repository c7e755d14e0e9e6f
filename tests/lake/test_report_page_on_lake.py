"""`ledger report` and `ledger serve page` on a lake (issue 39): both read the ledger's record (its
id, newest commit and every stream's head) through the one Reader at its pinned snapshot, from the
catalog itself (another host's commits included), never opening the writer; the live page follows
new snapshots. SQLite and PostgreSQL catalogs."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.query import Reader
from runledger.ledger.report import record_status
from runledger.ledger.store import Ledger, SourceRecord
from runledger.ledger.stream_checkpoints import sign_checkpoints
from runledger.schemas.note import write_keypair
from tests.lake.conftest import Backend
from tests.support.factory import RunBuilder
from tests.web.test_live_page import WAIT_S, _page_live_data, read_sse, serving

runner = CliRunner()
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "200"}
RUN = "lake-r"
CATALOGS = pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)


def _lake(backend: Backend, root: Path, ledger_id: str = "lake-report") -> Ledger:
    return Ledger.create_on_lake(root, backend.catalog, backend.data, ledger_id=ledger_id)


def _commit(ledger: Ledger, run: RunBuilder, steps: range) -> None:
    """``steps`` more steps of ``run`` committed (every event of the run so far is offered: the
    ledger takes the new ones)."""
    for step in steps:
        run.step(step, loss=10.0 / step)
    ledger.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])


def _started(backend: Backend, root: Path, steps: int) -> tuple[Ledger, RunBuilder]:
    """A lake holding run ``lake-r``: its start and ``steps`` steps, in two commits."""
    ledger = _lake(backend, root)
    run = RunBuilder(run_id=RUN)
    run.start()
    _commit(ledger, run, range(1, steps // 2 + 1))
    _commit(ledger, run, range(steps // 2 + 1, steps + 1))
    return ledger, run


def _report_data(html: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        html.split('<script id="report-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    )
    return data


@CATALOGS
def test_cli_report_on_a_lake_shows_each_streams_head_as_the_ledger_has_it(
    backend: Backend, tmp_path: Path
) -> None:
    root = tmp_path / "ledger"
    ledger, _run = _started(backend, root, 30)
    heads = ledger.stream_heads()
    ledger.close()
    out = tmp_path / "report.html"
    result = runner.invoke(app, ["report", RUN, "-o", str(out), "--ledger", str(root)], env=ENV)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "1 events marked" in result.output  # (the start)
    record = _report_data(out.read_text())["record"]
    assert [(s["stream"], s["size"]) for s in record["streams"]] == [(RUN, 31)]  # the start and 30 steps
    assert record["streams"][0]["root"] == heads[RUN].tree.root().hex()
    assert record["streams"][0]["checkpoint"] == "not signed"
    assert record["ledger"] == str(root.resolve())


@CATALOGS
def test_a_readers_record_is_its_snapshots_and_holds_another_hosts_commits(
    backend: Backend, tmp_path: Path
) -> None:
    ledger, run = _started(backend, tmp_path / "a", 10)
    pinned = Reader(tmp_path / "a")
    assert (pinned.head.ledger_id, pinned.head.commit) == ("lake-report", 1)
    # Host B: its own folder on the same catalog and data; host A's folder never sees B's record.
    other = _lake(backend, tmp_path / "b")
    _commit(other, run, range(11, 16))
    b_heads = other.stream_heads()
    other.close()
    assert not (tmp_path / "a" / "_commits" / f"{2:010d}.json").exists()
    later = Reader(tmp_path / "a")
    assert later.head.commit == 2 and later.snapshot is not None and pinned.snapshot is not None
    assert later.snapshot > pinned.snapshot
    assert later.head.streams[RUN].size == 16 and pinned.head.streams[RUN].size == 11
    assert later.head.streams[RUN].tree.root() == b_heads[RUN].tree.root()
    # The report's record follows its reader's snapshot, not the catalog's newest.
    assert [s["size"] for s in record_status(pinned, None, None)["streams"]] == [11]
    assert [s["size"] for s in record_status(later, None, None)["streams"]] == [16]
    pinned.close()
    later.close()
    ledger.close()


@CATALOGS
def test_a_checkpoint_signed_before_the_lake_grew_is_checked_against_the_catalogs_heads(
    backend: Backend, tmp_path: Path
) -> None:
    root = tmp_path / "ledger"
    ledger, run = _started(backend, root, 10)
    private, public = write_keypair(tmp_path / "keys", "test")
    _other_private, other_public = write_keypair(tmp_path / "other", "test")
    sign_checkpoints(root, private.read_text().strip())
    _commit(ledger, run, range(11, 13))
    ledger.close()
    reader = Reader(root)
    (grown,) = record_status(reader, public.read_text().strip(), public)["streams"]
    assert (grown["size"], grown["signed_size"]) == (13, 11)
    assert grown["checkpoint"] == "matches the record (signature verified)"
    assert reader.stream_root(RUN, 12) is None  # no commit brought the stream to 12 leaves
    (wrong,) = record_status(reader, other_public.read_text().strip(), other_public)["streams"]
    assert wrong["checkpoint"].startswith("FAILS")
    reader.close()


@CATALOGS
def test_the_live_page_on_a_lake_shows_commits_made_after_it_started(
    backend: Backend, tmp_path: Path
) -> None:
    root = tmp_path / "ledger"
    ledger, run = _started(backend, root, 20)
    with serving(root) as url:
        page = _page_live_data(httpx.get(url + f"/runs/{RUN}", timeout=WAIT_S).text)
        assert page["after"] == 20 and page["commit"] == 1
        box: dict[str, Any] = {}
        listener = threading.Thread(
            target=lambda: box.update(m=read_sse(url + f"/runs/{RUN}/events", ids=10, params={"after": 20}))
        )
        listener.start()
        time.sleep(0.3)  # connected (the stream would deliver these in any case: they come after `after`)
        _commit(ledger, run, range(21, 26))  # from this folder's writer
        other = _lake(backend, tmp_path / "b")  # and from another host's folder: no record here
        _commit(other, run, range(26, 31))
        other.close()
        listener.join(timeout=WAIT_S)
        assert not listener.is_alive() and "m" in box, "the stream did not bring the 10 new leaves"
        messages = box["m"]
        assert [m["id"] for m in messages if "id" in m] == list(range(21, 31))
        assert [m["data"]["step"] for m in messages if m["event"] == "step"] == list(range(21, 31))
        index = httpx.get(url + "/", timeout=WAIT_S).text
        assert "ledger commit 3" in index
    ledger.close()
