"""`ledger demo`: the main job, end to end on CPU (``runledger.workflows.demo``).

A thin shell: options → ``prepare_workdir`` and ``run_demo``; prints the progress bar and the attempts'
endings while it runs (``_ConsoleObserver``), then the verification, the history, a few SQL answers
and where the report is. Exit codes: 0; 2 for a refused work folder; 128 + the signal number (130 for
Ctrl-C, 143 for SIGTERM) when a signal stopped it, in any phase (``runledger.workflows.demo``: the
ledger holds what was recorded up to the stop).
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runledger import signals
from runledger.cli.extras import command_needs
from runledger.cli.output import (
    Format,
    VerboseOption,
    console,
    escape,
    fail,
    plural,
    print_rows,
    third_party_warnings,
)
from runledger.schemas.catalogue import LEDGER_ANOMALY

# The demo's names for the options' defaults and help: that module imports only the standard library
# and runledger's own light core at its top (the trainer, the bus and the ledger inside ``run_demo``).
from runledger.workflows.demo import (
    DEMO_DIR,
    DEMO_OUTPUTS,
    MARKER,
    DemoError,
    DemoObserver,
    DemoStop,
    prepare_workdir,
)

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from runledger.ingest.spool_ingester import IngestStats
    from runledger.trainer.loop import TrainResult
    from runledger.trainer.telemetry import StepReport
    from runledger.workflows.demo import DemoResult

INTERRUPTED_EXIT = 128 + signal.SIGINT


def demo(
    workdir: Annotated[
        Path,
        typer.Option(
            help="Where the demo writes: a new or empty folder, or one an earlier demo made "
            f"(marked with {MARKER}; its outputs are replaced)."
        ),
    ] = DEMO_DIR,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 200,
    crash_at: Annotated[
        int,
        typer.Option(help="Step in which attempt 1 crashes (before its update: steps up to N-1 are done)."),
    ] = 130,
    change_at: Annotated[int, typer.Option(help="Step after which the config file is edited.")] = 60,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Use a non-empty --workdir the demo did not make. Still removes only what the demo "
            "writes there (" + ", ".join(DEMO_OUTPUTS) + "), never other files.",
        ),
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Train a tiny MoE on CPU with a live config change, a crash and a resume; fold it into a ledger.

    Example: ledger demo --workdir /tmp/demo --steps 60 --crash-at 40 --change-at 20
    """
    # The trainer extra (torch, Megatron-Core) first: without it, one line naming it, the folder untouched.
    with command_needs("ledger demo", "trainer"):
        from runledger.workflows.demo import run_demo

    # The folder is made ready whole (only the demo's outputs removed): a signal waits for it.
    with signals.deferred():
        try:
            prepare_workdir(workdir, force=force)
        except DemoError as exc:
            raise fail(str(exc), 2) from None
    signals.check()
    try:
        with third_party_warnings(verbose):
            result = run_demo(
                workdir, steps=steps, crash_at=crash_at, change_at=change_at, observer=_ConsoleObserver()
            )
    except KeyboardInterrupt as exc:  # a second signal while the spool was folded
        signum = getattr(exc, "signum", signal.SIGINT)
        raise fail(
            f"interrupted by {_signal_name(signum)}; the ledger holds only whole commits. Fold the rest "
            f"of the spool with `ledger ingest spool --spool {_q(workdir / 'spool')} --ledger "
            f"{_q(workdir / 'ledger')}`",
            128 + signum,
        ) from None
    if result.stop is not None:
        message, code = _stopped(result, result.stop)
        raise fail(message, code)
    try:
        _print_result(result)
    except (KeyboardInterrupt, Exception) as exc:  # a signal while the results are printed: named too
        signum = signals.taken_for(exc)  # (DuckDB turns the raise inside a query into its own error)
        if signum is None and not isinstance(exc, KeyboardInterrupt):
            raise
        stop = DemoStop(signal.SIGINT if signum is None else signum, "the end", training=False)
        message, code = _stopped(result, stop)
        raise fail(message, code) from None


def _q(path: Path) -> str:
    return shlex.quote(str(path))


_signal_name = signals.signal_name


def _crash_note(result: TrainResult) -> str:
    """`` (RuntimeError: injected crash …)`` or `` (SIGINT: stopped …)``: how an attempt ended, if not well."""
    crash = result.crash
    if crash is None:
        return ""
    if crash.kind == "signal":
        name = _signal_name(crash.signal)
        detail = (crash.message or "").removeprefix(f"{name}:").strip()
        return f" (interrupted by {name}" + (
            f": {detail})" if detail and detail != f"signal {crash.signal}" else ")"
        )
    return " (" + ": ".join(part for part in (crash.exc_type, crash.message) if part) + ")"


