"""`ledger serve page`: how fast a commit reaches an open page, how long a page takes to load, and
the server's memory with 100 live clients. The server runs in its own process (``runledger.ledger.live_page.serve``)
on 127.0.0.1, as a person would run it.

1. Freshness. A run logs one step at a time through ``runledger.init`` → spool; the spool ingester
   commits it (its own time, the baseline: log → commit); an SSE client (httpx) notes when the
   step's event arrives, and (with Chromium) an open page notes when it drew the step
   (``window.__live.drawn``). Reported: ingest (log → commit), push (commit → event on the stream)
   and commit → point drawn, p50/p99, over ``--rounds`` rounds.
2. Page load over each ``--ledger`` (e.g. the reference run at 10 %, 30 % and 100 %; without one, a
   simulated ledger of ``--steps`` steps × 48 layers, bench.bench_report's ``build_ledger``). In the
   same run, the baselines: a plain DuckDB scan of the run's router rows and ``ledger report``'s
   build_report + render_html. Then the server: warm (the page built at its start: how long after
   start, the first GET, the next), GETs of the kept page while it is rebuilt in the background,
   cold (no warm-up: the first GET builds), and, with Chromium, navigation to charts drawn for the
   page and for the report file; the server's RSS and peak RSS.
3. Memory: the server's RSS idle, with ``--clients`` streams open, and after ``--burst`` events
   pushed to all of them (each client checks it got every id once).

    python -m bench.bench_live_page [--rounds 60] [--clients 100] [--ledger LEDGER ...] [--skip page]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVE = (  # SIGUSR1 dumps the server's threads (a stuck build can be seen)
    "import faulthandler, json, signal, sys; faulthandler.register(signal.SIGUSR1); "
    "from runledger.ledger.live_page import serve; serve(sys.argv[1], port=int(sys.argv[2]), **json.loads(sys.argv[3]))"
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, ledger: Path, **options: Any) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(ledger), str(self.port), json.dumps(options)], env=env
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    self.up_s = time.perf_counter() - started
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the server did not start")

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/healthz", timeout=30).json())

    def rss_mb(self, field: str = "VmRSS") -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(values: list[float]) -> str:
    return f"p50 {1000 * statistics.median(values):7.1f} ms   p99 {1000 * _pct(values, 0.99):7.1f} ms"


# ---------------------------------------------------------------------------------------- 1. freshness
def freshness(work: Path, rounds: int) -> dict[str, list[float]]:
    import runledger
    from runledger.ingest.spool_ingester import ingest_spool
    from runledger.ledger.store import Ledger

    spool, ledger = work / "spool", work / "ledger"
    run = runledger.init(
        "bench-live", config={"lr": 0.01}, spool=spool, state_dir=work / "state", handle_signals=False
    )
    run.log({"loss": 1.0}, step=0)
    run.emitter.flush()
    ingest_spool(Ledger.create(ledger), spool)
    server = Server(ledger)
    arrived: dict[int, float] = {}  # step → wall time its event reached the client

    def listen() -> None:
        with httpx.stream("GET", f"{server.url}/runs/bench-live/events", timeout=30) as resp:
            event = ""
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "step":
                    step = int(line.split('"step":', 1)[1].split(",", 1)[0])
                    arrived[step] = time.time()
                    if step == rounds:
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    time.sleep(1.0)
    ingest_s, push_s, total_s = [], [], []
    for step in range(1, rounds + 1):
        logged = time.time()
        run.log({"loss": 1.0 / step}, step=step)
        run.emitter.flush()
        ingest_spool(Ledger.open(ledger), spool)
        committed = time.time()
        deadline = time.monotonic() + 10
        while step not in arrived and time.monotonic() < deadline:
            time.sleep(0.002)
        ingest_s.append(committed - logged)
        push_s.append(arrived.get(step, float("inf")) - committed)
        total_s.append(arrived.get(step, float("inf")) - logged)
        time.sleep(0.05)
    run.finish()
    server.stop()
    return {"ingest": ingest_s, "push": push_s, "total": total_s}


def page_freshness(work: Path, rounds: int) -> dict[str, list[float]] | None:
    """Commit → point drawn on an open page in headless Chromium (live.js notes when each redraw
    drew up to which leaf: ``window.__live.drawn``), beside the ingester's log → commit."""
    import runledger
    from runledger.ingest.spool_ingester import ingest_spool
    from runledger.ledger.store import Ledger

    driver = _driver()
    if driver is None:
        return None
    spool, ledger = work / "pspool", work / "pledger"
    run = runledger.init(
        "bench-page", config={"lr": 0.01}, spool=spool, state_dir=work / "pstate", handle_signals=False
    )
    run.log({"loss": 1.0}, step=0)
    run.emitter.flush()
    ingest_spool(Ledger.create(ledger), spool)
    server = Server(ledger)
    ingest_s, drawn_s = [], []
    try:
        driver.get(f"{server.url}/runs/bench-page")
        deadline = time.monotonic() + 60
        while not driver.execute_script("return !!(window.__live && window.__live.connected)"):
            if time.monotonic() > deadline:
                raise RuntimeError("the page did not connect")
            time.sleep(0.05)
        for step in range(1, rounds + 1):
            logged = time.time()
            run.log({"loss": 1.0 / step}, step=step)
            run.emitter.flush()
            led = Ledger.open(ledger)
            ingest_spool(led, spool)
            committed = time.time()
            leaf = led.stream_heads()["bench-page"].size - 1
            deadline = time.monotonic() + 10
            at = None
            while at is None and time.monotonic() < deadline:
                drawn = driver.execute_script("return window.__live.drawn")
                at = next((t / 1000 for last, t in drawn if last >= leaf), None)
                time.sleep(0.01)
            ingest_s.append(committed - logged)
            drawn_s.append((at if at is not None else float("inf")) - committed)
            time.sleep(0.05)
    finally:
        driver.quit()
        server.stop()
        run.finish()
    return {"ingest": ingest_s, "drawn": drawn_s}


