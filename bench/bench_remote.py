"""`ledger verify --remote` and `ledger query --remote` benchmark, one ledger, three ways to reach it.

* HTTP verify: a simulated ledger published and served by a local http.server, verified remotely from
  nothing, then again after 1,000 new steps (only what is new), then with nothing new; beside the
  baseline of `ledger verify` of the same ledger on disk. Bytes fetched are counted by the server.
* Query over HTTP (nginx, scripts/http.sh: Range requests): the verified download (`query --remote`,
  first time: every file; bytes from nginx's log) and `--direct` (DuckDB's httpfs by URL, only the
  ranges the query needs), for the same two queries.
* S3 (versitygw, scripts/s3.sh): the copy in a bucket (published there when `runledger.ledger.publish` writes
  S3, else mirrored file by file), then verify from nothing (when the monitor reads S3), the verified
  download and `--direct`.

Each check runs in its own subprocess so its peak RSS (VmHWM) is its own. Legs whose server is not
built here (no nginx, no versitygw) are left out, saying so on stderr.

    python -m bench.bench_remote [--sizes 20000 100000]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import runledger.ledger.publish
from bench.bench_publish import _grow
from runledger.ledger.monitor import check_log
from runledger.ledger.publish import publish
from runledger.ledger.publish_dest import S3Config, S3Dest
from runledger.ledger.store import Ledger
from runledger.schemas.note import generate_keypair

REPO = Path(__file__).resolve().parent.parent
QUERIES = {
    "count": "SELECT count(*) AS n, max(step) AS last FROM metrics WHERE name = 'loss'",
    "scan": "SELECT name, avg(value) AS mean FROM metrics GROUP BY name",
}

_CHILD = """
import json, sys, time
from pathlib import Path
from runledger.ledger.integrity import verify_ledger
from runledger.ledger.remote import verify_remote
t0 = time.perf_counter()  # after the imports: what is timed is the check itself
if sys.argv[1] == "local":
    report = verify_ledger(sys.argv[2], None)
    assert report.ok, report.problems
