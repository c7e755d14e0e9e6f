"""Commands over one ledger: `ledger query`, `runs`, `history`, `state`, `diff`, `blame`, `compact`, `views`."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from runledger.cli.output import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_LEDGER,
    AtCheckpointOption,
    FetchTimeoutOption,
    Format,
    FormatOption,
    FullOption,
    LedgerOption,
    LimitOption,
    OutputOption,
    Program,
    SnapshotOption,
    console,
    err_console,
    escape,
    fail,
    fetch_timeout_s,
    plural,
    print_json,
    print_lines,
    print_rows,
    resolve_format,
    short_hash,
    user_errors,
)

RunArgument = Annotated[
    str,
    typer.Argument(
        metavar="RUN", help="Run id, or `latest` (the most recently started run).", show_default=False
    ),
]

# "The run" is its lineage across run ids (a relaunch, fork or resume under a new id: issue 44).
RunOnlyOption = Annotated[
    bool,
    typer.Option(
        "--run-only",
        help="Only this run id, not its lineage (the runs it continues and those that continue it).",
    ),
]


# The limits one statement runs under (``runledger.ledger.sql_guard.QueryLimits``): `ledger query` and `ledger shell`.
TimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        help="Stop a statement after this many seconds (default 300).",
        show_default=False,
    ),
]
MemoryLimitOption = Annotated[
    str | None,
    typer.Option(
        "--memory-limit",
        help="DuckDB's memory for a statement, e.g. 512MB (default 2GiB or a quarter of the memory, "
        "whichever is smaller); beyond it DuckDB spills to disk where it can.",
        show_default=False,
    ),
]
SpillLimitOption = Annotated[
    str | None,
    typer.Option(
        "--spill-limit",
        help="Disk a statement may spill to (the ledger's .spill folder), e.g. 1GB (default 10GB).",
        show_default=False,
    ),
]


def query_limits(timeout: float | None, memory: str | None, spill: str | None) -> Any:
    """The ``QueryLimits`` the options give, or a one-line usage error."""
    from runledger.ledger.sql_guard import query_limits as limits_of

    try:
        return limits_of(timeout, memory, spill)
    except ValueError as exc:
        raise fail(str(exc), 2) from None


def _reader(ledger: Path, snapshot: int | None = None, at_checkpoint: Path | None = None, limits: Any = None):
    """The ledger's reader; a ledger on DuckLake answers at one snapshot (the newest, ``snapshot``, or
    the one a signed checkpoint pins), named on stderr when one was asked for."""
    from runledger.ledger.query import Reader

    text = None
    if at_checkpoint is not None:
        try:
            text = at_checkpoint.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise fail(f"--at-checkpoint {at_checkpoint}: {exc}") from None
    # The program alone (no writer of this process holds the catalog) lists a SQLite catalog's files
    # with Python's sqlite3: no DuckDB extension loaded for it (issue 41).
    reader = Reader(
        ledger,
        snapshot=snapshot,
        at_checkpoint=text,
        limits=limits,
        sqlite3_catalog=Program.is_whole_process,
    )
    if reader.snapshot is not None and (snapshot is not None or at_checkpoint is not None):
        err_console.print(f"as of lake snapshot {reader.snapshot}", highlight=False)
    return reader


def _earlier_first(from_step: int | None, to_step: int | None) -> None:
    """A range of steps given the wrong way round is the user's slip, not an empty answer."""
    if from_step is not None and to_step is not None and from_step > to_step:
        raise fail(f"--from-step {from_step} is after --to-step {to_step}: give the earlier step first", 2)


def resolve_run(reader, run: str) -> str:
    """The run a RUN argument names: `latest` is the run started most recently (every command that
    takes a run id: history, state, diff, blame, report, plot)."""
    if run != "latest":
        return run
    # (``runs``'s started_at, without the rest of that view: its last step scans every metric)
    rows = reader.sql(
        "SELECT run_id FROM attempts GROUP BY run_id ORDER BY min(started_at) DESC, run_id DESC LIMIT 1"
    ).rows
    if not rows:
        raise fail("the ledger has no runs yet, so no `latest` run")
    return rows[0][0]