def _driver() -> Any:
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        return None
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1800",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))


# ---------------------------------------------------------------------------------------- 2. page load
def page_load(work: Path, ledger: Path | None, steps: int) -> dict[str, Any]:
    """The run's page over ``ledger`` (or, without one, a simulated ledger of ``steps`` steps):
    baselines first (a plain DuckDB scan of the router rows, ``ledger report``'s build), then the
    server three ways: warm (its start builds the page), a visit while a rebuild runs (page kept,
    ``page_max_age_s=0``: every GET starts one), and cold (no warm-up: the first GET builds)."""
    from runledger.ledger.query import Reader
    from runledger.ledger.report import build_report, render_html

    out: dict[str, Any] = {"built_s": None}
    if ledger is None:
        from bench.bench_report import build_ledger

        ledger = work / "big"
        out["built_s"] = build_ledger(ledger, steps, expert_every=1000)
    reader = Reader(ledger)
    run_id = str(reader.sql("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1").rows[0][0])
    out["run_id"] = run_id
    out["events"] = int(reader.sql("SELECT count(*) FROM events").rows[0][0])
    t = time.perf_counter()
    rows = reader.sql(
        "SELECT count(*), avg(token_drop_rate) FROM _moe_layer_stats WHERE run_id = ?", [run_id]
    ).rows[0]
    out["scan_s"], out["layer_rows"] = time.perf_counter() - t, int(rows[0])
    t = time.perf_counter()
    report_file = work / "report.html"  # the baseline: `ledger report`'s own work, and its file
    report_file.write_text(render_html(build_report(reader, [run_id])))
    out["report_s"] = time.perf_counter() - t
    page = f"/runs/{run_id}"
    out.update(_warm_server(ledger, page))
    out.update(_while_rebuilding(ledger, page))
    out.update(_cold_server(ledger, page))
    # The live page twice (the first navigation of a fresh Chromium is a cold start), the file once.
    server = Server(ledger)
    try:
        _until_built(server, 1)
        cold, out["report_browser_s"], out["browser_s"] = _browser_load(
            [server.url + page, report_file.as_uri(), server.url + page]
        )
        out["cold_browser_s"] = cold
    finally:
        server.stop()
    return out


def _until_built(server: Server, pages: int, wait_s: float = 600) -> float:
    """Seconds until the server has built ``pages`` pages (its warm-up or rebuilds)."""
    t = time.perf_counter()
    while server.health()["pages_built"] < pages:
        if time.perf_counter() - t > wait_s:
            raise RuntimeError("the page was not built")
        time.sleep(0.05)
    return time.perf_counter() - t


