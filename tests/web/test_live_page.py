"""`ledger serve page`: the run's page, live. Real servers on 127.0.0.1 (uvicorn), real SSE clients
(httpx), a real headless Chromium, a real ledger fed by `runledger.init` through the spool ingester.

Every wait is bounded and polls (no test asserts a speed: bench/bench_live_page.py measures them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient

import runledger
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.live_page import LivePage, create_app
from runledger.ledger.store import Ledger, SourceRecord
from runledger.ledger.stream_checkpoints import sign_checkpoints
from runledger.schemas import encode_event, make_event
from runledger.schemas import payloads as p
from runledger.schemas.github import GitHubPullRequest
from runledger.schemas.note import write_keypair
from tests.support.browser import chromium
from tests.support.factory import T0, RunBuilder

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = '</script><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> & ü <!--'
WAIT_S = 15.0  # every bounded wait below (a loaded 2-core machine is slow, never this slow)


# ---------------------------------------------------------------------------------------- a ledger
def _story(ledger: Path) -> RunBuilder:
    """Run live-r: 60 steps with router stats, a config change at 20, a crash at 40 (its message
    hostile), a resume from 35, a hostile note and a hostile config key."""
    run = RunBuilder(run_id="live-r", config={"lr": 0.001, "moe": {"capacity_factor": 1.0}, HOSTILE: 1})
    run.start(repository="octo/live")
    for step in range(1, 61):
        if step == 20:
            run.change(step, "moe/capacity_factor", 1.5)
        run.step(step, loss=5.0 / step)
        layers = [
            p.MoeLayerStats(layer=k, tokens=100, top_k=2, dropped=2 * k, token_drop_rate=0.01 * k)
            for k in range(3)
        ]
        run._emit(p.MoeRouterStats(layers=layers), step)
        if step == 40:
            run._emit(
                p.RunCrashed(kind="exception", exc_type="RuntimeError", message=HOSTILE, last_step=40), 40
            )
            run.resume(35)
            run._emit(p.Annotation(author="ana", text=HOSTILE), 36)
    merge = make_event(  # a PR of the run's repository merged during the run, its title hostile
        GitHubPullRequest(
            action="closed", repo="octo/live", number=7, title=HOSTILE, merged=True, actor="ana"
        ),
        source="github/webhook",
        stream="octo/live",
        seq=0,
        id="gh-7",
        time=T0 + timedelta(seconds=50.5),
    )
    led = Ledger.create(ledger)
    led.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    led.commit([SourceRecord("spool:g", 0, encode_event(merge))])
    return run


def _commit_steps(ledger: Path, run: RunBuilder, steps: range) -> int:
    """More steps of ``run`` committed; returns the run stream's size after."""
    for step in steps:
        run.step(step, loss=5.0 / step)  # the story's curve goes on (a jump would be a loss spike's marker)
    led = Ledger.open(ledger)
    led.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    return led.stream_heads()[run.run_id].size


def _head(ledger: Path, stream: str) -> int:
    return Ledger.open(ledger).stream_heads()[stream].size


