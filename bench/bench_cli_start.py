"""How long a user waits for the ``ledger`` command, as a ratio to ``python -c "import duckdb"`` measured
in the same run (issue 41: within 2.5x for ``--help``, ``query`` and ``state``).

    .venv/bin/python -m bench.bench_cli_start --small S --large L [--run RUN] [--checkout DIR] [--repeat 7]

``--small``/``--large``: lake ledgers (e.g. ``ledger simulate reference-535b --steps 2000`` /
``--steps 40000`` then ``ledger ingest spool``: ~6.5k and ~115k events). ``--checkout``: the source
tree whose ``cli`` runs (default this one): another tree, e.g. ``git worktree add /tmp/base HEAD``,
measures the code before a change with the same interpreter. Each command runs ``--repeat`` times,
the commands interleaved (so a busy spell of a shared machine falls on all of them alike); the median
wall time of each is printed with its ratio to the bare DuckDB import.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RATIO_GOAL = 2.5  # issue 41: each command within this many times the bare DuckDB import


def _commands(small: Path, large: Path | None, run: str) -> dict[str, list[str]]:
    """Name -> argv (after the interpreter) of every measured command."""
    count = "SELECT count(*) FROM events"
    commands = {
        'python -c "import duckdb"': ["-c", "import duckdb"],
        "ledger --help": ["-m", "runledger.cli.main", "--help"],
        "ledger query (small)": ["-m", "runledger.cli.main", "query", count, "--ledger", str(small)],
    }
    if large is not None:
        commands["ledger query (large)"] = [
            "-m",
            "runledger.cli.main",
            "query",
            count,
            "--ledger",
            str(large),
        ]
        commands[f"ledger state {run} (large)"] = [
            "-m",
            "runledger.cli.main",
            "state",
            run,
            "--ledger",
            str(large),
        ]
    return commands


def _wall_and_cpu_s(argv: list[str], checkout: Path, env: dict[str, str]) -> tuple[float, float]:
    """One run's wall time and CPU time (user + system: on a shared machine the wall time also counts
    the waits for a core); a failing command stops the bench with its output (no figure for it)."""
    cpu_before = _children_cpu_s()
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv], cwd=checkout, env=env, capture_output=True, timeout=300, check=False
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.decode()[-500:]}")
    return elapsed, _children_cpu_s() - cpu_before


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(commands: dict[str, list[str]], checkout: Path, repeat: int) -> dict[str, tuple[float, float]]:
    """The median wall and CPU time of each command, runs interleaved after one unmeasured warm-up round."""
    # The checkout's own packages first (``-m`` puts the working directory first on sys.path).
    env = dict(os.environ, PYTHONPATH=str(checkout), COLUMNS="100")
    # As an installed package is: pip compiles its bytecode at install. Where the environment forbids
    # writing it, every run would time the compiler (~25 ms for the largest modules), not the start.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for package in ("runledger", "cli", "ledger", "ingest", "schemas"):  # (runledger's others are links)
        compileall.compile_dir(checkout / package, quiet=1, workers=1)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for argv in commands.values():  # warm-up: the page cache holds the files after this
        _wall_and_cpu_s(argv, checkout, env)
    for _ in range(repeat):
        for name, argv in commands.items():
            times[name].append(_wall_and_cpu_s(argv, checkout, env))
    return {
        name: (statistics.median(w for w, _ in pairs), statistics.median(c for _, c in pairs))
        for name, pairs in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=Path, required=True, help="a demo-sized lake ledger")
    parser.add_argument("--large", type=Path, help="a larger lake ledger (>=100k events)")
    parser.add_argument("--run", default="latest", help="the run `ledger state` reads")
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    if args.repeat < 1:
        sys.exit("--repeat must be at least 1")
    for given in (args.small, args.large):
        if given is not None and not (given / "LAKE.json").is_file():
            sys.exit(f"{given}: not a lake ledger (no LAKE.json)")
    commands = _commands(args.small.resolve(), args.large.resolve() if args.large else None, args.run)
    medians = measure(commands, args.checkout.resolve(), args.repeat)
    base_wall_s, base_cpu_s = medians['python -c "import duckdb"']
    print(f"checkout {args.checkout}, median of {args.repeat}; ratios to the bare DuckDB import")
    print(f"  {'command':<32} {'wall':>8}  {'ratio':>6}  {'cpu':>8}  {'ratio':>6}")
    for name, (wall_s, cpu_s) in medians.items():
        ratio = wall_s / base_wall_s
        mark = "" if name.startswith("python") else ("  ok" if ratio <= RATIO_GOAL else f"  > {RATIO_GOAL}x")
        print(
            f"  {name:<32} {wall_s * 1000:5.0f} ms  {ratio:5.2f}x  {cpu_s * 1000:5.0f} ms  "
            f"{cpu_s / base_cpu_s:5.2f}x{mark}"
        )


if __name__ == "__main__":
    main()
