"""Alert latency from a commit to the webhook (issue 44): ``ledger alerts deliver --follow`` against a
receiver on 127.0.0.1, p50/p99 over ``--rounds`` commits, beside its baselines in the same run.

Each round commits one batch of a run's steps whose last loss spikes (the ledger's loss-spike rule
records one ``ledger.anomaly`` at that commit) and times the spike from the moment ``commit`` returns
(the anomaly is readable) to the moment the receiver has read its POST. The follower is the real
program, ``python -m runledger.cli.alerts_cmd alerts deliver --follow --interval I``, in its own
process. The latency is expected near ``I / 2`` (the commit lands anywhere in a poll's wait) plus one
pass (a Reader opened at the newest snapshot, the query) plus one POST; the baselines, measured in
the same run on the same machine, are those parts:

* ``bare POST``: one ``http.client`` POST of an alert-sized body to the same receiver;
* ``empty pass``: ``deliver_alerts`` in this process with nothing new to deliver (open, query, close);
* ``half the interval``: ``I / 2``.

    python -m bench.bench_alerts [--rounds 30] [--interval 0.5] [--work DIR]

With 30 rounds, p99 is the slowest of the 30 samples (read it as "the worst seen"). After the
rounds, the follower's own CPU over ``--idle`` seconds with nothing committed is set beside what a
pass per look would cost (the empty pass's CPU times the looks): an idle follower lists the commit
records, and opens no Reader (``runledger.ledger.alerts.CommitWatch``).

Measured (2026-12-06, a shared 2-core machine at load ~19, so wall times are loose; 30 rounds,
``--interval 0.5``):

    commit -> receiver (--follow)    p50   1006.4 ms   p99   1634.6 ms   (n=30)
    baseline: bare POST              p50      0.5 ms   p99    115.4 ms   (n=30)
    baseline: empty pass             p50    580.1 ms   p99    774.2 ms   (n=10)
    baseline: half the interval         250.0 ms
    p50 latency / (half the interval + empty pass p50 + bare POST p50) = 1.18
    idle follower CPU over 10 s: 10 ms; a pass per look (20 looks x 173 ms CPU) would be 3460 ms

Measured again (2026-12-07, the same machine idle, load 0.2; 30 rounds, ``--interval 0.5``):

    commit -> receiver (--follow)    p50    464.3 ms   p99    479.9 ms   (n=30)
    baseline: bare POST              p50      0.5 ms   p99      1.2 ms   (n=30)
    baseline: empty pass             p50     36.6 ms   p99     37.6 ms   (n=10)
    baseline: half the interval         250.0 ms
    p50 latency / (half the interval + empty pass p50 + bare POST p50) = 1.62
    idle follower CPU over 10 s: 10 ms; a pass per look (20 looks x 40 ms CPU) would be 806 ms

(~180 ms above the sum of the parts, not broken down here: the follower's pass runs in its own
process and has an anomaly to deliver; the empty pass runs in this one with nothing to deliver).

so the latency is the poll's wait plus one pass, nearly all of it opening a Reader at the newest
snapshot (the POST itself is under a millisecond on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from runledger.ledger.alerts import deliver_alerts
from runledger.ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60.0  # the longest any one anomaly is waited for
STEPS_PER_ROUND = 10
WARM_STEPS = 30  # flat losses before the first spike: the rule's window must hold 20


class Arrivals:
    """What the receiver read, and when (``time.monotonic``), by event id."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.changed = threading.Condition()

    def note(self, event_id: str) -> None:
        with self.changed:
            self.at.setdefault(event_id, time.monotonic())
            self.changed.notify_all()

    def wait(self, count: int) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: len(self.at) >= count, WAIT_S):
                raise SystemExit(f"the receiver got {len(self.at)} of {count} anomalies in {WAIT_S:g} s")


@contextmanager
def receiver(arrivals: Arrivals) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            event_id = json.loads(body).get("runledger", {}).get("event_id")
            if event_id:
                arrivals.note(event_id)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


class Committer:
    """One run's events, committed a batch at a time (each batch ending in a spike)."""

    def __init__(self, root: Path) -> None:
        self.ledger = Ledger.create(root)
        self.run = RunBuilder(run_id="bench-alerts")
        self.run.start()
        self.step = 0
        self.sent = 0  # events committed so far (their positions on the bench's source)

    def commit(self, steps: int, spike: bool) -> None:
        for i in range(steps):
            self.step += 1
            self.run.step(self.step, loss=9.0 if spike and i == steps - 1 else 1.0)
        raws = self.run.events[self.sent :]
        self.ledger.commit([SourceRecord("spool:bench", self.sent + i, raw) for i, raw in enumerate(raws)])
        self.sent += len(raws)


