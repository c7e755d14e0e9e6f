"""Anomalies delivered to a real webhook receiver on 127.0.0.1 (issue 44): in order, at least once,
de-duplicable by event id; retries on 5xx, a hang bounded, a 4xx or a bad URL one line; a kill in the
middle loses nothing (``runledger.ledger.alerts``, ``ledger alerts``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from runledger.cli.alerts_cmd import alerts_app
from runledger.ledger import alerts
from runledger.ledger.alerts import (
    CommitWatch,
    DeliveryError,
    RetryPolicy,
    cursor_lock,
    deliver_alerts,
    follow_alerts,
    load_cursor,
    read_anomalies,
)
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import payloads as p
from tests.support.factory import RunBuilder

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "alerts.md"
FAST = RetryPolicy(
    timeout_s=5.0, max_tries=4, first_backoff_s=0.01, max_backoff_s=0.05, max_retry_after_s=0.05
)
WAIT_S = 60.0  # every wait on a subprocess or the receiver is bounded by this
SPIKE_STEPS = (31, 35, 40, 44)  # steps whose loss spikes: one loss-spike anomaly each

cli = typer.Typer()
cli.add_typer(alerts_app, name="alerts")  # as `ledger alerts` (cli/main.py mounts it the same way)
runner = CliRunner()


# ------------------------------------------------------------------------------------- the receiver
@dataclass
class Receiver:
    """A webhook on 127.0.0.1: records every POST it read; answers by ``plan`` (per request number,
    default 200): an int status, "close" (read, then drop the connection) or "hang" (until released)."""

    plan: dict[int, Any] = field(default_factory=dict)
    got: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def handle(self, handler: BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length", "0")))
        with self.lock:
            self.got.append((dict(handler.headers.items()), json.loads(body)))
            answer = self.plan.get(len(self.got), 200)
        if answer == "hang":
            self.release.wait(WAIT_S)
            handler.close_connection = True
            return
        if answer == "close":
            handler.close_connection = True
            return
        status, retry_after = answer if isinstance(answer, tuple) else (answer, None)
        handler.send_response(status)
        if retry_after is not None:
            handler.send_header("Retry-After", retry_after)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    @property
    def ids(self) -> list[str]:
        with self.lock:
            return [body["runledger"]["event_id"] for _, body in self.got]

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while len(self.ids) < count:
            assert time.monotonic() < deadline, f"the receiver got {len(self.ids)} of {count} posts"
            time.sleep(0.02)


@contextmanager
def receiver(plan: dict[int, Any] | None = None, path: str = "/services/T0/B0/secret") -> Iterator[Receiver]:
    rec = Receiver(plan or {})

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            rec.handle(self)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: pytest shows failures
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    rec.url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield rec
    finally:
        rec.release.set()
        server.shutdown()
        server.server_close()
        thread.join(WAIT_S)


# ---------------------------------------------------------------------------------------- ledgers
def spiking_run(run_id: str, spikes: tuple[int, ...] = SPIKE_STEPS, steps: int = 45) -> list[bytes]:
    """A run whose loss is flat but for ``spikes``: the ledger's loss-spike rule records one each."""
    run = RunBuilder(run_id=run_id)
    run.start()
    for step in range(1, steps + 1):
        run.step(step, loss=8.0 if step in spikes else 1.0)
    return run.events


def commit_runs(root: Path, *runs: list[bytes], source: str = "spool:test") -> None:
    """One commit of the runs' events (a new ledger at ``root`` unless one is there)."""
    with Ledger.open(root) if root.exists() else Ledger.create(root) as ledger:
        raws = [raw for events in runs for raw in events]
        ledger.commit([SourceRecord(source, i, raw) for i, raw in enumerate(raws)])