def query(
    sql: Annotated[
        str, typer.Argument(metavar="SQL", help="One read-only SQL statement over the ledger's views.")
    ],
    ledger: LedgerOption = DEFAULT_LEDGER,
    snapshot: SnapshotOption = None,
    at_checkpoint: AtCheckpointOption = None,
    fmt: FormatOption = None,
    output: OutputOption = None,
    limit: LimitOption = None,
    full: FullOption = False,
    remote: Annotated[
        str | None,
        typer.Option(
            "--remote",
            help="Answer over a copy published at this URL or s3://bucket/prefix (needs --log-key).",
        ),
    ] = None,
    log_key: Annotated[
        str | None, typer.Option("--log-key", help="With --remote: the log's public key (vkey or .pub file).")
    ] = None,
    cache: Annotated[
        Path, typer.Option("--cache", help="With --remote: where the verified data files are kept.")
    ] = Path(".runledger/remote-cache"),
    direct: Annotated[
        bool,
        typer.Option(
            "--direct",
            help="With --remote: DuckDB reads the published Parquet files by URL (httpfs), nothing "
            "downloaded; their bytes are not checked against the signed SHA-256.",
        ),
    ] = False,
    timeout: TimeoutOption = None,
    memory_limit: MemoryLimitOption = None,
    spill_limit: SpillLimitOption = None,
    fetch_timeout: FetchTimeoutOption = DEFAULT_FETCH_TIMEOUT_S,
) -> None:
    """Run SQL over the ledger's views. Statements that would write are refused; each statement runs
    under --timeout, --memory-limit and --spill-limit (one line and a non-zero exit when one stops it).

    With --remote URL --log-key VKEY: over a published copy; its signed manifest is checked, the data
    files it names are downloaded (only those not cached) and checked against their SHA-256, and the
    checkpoint the answer is as of is printed on stderr. With --direct: DuckDB's httpfs reads the files
    the signed manifest names by URL, only the byte ranges the query needs (an HTTP server must answer
    Range requests); the checkpoint and manifest are verified, the data bytes are not (DuckDB cannot
    check what it reads against the manifest's SHA-256), which is why the verified download is the default.
    S3: the server and credentials come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY.
    Example: ledger query "SELECT step, value FROM metrics WHERE name = 'loss' ORDER BY step" -o loss.csv
    """
    fmt = resolve_format(fmt, output)
    limits = query_limits(timeout, memory_limit, spill_limit)
    if direct and remote is None:
        raise fail("--direct needs --remote URL", 2)
    if remote is not None:
        deadline_s = fetch_timeout_s(fetch_timeout)
        result = (
            _direct_sql(remote, log_key, sql, limits, deadline_s)
            if direct
            else _remote_sql(remote, log_key, cache, sql, limits, deadline_s)
        )
        print_rows(result.columns, result.rows, fmt, output, limit=limit, full=full)
        return
    with user_errors(ledger):
        reader = _reader(ledger, snapshot, at_checkpoint, limits)
        try:
            result = reader.sql(sql)
        finally:
            reader.close()  # (its spill folder goes with it)
    print_rows(result.columns, result.rows, fmt, output, limit=limit, full=full)


def _direct_sql(url: str, log_key: str | None, sql: str, limits: Any, deadline_s: float) -> Any:
    import base64

    from runledger.cli.merkle_cmd import _vkey
    from runledger.ledger.remote import RemoteError, query_direct

    if log_key is None:
        raise fail("--remote needs --log-key VKEY (the published log's public key)", 2)
    key = _vkey(log_key)
    with user_errors():
        try:
            answer = query_direct(url, key, sql, deadline_s=deadline_s, limits=limits)
        except RemoteError as exc:
            raise fail(f"REFUSED {exc}") from None
    cp = answer.checkpoint
    err_console.print(
        f"as of {cp.origin} checkpoint size {cp.size} root {base64.b64encode(cp.root).decode()} "
        f"(signed manifest at log size {answer.manifest_log_size}; read directly from "
        f"{answer.files} files, their bytes not checked against the manifest)",
        highlight=False,
        markup=False,
    )
    return answer.result


