"""`ledger report` (one self-contained HTML page) and `ledger plot` (an image): a run's curves with its
history drawn on them. The work is in ``runledger.ledger.report``; these are thin shells."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.extras import command_needs
from runledger.cli.output import DEFAULT_LEDGER, LedgerOption, console, fail, user_errors

FromStep = Annotated[
    int | None, typer.Option("--from-step", help="First step shown (default: the run's first).")
]
ToStep = Annotated[int | None, typer.Option("--to-step", help="Last step shown (default: the run's last).")]


def report(
    runs: Annotated[
        list[str],
        typer.Argument(metavar="RUN", help="Run id(s), or `latest`; several runs are overlaid."),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The HTML file to write.")] = Path(
        "report.html"
    ),
    from_step: FromStep = None,
    to_step: ToStep = None,
    buckets: Annotated[
        int, typer.Option(help="Step buckets per curve: each keeps its min and max point.")
    ] = 2000,
    expert_step: Annotated[
        int | None,
        typer.Option(help="Logged step whose layer × expert load is shown first (default: the last)."),
    ] = None,
    public_key: Annotated[
        Path | None,
        typer.Option("--public-key", help="Check the signed checkpoints' signatures with this key."),
    ] = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Write one HTML file (opens from disk, no network) with the run's curves and its history on them."""
    from runledger.ledger.report import write_report

    if output.suffix.lower() not in (".html", ".htm"):
        raise fail(f"--output {output}: give an .html file", 2)
    with user_errors(ledger):
        runs = _resolve_runs(ledger, runs)
        path, data = write_report(
            ledger,
            runs,
            output,
            from_step=from_step,
            to_step=to_step,
            buckets=buckets,
            expert_step=expert_step,
            public_key_path=public_key,
        )
    markers = sum(len(r["markers"]) for r in data["runs"])
    console.print(
        f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {markers} events marked)", highlight=False
    )


def plot(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Run id, or `latest`.")],
    metrics: Annotated[
        list[str], typer.Argument(metavar="METRIC", help="Metric names, e.g. loss lr grad_norm.")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Image file: .png or .svg.")] = Path(
        "plot.png"
    ),
    from_step: FromStep = None,
    to_step: ToStep = None,
    buckets: Annotated[int, typer.Option(help="Step buckets per curve (min and max kept).")] = 2000,
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Draw metrics against step as an image, with the same event markers as the report."""
    with command_needs("ledger plot", "operator"):
        from runledger.ledger.report import write_plot

    if output.suffix.lower() not in (".png", ".svg"):
        raise fail(f"--output {output}: give a .png or .svg file", 2)
    with user_errors(ledger):
        (run,) = _resolve_runs(ledger, [run])
        path = write_plot(ledger, run, metrics, output, from_step=from_step, to_step=to_step, buckets=buckets)
    console.print(f"wrote {path}", highlight=False)


def _resolve_runs(ledger: Path, runs: list[str]) -> list[str]:
    """The run ids the RUN arguments name (``latest``: the most recently started run), as every
    command that takes a run id reads them."""
    if "latest" not in runs:
        return runs
    from runledger.cli.ledger_cmd import resolve_run
    from runledger.ledger.query import Reader

    reader = Reader(ledger)
    return [resolve_run(reader, run) for run in runs]