@pytest.fixture(scope="module")
def anomalous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ledger with the anomalies of two runs (run-a's four spikes, run-b's two)."""
    root = tmp_path_factory.mktemp("alerts") / "ledger"
    commit_runs(root, spiking_run("run-a"), spiking_run("run-b", spikes=(33, 42)))
    return root


def recorded(root: Path, **filters: Any) -> list[str]:
    reader = Reader(root)
    try:
        return [a.event_id for a in read_anomalies(reader, **filters)]
    finally:
        reader.close()


def wait_for_cursor(path: Path, event_id: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() or load_cursor(path).event_id != event_id:
        assert time.monotonic() < deadline, f"the cursor never reached {event_id}"
        time.sleep(0.02)


def command(*args: str) -> tuple[int, str]:
    result = runner.invoke(cli, list(args))
    return result.exit_code, result.output


def subprocess_deliver(*args: str) -> subprocess.Popen[bytes]:
    """`ledger alerts deliver` as its own process (the group run on its own, the program's signals)."""
    argv = [sys.executable, "-m", "runledger.cli.alerts_cmd", "alerts", "deliver", *args]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# ------------------------------------------------------------------------------------------ tests
def test_the_ledger_records_the_spikes_the_tests_deliver(anomalous: Path) -> None:
    assert len(recorded(anomalous)) == 6
    assert len(recorded(anomalous, run_id="run-a")) == len(SPIKE_STEPS)


def test_every_anomaly_is_delivered_once_in_order(anomalous: Path, tmp_path: Path) -> None:
    cursor = tmp_path / "cursor.json"
    with receiver() as rec:
        report = deliver_alerts(anomalous, rec.url, cursor, policy=FAST)
        again = deliver_alerts(anomalous, rec.url, cursor, policy=FAST)
    assert rec.ids == recorded(anomalous) and report.delivered == report.posts == 6
    assert again.delivered == again.posts == 0  # nothing new: nothing sent
    headers, body = rec.got[0]
    assert headers["Idempotency-Key"] == body["runledger"]["event_id"] == rec.ids[0]
    assert headers["Content-Type"] == "application/json"
    meta = body["runledger"]
    assert (meta["rule"], meta["run_id"], meta["step"], meta["value"], meta["baseline"]) == (
        "loss-spike",
        "run-a",
        31,
        8.0,
        1.0,
    )
    assert meta["score"] > 6 and "loss-spike" in body["text"] and body["blocks"][0]["type"] == "section"
    assert load_cursor(cursor).event_id == rec.ids[-1]


def test_a_non_finite_value_arrives_null_and_names_reach_slack_escaped(tmp_path: Path) -> None:
    run = RunBuilder(run_id="run-nan")
    run.start()
    run.step(1)
    run._emit(p.StepSkipped(reason="nonfinite_loss", value="nan"), 2)  # how the client sends a NaN loss
    run._emit(p.StepMetrics(loss=1.0, scalars={"<!channel>": None}), 3)  # a null scalar: a NaN too
    commit_runs(tmp_path / "ledger", run.events)
    with receiver() as rec:
        deliver_alerts(tmp_path / "ledger", rec.url, tmp_path / "c.json", policy=FAST)
    [(_, nan), (_, mention)] = rec.got
    meta = nan["runledger"]
    assert (meta["rule"], meta["metric"], meta["step"], meta["value"]) == ("non-finite", "loss", 2, None)
    assert "loss = non-finite" in nan["text"]
    # What a producer named reaches Slack escaped (no @channel), and the machines' object as it is.
    assert mention["runledger"]["metric"] == "scalars.<!channel>"
    assert "<!channel>" not in json.dumps(mention["blocks"]) + mention["text"]
    assert "scalars.&lt;!channel&gt; = non-finite" in mention["text"]


def test_a_backlog_goes_out_in_batches_in_order(
    anomalous: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(alerts, "BATCH_ANOMALIES", 4)  # 6 anomalies: a full batch, then a short one
    with receiver() as rec:
        report = deliver_alerts(anomalous, rec.url, tmp_path / "c.json", policy=FAST)
    assert report.delivered == 6 and rec.ids == recorded(anomalous)


def test_one_deliverer_per_cursor(anomalous: Path, tmp_path: Path) -> None:
    cursor = tmp_path / "c.json"
    with receiver() as rec, cursor_lock(cursor), pytest.raises(DeliveryError, match="in use by another"):
        deliver_alerts(anomalous, rec.url, cursor, policy=FAST)
    assert rec.ids == []


def test_500_twice_then_200_loses_nothing(anomalous: Path, tmp_path: Path) -> None:
    with receiver({1: 500, 2: 503}) as rec:
        report = deliver_alerts(anomalous, rec.url, tmp_path / "c.json", policy=FAST)
    assert report.delivered == 6 and report.posts == 8
    assert rec.ids[:3] == [rec.ids[0]] * 3  # the first anomaly three times, then each once
    assert rec.ids[2:] == recorded(anomalous)


def test_429_waits_as_retry_after_says_up_to_the_cap(anomalous: Path, tmp_path: Path) -> None:
    waits: list[float] = []
    with receiver({1: (429, "0.01"), 2: (429, "3600")}) as rec:
        deliver_alerts(anomalous, rec.url, tmp_path / "c.json", policy=FAST, sleep=waits.append)
    assert waits == [0.01, FAST.max_retry_after_s] and rec.ids[2:] == recorded(anomalous)


def test_a_dropped_connection_resends_only_that_anomaly_with_its_id(anomalous: Path, tmp_path: Path) -> None:
    cursor = tmp_path / "c.json"
    once = RetryPolicy(timeout_s=5.0, max_tries=1)
    with receiver({3: "close"}) as rec:
        with pytest.raises(DeliveryError, match=r"gave up on anomaly .* after 1 tries"):
            deliver_alerts(anomalous, rec.url, cursor, policy=once)
        assert load_cursor(cursor).event_id == rec.ids[1]  # the two acknowledged, not the third
        deliver_alerts(anomalous, rec.url, cursor, policy=once)
    expected = recorded(anomalous)
    assert rec.ids == expected[:3] + expected[2:]  # the one in flight twice, the same id both times
    keys = [h["Idempotency-Key"] for h, _ in rec.got]
    assert keys[2] == keys[3] == expected[2]


def test_sigkill_in_the_middle_then_rerun_delivers_the_rest(anomalous: Path, tmp_path: Path) -> None:
    cursor = tmp_path / "c.json"
    with receiver({3: "hang"}) as rec:
        proc = subprocess_deliver("--url", rec.url, "--ledger", str(anomalous), "--cursor", str(cursor))
        try:
            rec.wait_for(3)  # two acknowledged, the third read and never answered
        finally:
            proc.kill()
            proc.communicate(timeout=WAIT_S)
        assert proc.returncode == -signal.SIGKILL
        code, out = command(
            "alerts", "deliver", "--url", rec.url, "--ledger", str(anomalous), "--cursor", str(cursor)
        )
    assert code == 0, out
    expected = recorded(anomalous)
    assert rec.ids == expected[:3] + expected[2:]
    assert "4 anomalies delivered to http://127.0.0.1:" in out and "secret" not in out


def test_a_400_stops_with_one_line_and_keeps_the_cursor(anomalous: Path, tmp_path: Path) -> None:
    cursor = tmp_path / "c.json"
    with receiver({3: 400}) as rec:
        code, out = command(
            "alerts", "deliver", "--url", rec.url, "--ledger", str(anomalous), "--cursor", str(cursor)
        )
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 1 and "HTTP 400" in lines[0] and "not retried" in lines[0]
    assert "Traceback" not in out and "secret" not in out
    assert len(rec.ids) == 3 and load_cursor(cursor).event_id == rec.ids[1]


def test_a_hanging_receiver_is_given_up_on_after_bounded_tries(anomalous: Path, tmp_path: Path) -> None:
    hang = RetryPolicy(timeout_s=0.3, max_tries=2, first_backoff_s=0.01)
    with (
        receiver({1: "hang", 2: "hang"}) as rec,
        pytest.raises(DeliveryError, match=r"after 2 tries: no answer within 0.3 s"),
    ):
        deliver_alerts(anomalous, rec.url, tmp_path / "c.json", policy=hang)
    assert len(rec.ids) == 2 and not (tmp_path / "c.json").exists()


def test_a_receiver_that_is_not_there_is_one_line(anomalous: Path, tmp_path: Path) -> None:
    with receiver() as rec:
        url = rec.url  # its port, closed once the block ends
    code, out = command(
        "alerts",
        "deliver",
        "--url",
        url,
        "--ledger",
        str(anomalous),
        "--cursor",
        str(tmp_path / "c"),
        "--tries",
        "2",
    )
    assert code == 1 and re.search(
        r"error: http://127\.0\.0\.1:\d+: gave up on anomaly .* after 2 tries", out
    )
    assert len(out.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://example.org/hook", "the scheme must be http or https"),
        ("not a url", "the scheme must be http or https"),
        ("http:///path-only", "no host"),
        ("http://127.0.0.1:99999/x", "bad webhook URL"),
        ("http://127.0.0.1:9/a b", "a space or control character in its path"),
    ],
)
def test_a_bad_url_is_one_line(anomalous: Path, tmp_path: Path, url: str, why: str) -> None:
    code, out = command(
        "alerts", "deliver", "--url", url, "--ledger", str(anomalous), "--cursor", str(tmp_path / "c")
    )
    assert code == 1 and why in out and len(out.strip().splitlines()) == 1 and "Traceback" not in out


def test_a_cursor_of_another_ledger_is_refused(anomalous: Path, tmp_path: Path) -> None:
    cursor = tmp_path / "c.json"
    cursor.write_text(json.dumps({"format": 1, "position": 0, "event_id": "x", "ledger_id": "another"}))
    with receiver() as rec, pytest.raises(DeliveryError, match="belongs to ledger another"):
        deliver_alerts(anomalous, rec.url, cursor, policy=FAST)
    assert rec.ids == []


def test_list_filters_by_run_and_rule(anomalous: Path) -> None:
    code, out = command("alerts", "list", "--ledger", str(anomalous), "--run", "run-b", "--format", "json")
    rows = json.loads(out)
    assert code == 0 and [(r["run_id"], r["step"], r["rule"]) for r in rows] == [
        ("run-b", 33, "loss-spike"),
        ("run-b", 42, "loss-spike"),
    ]
    code, out = command(
        "alerts", "list", "--ledger", str(anomalous), "--rule", "non-finite", "--format", "json"
    )
    assert code == 0 and json.loads(out) == []


def test_follow_delivers_new_commits_and_ctrl_c_ends_with_130(tmp_path: Path) -> None:
    root = tmp_path / "ledger"
    commit_runs(root, spiking_run("run-a", spikes=(31,)))
    with receiver() as rec:
        proc = subprocess_deliver(
            "--url",
            rec.url,
            "--ledger",
            str(root),
            "--follow",
            "--interval",
            "0.1",
            "--cursor",
            str(tmp_path / "c"),
        )
        try:
            rec.wait_for(1)
            commit_runs(root, spiking_run("run-c", spikes=(33, 40)), source="spool:more")
            rec.wait_for(3)
            wait_for_cursor(tmp_path / "c", rec.ids[-1])  # acknowledged and remembered
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=WAIT_S)
        finally:
            proc.kill()
    assert proc.returncode == 130, err.decode()
    assert rec.ids == recorded(root) and len(rec.ids) == 3
    assert (
        "delivered loss-spike run run-a step 31" in out.decode() and "interrupted by SIGINT" in err.decode()
    )