def _remote_sql(url: str, log_key: str | None, cache: Path, sql: str, limits: Any, deadline_s: float) -> Any:
    import base64

    from runledger.cli.merkle_cmd import _vkey
    from runledger.ledger.remote import RemoteError, fetch_copy

    if log_key is None:
        raise fail("--remote needs --log-key VKEY (the published log's public key)", 2)
    key = _vkey(log_key)
    with user_errors():
        try:
            copy = fetch_copy(url, key, cache, deadline_s=deadline_s)
        except RemoteError as exc:
            raise fail(f"REFUSED {exc}") from None
        result = copy.sql(sql, limits=limits)
    cp = copy.checkpoint
    err_console.print(
        f"as of {cp.origin} checkpoint size {cp.size} root {base64.b64encode(cp.root).decode()} "
        f"(signed manifest at log size {copy.manifest_log_size}; {copy.downloaded} files downloaded)",
        highlight=False,
        markup=False,
    )
    return result


def runs(
    ledger: LedgerOption = DEFAULT_LEDGER,
    snapshot: SnapshotOption = None,
    at_checkpoint: AtCheckpointOption = None,
    fmt: FormatOption = None,
    output: OutputOption = None,
    limit: LimitOption = None,
    full: FullOption = False,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            metavar="PATTERN",
            help="Run id or name: a glob (* ? [..]), or text it contains.",
            show_default=False,
        ),
    ] = None,
    tags: Annotated[
        list[str] | None,
        typer.Option(
            "--tag", metavar="TAG", help="A tag of the run's notes (repeat: every one).", show_default=False
        ),
    ] = None,
    status: Annotated[
        str | None,
        typer.Option("--status", metavar="STATUS", help="running, finished or crashed.", show_default=False),
    ] = None,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            metavar="KEY=VALUE",
            help="KEY=VALUE on the run's latest config, KEY a dotted path, VALUE typed as JSON "
            "(also != < <= > >=; repeat: every one).",
            show_default=False,
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            metavar="WHEN",
            help="Started at or after: 2026-06-01, a date-time, or an age (7d).",
            show_default=False,
        ),
    ] = None,
    until: Annotated[
        str | None,
        typer.Option("--until", metavar="WHEN", help="Started before (as --since).", show_default=False),
    ] = None,
    metric: Annotated[
        str | None,
        typer.Option(
            "--metric",
            metavar="NAME",
            help="Add this metric's value per run (metric_value, metric_step).",
            show_default=False,
        ),
    ] = None,
    best: Annotated[
        str | None,
        typer.Option(
            "--best",
            metavar="min|max",
            help="min or max: the metric's best value (sorted best first).",
            show_default=False,
        ),
    ] = None,
    last: Annotated[
        bool, typer.Option("--last", help="The metric's value at its last step (the default).")
    ] = False,
    sort: Annotated[
        str | None,
        typer.Option(
            "--sort", metavar="COLUMN", help="A column to sort by (default started_at).", show_default=False
        ),
    ] = None,
    desc: Annotated[bool, typer.Option("--desc", help="Sort descending.")] = False,
) -> None:
    """List the runs in the ledger, filtered and sorted.

    Filters combine (all must hold). Status is the newest attempt's: crashed (a crash or a failed
    finish is its last end), finished, or running (no end recorded).
    Example: ledger runs --config moe.capacity_factor=1.25 --since 2026-06-01 --metric eval/loss --best min
    """
    from runledger.ledger.run_search import RunFilterError

    fmt = resolve_format(fmt, output)
    try:
        filt = _run_filter(name, tags, status, config, since, until, metric, best, last, sort, desc)
    except RunFilterError as exc:
        raise fail(str(exc), 2) from None
    with user_errors(ledger):
        result = _reader(ledger, snapshot, at_checkpoint).runs(filt)
    print_rows(result.columns, result.rows, fmt, output, title="runs", limit=limit, full=full)


