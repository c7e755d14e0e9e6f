"""Commands over one ledger: `ledger query`, `runs`, `history`, `state`, `diff`, `blame`, `compact`, `views`."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.output import (
    DEFAULT_LEDGER,
    Format,
    FormatOption,
    LedgerOption,
    OutputOption,
    console,
    fail,
    print_json,
    print_rows,
    user_errors,
)


def _reader(ledger: Path):
    from runledger.ledger.query import Reader

    return Reader(ledger)


def query(
    sql: Annotated[str, typer.Argument(help="SQL over the ledger's views (read-only).")],
    ledger: LedgerOption = DEFAULT_LEDGER,
    fmt: FormatOption = Format.table,
    output: OutputOption = None,
) -> None:
    """Run SQL over the ledger's views. Statements that would write are refused."""
    with user_errors():
        result = _reader(ledger).sql(sql)
    print_rows(result.columns, result.rows, fmt, output)


def runs(
    ledger: LedgerOption = DEFAULT_LEDGER, fmt: FormatOption = Format.table, output: OutputOption = None
) -> None:
    """List the runs in the ledger."""
    with user_errors():
        result = _reader(ledger).runs()
    print_rows(result.columns, result.rows, fmt, output, title="runs")


def history(
    run: Annotated[str, typer.Argument(help="Run id.")],
    ledger: LedgerOption = DEFAULT_LEDGER,
    fmt: FormatOption = Format.table,
    output: OutputOption = None,
) -> None:
    """The run's story in order: launches, config changes, checkpoints, crashes, GitHub events."""
    with user_errors():
        items = _reader(ledger).history(run)
    rows = [(i.time, i.step, i.attempt, i.kind, i.text) for i in items]
    print_rows(["time", "step", "attempt", "kind", "what"], rows, fmt, output, title=f"history of {run}")


def state(
    run: Annotated[str, typer.Argument(help="Run id.")],
    step: Annotated[int | None, typer.Option("--step", help="Training step.")] = None,
    at: Annotated[
        datetime | None, typer.Option("--at", help="Wall-clock time (ISO 8601, UTC if no offset).")
    ] = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
    fmt: Annotated[Format, typer.Option("--format", "-f", help="table or json.")] = Format.table,
    output: OutputOption = None,
) -> None:
    """The run's state at a step or a time: config, commit, attempt, last checkpoint, crashes so far."""
    if step is not None and at is not None:
        raise fail("give --step or --at, not both", 2)
    if at is not None and at.tzinfo is None:
        from datetime import UTC

        at = at.replace(tzinfo=UTC)
    with user_errors():
        reader = _reader(ledger)
        result = reader.state(run, step=step, at=at)
        if at is not None and result.attempt is None:
            # Like --step out of range: no state exists before the run's first event.
            began = reader.sql("SELECT min(time) FROM events WHERE stream = ?", [run]).rows[0][0]
            since = f" (it began at {began.isoformat()})" if began is not None else ""
            raise fail(f"--at {at.isoformat()} is before run {run} began{since}")
    if fmt == Format.json:
        print_json(result.to_dict(), output)
        return
    if fmt != Format.table:
        raise fail("state prints as table or json", 2)
    console.print(f"[bold]{run}[/] at step {result.step} (attempt {result.attempt})")
    console.print(f"  commit: {result.git_commit}{' (dirty)' if result.git_dirty else ''}")
    console.print(f"  config hash: {result.config_hash}")
    ckpt = result.last_checkpoint
    where = f"step {ckpt['step']} ({ckpt['path']})" if ckpt else "none"
    console.print(f"  last checkpoint: {where}")
    console.print(
        f"  crashes so far: {len(result.crashes)}; config changes so far: {len(result.config_changes)}"
    )
    console.print(f"  GitHub events so far: {len(result.github)}")
    rows = sorted(_flatten(result.config).items())
    print_rows(["key", "value"], rows, Format.table, None, title="config")


def diff(
    run: Annotated[str, typer.Argument(help="Run id.")],
    from_step: Annotated[int, typer.Option("--from-step", help="Earlier step.")],
    to_step: Annotated[int, typer.Option("--to-step", help="Later step.")],
    ledger: LedgerOption = DEFAULT_LEDGER,
    fmt: Annotated[Format, typer.Option("--format", "-f", help="table or json.")] = Format.table,
    output: OutputOption = None,
) -> None:
    """Config diff between two steps, and everything that happened between them."""
    with user_errors():
        result = _reader(ledger).diff(run, from_step, to_step)
    if fmt == Format.json:
        print_json(result, output)
        return
    console.print(
        f"[bold]{run}[/] step {from_step} (attempt {result['from']['attempt']}) → "
        f"step {to_step} (attempt {result['to']['attempt']})"
    )
    rows = [(op["op"], op["path"], op.get("value")) for op in result["config_patch"]]
    print_rows(["op", "path", "value"], rows, Format.table, None, title="config diff")
    rows = [(i.time, i.step, i.attempt, i.kind, i.text) for i in result["events"]]
    print_rows(["time", "step", "attempt", "kind", "what"], rows, Format.table, None, title="in between")


def blame(
    run: Annotated[str, typer.Argument(help="Run id.")],
    key: Annotated[str, typer.Argument(help="Dotted config key, e.g. moe.capacity_factor.")],
    step: Annotated[int | None, typer.Option("--step", help="Step (default: the last).")] = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
    fmt: Annotated[Format, typer.Option("--format", "-f", help="table or json.")] = Format.table,
    output: OutputOption = None,
) -> None:
    """Which change set a config key's value live at a step, and the commit/PR/person behind it."""
    with user_errors():
        result = _reader(ledger).blame(run, key, step)
    if fmt == Format.json:
        print_json(result, output)
        return
    s = result["set_by"]
    cause = s["cause"] or {}
    who = f" by {cause['actor']}" if cause.get("actor") else ""
    how = f" ({cause.get('kind')}{': ' + cause['detail'] if cause.get('detail') else ''})" if cause else ""
    console.print(f"{key} = {result['value']!r} at step {result['step']} of {run}")
    console.print(f"  set by {s['kind']} at step {s['step']} (attempt {s['attempt']}, {s['time']}){who}{how}")
    title = f" “{result['commit_title']}”" if result.get("commit_title") else ""
    console.print(
        f"  code: {result['commit'] or 'unknown'}{' (dirty)' if result['git_dirty'] else ''}{title}"
    )
    if result.get("person"):
        console.print(f"  person: {result['person']}")
    for pr in result["pull_requests"]:
        state = f"merged {pr['merged_at']}" if pr["merged"] else pr["state"]
        how = "merge commit" if pr["relation"] == "merge_commit" else "head commit"
        console.print(f"  PR {pr['repo']}#{pr['number']} {pr['title']!r} by {pr['author']} ({state}; {how})")


def compact(ledger: LedgerOption = DEFAULT_LEDGER) -> None:
    """Merge each partition's small Parquet files into one (answers do not change)."""
    from runledger.ledger.store import Ledger

    with user_errors():
        result = Ledger.open(ledger).compact()
    console.print(f"merged {result['merged_partitions']} partitions, removed {result['removed_files']} files")


def views(ledger: LedgerOption = DEFAULT_LEDGER) -> None:
    """Write <ledger>/views.sql: the views, for `duckdb -init <ledger>/views.sql` without runledger."""
    from runledger.ledger.store import Ledger
    from runledger.ledger.views import write_views_file

    with user_errors():
        path = write_views_file(Ledger.open(ledger).root)
    console.print(f"wrote {path}")


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}
