"""Publishing a merged lake beside the same lake unmerged, in one run (issue 39, "publish").

A file DuckLake's merge wrote carries its row-lineage column(s) last; ``ledger publish`` hides them
from outside readers. It used to re-encode each such file (read, zstd write); it now rewrites only the
footer (``runledger.ledger.parquet_footer``) and copies the body. Per lake size, three whole
``ledger publish`` processes into a new folder, each from a fresh copy of the lake (a publish keeps
its copies under ``LEDGER/_publish``), interleaved ``--repeat`` times:

* ``unmerged``: the lake as ingest left it (every file published byte for byte): the baseline;
* ``merged``: the same lake after ``ledger compact`` (this code: footers rewritten);
* ``merged, re-encoded``: the same merged lake, publish made to re-encode (the path before, kept for
  footers it does not rewrite: ``copy_without_trailing_columns`` replaced by one that refuses).

Lakes are built once under ``--work`` (``ledger simulate reference-535b --steps N``, ``ledger ingest
spool``, batches of 5,000) and reused. Medians of wall s, CPU s (GNU time) and peak RSS.

    python -m bench.bench_publish_merged [--steps 5000 15000 40000] [--repeat 3] [--work DIR]

Measured (2026-12-07, this machine idle, load < 1; medians of 3; CPU s, and the ratio to unmerged):

    steps (events)     unmerged   merged (footer)   merged, re-encoded
    5,000 (15,147)       3.07      2.47 (0.80x)       2.99 (0.97x)
    15,000 (44,379)      3.93      3.93 (1.00x)       6.10 (1.55x)
    40,000 (115,469)     8.00      6.58 (0.82x)      13.67 (1.71x)

(docs/notes/one_format.md, "Why publish costs more on a merged lake").
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench.measure import Measured, run_measured

PYTHON = sys.executable
CLI = [PYTHON, "-m", "runledger.cli.main"]
# The path before: publish with the footer rewrite refusing every file (so each is re-encoded).
REENCODE = [
    PYTHON,
    "-c",
    "import sys; import runledger.ledger.publish as p; from runledger.ledger.parquet_footer import FooterError\n"
    "def refuse(*a, **k): raise FooterError('bench: re-encode')\n"
    "p.copy_without_trailing_columns = refuse\n"
    "from runledger.cli.main import run; sys.argv = ['ledger', *sys.argv[1:]]; run()",
]
VARIANTS = {"unmerged": CLI, "merged": CLI, "merged, re-encoded": REENCODE}


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])}… failed: {(done.stderr or done.stdout).strip()[-600:]}")
    return done.stdout


def build(work: Path, steps: int) -> tuple[Path, Path, int]:
    """The lake of ``steps`` reference steps as ingest leaves it and after ``ledger compact``, and its events."""
    base = work / f"lake-{steps}"
    unmerged, merged = base / "unmerged", base / "merged"
    if not (merged / "LAKE.json").exists():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        spool = base / "spool"
        _run([*CLI, "simulate", "reference-535b", "--steps", str(steps), "--spool", str(spool)])
        _run(
            [
                *CLI,
                "ingest",
                "spool",
                "--spool",
                str(spool),
                "--ledger",
                str(unmerged),
                "--batch-size",
                "5000",
            ]
        )
        shutil.copytree(unmerged, merged)
        _run([*CLI, "compact", "--ledger", str(merged)])
        _run([*CLI, "keys", "init", "--name", "bench", "--keys", str(base / "keys")])
    out = _run([*CLI, "query", "--ledger", str(unmerged), "--format", "csv", "SELECT count(*) FROM events"])
    return unmerged, merged, int(out.split()[-1])


def publish_once(source: Path, cmd: list[str], scratch: Path, keys: Path) -> Measured:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(source, scratch / "ledger")
    done = run_measured(
        [*cmd, "publish", str(scratch / "dest"), "--ledger", str(scratch / "ledger"), "--keys", str(keys)]
    )
    if done.returncode:
        raise RuntimeError(f"publish failed: {done.stdout.strip()[-600:]}")
    shutil.rmtree(scratch, ignore_errors=True)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[5000, 15000, 40000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/runledger-bench-publish-merged"))
    args = parser.parse_args()
    print(
        f"{'steps':>7} {'events':>9} {'publish of':>20} {'wall s':>8} {'CPU s':>7} {'peak MB':>8} {'CPU / unmerged':>15}"
    )
    for steps in args.steps:
        unmerged, merged, events = build(args.work, steps)
        keys = unmerged.parent / "keys"
        runs: dict[str, list[Measured]] = {name: [] for name in VARIANTS}
        for _ in range(args.repeat):
            for name, cmd in VARIANTS.items():
                source = unmerged if name == "unmerged" else merged
                runs[name].append(publish_once(source, cmd, args.work / "scratch", keys))
        base_cpu = statistics.median(m.cpu_s for m in runs["unmerged"])
        for name, measured in runs.items():
            cpu = statistics.median(m.cpu_s for m in measured)
            print(
                f"{steps:7,d} {events:9,d} {name:>20} {statistics.median(m.seconds for m in measured):8.2f} "
                f"{cpu:7.2f} {statistics.median(m.peak_rss_mb for m in measured):8.0f} {cpu / base_cpu:14.2f}x"
            )


if __name__ == "__main__":
    main()
