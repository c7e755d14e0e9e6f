"""`ledger ingest spool|kafka|github|wandb`: events from a bus or an outside system.

``spool`` and ``kafka`` fold the bus into the ledger. ``github`` and ``wandb`` are producers: they write
events to the bus (``runledger.ingest.bus.open_sink``: the spool, or Kafka when configured), which
``ledger ingest spool`` (or ``kafka``) then folds in. For the producers a mistake a user can fix is one
line on stderr and exit code 2; a failure outside their control (network, GitHub, W&B) exits 1; events
Kafka had not taken when they end (left in the outage spool) are one line naming the count, the spool
and the `ledger kafka drain-spool` command that sends them, and exit 3. The
producers sign their events with the key file named by ``RUNLEDGER_PRODUCER_KEY`` when it is set
(``_open_sink``, the one way they get a sink). ``wandb`` takes an offline run directory or, when no
such path exists, an online ``ENTITY/PROJECT[/RUN]`` (``runledger.ingest.wandb_online``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runledger.cli.kafka_cmd import (
    BatchMaxOption,
    BootstrapOption,
    ConnectTimeoutOption,
    TopicOption,
    kafka_errors,
    stop_on_signals,
    undelivered_exit,
    undelivered_of,
)
from runledger.cli.output import (
    DEFAULT_LEDGER,
    LedgerOption,
    SpoolOption,
    commits_counted,
    console,
    disk_full_error,
    err_console,
    fail,
    plural,
    print_json,
    progress,
    user_errors,
)
from runledger.cli.quarantine_summary import QuarantineTally, say_quarantined
from runledger.ingest.kafka_config import COMMIT_BATCH_MAX
from runledger.schemas.durable import disk_full

if TYPE_CHECKING:  # the bus and the signer load cryptography (~25 ms): imported by the commands using them
    from runledger.ingest.bus import EventSink
    from runledger.schemas import Envelope
    from runledger.schemas.signing import Sealer


def ingest_spool(
    spool: Annotated[Path, typer.Option("--spool", envvar="RUNLEDGER_SPOOL", help="Spool directory.")] = Path(
        ".runledger/spool"
    ),
    ledger: LedgerOption = DEFAULT_LEDGER,
    batch_size: Annotated[int, typer.Option(help="Events per commit.")] = 5000,
) -> None:
    """Fold the embedded spool into the ledger (exactly once; safe to repeat).

    Example: ledger ingest spool --spool .runledger/spool --ledger .runledger/ledger
    """
    from runledger.ingest import spool_ingester
    from runledger.ledger.store import Ledger

    with user_errors(ledger), progress("ingest spool", "records") as report:
        if not spool.is_dir():
            raise fail(f"no spool at {spool}")
        tally = QuarantineTally(then=commits_counted(report))
        with Ledger.create(ledger) as target:
            stats = spool_ingester.ingest_spool(target, spool, batch_size=batch_size, on_commit=tally)
    console.print(
        f"ingested {plural(stats.accepted, 'event')} ({plural(stats.metric_values, 'metric value')}) in "
        f"{plural(stats.commits, 'commit')}; {plural(stats.duplicates, 'duplicate')} dropped, "
        f"{stats.quarantined} quarantined"
        + (f"; {plural(stats.missing, 'spool position')} held no record (recorded)" if stats.missing else "")
    )
    say_quarantined(tally, ledger)


def ingest_kafka(
    bootstrap: BootstrapOption = None,
    group: Annotated[str, typer.Option("--group", help="Consumer group id.")] = "runledger-ingest",
    topic: TopicOption = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
    until_idle: Annotated[
        float | None,
        typer.Option(
            "--until-idle",
            help="Stop after this many seconds without records on the assigned partitions.",
            show_default=False,
        ),
    ] = None,
    batch_max: BatchMaxOption = COMMIT_BATCH_MAX,
    poll_ms: Annotated[int, typer.Option("--poll-ms", help="Longest wait for records per poll.")] = 200,
    session_timeout_ms: Annotated[
        int,
        typer.Option(
            "--session-timeout-ms", help="Group session timeout (a dead member's partitions move after it)."
        ),
    ] = 10000,
    instance_id: Annotated[
        str | None,
        typer.Option(
            "--instance-id",
            help="Static group membership id: a restart with the same id takes its partitions back at once.",
            show_default=False,
        ),
    ] = None,
    deadletter: Annotated[
        str | None,
        typer.Option(
            "--deadletter", help="Dead-letter topic. Default: <prefix>deadletter.", show_default=False
        ),
    ] = None,
    no_deadletter: Annotated[
        bool, typer.Option("--no-deadletter", help="Don't copy quarantined records to Kafka.")
    ] = False,
    create: Annotated[
        bool, typer.Option("--create/--no-create", help="Create the ledger if it does not exist.")
    ] = True,
    connect_timeout: ConnectTimeoutOption = 15.0,
    wait_for_topic: Annotated[
        float,
        typer.Option(
            "--wait-for-topic",
            min=0,
            help="Seconds a missing (or unreadable) topic may take to appear; 0: it must exist now.",
            metavar="SECONDS",
        ),
    ] = 0.0,
) -> None:
    """Consume Kafka into the ledger in a consumer group, exactly once, until SIGTERM/SIGINT.

    A topic that does not exist, has no partitions or may not be read is one line and exit 1
    (after --wait-for-topic SECONDS, if given).

    Example: ledger ingest kafka --bootstrap localhost:9092 --group runledger-ingest
    """
    from runledger.ingest.kafka_config import TopicUnavailableError
    from runledger.ingest.kafka_ingester import run_ingester
    from runledger.ledger.lake import LAKE_MARKER

    stop = threading.Event()
    started = time.monotonic()
    tally = QuarantineTally()
    with kafka_errors(), stop_on_signals(stop):
        if not create and not any((ledger / marker).exists() for marker in (LAKE_MARKER, "LEDGER.json")):
            raise fail(f"no ledger at {ledger} (drop --no-create to make one)")
        try:
            stats = run_ingester(
                ledger,
                bootstrap,
                group,
                topic or None,
                batch_max=batch_max,
                poll_ms=poll_ms,
                stop_event=stop,
                idle_timeout_s=until_idle,
                create=create,
                deadletter=None if no_deadletter else (deadletter or ""),
                session_timeout_ms=session_timeout_ms,
                instance_id=instance_id,
                connect_timeout_s=connect_timeout,
                wait_for_topic_s=wait_for_topic,
                on_commit=tally,
                on_warning=_warn,
            )
        except TopicUnavailableError as exc:
            # A subscription to it would ingest nothing, silently: say so, with the ways to make it
            # (a broker's auto-created topic has one partition) or to wait for it.
            raise fail(f"{exc}{_missing_topic_hint(str(exc), topic or [], wait_for_topic)}") from None
    seconds = time.monotonic() - started
    console.print(
        f"ingested {plural(stats.accepted, 'event')} ({plural(stats.metric_values, 'metric value')}) in "
        f"{plural(stats.commits, 'commit')} over {seconds:.1f} s; {plural(stats.duplicates, 'duplicate')} "
        f"dropped, {stats.skipped} already held, "
        f"{stats.quarantined} quarantined ({stats.deadlettered} dead-lettered)"
    )
    say_quarantined(tally, ledger)


def _warn(line: str) -> None:
    """A warning from a long-running ingester: one line on stderr, as it happens."""
    err_console.print(f"warning: {line}", highlight=False, markup=False, emoji=False)


def _missing_topic_hint(problem: str, topics: list[str], waited_s: float) -> str:
    """What to do about a topic that is not there: make it with partitions (and, when the ingester
    did not wait, that it can wait)."""
    if "does not exist" not in problem:
        return "" if waited_s else "; --wait-for-topic SECONDS waits for it"
    from runledger.ingest.kafka_config import events_topic

    name = next((t for t in topics if f"topic {t} does not exist" in problem), events_topic())
    wait = "" if waited_s else ", or --wait-for-topic SECONDS waits for it"
    return f"; `ledger kafka topic create {name} --partitions 12` makes it{wait}"


def ingest_github(
    repo: Annotated[str, typer.Argument(help="OWNER/REPO")],
    since: Annotated[
        str | None, typer.Option(help="Read objects updated since (overrides the cursor).")
    ] = None,
    base_url: Annotated[
        str, typer.Option("--base-url", help="API root (GitHub Enterprise: https://HOST/api/v3).")
    ] = "https://api.github.com",
    token_file: Annotated[
        Path | None, typer.Option("--token-file", help="File holding a token (default: $GITHUB_TOKEN).")
    ] = None,
    spool: SpoolOption = None,
    cursor_file: Annotated[
        Path | None, typer.Option("--cursor-file", help="Resume cursors (default: beside the spool).")
    ] = None,
    per_page: Annotated[int, typer.Option("--per-page", min=1, max=100)] = 100,
    request_interval: Annotated[
        float,
        typer.Option("--request-interval", help="Seconds between requests (GitHub asks for serial)."),
    ] = 0.25,
    max_rate_limit_wait: Annotated[
        float, typer.Option("--max-rate-limit-wait", help="Longest rate-limit wait, seconds.")
    ] = 900.0,
) -> None:
    """Backfill a repository's issues, PRs, reviews, comments and commits onto the bus.

    Example: ledger ingest github NVIDIA/Megatron-LM --since 2025-01-01   (token from $GITHUB_TOKEN)
    """
    from runledger.ingest.github_backfill import (
        BackfillError,
        JsonCursorStore,
        backfill,
        cursor_from_spool,
        default_cursor_file,
    )
    from runledger.ingest.github_events import valid_repo

    if not valid_repo(repo):
        raise fail(f"not a repository name: {repo!r} (expected OWNER/REPO)", 2)
    start = _parse_since(since) if since is not None else None
    token = _token(token_file)
    from runledger.ingest.bus import default_spool_dir

    where = spool if spool is not None else default_spool_dir()
    try:
        store = JsonCursorStore(cursor_file if cursor_file is not None else default_cursor_file(where))
    except (OSError, ValueError) as exc:
        raise fail(f"unreadable cursor file: {exc}", 2) from None
    if start is None and not store.has(repo):
        # No cursor recorded: resume from the backfill events already on the spool, if any.
        for kind, value in cursor_from_spool(where, repo).items():
            store.set(repo, kind, value)
    sink = _open_sink(spool, "ingest github")
    if token is None:  # said once nothing else can fail first, so an error stays one line
        err_console.print(
            "note: no token ($GITHUB_TOKEN or --token-file): anonymous, 60 requests/hour",
            highlight=False,
            markup=False,
            emoji=False,
        )
    try:
        stats = backfill(
            repo,
            sink,
            token=token,
            base_url=base_url,
            since=start,
            cursor_store=store,
            per_page=per_page,
            seconds_between_requests=request_interval or None,
            max_rate_limit_wait_s=max_rate_limit_wait,
        )
    except BackfillError as exc:
        raise fail(str(exc), exc.code) from None
    finally:
        sink.close()
    print_json(stats.as_dict())
    left = _undelivered_exit(sink, "backfill done")
    if left is not None:
        raise left


def ingest_wandb(
    target: Annotated[
        str,
        typer.Argument(
            help="A W&B offline run directory (or its .wandb file), or an online ENTITY/PROJECT or "
            "ENTITY/PROJECT/RUN. A local path that exists wins.",
            metavar="PATH|ENTITY/PROJECT[/RUN]",
        ),
    ],
    run_id: Annotated[
        str | None, typer.Option("--run-id", help="Ledger run id (default: the W&B run id).")
    ] = None,
    spool: SpoolOption = None,
    cursor_file: Annotated[
        Path | None,
        typer.Option("--cursor-file", help="Online: resume cursors (default: beside the spool)."),
    ] = None,
    accept_partial: Annotated[
        bool,
        typer.Option(
            "--accept-partial",
            help="Offline: exit 0 although wandb's reader skipped damaged data (what it read is "
            "imported either way; without this the import exits 1 and says what was skipped).",
        ),
    ] = False,
) -> None:
    """Import W&B runs as ledger events: an offline run directory, or online runs through W&B's API.

    Example: ledger ingest wandb wandb/offline-run-20250101_120000-abc123

    Example: WANDB_API_KEY=… ledger ingest wandb my-team/moe-pretrain      (every run; or my-team/moe-pretrain/RUN_ID)

    Online, the API key is wandb's ($WANDB_API_KEY or `wandb login`) and the server is $WANDB_BASE_URL
    (default api.wandb.ai). A second import continues each run where the last stopped.
    """
    from runledger.ingest.wandb_online import TARGET_RE

    # A path that exists is a local run; else W&B's ENTITY/PROJECT[/RUN] form goes online; anything
    # else is a local path that is not there (and says so).
    if not Path(target).exists() and TARGET_RE.match(target):
        _ingest_wandb_online(target, run_id, spool, cursor_file)
    else:
        _ingest_wandb_offline(Path(target), run_id, spool, accept_partial)


def _ingest_wandb_offline(
    directory: Path, run_id: str | None, spool: Path | None, accept_partial: bool = False
) -> None:
    from runledger.ingest.wandb_import import (
        PartialImportError,
        WandbImportError,
        find_offline_runs,
        import_offline_run,
    )

    try:
        files = find_offline_runs(directory)
    except WandbImportError as exc:
        raise fail(str(exc), 2) from None
    if run_id is not None and len(files) > 1:
        raise fail(f"{directory} holds {len(files)} runs; --run-id needs exactly one", 2)
    sink = _open_sink(spool, "ingest wandb")
    try:
        for wandb_file in files:
            try:
                stats = import_offline_run(wandb_file, sink, run_id=run_id, accept_partial=accept_partial)
            except PartialImportError as exc:
                print_json(exc.stats.as_dict())
                raise fail(str(exc), 1) from None
            except WandbImportError as exc:
                raise fail(str(exc), 2 if "run id" in str(exc) else 1) from None
            print_json(stats.as_dict())
    finally:
        sink.close()
    left = _undelivered_exit(sink, "import done")
    if left is not None:
        raise left


def _ingest_wandb_online(
    target: str, run_id: str | None, spool: Path | None, cursor_file: Path | None
) -> None:
    from runledger.ingest.wandb_cursor import CursorFileError, CursorStore, default_cursor_file
    from runledger.ingest.wandb_online import OnlineImportError, import_online, open_api, parse_target

    _, _, run_name = parse_target(target)
    if run_id is not None and run_name is None:
        raise fail("--run-id needs one run (ENTITY/PROJECT/RUN)", 2)
    from runledger.ingest.bus import default_spool_dir

    where = spool if spool is not None else default_spool_dir()
    try:
        cursors = CursorStore(cursor_file if cursor_file is not None else default_cursor_file(where))
    except CursorFileError as exc:
        raise fail(str(exc), 2) from None
    try:
        api = open_api()
    except OnlineImportError as exc:
        raise fail(str(exc), 1) from None
    sink = _open_sink(spool, "ingest wandb")
    try:
        result = import_online(target, sink, cursors, api=api, run_id=run_id)
    finally:
        sink.close()
    for stats in result.runs:
        print_json(stats.as_dict())
    failed = [fail(line) for line in result.errors]  # each on its own line; the others were imported
    left = _undelivered_exit(sink, "import done")
    if failed:
        raise failed[-1]
    if left is not None:
        raise left


def _producer_sealer() -> Sealer | None:
    """The ingest commands' signer: the key file named by ``RUNLEDGER_PRODUCER_KEY``, as for the
    trainer. Not chained: an import may stop and resume in a new process (and GitHub events all have
    ``seq`` 0), so a chain would restart at genesis; each event is still signed."""
    from runledger.schemas.signing import PRODUCER_KEY_ENV, Sealer

    try:
        return Sealer.from_env(chain=False)
    except OSError as exc:
        raise fail(
            f"cannot read producer key ${PRODUCER_KEY_ENV}: {exc.strerror}: {exc.filename}", 2
        ) from None
    except ValueError as exc:
        raise fail(f"producer key ${PRODUCER_KEY_ENV} is not a private key: {exc}", 2) from None


def _open_sink(spool: Path | None, what: str = "") -> EventSink:
    """The producer's sink (signed when a key is set); with ``what``, it shows its progress (events
    written) until it is closed."""
    from runledger.ingest.bus import default_spool_dir, open_sink
    from runledger.ingest.spool import SpoolLockedError

    sealer = _producer_sealer()
    where = spool if spool is not None else default_spool_dir()
    try:
        sink = open_sink(spool, sealer=sealer)
    except SpoolLockedError:
        raise fail(
            f"spool {where} already has a live writer (another producer?); give this one its own --spool", 2
        ) from None
    except OSError as exc:
        if disk_full(exc) is not None:
            raise disk_full_error(exc, [Path(where)]) from None
        raise fail(f"cannot open spool: {exc.strerror}: {exc.filename}", 2) from None
    return _ProgressSink(sink, what) if what else sink


def _undelivered_exit(sink: EventSink, done: str) -> typer.Exit | None:
    """After ``close()``: the events a Kafka sink left in its outage spool, said in one line (with
    the command that sends them), and the exit 3 to raise; None when all are on the bus."""
    undelivered = undelivered_of(sink.sink if isinstance(sink, _ProgressSink) else sink)
    if undelivered is None or not undelivered.events:
        return None
    return undelivered_exit(done, undelivered)


class _ProgressSink:
    """A sink that shows how many events went through it (``runledger.cli.output.progress``) until closed."""

    def __init__(self, sink: EventSink, what: str) -> None:
        self.sink = sink
        self.events = 0
        self._shown = contextlib.ExitStack()
        self._report = self._shown.enter_context(progress(what, "events"))

    def emit(self, envelope: Envelope) -> None:
        self.sink.emit(envelope)
        self.events += 1
        self._report(self.events, None)

    def sync(self) -> None:
        self.sink.sync()

    def close(self) -> None:
        try:
            self.sink.close()
        finally:
            self._shown.close()


def _parse_since(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise fail(f"--since {text!r} is not a date (use 2024-03-01 or 2024-03-01T12:00:00Z)", 2) from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _token(token_file: Path | None) -> str | None:
    """From --token-file, else $GITHUB_TOKEN: never from the command line, where `ps` would show it."""
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise fail(f"cannot read token file {token_file}: {exc.strerror}", 2) from None
        if not token:
            raise fail(f"token file {token_file} is empty", 2)
        return token
    return os.environ.get("GITHUB_TOKEN") or None