def test_follow_passes_are_bounded(anomalous: Path, tmp_path: Path) -> None:
    waits: list[float] = []
    with receiver() as rec:
        report = follow_alerts(
            anomalous, rec.url, tmp_path / "c.json", interval_s=0.5, passes=3, policy=FAST, sleep=waits.append
        )
    assert report.delivered == 6 and waits == [0.5, 0.5]


def test_an_idle_follow_opens_no_reader_until_a_commit_records_an_anomaly(tmp_path: Path) -> None:
    root, cursor = tmp_path / "ledger", tmp_path / "c.json"
    commit_runs(root, spiking_run("run-a", spikes=(31,)))
    watch = CommitWatch(root, full_look_s=3600.0)
    with receiver() as rec:
        follow_alerts(root, rec.url, cursor, passes=1, policy=FAST, watch=watch)
        looked = watch.looked_at
        follow_alerts(root, rec.url, cursor, passes=3, policy=FAST, watch=watch, sleep=lambda s: None)
        assert watch.looked_at == looked  # nothing new in the commit records: no pass
        commit_runs(root, spiking_run("run-c", spikes=(33,)), source="spool:more")
        report = follow_alerts(root, rec.url, cursor, passes=1, policy=FAST, watch=watch)
    assert watch.looked_at > looked and report.delivered == 1 and rec.ids == recorded(root)


def _doc_commands() -> list[list[str]]:
    """Every `ledger alerts …` line of docs/alerts.md's sh blocks, as argv after `ledger`."""
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("ledger alerts")]


def test_every_command_of_the_guide_runs(anomalous: Path, tmp_path: Path) -> None:
    commands = _doc_commands()
    assert commands and all(c[:1] == ["alerts"] for c in commands)
    with receiver() as rec:
        for argv in commands:
            if "--follow" in argv:  # (a follow runs until Ctrl-C: test_follow_… runs it as a process)
                continue
            filled = [_fill(arg, anomalous, rec.url, tmp_path) for arg in argv]
            code, out = command(*filled)
            assert code == 0, f"ledger {' '.join(argv)}: {out}"
    assert rec.ids and set(rec.ids) <= set(recorded(anomalous))


def _fill(arg: str, ledger: Path, url: str, tmp_path: Path) -> str:
    values: dict[str, Callable[[], str]] = {
        "$LEDGER": lambda: str(ledger),
        "$WEBHOOK_URL": lambda: url,
        "$CURSOR": lambda: str(tmp_path / "doc-cursor.json"),
    }
    for name, value in values.items():
        arg = arg.replace(name, value())
    return os.path.expandvars(arg)
