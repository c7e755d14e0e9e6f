"""`ledger demo`: the main job, end to end on CPU.

A tiny Megatron-Core MoE trains on the shipped corpus; mid-run its config file is edited (the
capacity factor), a crash is injected, the run resumes from its last checkpoint; every event goes
through the embedded spool into a fresh ledger, whose history, a few SQL answers and a Merkle
verification are printed.

The work folder: the demo only ever removes what it creates itself (``DEMO_OUTPUTS``). It makes the
folder, or takes an empty one, and marks it with ``MARKER``; a rerun reuses a marked folder. A
non-empty folder it did not make is refused unless ``--force``; the current folder, any folder
above it, $HOME and / are always refused.

Ctrl-C (SIGINT) or SIGTERM: the trainer stops at the next step boundary and records the stop; the
demo folds what was spooled into the ledger (commits are atomic, so a second Ctrl-C leaves it
consistent too), does not resume, and exits 128 + the signal number (130 for Ctrl-C).
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cli.output import (
    Format,
    VerboseOption,
    console,
    fail,
    plural,
    print_rows,
    third_party_warnings,
)

DEMO_DIR = Path(".runledger/demo")
MARKER = ".runledger-demo"  # written into every work folder the demo made or took over
# All the demo writes there.
DEMO_OUTPUTS = ("checkpoints", "spool", "ledger", "keys", "config.toml", "report.html")
INTERRUPTED_EXIT = 128 + signal.SIGINT


class Interrupted(Exception):
    """The run was stopped by a signal; the ledger holds what happened up to the stop."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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
    try:
        prepare_workdir(workdir, force=force)
        with third_party_warnings(verbose):
            run_demo(workdir, steps=steps, crash_at=crash_at, change_at=change_at)
    except Interrupted as exc:
        raise fail(str(exc), exc.exit_code) from None
    except KeyboardInterrupt:
        raise fail(
            "interrupted (Ctrl-C); the ledger holds only whole commits. Fold the rest of the spool with "
            f"`ledger ingest spool --spool {_q(workdir / 'spool')} --ledger {_q(workdir / 'ledger')}`",
            INTERRUPTED_EXIT,
        ) from None


def _q(path: Path) -> str:
    return shlex.quote(str(path))


def _protected(target: Path) -> str | None:
    """Why ``target`` (resolved) must never be a work folder, or None."""
    if target == Path(target.anchor):
        return "it is the root folder"
    try:
        if target == Path.home().resolve():
            return "it is your home folder"
    except RuntimeError:  # no home folder can be determined
        pass
    cwd = Path.cwd().resolve()
    if target == cwd:
        return "it is the current folder"
    if target in cwd.parents:
        return "it holds the current folder"
    return None


def prepare_workdir(workdir: Path, *, force: bool = False) -> None:
    """Make ``workdir`` ready for a demo, removing only the demo's own outputs; refuse anything else."""
    target = workdir.expanduser().resolve()
    why = _protected(target)
    if why is not None:
        raise fail(
            f"refusing --workdir {workdir}: {why}; the demo needs a folder of its own, "
            f"e.g. --workdir {DEMO_DIR}",
            2,
        )
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise fail(f"refusing --workdir {workdir}: it is not a folder", 2)
        ours = (target / MARKER).is_file()
        if not ours and not force and any(target.iterdir()):
            raise fail(
                f"refusing --workdir {workdir}: it is not empty and was not made by `ledger demo`; "
                "give a new or empty folder, or --force to use it (removes only "
                + ", ".join(DEMO_OUTPUTS)
                + " there)",
                2,
            )
        for name in DEMO_OUTPUTS:
            path = target / name
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
    target.mkdir(parents=True, exist_ok=True)
    (target / MARKER).write_text(
        "This folder was made by `ledger demo`; a rerun replaces its outputs: "
        + ", ".join(DEMO_OUTPUTS)
        + ".\n"
    )


def _signal_name(signum: int | None) -> str:
    try:
        return signal.Signals(signum).name if signum is not None else "a signal"
    except ValueError:
        return f"signal {signum}"


