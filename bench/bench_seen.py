"""What the ledger's dedupe index costs: the (source, id) of every stored event, now with its leaf hash
(so a record with a stored id but other bytes is a conflict, not a silent duplicate; issue 16).

Figures, over one ledger built here, each beside its baseline from the same run:

* rebuilding the index when a writer opens the ledger: from the commit log's recorded leaves and ids
  (what ``Ledger`` does) vs. the former way, a set of (source, id) read from the ``events`` Parquet
  files (no hashes, so no conflict detection);
* the memory the index holds (tracemalloc, Python objects) and bytes per event, for both;
* a commit of all-duplicate records (every one looked up, hashed and compared) vs. the same batch's
  decode alone.

    python -m bench.bench_seen [--events 200000]
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import decode_event, encode_event, make_event
from runledger.schemas import payloads as p

BATCH = 20000


def _events(n: int) -> list[bytes]:
    rng = random.Random(0)  # realistic, non-constant values: the event sizes of a real run
    return [
        encode_event(
            make_event(
                p.StepMetrics(
                    loss=2.0 + 8.0 / (1 + i / 500) + rng.gauss(0, 0.05),
                    lr=3e-4 * min(1.0, (i + 1) / 2000),
                    grad_norm=abs(rng.gauss(1.0, 0.3)),
                    scalars={f"s{k}": rng.gauss(0, 1) for k in range(8)},
                ),
                source="trainer/bench/rank0",
                stream="bench",
                run_id="bench",
                attempt=1,
                step=i,
                seq=i,
            )
        )
        for i in range(n)
    ]


def _measured(build: Callable[[], Any]) -> tuple[int, float, int, int]:
    """(size of the result, seconds, bytes retained, peak bytes) of ``build``: timed on its own, then
    run again under tracemalloc (which slows Python code several times) for the memory figures."""
    gc.collect()
    start = time.perf_counter()
    size = len(build())
    seconds = time.perf_counter() - start
    gc.collect()
    tracemalloc.start()
    result = build()
    retained, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del result
    return size, seconds, retained, peak


def _parquet_ids(root: Path) -> set[tuple[str, str]]:
    """The former index: (source, id) pairs read from every events file."""
    seen: set[tuple[str, str]] = set()
    for path in (root / "events").rglob("*.parquet"):
        table = pq.read_table(path, columns=["source", "id"])
        seen.update(zip(table.column("source").to_pylist(), table.column("id").to_pylist(), strict=True))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    args = parser.parse_args()
    raws = _events(args.events)
    with tempfile.TemporaryDirectory(prefix="bench-seen-") as tmp:
        root = Path(tmp) / "ledger"
        ledger = Ledger.create(root)
        for first in range(0, len(raws), BATCH):
            batch = raws[first : first + BATCH]
            ledger.commit([SourceRecord("spool:b", first + i, raw) for i, raw in enumerate(batch)])
        n = len(raws)
        print(f"ledger: {n:,} events in {len(ledger.commit_paths()):,} commits")

        size, t_new, mem_new, peak_new = _measured(lambda: Ledger.open(root)._seen_ids())
        assert size == n
        size, t_old, mem_old, peak_old = _measured(lambda: _parquet_ids(root))
        assert size == n
        print("index rebuild on open (commit log, id -> leaf hash)   vs  baseline (Parquet ids, set)")
        print(f"  time                {t_new:8.2f} s                        {t_old:8.2f} s")
        print(
            f"  memory retained     {mem_new / 2**20:8.1f} MiB ({mem_new / n:5.0f} B/event)  "
            f"{mem_old / 2**20:8.1f} MiB ({mem_old / n:5.0f} B/event)"
        )
        print(
            f"  peak while building {peak_new / 2**20:8.1f} MiB                      {peak_old / 2**20:8.1f} MiB"
        )

        # Every record again from another source position: all duplicates (hash + compare each).
        batch = raws[:BATCH]
        start = time.perf_counter()
        result = ledger.commit([SourceRecord("spool:again", i, raw) for i, raw in enumerate(batch)])
        t_dup = time.perf_counter() - start
        assert result.duplicates == len(batch) and not result.quarantined
        start = time.perf_counter()
        for raw in batch:
            decode_event(raw)
        t_decode = time.perf_counter() - start
        print(f"all-duplicate commit of {len(batch):,} records   vs  baseline (their decode alone)")
        print(
            f"  {len(batch) / t_dup:12,.0f} records/s                      {len(batch) / t_decode:12,.0f} records/s"
        )


if __name__ == "__main__":
    main()