def bare_post_s(url: str, rounds: int) -> list[float]:
    """The baseline of the POST alone: an alert-sized body, a fresh connection each, as deliver does."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"text": "x" * 200, "blocks": [], "runledger": {"event_id": ""}}).encode()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/hook", body=body, headers={"Content-Type": "application/json"})
        conn.getresponse().read()
        conn.close()
        times.append(time.perf_counter() - started)
    return times


def empty_pass_s(root: Path, url: str, cursor: Path, rounds: int) -> tuple[list[float], list[float]]:
    """The baseline of one follow pass with nothing new (a Reader at the newest snapshot, the
    query): its wall and CPU seconds."""
    deliver_alerts(root, url, cursor)  # (the first: imports and the anomalies so far)
    walls, cpus = [], []
    for _ in range(rounds):
        started, cpu = time.perf_counter(), time.process_time()
        report = deliver_alerts(root, url, cursor)
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu)
        assert report.delivered == 0
    return walls, cpus


def process_cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_s(follower: subprocess.Popen[bytes], window_s: float) -> float:
    """The follower's CPU seconds over ``window_s`` with nothing committed."""
    before = process_cpu_s(follower.pid)
    time.sleep(window_s)
    return process_cpu_s(follower.pid) - before


def follow_latencies_s(committer: Committer, arrivals: Arrivals, rounds: int) -> list[float]:
    """Per round: commit a spike, then wait for the receiver to read its anomaly."""
    latencies = []
    for n in range(1, rounds + 1):
        committer.commit(STEPS_PER_ROUND, spike=True)
        committed = time.monotonic()
        arrivals.wait(n)
        newest = max(arrivals.at.values())
        latencies.append(newest - committed)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def line(name: str, values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return (
        f"{name:<32} p50 {percentile(ms, 0.5):8.1f} ms   p99 {percentile(ms, 0.99):8.1f} ms   (n={len(ms)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--interval", type=float, default=0.5, help="the follower's --interval, seconds")
    parser.add_argument(
        "--idle", type=float, default=10.0, help="seconds the idle follower's CPU is measured"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="a folder for the ledger (default: a temporary one)"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-alerts-"))
    root = work / "ledger"
    shutil.rmtree(root, ignore_errors=True)
    arrivals = Arrivals()
    committer = Committer(root)
    committer.commit(WARM_STEPS, spike=False)
    with receiver(arrivals) as url:
        posts = bare_post_s(url, args.rounds)
        pass_walls, pass_cpus = empty_pass_s(root, url, work / "empty-cursor.json", min(args.rounds, 10))
        follower = _follower(root, url, work / "cursor.json", args.interval)
        try:
            latencies = follow_latencies_s(committer, arrivals, args.rounds)
            idle = idle_cpu_s(follower, args.idle)
        finally:
            follower.terminate()
            follower.wait(WAIT_S)
    committer.ledger.close()
    _print(args, latencies, posts, pass_walls, pass_cpus, idle)


def _print(
    args: argparse.Namespace,
    latencies: list[float],
    posts: list[float],
    pass_walls: list[float],
    pass_cpus: list[float],
    idle_cpu: float,
) -> None:
    print(line("commit -> receiver (--follow)", latencies))
    print(line("baseline: bare POST", posts))
    print(line("baseline: empty pass", pass_walls))
    print(f"{'baseline: half the interval':<32} {args.interval * 500:8.1f} ms")
    parts = args.interval / 2 + statistics.median(pass_walls) + statistics.median(posts)
    print(
        f"p50 latency / (half the interval + empty pass p50 + bare POST p50) = {statistics.median(latencies) / parts:.2f}"
    )
    looks = args.idle / args.interval
    without_watch = looks * statistics.median(pass_cpus)
    print(
        f"idle follower CPU over {args.idle:g} s: {idle_cpu * 1000:.0f} ms; a pass per look ({looks:.0f} looks "
        f"x {statistics.median(pass_cpus) * 1000:.0f} ms CPU) would be {without_watch * 1000:.0f} ms "
        f"({idle_cpu / without_watch:.2f}x)"
    )


def _follower(root: Path, url: str, cursor: Path, interval_s: float) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "runledger.cli.alerts_cmd", "alerts", "deliver", "--url", url]
    argv += ["--ledger", str(root), "--cursor", str(cursor), "--follow", "--interval", str(interval_s)]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