# ---------------------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(ledger: Path, **options: Any) -> Iterator[str]:
    """The live page in this process (uvicorn in a thread); yields its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(ledger, poll_s=0.1, **options),
            host="127.0.0.1",
            port=_free_port(),
            log_level="warning",
            timeout_graceful_shutdown=1,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _until(lambda: server.started, "the server started")
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


SERVE = "import sys; from runledger.ledger.live_page import serve; serve(sys.argv[1], port=int(sys.argv[2]), poll_s=0.1)"


class ServerProcess:
    """`ledger serve page`'s server in its own process, to kill (SIGKILL) and start again."""

    def __init__(self, ledger: Path, port: int) -> None:
        self.ledger, self.port = ledger, port
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self, wait: bool = True) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, str(self.ledger), str(self.port)], env=env)
        if wait:
            self.wait()

    def wait(self) -> None:
        _until(
            self._up, "the server process answered /healthz", wait_s=2 * WAIT_S
        )  # imports on a busy machine

    def _up(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _until(done: Callable[[], Any], what: str, wait_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        value = done()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {wait_s:.0f}s: {what}")


def read_sse(
    url: str, *, ids: int, headers: dict[str, str] | None = None, params: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Messages of an event stream until ``ids`` of them carried an id (bounded by WAIT_S)."""
    messages: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    seen = 0
    with httpx.stream("GET", url, headers=headers, params=params, timeout=WAIT_S) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line:
                if "event" in current:
                    messages.append(current)
                    seen += "id" in current
                current = {}
                if seen >= ids:
                    break
                continue
            name, _, value = line.partition(": ")
            if name in ("id", "event", "data"):
                current[name] = int(value) if name == "id" else json.loads(value) if name == "data" else value
    return messages


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=WAIT_S)  # a page is built once per commit; a busy machine is slow


def _page_live_data(body: str) -> dict[str, Any]:
    return json.loads(
        body.split('<script id="live-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    )


@pytest.fixture(scope="module")
def story_ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ledger = tmp_path_factory.mktemp("live") / "ledger"
    _story(ledger)
    return ledger


# ---------------------------------------------------------------------------------------- no browser
def test_index_and_page_are_read_only_and_escape_every_ledger_text(story_ledger: Path) -> None:
    with TestClient(create_app(story_ledger)) as client:
        index = client.get("/")
        assert index.status_code == 200 and "live-r" in index.text
        page = client.get("/runs/live-r")
        assert page.status_code == 200
        csp = page.headers["content-security-policy"]
        assert (
            "script-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src", 1)[1].split(";")[0]
        )
        # The hostile texts are in the page only as JSON data, never as markup that could end the element.
        assert HOSTILE not in page.text and "<img src=x" not in page.text
        assert page.text.count("</script>") == 5  # the two data elements and the three script files
        live = _page_live_data(page.text)
        assert HOSTILE in live["state"]["config"]
        assert live["after"] == _head(story_ledger, "live-r") - 1
        for path in (
            "/query?sql=select+1",
            "/sql",
            "/runs/live-r/query",
            "/assets/report.py",
            "/assets/..%2Fstore.py",
        ):
            assert client.get(path).status_code == 404, path
        assert client.post("/runs/live-r").status_code == 405
        assert client.get("/runs/no-such-run").status_code == 404
        assert client.get("/runs/%3Cscript%3E").status_code == 404
        bad = client.get("/runs/live-r/events", headers={"Last-Event-ID": "<x>"})
        assert bad.status_code == 400 and "<x>" not in bad.text.replace("'<x>'", "")


def test_events_resume_exactly_after_last_event_id_across_a_restart(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    run = _story(ledger)
    start = _head(ledger, "live-r")
    with serving(ledger) as url:
        page = _page_live_data(_get(url + "/runs/live-r").text)
        assert page["after"] == start - 1
        box: dict[str, Any] = {}
        reader = threading.Thread(
            target=lambda: box.update(
                m=read_sse(url + "/runs/live-r/events", ids=10, params={"after": page["after"]})
            )
        )
        reader.start()
        time.sleep(0.3)  # connected (the stream would deliver these in any case: they come after `after`)
        head = _commit_steps(ledger, run, range(61, 81))
        reader.join(timeout=WAIT_S)
        first = [m["id"] for m in box["m"] if "id" in m]
        assert first == list(range(start, start + 10))
        steps = [m["data"]["step"] for m in box["m"] if m["event"] == "step"]
        assert steps == list(range(61, 71))
    with serving(ledger) as url:  # a new server: nothing of the old one's memory
        again = read_sse(
            url + "/runs/live-r/events", ids=head - start - 10, headers={"Last-Event-ID": str(first[-1])}
        )
        assert [m["id"] for m in again if "id" in m] == list(range(first[-1] + 1, head))


def test_hundred_clients_each_receive_every_event_and_the_201st_is_refused(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    run = _story(ledger)
    start = _head(ledger, "live-r")
    clients, new_steps = 100, 12

    async def one(client: httpx.AsyncClient, url: str, ready: asyncio.Event, count: list[int]) -> list[int]:
        ids: list[int] = []
        async with client.stream("GET", url, params={"after": start - 1}) as resp:
            assert resp.status_code == 200
            count[0] += 1
            if count[0] == clients:
                ready.set()
            async for line in resp.aiter_lines():
                if line.startswith("id: "):
                    ids.append(int(line[4:]))
                    if len(ids) == new_steps:
                        break
        return ids

    async def all_of_them(url: str) -> list[list[int]]:
        limits = httpx.Limits(max_connections=clients + 10)
        async with httpx.AsyncClient(timeout=WAIT_S, limits=limits) as client:
            ready, count = asyncio.Event(), [0]
            tasks = [asyncio.create_task(one(client, url, ready, count)) for _ in range(clients)]
            await asyncio.wait_for(ready.wait(), WAIT_S)
            refused = await client.get(url)  # the server allows exactly `clients` streams
            assert refused.status_code == 503 and "too many" in refused.text
            await asyncio.to_thread(_commit_steps, ledger, run, range(61, 61 + new_steps))
            return await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)

    with serving(ledger, max_clients=clients) as url:
        got = asyncio.run(all_of_them(url + "/runs/live-r/events"))
        assert len(got) == clients
        assert all(ids == list(range(start, start + new_steps)) for ids in got)
        health = _until(lambda: (h := _get(url + "/healthz").json())["clients"] == 0 and h, "streams closed")
        assert health["ok"]


def test_the_record_status_follows_a_signing_and_checks_its_signature(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    _story(ledger)
    private, public = write_keypair(tmp_path / "keys", "test")
    with serving(ledger, public_key_path=public) as url:
        live = _page_live_data(_get(url + "/runs/live-r").text)
        assert live["record"]["signed_size"] is None and "not signed" in live["record"]["checkpoint"]
        records: list[dict[str, Any]] = []

        def listen() -> None:
            with httpx.stream("GET", url + "/runs/live-r/events", timeout=WAIT_S) as resp:
                event = ""
                for line in resp.iter_lines():
                    event = line[7:] if line.startswith("event: ") else event
                    if line.startswith("data: ") and event == "record":
                        records.append(json.loads(line[6:]))
                        if records[-1]["signed_size"] is not None:
                            return

        listener = threading.Thread(target=listen)
        listener.start()
        _until(lambda: records, "the first record status")
        sign_checkpoints(ledger, private.read_text().strip())  # no commit: the page sees the file change
        listener.join(timeout=WAIT_S)
        signed = records[-1]
        assert signed["signed_size"] == signed["size"] == _head(ledger, "live-r")
        assert signed["checkpoint"].endswith("at the head (signature verified)"), signed
        assert signed["signers"] == ["test"]


def test_a_page_that_loses_its_ledger_says_so(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    _story(ledger)
    hidden = tmp_path / "moved-away"
    with serving(ledger) as url:
        told: list[dict[str, Any]] = []

        def listen() -> None:
            with httpx.stream("GET", url + "/runs/live-r/events", timeout=WAIT_S) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and '"ok"' in line:
                        told.append(json.loads(line[6:]))
                        if len(told) == 2:
                            return

        listener = threading.Thread(target=listen)
        listener.start()
        time.sleep(0.3)
        ledger.rename(hidden)
        try:
            _until(lambda: told, "the stream said the ledger is gone")
            assert told[0]["ok"] is False and "gone" in told[0]["message"]
            page = _get(url + "/runs/live-r")
            assert page.status_code == 503 and "ledger unavailable" in page.text and "gone" in page.text
            assert _get(url + "/healthz").status_code == 503
        finally:
            hidden.rename(ledger)
        listener.join(timeout=WAIT_S)
        assert [t["ok"] for t in told] == [False, True]
        assert _until(lambda: _get(url + "/runs/live-r").status_code == 200, "the page is back")


def test_bad_input_gets_a_clear_4xx_never_a_5xx(story_ledger: Path) -> None:
    page = LivePage(story_ledger)
    with TestClient(page.app) as client:
        for path, code in [
            ("/runs/live-r/events?after=abc", 400),
            ("/runs/live-r/events?after=-5", 400),
            ("/runs/live-r/events?after=99999999999999999999999", 400),
            ("/runs/" + "a" * 300, 404),
            ("/assets/live.html", 404),
        ]:
            resp = client.get(path)
            assert resp.status_code == code, (path, resp.text)
            assert len(resp.text.splitlines()) == 1


# ---------------------------------------------------------------------------------------- a real browser
def _chromium(window: tuple[int, int] = (1400, 2200)) -> Any:
    return chromium((f"--window-size={window[0]},{window[1]}",), {"browser": "ALL"})


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = _chromium()
    try:
        yield driver
    finally:
        driver.quit()


def _open(driver: Any, url: str) -> None:
    driver.get(url)
    _until(
        lambda: driver.execute_script("return !!(window.__report && window.__report.ready && window.__live)"),
        "page drawn",
    )


def _drawn_points(driver: Any, chart: str) -> list[list[float]]:
    return driver.execute_script(
        "var name = arguments[0];"
        "var c = window.__report.charts.filter(function (c) { return c.name === name; })[0];"
        "var out = []; c.chart.getOption().series.forEach(function (s) {"
        "  if (s.type === 'line') (s.data || []).forEach(function (d) { out.push(d); }); });"
        "return out;",
        chart,
    )


def test_page_draws_its_charts_and_hostile_texts_stay_text(story_ledger: Path, browser: Any) -> None:
    driver = browser
    with serving(story_ledger) as url:
        try:
            _open(driver, url + "/runs/live-r")
            names = driver.execute_script(
                "return window.__report.charts.map(function (c) { return c.name; })"
            )
            assert {"curve:loss", "drop-heatmap:live-r", "mean-drop", "attempts"} <= set(names)
            assert len(_drawn_points(driver, "curve:loss")) > 10
            heat = driver.execute_script(
                "return window.__report.charts.filter(function (c) { return c.name === 'drop-heatmap:live-r'; })[0]"
                ".chart.getOption().series[0].data.length"
            )
            assert heat > 0
            # Canvas pixels: the charts really drew (not just options set).
            painted = driver.execute_script(
                "var c = document.querySelector('[data-chart=\"curve:loss\"] canvas');"
                "var d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, n = 0;"
                "for (var i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n;"
            )
            assert painted > 1000
            assert driver.execute_script("return window.__pwned === undefined")
            assert driver.execute_script("return document.querySelectorAll('img').length") == 0
            # The crash message, the note and the PR's title, each shown whole as text in the events table.
            events = driver.execute_script("return document.getElementById('events').textContent")
            assert events.count(HOSTILE) == 3
            config = driver.execute_script("return document.getElementById('config').textContent")
            assert json.dumps(HOSTILE, ensure_ascii=False) in config  # the config key, as JSON text
            assert "live" in driver.find_element("id", "live-status").get_attribute("class")
            assert "not signed yet" in driver.find_element("id", "record-now").text
            severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not severe, severe
        finally:
            driver.get("about:blank")  # the page's stream closed before the server stops


def test_a_logged_step_reaches_the_open_page_and_a_restart_loses_and_repeats_nothing(
    tmp_path: Path, browser: Any
) -> None:
    spool, state, ledger = tmp_path / "spool", tmp_path / "state", tmp_path / "ledger"
    run = runledger.init("live-c", config={"lr": 0.01}, spool=spool, state_dir=state, handle_signals=False)

    def log_and_ingest(steps: range) -> int:
        for step in steps:
            assert run.log({"loss": 2.0 / step, "lr": 0.01}, step=step)
        assert run.emitter.flush()
        ingest_spool(Ledger.create(ledger), spool)
        return _head(ledger, "live-c")

    log_and_ingest(range(1, 21))
    server = ServerProcess(ledger, _free_port())
    driver = browser
    try:
        server.start()
        _open(driver, server.url + "/runs/live-c")
        after = driver.execute_script("return window.__live.last")
        _until(lambda: driver.execute_script("return window.__live.connected"), "the stream connected")
        head = log_and_ingest(range(21, 26))
        _until(
            lambda: driver.execute_script("return window.__live.last") == head - 1, "steps 21-25 on the page"
        )
        _until(
            lambda: [p[0] for p in _drawn_points(driver, "curve:loss")][-5:] == [21, 22, 23, 24, 25], "drawn"
        )

        server.kill()  # SIGKILL: no goodbye to the browser
        _until(
            lambda: "stale" in driver.find_element("id", "live-status").get_attribute("class"),
            "page says stale",
        )
        head = log_and_ingest(range(26, 41))  # committed while no server runs
        server.start()
        _until(
            lambda: driver.execute_script("return window.__live.last") == head - 1,
            "steps 26-40 after the restart",
        )
        assert run.annotate(HOSTILE, step=40, author="<b>eve</b>")  # a live marker with hostile text
        head = log_and_ingest(range(41, 46))
        _until(
            lambda: driver.execute_script("return window.__live.last") == head - 1, "steps 41-45, live again"
        )
        live = driver.execute_script("return window.__live")
        assert live["ids"] == list(range(after + 1, head))  # every leaf once: no gap, no duplicate
        assert live["duplicates"] == 0 and live["gaps"] == 0
        _until(lambda: _drawn_points(driver, "curve:loss")[-1][0] == 45, "step 45 drawn")
        steps = [p[0] for p in _drawn_points(driver, "curve:loss")]
        assert steps == sorted(set(steps)) and steps[-25:] == list(range(21, 46))
        assert "live" in driver.find_element("id", "live-status").get_attribute("class")
        live_rows = driver.execute_script(
            "return Array.prototype.map.call(document.querySelectorAll('#events tr[data-live]'),"
            " function (tr) { return tr.textContent; })"
        )
        assert len(live_rows) == 1 and HOSTILE in live_rows[0] and "<b>eve</b>" in live_rows[0]
        assert driver.execute_script(
            "return window.__pwned === undefined && !document.querySelector('img, b')"
        )
        state_now = driver.find_element("id", "state-now")
        _until(lambda: state_now.text.splitlines()[0] == "step 45", "the state panel caught up")
    finally:
        driver.get("about:blank")
        server.kill()
        run.finish()


def test_cli_serve_page_is_registered_and_refuses_a_missing_ledger(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from runledger.cli.main import app

    result = CliRunner().invoke(app, ["serve", "page", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0 and "--ledger" in result.output and "--port" in result.output
    result = CliRunner().invoke(app, ["serve", "page", "--ledger", str(tmp_path / "nowhere")])
    assert result.exit_code == 1 and "no ledger at" in result.output
