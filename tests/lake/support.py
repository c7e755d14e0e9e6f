"""Helpers for the lake tests: a catalog per backend, batches of rows, and a writer process.

``python -m tests.lake.support write|race ...`` runs a real writer in its own process (the tests
kill it with SIGKILL or race several of them)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa

from runledger.ledger.lake import LakeCommit, LakeTables, lake_schema

ROOT = Path(__file__).resolve().parents[2]
PG_SCRIPT = ROOT / "scripts" / "postgres.sh"


def _typed(name: str, cols: Mapping[str, Sequence[object]]) -> pa.Table:
    schema = lake_schema(name)
    return pa.table({c: pa.array(v, type=schema.field(c).type) for c, v in cols.items()})


def batch(source: str, start: int, rows: int, tag: int) -> dict[str, pa.Table]:
    """Rows of one commit: ``rows`` events of stream ``source`` (stream_seq from ``start``, commit
    ``tag``) and one metric per event (attempt ``tag``), so a test can tell the commits apart."""
    seqs = list(range(start, start + rows))
    events = _typed(
        "events",
        {
            "stream": [source] * rows,
            "stream_seq": seqs,
            "id": [f"{source}-{s}" for s in seqs],
            "commit": [tag] * rows,
            "canonical": ["x" * 64] * rows,
            "stream_type": ["run"] * rows,
        },
    )
    metrics = _typed(
        "metrics",
        {
            "attempt": [tag] * rows,
            "step": seqs,
            "name": ["loss"] * rows,
            "value": [float(s) for s in seqs],
            "stream": [source] * rows,
            "stream_seq": seqs,
            "run_id": [source] * rows,
        },
    )
    return {"events": events, "metrics": metrics}


def commit_batches(lake: LakeTables, source: str, batches: int, rows: int, *, report: bool = False) -> int:
    """Land batches 0..batches-1 of ``source`` exactly once, skipping what the lake already covers
    (as an ingester does on a stale answer). Returns how many this process committed."""
    mine = 0
    next_pos = lake.fence_positions([source])[source]
    for b in range(batches):
        start = b * rows
        while next_pos < start + rows:  # not covered yet: try; a stale answer says who covered it
            result: LakeCommit = lake.commit(
                batch(source, start, rows, b),
                {source: (start, start + rows)},
                {f"head:{source}": b},
                writer=source,
            )
            if result.ok:
                mine += 1
                next_pos = start + rows
                if report:
                    print(b, flush=True)
            else:
                next_pos = result.stale[source]
                if next_pos < start:
                    raise RuntimeError(f"{source}: stored position {next_pos} is behind batch {b}")
    return mine


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.lake.support", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


class Postgres:
    """A real PostgreSQL started by scripts/postgres.sh in a folder of its own; a database per test."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        out = subprocess.run(
            ["bash", str(PG_SCRIPT), "start", str(folder)], capture_output=True, text=True, timeout=180
        )
        if out.returncode != 0:
            raise RuntimeError(
                out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "postgres.sh failed"
            )
        self.dsn = out.stdout.strip().splitlines()[-1]
        self.port = int(self.dsn.split("port=")[1].split()[0])

    def database(self) -> str:
        name = "lake_" + uuid.uuid4().hex[:12]
        psql = sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))[-1]
        subprocess.run(
            [
                str(psql),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-qc",
                f"CREATE DATABASE {name}",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return self.dsn.replace("dbname=ledger", f"dbname={name}")

    def stop(self) -> None:
        subprocess.run(["bash", str(PG_SCRIPT), "stop", str(self.folder)], capture_output=True, timeout=60)


def _main(argv: list[str]) -> int:
    command, catalog, data = argv[:3]
    lake = LakeTables(catalog, data)
    if command == "write":  # batches forever (until killed): tag k, ROWS rows, one source
        source, rows = argv[3], int(argv[4])
        for b in range(10**9):
            lake.commit(batch(source, b * rows, rows, b), {source: (b * rows, (b + 1) * rows)}, {"b": b})
            print(b, flush=True)
    elif command == "hold":  # a commit's transaction, its rows inserted (data files written), never
        # committed: the test kills the process here with SIGKILL
        source, rows = argv[3], int(argv[4])
        written = lake._write_files(batch(source, 10**6, rows, 99))
        lake.con.execute("BEGIN")
        for name, path in written:
            lake.con.execute("CALL ducklake_add_data_files('lake', ?, ?)", [name, str(path)])
        print("holding", flush=True)
        time.sleep(600)
    elif command == "race":  # the same source's batches, exactly once between racing copies
        source, batches, rows = argv[3], int(argv[4]), int(argv[5])
        started = time.monotonic()
        mine = commit_batches(lake, source, batches, rows)
        print(
            json.dumps({"mine": mine, "retries": lake.retries, "s": time.monotonic() - started}), flush=True
        )
    lake.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
