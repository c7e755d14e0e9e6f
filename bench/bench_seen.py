"""What the ledger's dedupe index costs: the (source, id) and leaf hash of every stored event, kept in
SQLite beside the commit log (``runledger.ledger.seen_index``), so that a writer's memory does not grow with
the ledger.

Figures, over one ledger built here, each beside its baseline from the same run:

* a new writer's first commit on the ledger, with the index on disk (nothing to read) vs. after the
  index is deleted (rebuilt from the commit log: what a writer did on every open before the index
  moved to disk, and what a lost index costs once);
* memory: the writer process's peak RSS for that first commit, with the index on disk vs. the dict
  of the same entries that writers used to hold (its Python objects, tracemalloc), and bytes per
  event on disk;
* a commit of all-duplicate records (every one looked up, hashed and compared) vs. the same batch's
  decode alone.

    python -m bench.bench_seen [--events 200000]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bench.measure import run_measured
from runledger.ledger.seen_index import INDEX_DIR, appended_entries
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


def _dict_index(root: Path) -> dict[bytes, bytes]:
    """The former index: every entry in a dict, rebuilt from the commit log on open."""
    seen: dict[bytes, bytes] = {}
    for path in sorted((root / "_commits").glob("*.json")):
        seen.update(appended_entries(msgspec.json.decode(path.read_bytes())))
    return seen


def _first_commit(root: Path, probe: bytes) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of a new writer process opening the ledger and committing one record
    (the seconds exclude the interpreter's start)."""
    code = (
        "import time; from pathlib import Path; "
        "from runledger.ledger.store import Ledger, SourceRecord; "
        "t = time.perf_counter(); "
        f"Ledger.open(Path({str(root)!r})).commit([SourceRecord('spool:probe', 0, {probe!r})]); "
        "print(time.perf_counter() - t)"
    )
    child = run_measured([sys.executable, "-c", code])
    if child.returncode != 0:
        raise RuntimeError(child.stdout)
    return float(child.stdout.split()[-1]), child.peak_rss_mb


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

        probe = raws[0]  # a duplicate: looked up, nothing stored
        t_disk, rss_disk = _first_commit(root, probe)
        for path in (root / INDEX_DIR).iterdir():
            path.unlink()
        t_rebuild, rss_rebuild = _first_commit(root, probe)
        index_bytes = sum(path.stat().st_size for path in (root / INDEX_DIR).iterdir())
        size, t_dict, mem_dict, _peak = _measured(lambda: _dict_index(root))
        assert size == n
        print("a new writer's first commit     index on disk        vs  index rebuilt from the commit log")
        print(f"  time                         {t_disk:8.2f} s                {t_rebuild:8.2f} s")
        print(f"  peak RSS of the process      {rss_disk:8.0f} MiB              {rss_rebuild:8.0f} MiB")
        print(
            f"index size: {index_bytes / 2**20:.1f} MiB on disk ({index_bytes / n:.0f} B/event); "
            f"the same entries in a dict (the former in-memory index): {mem_dict / 2**20:.1f} MiB "
            f"({mem_dict / n:.0f} B/event), {t_dict:.2f} s to build"
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