def _get(url: str) -> tuple[float, httpx.Response]:
    t = time.perf_counter()
    resp = httpx.get(url, timeout=600)
    return time.perf_counter() - t, resp


def _warm_server(ledger: Path, page: str) -> dict[str, Any]:
    server = Server(ledger)
    try:
        warm_s = server.up_s + _until_built(server, 1)
        first_s, first = _get(server.url + page)
        again_s, _ = _get(server.url + page)
        return {
            "up_s": server.up_s,
            "warm_s": warm_s,
            "build_s": server.health()["page_build_s"][-1],
            "first_s": first_s,
            "again_s": again_s,
            "bytes": len(first.content),
            "status": first.status_code,
            "rss_mb": server.rss_mb(),
            "peak_rss_mb": server.rss_mb("VmHWM"),
        }
    finally:
        server.stop()


def _while_rebuilding(ledger: Path, page: str) -> dict[str, Any]:
    """GETs of a kept page while its rebuild runs (every GET of an old page starts one)."""
    server = Server(ledger, page_max_age_s=0.0)
    try:
        _until_built(server, 1)
        times: list[float] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not times or server.health()["pages_built"] < 2):
            took, resp = _get(server.url + page)
            assert resp.status_code == 200
            times.append(took)
            time.sleep(0.2)
        return {"rebuilding_get_s": times}
    finally:
        server.stop()


def _cold_server(ledger: Path, page: str) -> dict[str, Any]:
    server = Server(ledger, warm=False)
    try:
        cold_s, resp = _get(server.url + page)
        assert resp.status_code == 200
        return {"cold_first_s": cold_s}
    finally:
        server.stop()


def _browser_load(urls: list[str]) -> list[tuple[float, float, float] | None]:
    """Per URL, in one headless Chromium: navigation start to the first screen's charts drawn (the page
    ready), the response's part of it, and navigation start to every chart drawn (all None without
    Chromium)."""
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        return [None for _ in urls]
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1800",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    out: list[tuple[float, float, float] | None] = []
    try:
        for url in urls:
            driver.get("about:blank")
            driver.get(url)
            deadline = time.monotonic() + 120
            # The page's own clock (ms since navigation): polling from here would add its own delay.
            while not driver.execute_script("return !!(window.__report && window.__report.complete)"):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            response_ms, ready_ms, complete_ms = driver.execute_script(
                "return [performance.getEntriesByType('navigation')[0].responseEnd,"
                " window.__report.ready_ms, window.__report.complete_ms]"
            )
            out.append((ready_ms / 1000, response_ms / 1000, complete_ms / 1000))
        return out
    finally:
        driver.quit()


