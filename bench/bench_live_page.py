"""`ledger serve page`: how fast a commit reaches an open page, how long a page takes to load, and
the server's memory with 100 live clients. The server runs in its own process (``ledger.live_page.serve``)
on 127.0.0.1, as a person would run it.

1. Freshness. A run logs one step at a time through ``runledger.init`` → spool; the spool ingester
   commits it (its own time, the baseline: log → commit); an SSE client (httpx) notes when the
   step's event arrives. Reported: ingest (log → commit) and push (commit → event on the stream)
   p50/p99, over ``--rounds`` rounds.
2. Page load on a simulated ledger of ``--steps`` steps × 48 layers (bench.bench_report's
   ``build_ledger``): the first GET of the run's page (built: the report's queries), a second
   (cached per commit), its size; and, when Chromium is here, navigation to charts drawn.
3. Memory: the server's RSS idle, with ``--clients`` streams open, and after ``--burst`` events
   pushed to all of them (each client checks it got every id once).

    python -m bench.bench_live_page [--rounds 60] [--steps 100000] [--clients 100]
"""

from __future__ import annotations

import argparse
import asyncio
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
SERVE = "import sys; from ledger.live_page import serve; serve(sys.argv[1], port=int(sys.argv[2]))"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, ledger: Path) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, str(ledger), str(self.port)], env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the server did not start")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
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
    from ingest.spool_ingester import ingest_spool
    from ledger.store import Ledger

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


# ---------------------------------------------------------------------------------------- 2. page load
def page_load(work: Path, steps: int) -> dict[str, Any]:
    from bench.bench_report import build_ledger
    from ledger.query import Reader
    from ledger.report import build_report, render_html

    ledger = work / "big"
    built_s = build_ledger(ledger, steps, expert_every=1000)
    t = time.perf_counter()
    report_file = work / "report.html"  # the baseline: `ledger report`'s own work, and its file
    report_file.write_text(render_html(build_report(Reader(ledger), ["bench-run"])))
    report_s = time.perf_counter() - t
    server = Server(ledger)
    try:
        t = time.perf_counter()
        first = httpx.get(f"{server.url}/runs/bench-run", timeout=120)
        first_s = time.perf_counter() - t
        t = time.perf_counter()
        httpx.get(f"{server.url}/runs/bench-run", timeout=120)
        cached_s = time.perf_counter() - t
        out: dict[str, Any] = {
            "steps": steps,
            "built_s": built_s,
            "report_s": report_s,
            "first_s": first_s,
            "cached_s": cached_s,
            "bytes": len(first.content),
            "status": first.status_code,
            "rss_mb": server.rss_mb(),
        }
        # The live page twice (the first navigation of a fresh Chromium is a cold start), the file once.
        live_url = f"{server.url}/runs/bench-run"
        cold, out["report_browser_s"], out["browser_s"] = _browser_load(
            [live_url, report_file.as_uri(), live_url]
        )
        out["cold_browser_s"] = cold
        return out
    finally:
        server.stop()


def _browser_load(urls: list[str]) -> list[tuple[float, float] | None]:
    """Per URL: navigation start to the report's charts drawn, in one headless Chromium, and the
    response's part of it (all None without Chromium)."""
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
    out: list[tuple[float, float] | None] = []
    try:
        for url in urls:
            driver.get("about:blank")
            t = time.perf_counter()
            driver.get(url)
            deadline = time.monotonic() + 120
            while not driver.execute_script("return !!(window.__report && window.__report.ready)"):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            took = time.perf_counter() - t
            response_ms = driver.execute_script(
                "return performance.getEntriesByType('navigation')[0].responseEnd"
            )
            out.append((took, response_ms / 1000))
        return out
    finally:
        driver.quit()


# ---------------------------------------------------------------------------------------- 3. memory
def memory(work: Path, clients: int, burst: int) -> dict[str, Any]:
    from ledger.store import Ledger, SourceRecord
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
        if "memory" not in skip:
            m = memory(work, args.clients, args.burst)
            print(
                f"memory with {args.clients} SSE clients: RSS idle {m['idle']:.0f} MB, connected {m['connected']:.0f} MB, "
                f"after {args.burst} events to each {m['after']:.0f} MB; {m['complete']}/{args.clients} clients got every "
                f"id once; commit → last client's last event {m['fanout_s']:.2f} s"
            )
        if "page" not in skip:
            pl = page_load(work, args.steps)
            b, r = pl["browser_s"], pl["report_browser_s"]
            browser = (
                f"{b[0]:.2f} s (the response {b[1]:.2f} s of it; a fresh Chromium's first load "
                f"{pl['cold_browser_s'][0]:.2f} s; the report file from disk: {r[0]:.2f} s)"
                if b is not None and r is not None
                else "no Chromium"
            )
            print(
                f"page load, {pl['steps']:,} steps × 48 layers (ledger built in {pl['built_s']:.0f} s): "
                f"`ledger report`'s build_report+render_html {pl['report_s']:.2f} s; first GET {pl['first_s']:.2f} s (HTTP {pl['status']}, {pl['bytes'] / 1e6:.2f} MB), next GET (page kept 30 s) "
                f"{pl['cached_s'] * 1000:.0f} ms, in Chromium to charts drawn {browser}; server RSS {pl['rss_mb']:.0f} MB"
            )


if __name__ == "__main__":
    main()
