"""`ledger verify --remote` benchmark: a simulated ledger published and served by a local http.server,
verified remotely from nothing, then again after 1,000 new steps (only what is new), then with nothing
new; beside the baseline of `ledger verify` of the same ledger on disk. Each check runs in its own
subprocess so its peak RSS (VmHWM) is its own; bytes fetched are counted by the server.

    python -m bench.bench_remote [--sizes 20000 100000]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from bench.bench_publish import _grow
from ledger.publish import publish
from ledger.store import Ledger
from schemas.note import generate_keypair

_CHILD = """
import json, sys, time
from pathlib import Path
from ledger.integrity import verify_ledger
from ledger.remote import verify_remote
t0 = time.perf_counter()  # after the imports: what is timed is the check itself
if sys.argv[1] == "local":
    report = verify_ledger(sys.argv[2], None)
    assert report.ok, report.problems
else:
    verify_remote(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
seconds = time.perf_counter() - t0
# VmHWM, not getrusage's ru_maxrss: a forked child's ru_maxrss counts the parent's pages (this
# benchmark's ledger builder) from before exec; VmHWM belongs to the new address space only.
status = Path("/proc/self/status").read_text()
peak_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
print(json.dumps({"s": seconds, "peak_rss_mb": peak_kb / 1024}))
"""


def _child(*args: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, check=True)
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


def bench(events: int, work: Path) -> dict[str, float]:
    ledger = Ledger.create(work / "ledger", ledger_id="bench")
    ledger.auto_compact = False
    skey, vkey = generate_keypair("bench-log")
    _grow(ledger, 0, events)
    publish(work / "ledger", work / "site", skey)
    counter = [0]
    server = _serve(work / "site", counter)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    state = str(work / "remote.json")
    try:
        row: dict[str, float] = {"events": events}
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
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 100000])
    sizes = parser.parse_args().sizes
    for events in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(bench(events, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