class _ConsoleObserver(DemoObserver):
    """The demo's live output: a header, a progress bar over both attempts, how each ended, the fold."""

    def __init__(self) -> None:
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def started(self, run_id: str, steps: int) -> None:
        console.print(
            f"[bold]runledger demo[/]: run {run_id}, {steps} steps of a tiny Megatron-Core MoE on CPU"
        )

    @contextmanager
    def training(self, steps: int) -> Iterator[None]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed:.0f}/{task.total}"),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=console.made,
        ) as progress:
            self.progress, self.task = progress, progress.add_task("attempt 1", total=steps, loss="-")
            try:
                yield
            finally:
                self.progress = self.task = None

    def step(self, report: StepReport) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=report.step, loss=f"{report.loss:.3f}")

    def resuming(self) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, description="attempt 2 (resumed)")

    def attempt_ended(self, result: TrainResult, *, resumed: bool) -> None:
        if resumed:
            line = (
                f"attempt {result.attempt} resumed from step {result.start_step}: {result.status} "
                f"at step {result.final_step}{_crash_note(result)}"
            )
        else:
            # "after step N": the injected crash (--crash-at N + 1) stops step N + 1 before its update.
            line = f"attempt 1 ended: {result.status} after step {result.final_step}{_crash_note(result)}"
        console.print(line, markup=False)

    def folded(self, stats: IngestStats, ledger_dir: Path) -> None:
        console.print(
            f"ledger: {plural(stats.accepted, 'event')}, {plural(stats.metric_values, 'metric value')} in "
            f"{plural(stats.commits, 'commit')} ({stats.quarantined} quarantined) at {ledger_dir}"
        )


def _stopped(result: DemoResult, stop: DemoStop) -> tuple[str, int]:
    """The one line and exit code of a demo a signal stopped: what the ledger holds, by phase."""
    said = f"interrupted by {_signal_name(stop.signum)} at {stop.where}"
    code = 128 + stop.signum if stop.signum else INTERRUPTED_EXIT
    ledger = _q(result.ledger_dir)
    if result.ingested is None:
        return f"{said}: nothing was recorded yet, so no ledger was made", code
    if stop.training:
        return (
            f"{said}: not resuming. The ledger holds the run up to the stop: "
            f"`ledger history {result.run_id} --ledger {ledger}`",
            code,
        )
    key = f" --public-key {_q(result.public_key)}" if result.public_key is not None else ""
    return f"{said}: the ledger holds the whole run: `ledger verify --ledger {ledger}{key}`", code


def _print_result(result: DemoResult) -> None:
    """After a whole demo: the verification, the history, the answers, the report, what to do next."""
    ledger_dir = result.ledger_dir
    report = result.verify
    assert report is not None and result.public_key is not None
    check = f"ledger verify --ledger {_q(ledger_dir)} --public-key {_q(result.public_key)}"
    console.print(
        f"verify: {'OK' if report.ok else 'FAILED'} ({plural(report.events, 'event')}, "
        f"{plural(report.checkpoints, 'signed checkpoint')} checked). Check it yourself: "
        f"[bold]{escape(check)}[/]",
        highlight=False,
    )
    console.print(
        anomalies_before_first_crash(ledger_dir, result.run_id) + " (each one: ledger alerts list)",
        markup=False,
        highlight=False,
    )
    # Without the time column, so the story itself ("moe.capacity_factor 1.0 → 1.25") fits 100 columns;
    # without the anomalies, counted above (a CPU shared with other work makes a throughput drop a step).
    print_rows(
        ["step", "attempt", "kind", "what"],
        [(i.step, i.attempt, i.kind, i.text) for i in result.history if i.kind != LEDGER_ANOMALY],
        Format.table,
        None,
        title=f"history of {result.run_id}",
        limit=0,
    )
    for title, answer in result.answers:
        print_rows(answer.columns, answer.rows, Format.table, None, title=title)
    console.print(f"report (open it in a browser, no network needed): [bold]{escape(str(result.report))}[/]")
    # The export makes every later `ledger …` command find this ledger without --ledger.
    explore = f"export RUNLEDGER_LEDGER={_q(ledger_dir)}; ledger runs; ledger history latest"
    console.print(
        f"done in {result.elapsed_s:.0f} s. Explore: [bold]{escape(explore)}[/]",
        highlight=False,
    )


def anomalies_before_first_crash(ledger_dir: Path, run_id: str) -> str:
    """``anomalies before the first crash (step 130): 2 non-finite, 1 loss-spike, 3 router-collapse``: the anomaly
    events the ledger recorded on the run's stream before its first ``run.crashed`` event, and those
    the crash itself caused (a NaN crash is a non-finite finding), by rule
    (``runledger.ledger.anomalies``), so the counters written before a crash are in view."""
    from runledger.ledger.query import Reader
    from runledger.schemas import catalogue as c
    from runledger.schemas.codec import Event, decode_event

    reader = Reader(ledger_dir)
    try:
        crash = reader.sql(
            "SELECT stream_seq, step, id FROM events WHERE stream = ? AND type = ? ORDER BY stream_seq LIMIT 1",
            [run_id, c.RUN_CRASHED],
        ).rows
        rows = reader.sql(
            "SELECT stream_seq, canonical FROM events WHERE stream = ? AND type = ? ORDER BY stream_seq",
            [run_id, c.LEDGER_ANOMALY],
        ).rows
    finally:
        reader.close()
    # Counted by rule from the events themselves (few: one per finding); NaNs and spikes always named.
    counts: dict[str, int] = {"non-finite": 0, "loss-spike": 0}
    for seq, text in rows:
        decoded = decode_event(text.encode())
        if not isinstance(decoded, Event):
            continue
        data = decoded.envelope.data
        if crash and seq > crash[0][0] and data.event_id != crash[0][2]:
            continue
        counts[str(data.rule)] = counts.get(str(data.rule), 0) + 1
    where = f"before the first crash (step {crash[0][1]})" if crash else "(the run did not crash)"
    named = ["non-finite", "loss-spike", *sorted(set(counts) - {"non-finite", "loss-spike"})]
    found = ", ".join(f"{counts[rule]} {rule}" for rule in named)
    return f"anomalies {where}: {found}"