def _run_filter(
    name: str | None,
    tags: list[str] | None,
    status: str | None,
    config: list[str] | None,
    since: str | None,
    until: str | None,
    metric: str | None,
    best: str | None,
    last: bool,
    sort: str | None,
    desc: bool,
) -> Any:
    """`ledger runs`' options as a checked ``RunFilter`` (``RunFilterError``: one line, exit 2)."""
    from runledger.ledger import run_search as rs

    if (best or last) and not metric:
        raise rs.RunFilterError("--best and --last need --metric NAME")
    if best and last:
        raise rs.RunFilterError("--best and --last exclude each other")
    filt = rs.RunFilter(
        pattern=name,
        tags=tuple(tags or ()),
        status=rs.parse_status(status) if status is not None else None,
        config=tuple(rs.parse_config_test(text) for text in config or ()),
        since=rs.parse_time(since) if since is not None else None,
        until=rs.parse_time(until) if until is not None else None,
        metric=metric,
        metric_mode=rs.parse_metric_mode(best) if best else "last",
        sort=sort,
        descending=desc,
    )
    rs.check(filt)
    return filt


def history(
    run: RunArgument,
    ledger: LedgerOption = DEFAULT_LEDGER,
    snapshot: SnapshotOption = None,
    at_checkpoint: AtCheckpointOption = None,
    fmt: FormatOption = None,
    output: OutputOption = None,
    limit: LimitOption = None,
    full: FullOption = False,
    from_step: Annotated[
        int | None,
        typer.Option("--from-step", min=0, help="Every event from this step on (with --to-step: a range)."),
    ] = None,
    to_step: Annotated[
        int | None, typer.Option("--to-step", min=0, help="Every event up to this step.")
    ] = None,
    every: Annotated[bool, typer.Option("--all", help="Every event of the run, not a summary.")] = False,
    run_only: RunOnlyOption = False,
) -> None:
    """The run's story in order: launches, config changes, checkpoints, crashes, GitHub events.

    A long history is summarised to about a screen: launches, config changes, crashes, merges and
    notes, with routine checkpoints and GitHub events counted between them (a months-long run: only
    launches, changes, notes and each crash with its resume); --from-step/--to-step show every event
    of a range, --all every event of the run. The run's lineage is told with it (the runs it
    continues and those that continue it, each line of another run id naming it); --run-only: this
    run id alone.
    Example: ledger history latest --from-step 81000 --to-step 82000
    """
    from runledger.ledger.history import history_counts, history_range, summarise_history
    from runledger.ledger.lineage import line_text

    fmt = resolve_format(fmt, output)
    _earlier_first(from_step, to_step)
    with user_errors(ledger):
        reader = _reader(ledger, snapshot, at_checkpoint)
        run = resolve_run(reader, run)
        items = reader.history(run, lineage=not run_only)
        line = [] if run_only else reader.lineage(run)
        ranged = from_step is not None or to_step is not None
        window = _lineage_window(reader, run, line, from_step, to_step) if ranged else None
    title = f"history of {run}" + (f" (lineage {line_text(line)})" if len(line) > 1 else "")
    if ranged:
        items = history_range(items, from_step, to_step, window)
        title += f", steps {from_step if from_step is not None else 0}..{'' if to_step is None else to_step}"
    elif not every:
        shown = summarise_history(items)
        if len(shown) < len(items):
            title += f": {history_counts(items)} (summarised; --all or --from-step/--to-step for every event)"
        items = shown
    columns, rows = _history_rows(items, lineage=len(line) > 1)
    print_rows(columns, rows, fmt, output, title=title, limit=limit, full=full)


def _lineage_window(
    reader: Any, run: str, line: list[Any], from_step: int | None, to_step: int | None
) -> tuple[datetime, datetime] | None:
    """When the run (each member of its lineage, at the steps it supplies) was at from..to."""
    lo, hi = from_step or 0, 2**62 if to_step is None else to_step
    if len(line) <= 1:
        return reader.step_window(run, lo, hi)
    return reader.lineage_window(line, lo, hi)


def _history_rows(items: list[Any], *, lineage: bool) -> tuple[list[str], list[tuple[Any, ...]]]:
    """History items as table rows; a lineage's with a `run` column (empty: the run asked about)."""
    if not lineage:
        return ["time", "step", "attempt", "kind", "what"], [
            (i.time, i.step, i.attempt, i.kind, i.text) for i in items
        ]
    return ["time", "run", "step", "attempt", "kind", "what"], [
        (i.time, i.run_id or "", i.step, i.attempt, i.kind, i.text) for i in items
    ]