class _PendingSignal:
    """SIGINT/SIGTERM outside the trainer's own handlers: remembered, acted on at the next safe point."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum


@contextlib.contextmanager
def _deferred_signals(pending: _PendingSignal) -> Iterator[None]:
    # The trainer installs its own handlers while it trains and puts these back when it returns, so a
    # second Ctrl-C that lands after the trainer stopped is remembered here instead of tearing the
    # demo down half-way through folding the spool.
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    previous = {s: signal.signal(s, pending) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_demo(workdir: Path, *, steps: int, crash_at: int, change_at: int) -> Path:
    """The demo in ``workdir`` (made ready by ``prepare_workdir``); raises Interrupted on a signal stop."""
    from ingest.bus import SpoolSink
    from ingest.spool_ingester import ingest_spool
    from ledger.admission import register_producer
    from ledger.integrity import sign_checkpoints, verify_ledger
    from ledger.log_checkpoint import write_keypair
    from ledger.query import Reader
    from ledger.store import Ledger
    from schemas.payloads import ProducerScope
    from schemas.signing import Sealer
    from trainer.config import load_config, write_config
    from trainer.loop import SignalStop, train

    started = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "config.toml"
    ledger_dir = workdir / "ledger"
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = load_config(
        None,
        [
            f"run.run_id={run_id}",
            f"run.steps={steps}",
            "run.device=cpu",
            "moe.capacity_factor=1.0",
            f"checkpoint.dir={workdir / 'checkpoints'}",
            f"checkpoint.interval={max(5, min(50, crash_at // 3 // 5 * 5))}",
            f"debug.crash_at_step={crash_at}",
            "telemetry.peak_tflops=0.2",
        ],
    )
    write_config(config_path, cfg)
    # The trainer signs (and chains) its events with its own producer key; the ledger registers it.
    producer_key, producer_pub = write_keypair(workdir / "keys", "demo-trainer")
    sink = SpoolSink(workdir / "spool", sealer=Sealer(producer_key.read_text()))
    console.print(f"[bold]runledger demo[/]: run {run_id}, {steps} steps of a tiny Megatron-Core MoE on CPU")

    stop: tuple[int | None, str] | None = None  # (signal, where) when a signal stopped the run
    pending = _PendingSignal()
    try:
        with (
            _deferred_signals(pending),
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("step {task.completed:.0f}/{task.total}"),
                TextColumn("loss {task.fields[loss]}"),
                TimeElapsedColumn(),
                console=console,
            ) as progress,
        ):
            task = progress.add_task("attempt 1", total=steps, loss="-")
            edited = False

            def on_step(report) -> None:
                nonlocal edited
                progress.update(task, completed=report.step, loss=f"{report.loss:.3f}")
                if report.step >= change_at and not edited:
                    # A person edits the watched config file: picked up at the next step boundary.
                    text = config_path.read_text().replace("capacity_factor = 1.0", "capacity_factor = 1.25")
                    config_path.write_text(text)
                    edited = True

            first = train(config_path, sink, progress=on_step)
            console.print(
                # "after step N": the injected crash (--crash-at N + 1) stops step N + 1 before its update.
                f"attempt 1 ended: {first.status} after step {first.final_step}{_crash_note(first)}",
                markup=False,
            )
            if first.status == "signal":
                stop = (first.crash.signal if first.crash else None, f"step {first.final_step} of attempt 1")
            elif pending.signum is not None:  # Ctrl-C between the trainer's handlers: do not resume
                stop = (pending.signum, f"step {first.final_step} of attempt 1")
            else:
                progress.update(task, description="attempt 2 (resumed)")
                second = train(config_path, sink, resume_from="latest", progress=on_step)
                console.print(
                    f"attempt {second.attempt} resumed from step {second.start_step}: {second.status} "
                    f"at step {second.final_step}{_crash_note(second)}",
                    markup=False,
                )
                if second.status == "signal":
                    stop = (
                        second.crash.signal if second.crash else None,
                        f"step {second.final_step} of attempt {second.attempt}",
                    )
    except SignalStop as exc:  # a second signal while the trainer was recording the first
        stop = (exc.signum, "a step boundary")
    finally:
        sink.close()

    with _deferred_signals(pending):  # the fold is short and leaves whole commits: let it finish
        ledger = Ledger.create(ledger_dir)
        register_producer(
            ledger, "demo-trainer", producer_pub.read_text(), ProducerScope(sources=["trainer/"])
        )
        stats = ingest_spool(ledger, workdir / "spool")
    if stop is None and pending.signum is not None:
        stop = (pending.signum, "the end of training")
    console.print(
        f"ledger: {plural(stats.accepted, 'event')}, {plural(stats.metric_values, 'metric value')} in "
        f"{plural(stats.commits, 'commit')} ({stats.quarantined} quarantined) at {ledger_dir}"
    )
    if stop is not None:
        signum, where = stop
        raise Interrupted(
            f"interrupted by {_signal_name(signum)} at {where}: not resuming. The ledger holds the run "
            f"up to the stop: `ledger history {run_id} --ledger {_q(ledger_dir)}`",
            128 + signum if signum else INTERRUPTED_EXIT,
        )
    private, public = write_keypair(workdir / "keys", "demo")
    sign_checkpoints(ledger_dir, private.read_text().strip())
    report = verify_ledger(ledger_dir, public.read_text().strip())
    check = f"ledger verify --ledger {_q(ledger_dir)} --public-key {_q(public)}"
    console.print(
        f"verify: {'OK' if report.ok else 'FAILED'} ({plural(report.events, 'event')}, "
        f"{plural(report.checkpoints, 'signed checkpoint')} checked). Check it yourself: "
        f"[bold]{escape(check)}[/]",
        highlight=False,
    )

    reader = Reader(ledger_dir)
    items = reader.history(run_id)
    # Without the time column, so the story itself ("moe.capacity_factor 1.0 → 1.25") fits 100 columns.
    print_rows(
        ["step", "attempt", "kind", "what"],
        [(i.step, i.attempt, i.kind, i.text) for i in items],
        Format.table,
        None,
        title=f"history of {run_id}",
        limit=0,
    )
    answers = [
        (
            "loss by attempt (superseded steps kept, not overwritten)",
            "SELECT attempt, count(*) AS steps, sum(superseded::INT) AS superseded, round(min(value), 3) AS min_loss, "
            "round(max(value), 3) AS max_loss FROM metrics_all WHERE name = 'loss' GROUP BY attempt ORDER BY attempt",
        ),
        (
            "token-drop rate before and after the capacity-factor change",
            f"SELECT CASE WHEN step < {change_at + 1} THEN 'capacity 1.0' ELSE 'capacity 1.25' END AS phase, "
            "round(avg(token_drop_rate) * 100, 3) AS drop_pct, count(DISTINCT step) AS steps "
            "FROM moe_layer_stats GROUP BY phase ORDER BY phase",
        ),
        (
            "config live at the crash step, from SQL",
            f"SELECT attempt, step, json_extract(config, '$.moe.capacity_factor') AS capacity_factor, "
            f"left(config_hash, 12) AS hash FROM config_at('{run_id}', {crash_at})",
        ),
    ]
    for title, sql in answers:
        result = reader.sql(sql)
        print_rows(result.columns, result.rows, Format.table, None, title=title)
    from ledger.report import write_report

    report_path, _ = write_report(ledger_dir, [run_id], workdir / "report.html", public_key_path=public)
    console.print(f"report (open it in a browser, no network needed): [bold]{escape(str(report_path))}[/]")
    # The export makes every later `ledger …` command find this ledger without --ledger.
    explore = f"export RUNLEDGER_LEDGER={_q(ledger_dir)}; ledger runs; ledger history latest"
    console.print(
        f"done in {time.perf_counter() - started:.0f} s. Explore: [bold]{escape(explore)}[/]",
        highlight=False,
    )
    return ledger_dir


def _crash_note(result) -> str:
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