# ---------------------------------------------------------------------------------------- 3. memory
def memory(work: Path, clients: int, burst: int) -> dict[str, Any]:
    from runledger.ledger.store import Ledger, SourceRecord
    from tests.support.factory import RunBuilder

    ledger = work / "mem"
    run = RunBuilder(run_id="mem-run")
    run.start()
    Ledger.create(ledger).commit([SourceRecord("spool:b", i, raw) for i, raw in enumerate(run.events)])
    start = Ledger.open(ledger).stream_heads()["mem-run"].size
    server = Server(ledger)
    idle = server.rss_mb()

    async def one(client: httpx.AsyncClient, opened: list[int]) -> list[int]:
        ids: list[int] = []
        async with client.stream(
            "GET", f"{server.url}/runs/mem-run/events", params={"after": start - 1}
        ) as resp:
            opened[0] += 1
            async for line in resp.aiter_lines():
                if line.startswith("id: "):
                    ids.append(int(line[4:]))
                    if len(ids) == burst:
                        break
        return ids

    async def main() -> tuple[float, float, list[list[int]], float]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients + 10)) as client:
            opened = [0]
            tasks = [asyncio.create_task(one(client, opened)) for _ in range(clients)]
            while opened[0] < clients:
                await asyncio.sleep(0.05)
            connected = server.rss_mb()
            t = time.perf_counter()
            for step in range(1, burst + 1):
                run.step(step, loss=1.0 / step)
            led = Ledger.open(ledger)
            await asyncio.to_thread(
                led.commit, [SourceRecord("spool:b", i, raw) for i, raw in enumerate(run.events)]
            )
            got = await asyncio.gather(*tasks)
            return connected, server.rss_mb(), got, time.perf_counter() - t

    connected, after, got, fanout_s = asyncio.run(main())
    server.stop()
    complete = sum(ids == list(range(start, start + burst)) for ids in got)
    return {"idle": idle, "connected": connected, "after": after, "complete": complete, "fanout_s": fanout_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument(
        "--ledger",
        type=Path,
        action="append",
        default=[],
        help="measure the page over this ledger (repeat: e.g. the reference run at 10%%, 30%%, 100%%); "
        "default: a simulated one of --steps steps",
    )
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--burst", type=int, default=50)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: freshness,page,memory")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"bench_live_page: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
        work = Path(tmp)
        if "freshness" not in skip:
            f = freshness(work, args.rounds)
            print(
                f"freshness over {args.rounds} steps (log → commit by the spool ingester, then commit → SSE event):"
            )
            print(f"  ingester, log → commit     {_ms(f['ingest'])}")
            print(f"  live page, commit → event  {_ms(f['push'])}")
            print(f"  log → event on the stream  {_ms(f['total'])}")
            pf = page_freshness(work, args.rounds)
            if pf is None:
                print("commit → point on the page: no Chromium")
            else:
                print(f"commit → point drawn on an open page in headless Chromium, over {args.rounds} steps:")
                print(f"  ingester, log → commit     {_ms(pf['ingest'])}")
                print(f"  commit → point drawn       {_ms(pf['drawn'])}")
        if "memory" not in skip:
            m = memory(work, args.clients, args.burst)
            print(
                f"memory with {args.clients} SSE clients: RSS idle {m['idle']:.0f} MB, connected {m['connected']:.0f} MB, "
                f"after {args.burst} events to each {m['after']:.0f} MB; {m['complete']}/{args.clients} clients got every "
                f"id once; commit → last client's last event {m['fanout_s']:.2f} s"
            )
        if "page" not in skip:
            for ledger in args.ledger or [None]:
                _print_page(page_load(work, ledger, args.steps), ledger)


def _print_page(pl: dict[str, Any], ledger: Path | None) -> None:
    b, r = pl["browser_s"], pl["report_browser_s"]
    browser = (
        f"first screen {b[0]:.2f} s, every chart {b[2]:.2f} s (the response {b[1]:.2f} s of it; a fresh "
        f"Chromium's first load {pl['cold_browser_s'][0]:.2f} s / {pl['cold_browser_s'][2]:.2f} s; the "
        f"report file from disk: {r[0]:.2f} s / {r[2]:.2f} s)"
        if b is not None and r is not None
        else "no Chromium"
    )
    where = str(ledger) if ledger is not None else f"simulated, built in {pl['built_s']:.0f} s"
    rebuilding = pl["rebuilding_get_s"]
    print(
        f"page load over {where}: run {pl['run_id']}, {pl['events']:,} events, {pl['layer_rows']:,} router rows"
    )
    print(
        f"  baselines: DuckDB scan of the router rows {pl['scan_s']:.2f} s; "
        f"`ledger report`'s build_report+render_html {pl['report_s']:.2f} s"
    )
    print(
        f"  warm server: up {pl['up_s']:.2f} s, page built {pl['warm_s']:.2f} s after start (the build "
        f"{pl['build_s']:.2f} s); first GET {pl['first_s'] * 1000:.0f} ms (HTTP {pl['status']}, "
        f"{pl['bytes'] / 1e6:.2f} MB), next {pl['again_s'] * 1000:.0f} ms; RSS {pl['rss_mb']:.0f} MB "
        f"(peak {pl['peak_rss_mb']:.0f} MB)"
    )
    print(
        f"  GET while the page is rebuilt: {len(rebuilding)} GETs, max {max(rebuilding) * 1000:.0f} ms, "
        f"median {statistics.median(rebuilding) * 1000:.0f} ms"
    )
    print(f"  cold server (no warm-up): first GET {pl['cold_first_s']:.2f} s (it builds the page)")
    print(f"  in Chromium to charts drawn: {browser}")


if __name__ == "__main__":
    main()