elif sys.argv[1] == "remote":
    verify_remote(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
elif sys.argv[1] == "download":
    from runledger.ledger.remote import fetch_copy
    rows = fetch_copy(sys.argv[2], sys.argv[3], Path(sys.argv[4])).sql(sys.argv[5]).rows
    assert rows, rows
else:
    from runledger.ledger.remote import query_direct
    rows = query_direct(sys.argv[2], sys.argv[3], sys.argv[4]).result.rows
    assert rows, rows
seconds = time.perf_counter() - t0
# VmHWM, not getrusage's ru_maxrss: a forked child's ru_maxrss counts the parent's pages (this
# benchmark's ledger builder) from before exec; VmHWM belongs to the new address space only.
status = Path("/proc/self/status").read_text()
peak_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
print(json.dumps({"s": seconds, "peak_rss_mb": peak_kb / 1024}))
"""


def _child(*args: str, env: dict[str, str] | None = None) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"bench child {args[0]} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _serve(folder: Path, counter: list[int]) -> http.server.ThreadingHTTPServer:
    class Counting(http.server.SimpleHTTPRequestHandler):
        def copyfile(self, source: Any, outputfile: Any) -> None:
            data = source.read()
            counter[0] += len(data)
            outputfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Counting, directory=str(folder))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _script(name: str, *args: str) -> str:
    done = subprocess.run(
        [str(REPO / "scripts" / name), *args], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def _nginx_bytes(folder: Path, prefix: str = "/data/") -> int:
    """Body bytes nginx sent for requests under ``prefix`` (its combined access log)."""
    total = 0
    for line in (folder / "access.log").read_text().splitlines():
        request, after = line.split('"')[1], line.split('"')[2].split()
        if request.split()[1].startswith(prefix):
            total += int(after[1])
    return total


def _query_legs(
    url: str, vkey: str, work: Path, name: str, env: dict[str, str] | None = None, log: Path | None = None
) -> dict[str, float]:
    """The verified download (first time, every file) and --direct, for each query."""
    row: dict[str, float] = {}
    for label, sql in QUERIES.items():
        cache = work / f"cache-{name}-{label}"
        sent = _nginx_bytes(log) if log else 0
        got = _child("download", url, vkey, str(cache), sql, env=env)
        row[f"{name}_download_{label}_s"] = got["s"]
        row[f"{name}_download_{label}_rss_mb"] = got["peak_rss_mb"]
        if log:
            row[f"{name}_download_{label}_mb"] = (_nginx_bytes(log) - sent) / 1e6
        sent = _nginx_bytes(log) if log else 0
        got = _child("direct", url, vkey, sql, env=env)
        row[f"{name}_direct_{label}_s"] = got["s"]
        row[f"{name}_direct_{label}_rss_mb"] = got["peak_rss_mb"]
        if log:
            row[f"{name}_direct_{label}_mb"] = (_nginx_bytes(log) - sent) / 1e6
    return row


def _http_legs(site: Path, vkey: str, work: Path) -> dict[str, float]:
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        print("bench_remote: no nginx (scripts/http.sh install): HTTP query legs left out", file=sys.stderr)
        return {}
    folder = work / "nginx"
    url = _script("http.sh", "start", str(folder), str(site)).splitlines()[-1]
    try:
        return _query_legs(url, vkey, work, "http", log=folder)
    finally:
        _script("http.sh", "stop", str(folder))


def _s3_legs(root: Path, site: Path, skey: str, vkey: str, work: Path) -> dict[str, float]:
    if not (REPO / ".go" / "bin" / "versitygw").exists():
        print("bench_remote: no versitygw (scripts/s3.sh build): S3 legs left out", file=sys.stderr)
        return {}
    folder = work / "s3"
    lines = _script("s3.sh", "start", str(folder)).splitlines()
    env = dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))
    child_env = os.environ | env
    config = S3Config.from_env(env)
    config.filesystem(allow_bucket_creation=True).create_dir("bench")  # type: ignore[attr-defined]
    url = "s3://bench/log"
    row: dict[str, float] = {}
    try:
        started = time.perf_counter()
        if getattr(runledger.ledger.publish, "open_dest", None) is not None:
            to_s3: Any = publish  # takes a Dest once runledger.ledger.publish writes through runledger.ledger.publish_dest
            to_s3(root, S3Dest(url, config), skey)
            row["s3_publish_s"] = time.perf_counter() - started
        else:
            dest = S3Dest(url, config)
            for path in sorted(p for p in site.rglob("*") if p.is_file()):
                dest.put_file(path.relative_to(site).as_posix(), path)
            row["s3_mirror_s"] = time.perf_counter() - started
        if "files" in inspect.signature(check_log).parameters:
            got = _child("remote", url, vkey, str(work / "s3-verify.json"), env=child_env)
            row |= {"s3_verify_s": got["s"], "s3_verify_rss_mb": got["peak_rss_mb"]}
        return row | _query_legs(url, vkey, work, "s3", env=child_env)
    finally:
        _script("s3.sh", "stop", str(folder))


def bench(events: int, work: Path) -> dict[str, float]:
    ledger = Ledger.create(work / "ledger", ledger_id="bench")
    skey, vkey = generate_keypair("bench-log")
    _grow(ledger, 0, events)
    started = time.perf_counter()
    publish(work / "ledger", work / "site", skey)
    folder_publish_s = time.perf_counter() - started
    counter = [0]
    server = _serve(work / "site", counter)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    state = str(work / "remote.json")
    try:
        row: dict[str, float] = {"events": events, "folder_publish_s": folder_publish_s}
        local = _child("local", str(work / "ledger"))
        row |= {"local_s": local["s"], "local_rss_mb": local["peak_rss_mb"]}
        first = _child("remote", url, vkey, state)
        row |= {"remote_s": first["s"], "remote_rss_mb": first["peak_rss_mb"], "remote_mb": counter[0] / 1e6}
        _grow(ledger, events, 1000)
        publish(work / "ledger", work / "site", skey)
        counter[0] = 0
        new = _child("remote", url, vkey, state)
        row |= {"new_s": new["s"], "new_rss_mb": new["peak_rss_mb"], "new_kb": counter[0] / 1e3}
        counter[0] = 0
        same = _child("remote", url, vkey, state)
        row |= {"same_s": same["s"], "same_kb": counter[0] / 1e3}
    finally:
        server.shutdown()
        server.server_close()
    row["data_mb"] = sum(p.stat().st_size for p in (work / "site" / "data").rglob("*") if p.is_file()) / 1e6
    row |= _http_legs(work / "site", vkey, work)
    return row | _s3_legs(work / "ledger", work / "site", skey, vkey, work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 100000])
    sizes = parser.parse_args().sizes
    for events in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(bench(events, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