def state(
    run: RunArgument,
    step: Annotated[int | None, typer.Option("--step", help="Training step (default: the last).")] = None,
    at: Annotated[
        datetime | None, typer.Option("--at", help="Wall-clock time (ISO 8601, UTC if no offset).")
    ] = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
    snapshot: SnapshotOption = None,
    at_checkpoint: AtCheckpointOption = None,
    fmt: FormatOption = None,
    output: OutputOption = None,
    limit: LimitOption = None,
    full: FullOption = False,
    run_only: RunOnlyOption = False,
) -> None:
    """The run's state at a step or a time: config, commit, attempt, last checkpoint, crashes so far.

    json prints the whole state; table a summary and the config; csv, jsonl and parquet the config's
    keys and values (as JSON). A step of the run's lineage is read in the run id that supplies it
    (named when it is another; json: run_id); --run-only: this run id alone.
    Example: ledger state latest --step 120
    """
    fmt = resolve_format(fmt, output)
    if step is not None and at is not None:
        raise fail("give --step or --at, not both", 2)
    if at is not None and at.tzinfo is None:
        from datetime import UTC

        at = at.replace(tzinfo=UTC)
    with user_errors(ledger):
        reader = _reader(ledger, snapshot, at_checkpoint)
        run = resolve_run(reader, run)
        # Only json prints the GitHub events themselves; the other formats count them, or print none.
        result = reader.state(run, step=step, at=at, lineage=not run_only, github_text=fmt == Format.json)
        if at is not None and result.attempt is None:
            # Like --step out of range: no state exists before the run's first event.
            began = reader.sql("SELECT min(time) FROM events WHERE stream = ?", [run]).rows[0][0]
            since = f" (it began at {began.isoformat()})" if began is not None else ""
            raise fail(f"--at {at.isoformat()} is before run {run} began{since}")
    if fmt == Format.json:
        print_json(result.to_dict(), output)
        return
    rows = sorted(_flatten(result.config).items())
    if fmt != Format.table or output is not None:
        print_rows(["key", "value"], [(k, _json(v)) for k, v in rows], fmt, output, limit=limit)
        return
    # Plain lines: no rich imported for a one-shot read (issue 41: importing it is ~22 ms).
    where = f"run {result.run_id}, " if result.run_id != run else ""
    commit = short_hash(result.git_commit, full)
    launch = next((a for a in result.attempts if a.attempt == result.attempt), None)
    unsigned = "" if launch is None or launch.authenticated else _UNAUTHENTICATED
    ckpt = result.last_checkpoint
    checkpoint = f"step {ckpt['step']} ({ckpt['path']})" if ckpt else "none"
    unsigned_changes = sum(not ch["authenticated"] for ch in result.config_changes)
    from runledger.ledger.history import incident_text

    print_lines(
        [
            f"{run} at step {result.step} ({where}attempt {result.attempt})",
            f"  commit: {commit}{' (dirty)' if result.git_dirty else ''}{unsigned}",
            f"  config hash: {short_hash(result.config_hash, full)}",
            *_mismatch_lines(result.hash_mismatches, full),
            f"  last checkpoint: {checkpoint}",
            f"  crashes so far: {len(result.crashes)}; config changes so far: {len(result.config_changes)}"
            + (f" ({unsigned_changes} unauthenticated)" if unsigned_changes else ""),
            *(
                f"  unauthenticated: {fact['kind']} at step {fact['step']} (attempt {fact['attempt']})"
                for fact in result.unauthenticated
            ),
            f"  GitHub events so far: {len(result.github)}",
            # ``  incident: 8 events lost by the producer (trainer/r/a1, …): …``
            *(f"  incident: {incident_text(fact, brief=True)}" for fact in result.incidents),
        ]
    )
    print_rows(["key", "value"], rows, Format.table, None, title="config", limit=limit, full=full)


