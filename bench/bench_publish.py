"""`ledger publish` benchmark: a simulated ledger published from scratch and after 1,000 new steps,
beside the baseline of copying the same Parquet files; bytes per event in bundles and tiles; a
remote check of every entry and data file (`ledger monitor --entries`) from a local http.server.

    python -m bench.bench_publish [--sizes 20000 100000]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from runledger.ledger.monitor import check_log
from runledger.ledger.publish import publish
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import encode_event, make_event
from runledger.schemas import payloads as p
from runledger.schemas.note import generate_keypair

T0 = datetime(2026, 11, 1, tzinfo=UTC)
COMMIT_EVENTS = 5000  # events per ledger commit, as an ingester batches them


def _steps(first: int, count: int) -> list[bytes]:
    return [
        encode_event(
            make_event(
                p.StepMetrics(loss=2.0 / (1 + s), lr=3e-4, tokens=4096, scalars={"aux": 0.01 * (s % 7)}),
                source="trainer/bench/rank0",
                stream="bench",
                run_id="bench",
                attempt=1,
                step=s,
                seq=s,
                id=f"bench-{s}",
                time=T0 + timedelta(seconds=s),
            )
        )
        for s in range(first, first + count)
    ]


def _grow(ledger: Ledger, first: int, count: int) -> None:
    for lo in range(first, first + count, COMMIT_EVENTS):
        n = min(COMMIT_EVENTS, first + count - lo)
        ledger.commit([SourceRecord("spool:bench", lo + i, raw) for i, raw in enumerate(_steps(lo, n))])


def _bytes_under(path: Path, prefix: str) -> int:
    return sum(f.stat().st_size for f in (path / prefix).rglob("*") if f.is_file())


def bench(events: int, work: Path) -> dict[str, float]:
    root, dest = work / "ledger", work / "site"
    ledger = Ledger.create(root, ledger_id="bench")
    _grow(ledger, 0, events)
    skey, vkey = generate_keypair("bench-log")
    started = time.perf_counter()
    first = publish(root, dest, skey)
    scratch_s = time.perf_counter() - started
    started = time.perf_counter()
    for table in root.iterdir():  # baseline: copying the same Parquet files, nothing else
        if table.is_dir() and not table.name.startswith("_"):
            shutil.copytree(table, work / "copy" / table.name, ignore=shutil.ignore_patterns("*.tmp"))
    copy_s = time.perf_counter() - started
    _grow(ledger, events, 1000)
    started = time.perf_counter()
    grown = publish(root, dest, skey)
    incremental_s = time.perf_counter() - started
    started = time.perf_counter()
    again = publish(root, dest, skey)
    noop_s = time.perf_counter() - started
    assert again.entries == 0 and grown.events == 1000 and first.events == events
    remote = _remote_check(dest, vkey, work / "monitor.json")
    bundles = _bytes_under(dest, "tile/entries")
    tiles = _bytes_under(dest, "tile") - bundles
    return {
        "events": events,
        "scratch_s": scratch_s,
        "copy_parquet_s": copy_s,
        "incremental_1000_s": incremental_s,
        "noop_s": noop_s,
        "bundle_bytes_per_event": bundles / grown.size,
        "tile_bytes_per_event": tiles / grown.size,
        "parquet_bytes_per_event": _bytes_under(dest, "data") / grown.size,
        **remote,
    }


def _remote_check(dest: Path, vkey: str, state: Path) -> dict[str, float]:
    """`ledger monitor --entries` from a local http.server: from scratch (every entry and data file),
    then again with nothing new; time and bytes fetched."""
    fetched = [0]

    class Counting(http.server.SimpleHTTPRequestHandler):
        def copyfile(self, source: Any, outputfile: Any) -> None:
            data = source.read()
            fetched[0] += len(data)
            outputfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Counting, directory=str(dest))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        started = time.perf_counter()
        report = check_log(url, vkey, state, entries=True)
        full_s, full_bytes = time.perf_counter() - started, fetched[0]
        started = time.perf_counter()
        check_log(url, vkey, state, entries=True)
        again_s = time.perf_counter() - started
    finally:
        server.shutdown()
        server.server_close()
    assert report.entries == report.size
    return {"remote_check_s": full_s, "remote_mb_fetched": full_bytes / 1e6, "remote_recheck_s": again_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 100_000])
    args = parser.parse_args()
    for events in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
            row = bench(events, Path(tmp))
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
