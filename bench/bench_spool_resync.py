"""What a damaged stretch in a spool segment costs the reader, beside an undamaged segment of the
same size read the same way, in the same run.

The reader is read as ``ledger ingest spool`` reads it: one ``SpoolReader``, batches of 5,000
records from where the last batch ended. Each spool is one segment: 4 MB of good records, the
stretch, 4 MB more. Stretches, at each size:

* ``random``: random bytes (a torn or overwritten region);
* ``zeros``: zero bytes (what a power loss can leave in a file);
* ``crafted``: one garbage byte before each tiny valid record, so the stretch is tens of thousands
  of damaged entries and records, read over many batches (the case that took 34 s for 3 MB when
  each read re-scanned the segment from its start);
* baseline: the same bytes as good records (the stretch's size in 200-byte records).

Figures: seconds to read the whole spool, and the damaged run's time over the baseline's. Linear
resync shows as a ratio that does not grow with the size.

    python -m bench.bench_spool_resync [--sizes-mb 0.5 1 3] [--batch 5000]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from runledger.ingest.spool import MAGIC, SpoolReader, SpoolWriter, _encode

PAYLOAD = 200
SIDE_BYTES = 4 << 20  # good records before and after the stretch


def _good(size: int, rng: random.Random) -> bytes:
    unit = PAYLOAD + 8
    return b"".join(_encode(rng.randbytes(PAYLOAD)) for _ in range(max(1, size // unit)))


def _random(size: int, rng: random.Random) -> bytes:
    return rng.randbytes(size)


def _zeros(size: int, rng: random.Random) -> bytes:
    return bytes(size)


def _crafted(size: int, rng: random.Random) -> bytes:
    unit = b"\xff" + _encode(b"x" * 8)
    return unit * (size // len(unit))


STRETCHES: dict[str, Callable[[int, random.Random], bytes]] = {
    "baseline": _good,
    "random": _random,
    "zeros": _zeros,
    "crafted": _crafted,
}


def _spool(directory: Path, stretch: bytes, rng: random.Random) -> None:
    with SpoolWriter(directory):  # spool.id, the lock file and one empty segment
        pass
    (segment,) = directory.glob("*.seg")
    segment.write_bytes(MAGIC + _good(SIDE_BYTES, rng) + stretch + _good(SIDE_BYTES, rng))


def _read_all(directory: Path, batch: int) -> tuple[float, int, int]:
    """Seconds to read every record in batches, the records read and the damaged ones among them."""
    reader = SpoolReader(directory)
    started = time.perf_counter()
    start = records = damaged = 0
    while chunk := list(reader.read(start, limit=batch)):
        records += len(chunk)
        damaged += sum(1 for r in chunk if r.corrupt)
        start = chunk[-1].index + 1
    return time.perf_counter() - started, records, damaged


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.5, 1.0, 3.0])
    parser.add_argument("--batch", type=int, default=5000)
    args = parser.parse_args()
    print(f"{'stretch':>9} {'MB':>5} {'records':>8} {'damaged':>8} {'seconds':>8} {'x baseline':>10}")
    with tempfile.TemporaryDirectory(prefix="bench-spool-resync-") as tmp:
        for size_mb in args.sizes_mb:
            size = int(size_mb * (1 << 20))
            baseline = None
            for name, make in STRETCHES.items():
                rng = random.Random(0)
                directory = Path(tmp) / f"{name}-{size}"
                _spool(directory, make(size, rng), rng)
                seconds, records, damaged = _read_all(directory, args.batch)
                baseline = seconds if baseline is None else baseline
                ratio = seconds / baseline if baseline else float("nan")
                print(f"{name:>9} {size_mb:>5} {records:>8} {damaged:>8} {seconds:>8.2f} {ratio:>10.2f}")


if __name__ == "__main__":
    main()
