"""Online W&B import rate (rows/s) against the local W&B API stand-in, beside wandb's own scan.

For each size, one run of that many history rows (the recorded reference-shape run,
``tests/fixtures/wandb_api/runs/moe-ref-2c9k``: 24 metrics per row, repeated with steps and times
moved on) is served by ``tests/support/wandb_api_server.py`` on 127.0.0.1, and timed two ways in
the same process, alternating, best of ``--rounds``:

* baseline: ``run.scan_history()`` iterated with nothing done to the rows (wandb's client and
  wandb-core paging the history over HTTP: the floor any importer built on ``wandb.Api`` pays);
* import: ``import_online`` of the same run into a fresh spool and cursor file (rows mapped to
  events, encoded, spooled, synced and the cursor saved after every page).

    python -m bench.bench_wandb_online [--sizes 2000 10000 30000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from runledger.ingest.bus import SpoolSink
from runledger.ingest.wandb_online import CursorStore, import_online, open_api
from tests.support.wandb_api_server import FIXTURES, RecordedRun, WandbApiServer

TEMPLATE = "moe-ref-2c9k"


def synthetic_run(rows: int) -> RecordedRun:
    """The recorded run's rows repeated to ``rows`` rows, steps and times continuing."""
    template = RecordedRun.load(FIXTURES / "runs" / TEMPLATE)
    source = [json.loads(line) for line in template.history_lines]
    lines = []
    for step in range(rows):
        row = dict(source[step % len(source)])
        lap = step // len(source)
        row["_step"] = step
        row["_runtime"] = round(row["_runtime"] + lap * 1800.0, 3)
        row["_timestamp"] = round(row["_timestamp"] + lap * 1800.0, 3)
        lines.append(json.dumps(row))
    node = dict(template.node, name=f"bench-{rows}", historyLineCount=rows)
    node["historyKeys"] = dict(node["historyKeys"], lastStep=rows - 1)
    return RecordedRun(node, lines, template.event_lines)


def time_scan(api: object, path: str) -> tuple[float, int]:
    run = api.run(path)  # type: ignore[attr-defined]
    started = time.perf_counter()
    count = sum(1 for _ in run.scan_history(page_size=1000))
    return time.perf_counter() - started, count


def time_import(api: object, path: str, work: Path) -> tuple[float, int]:
    spool = Path(tempfile.mkdtemp(dir=work))
    sink = SpoolSink(spool / "spool")
    started = time.perf_counter()
    result = import_online(path, sink, CursorStore(spool / "cursors.json"), api=api)
    seconds = time.perf_counter() - started
    sink.close()
    assert not result.errors, result.errors
    return seconds, result.runs[0].rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 10000, 30000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for key, folder in (("WANDB_DIR", "w"), ("WANDB_CONFIG_DIR", "c"), ("WANDB_CACHE_DIR", "k")):
            (work / folder).mkdir()
            os.environ[key] = str(work / folder)
        os.environ.update(WANDB_API_KEY="bench0" + "0" * 34, WANDB_ERROR_REPORTING="false")
        os.environ.pop("WANDB_MODE", None)
        with WandbApiServer() as server:
            api = open_api(server.base_url)
            print(f"online W&B import, local API stand-in ({os.cpu_count()} cores), best of {args.rounds}")
            print(
                f"{'rows':>8}  {'import rows/s':>14}  {'scan_history rows/s (baseline)':>31}  {'import/scan':>11}"
            )
            for size in args.sizes:
                name = f"bench-{size}"
                server.add_run(name, synthetic_run(size))
                path = f"{server.entity}/{server.project}/{name}"
                scans, imports = [], []
                for _ in range(args.rounds):  # alternated, so both see the same machine load
                    seconds, count = time_scan(api, path)
                    assert count == size, count
                    scans.append(seconds)
                    seconds, count = time_import(api, path, work)
                    assert count == size, count
                    imports.append(seconds)
                scan_rate, import_rate = size / min(scans), size / min(imports)
                print(
                    f"{size:>8}  {import_rate:>14,.0f}  {scan_rate:>31,.0f}  {import_rate / scan_rate:>11.2f}"
                )


if __name__ == "__main__":
    main()