def diff(
    run: RunArgument,
    from_step: Annotated[int, typer.Option("--from-step", min=0, help="Earlier step.")],
    to_step: Annotated[int, typer.Option("--to-step", min=0, help="Later step.")],
    ledger: LedgerOption = DEFAULT_LEDGER,
    snapshot: SnapshotOption = None,
    at_checkpoint: AtCheckpointOption = None,
    fmt: FormatOption = None,
    output: OutputOption = None,
    limit: LimitOption = None,
    full: FullOption = False,
    run_only: RunOnlyOption = False,
) -> None:
    """Config diff between two steps, and everything that happened between them.

    json prints the whole diff; table the changes and events; csv, jsonl and parquet one row per
    config change. The steps are the run's lineage's (each read in the run id that supplies it,
    named when it is another); --run-only: this run id alone.
    Example: ledger diff latest --from-step 50 --to-step 150
    """
    fmt = resolve_format(fmt, output)
    _earlier_first(from_step, to_step)
    with user_errors(ledger):
        reader = _reader(ledger, snapshot, at_checkpoint)
        run = resolve_run(reader, run)
        result = reader.diff(run, from_step, to_step, lineage=not run_only)
    if fmt == Format.json:
        print_json(result, output)
        return
    ops = result["config_patch"]
    if fmt != Format.table or output is not None:
        rows = [
            (op["op"], _dotted(op["path"]), text) for op, text in zip(ops, result["changes"], strict=True)
        ]
        print_rows(["op", "key", "change"], rows, fmt, output, limit=limit)
        return
    ends = [_end_text(run, result[end]) for end in ("from", "to")]
    console.print(
        f"[bold]{escape(run)}[/] step {from_step} {ends[0]} → step {to_step} {ends[1]}", highlight=False
    )
    for text in result["changes"] or ["config unchanged"]:
        console.print(f"  {text}", highlight=False, markup=False)
    for line in _mismatch_lines(result["hash_mismatches"], full):
        console.print(line, highlight=False, markup=False)
    lineage = any(i.run_id for i in result["events"]) or result["from"]["run_id"] != result["to"]["run_id"]
    columns, events = _history_rows(result["events"], lineage=lineage)
    print_rows(columns, events, Format.table, None, title="in between", limit=limit, full=full)


def _end_text(run: str, end: dict[str, Any]) -> str:
    """``(attempt 2)``, or ``(run C, attempt 1)`` for a step another run id of the lineage supplies."""
    where = f"run {escape(end['run_id'])}, " if end.get("run_id", run) != run else ""
    return f"({where}attempt {end['attempt']})"


