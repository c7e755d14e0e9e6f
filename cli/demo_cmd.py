"""`ledger demo`: the main job, end to end on CPU.

A tiny Megatron-Core MoE trains on the shipped corpus; mid-run its config file is edited (the
capacity factor), a crash is injected, the run resumes from its last checkpoint; every event goes
through the embedded spool into a fresh ledger, whose history, a few SQL answers and a Merkle
verification are printed.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from runledger.cli.output import Format, console, print_rows

DEMO_DIR = Path(".runledger/demo")


def demo(
    workdir: Annotated[Path, typer.Option(help="Where the demo writes (recreated).")] = DEMO_DIR,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 200,
    crash_at: Annotated[int, typer.Option(help="Step at which attempt 1 crashes.")] = 130,
    change_at: Annotated[int, typer.Option(help="Step after which the config file is edited.")] = 60,
) -> None:
    """Train a tiny MoE on CPU with a live config change, a crash and a resume; fold it into a ledger."""
    run_demo(workdir, steps=steps, crash_at=crash_at, change_at=change_at)


def run_demo(workdir: Path, *, steps: int, crash_at: int, change_at: int) -> Path:
    from runledger.ingest.bus import SpoolSink
    from runledger.ingest.spool_ingester import ingest_spool
    from runledger.ledger.integrity import sign_checkpoints, verify_ledger
    from runledger.ledger.log_checkpoint import write_keypair
    from runledger.ledger.query import Reader
    from runledger.ledger.store import Ledger
    from runledger.trainer.config import load_config, write_config
    from runledger.trainer.loop import train

    started = time.perf_counter()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    config_path = workdir / "config.toml"
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
    sink = SpoolSink(workdir / "spool")
    console.print(f"[bold]runledger demo[/]: run {run_id}, {steps} steps of a tiny Megatron-Core MoE on CPU")

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
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
            f"attempt 1 ended: {first.status} at step {first.final_step} "
            f"({first.crash.exc_type if first.crash else ''} {first.crash.message if first.crash else ''})"
        )
        progress.update(task, description="attempt 2 (resumed)")
        second = train(config_path, sink, resume_from="latest", progress=on_step)
        console.print(
            f"attempt {second.attempt} resumed from step {second.start_step}: {second.status} "
            f"at step {second.final_step}"
        )
    sink.close()

    ledger_dir = workdir / "ledger"
    stats = ingest_spool(Ledger.create(ledger_dir), workdir / "spool")
    console.print(
        f"ledger: {stats.accepted} events, {stats.metric_values} metric values in {stats.commits} commits "
        f"({stats.quarantined} quarantined) at {ledger_dir}"
    )
    private, public = write_keypair(workdir / "keys", "demo")
    sign_checkpoints(ledger_dir, private.read_text().strip())
    report = verify_ledger(ledger_dir, public.read_text().strip())
    console.print(
        f"verify: {'OK' if report.ok else 'FAILED'} ({report.events} events, {report.checkpoints} signed "
        "checkpoints)"
    )

    reader = Reader(ledger_dir)
    items = reader.history(run_id)
    print_rows(
        ["time", "step", "attempt", "kind", "what"],
        [(i.time, i.step, i.attempt, i.kind, i.text) for i in items],
        Format.table,
        None,
        title=f"history of {run_id}",
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
    console.print(
        f"done in {time.perf_counter() - started:.0f} s. Explore: "
        f'[bold]ledger query "SELECT * FROM runs" --ledger {ledger_dir}[/]'
    )
    return ledger_dir