def blame(
    run: RunArgument,
    key: Annotated[
        str, typer.Argument(metavar="KEY", help="Dotted config key or section, e.g. moe.capacity_factor.")
    ],
    step: Annotated[int | None, typer.Option("--step", help="Step (default: the last).")] = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
    snapshot: SnapshotOption = None,
    at_checkpoint: AtCheckpointOption = None,
    fmt: FormatOption = None,
    output: OutputOption = None,
    full: FullOption = False,
    run_only: RunOnlyOption = False,
) -> None:
    """Which change set a config key's value live at a step, and the commit/PR/person behind it.

    json prints the whole answer; table a few lines; csv, jsonl and parquet one row. The step is the
    run's lineage's, and a value a relaunch only carried over is blamed where it was set, in the run
    id that set it (named when it is another); --run-only: this run id alone.
    Example: ledger blame latest moe.capacity_factor --step 150
    """
    fmt = resolve_format(fmt, output)
    with user_errors(ledger):
        reader = _reader(ledger, snapshot, at_checkpoint)
        run = resolve_run(reader, run)
        result = reader.blame(run, key, step, lineage=not run_only)
    if fmt == Format.json:
        print_json(result, output)
        return
    s = result["set_by"]
    cause = s["cause"] or {}
    if fmt != Format.table or output is not None:
        columns = ["key", "value", "step", "set_by", "set_at_step", "attempt", "time", "actor", "commit"]
        row = (
            key,
            _json(result["value"]),
            result["step"],
            s["kind"],
            s["step"],
            s["attempt"],
            s["time"],
            cause.get("actor"),
            result["commit"],
        )
        print_rows(columns, [row], fmt, output)
        return
    actor = cause.get("actor") or (result.get("person") if cause.get("kind") != "commit" else None)
    who = f" by {actor}" if cause and actor else ""
    how = f" ({cause.get('kind')}{': ' + cause['detail'] if cause.get('detail') else ''})" if cause else ""
    unsigned = "" if s.get("authenticated", True) else _UNAUTHENTICATED
    say = console.print
    read_in = result.get("value_from", run)
    of = f"{run} (read in run {read_in})" if read_in != run else run
    say(f"{key} = {_json(result['value'])} at step {result['step']} of {of}", highlight=False, markup=False)
    setter_run = s.get("run_id", run)
    in_run = f" of run {setter_run}" if setter_run != run else ""
    say(
        f"  set by {s['kind']} at step {s['step']}{in_run} (attempt {s['attempt']}, {s['time']})"
        f"{who}{how}{unsigned}",
        highlight=False,
        markup=False,
    )
    if s.get("hash_matches") is False:
        say(
            "  config hash mismatch: the config recomputed here does not hash to the one its producer recorded",
            highlight=False,
            markup=False,
        )
    title = f" “{result['commit_title']}”" if result.get("commit_title") else ""
    commit = short_hash(result["commit"], full) if result["commit"] else "unknown"
    say(f"  code: {commit}{' (dirty)' if result['git_dirty'] else ''}{title}", highlight=False, markup=False)
    if result.get("person"):
        say(f"  person: {result['person']}", highlight=False, markup=False)
    for pr in result["pull_requests"]:
        state = f"merged {pr['merged_at']}" if pr["merged"] else pr["state"]
        how = "merge commit" if pr["relation"] == "merge_commit" else "head commit"
        say(
            f"  PR {pr['repo']}#{pr['number']} {pr['title']!r} by {pr['author']} ({state}; {how})",
            highlight=False,
            markup=False,
        )


def compact(ledger: LedgerOption = DEFAULT_LEDGER) -> None:
    """Merge the ledger's small Parquet files, expire old snapshots, delete files no snapshot needs
    (the lake's own maintenance; answers do not change).

    Example: ledger compact --ledger .runledger/ledger
    """
    from runledger.ledger.store import Ledger

    with user_errors(ledger), Ledger.open(ledger) as opened:
        result = opened.compact()
    # One line in the lake's terms: DuckLake's merge, cleanup and snapshot expiry.
    removed = result["files_deleted"] + result["orphans_deleted"]
    console.print(
        f"merged {plural(result['files_merged'], 'file')} into {result['files_written']}, "
        f"removed {plural(removed, 'file')}, expired {plural(result['snapshots_expired'], 'snapshot')}"
    )


def views(ledger: LedgerOption = DEFAULT_LEDGER) -> None:
    """Write <ledger>/views.sql: the views, for `duckdb -init <ledger>/views.sql` without runledger.

    Example: ledger views && cd .runledger/ledger && duckdb -init views.sql   (or just: ledger shell)
    """
    from runledger.ledger.store import Ledger
    from runledger.ledger.views import write_views_file

    with user_errors(ledger), Ledger.open(ledger) as opened:
        path = write_views_file(opened.root)
    console.print(f"wrote {path}")


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


_UNAUTHENTICATED = " (unauthenticated)"  # beside a fact admitted unsigned under the ledger's policy


def _mismatch_lines(mismatches: list[dict[str, Any]], full: bool) -> list[str]:
    """One line per config whose recomputed hash is not the one its producer recorded."""
    return [
        f"  config hash mismatch: {m['kind']} at step {m['step']} (attempt {m['attempt']}): "
        f"producer {short_hash(m['recorded'], full)}, recomputed {short_hash(m['recomputed'], full)}"
        for m in mismatches
    ]


def _dotted(path: str) -> str:
    """``/moe/capacity_factor`` → ``moe.capacity_factor``: a JSON Pointer as history and blame write keys."""
    return ".".join(p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/"))


def _json(value: object) -> str:
    """A config value as JSON (``1.25``, ``"adam"``, ``{"top_k": 2}``), never Python's repr."""
    return json.dumps(value, separators=(", ", ": "), default=str)
