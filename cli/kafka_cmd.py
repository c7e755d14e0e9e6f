"""Kafka commands: `ledger ingest kafka`, `ledger replay`, `ledger kafka drain-spool`."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.output import DEFAULT_LEDGER, LedgerOption, console, fail, user_errors

BootstrapOption = Annotated[
    str | None,
    typer.Option(
        "--bootstrap",
        envvar="RUNLEDGER_KAFKA_BOOTSTRAP",
        help="Kafka bootstrap servers, host:port[,host:port].",
        show_default=False,
    ),
]
TopicOption = Annotated[
    list[str] | None,
    typer.Option("--topic", help="Topic to read (repeatable). Default: <prefix>events.", show_default=False),
]
ConnectTimeoutOption = Annotated[
    float, typer.Option("--connect-timeout", help="Seconds to wait for a broker before giving up.")
]


@contextlib.contextmanager
def kafka_errors() -> Iterator[None]:
    """Broker trouble as one line and a non-zero exit (on top of the ledger's own user errors)."""
    from kafka.errors import KafkaError

    from runledger.ingest.kafka_config import BrokerUnavailableError

    with user_errors():
        try:
            yield
        except BrokerUnavailableError as exc:
            raise fail(str(exc)) from None
        except KafkaError as exc:
            raise fail(f"kafka: {exc}") from None


@contextlib.contextmanager
def stop_on_signals(event: threading.Event) -> Iterator[None]:
    """SIGTERM/SIGINT ask for a graceful stop: the batch in hand is committed first."""
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, lambda *_: event.set())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    batch_max: Annotated[int, typer.Option("--batch-max", help="Most records per ledger commit.")] = 5000,
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
) -> None:
    """Consume Kafka into the ledger in a consumer group, exactly once, until SIGTERM/SIGINT."""
    from runledger.ingest.kafka_ingester import run_ingester

    stop = threading.Event()
    started = time.monotonic()
    with kafka_errors(), stop_on_signals(stop):
        if not create and not (ledger / "LEDGER.json").exists():
            raise fail(f"no ledger at {ledger} (drop --no-create to make one)")
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
        )
    seconds = time.monotonic() - started
    console.print(
        f"ingested {stats.accepted} events ({stats.metric_values} metric values) in {stats.commits} commits "
        f"over {seconds:.1f} s; {stats.duplicates} duplicates dropped, {stats.skipped} already held, "
        f"{stats.quarantined} quarantined ({stats.deadlettered} dead-lettered)"
    )


def replay_cmd(
    to: Annotated[Path, typer.Option("--to", help="The new ledger to build (a new or empty directory).")],
    bootstrap: BootstrapOption = None,
    topic: TopicOption = None,
    batch_max: Annotated[int, typer.Option("--batch-max", help="Most records per ledger commit.")] = 20000,
    connect_timeout: ConnectTimeoutOption = 15.0,
) -> None:
    """Rebuild a ledger from the Kafka topics' beginning up to their current end."""
    from runledger.ingest.kafka_replay import replay

    with kafka_errors():
        stats = replay(bootstrap, to, topic or None, batch_max=batch_max, connect_timeout_s=connect_timeout)
    rate = stats.metric_values / stats.seconds if stats.seconds else 0.0
    console.print(
        f"{'resumed' if stats.resumed else 'replayed'} {stats.records} records from {stats.partitions} "
        f"partitions into {to}: {stats.accepted} events, {stats.metric_values} metric values "
        f"({rate:,.0f}/s), {stats.duplicates} duplicates, {stats.quarantined} quarantined, in {stats.seconds:.1f} s"
    )


def drain_spool(
    spool: Annotated[
        Path, typer.Option("--spool", envvar="RUNLEDGER_SPOOL", help="The producer's outage spool.")
    ] = Path(".runledger/spool"),
    bootstrap: BootstrapOption = None,
    topic: Annotated[str | None, typer.Option("--topic", help="Default: <prefix>events.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to keep trying.")] = 60.0,
) -> None:
    """Send what a dead producer left in its outage spool to Kafka (in order), then exit."""
    from runledger.ingest.kafka_sink import KafkaSink
    from runledger.ingest.spool import SpoolLockedError

    if not spool.is_dir():
        raise fail(f"no spool at {spool}")
    with kafka_errors():
        try:
            sink = KafkaSink(bootstrap, spool, topic=topic)
        except SpoolLockedError as exc:
            raise fail(f"{exc} (its producer is alive and drains it itself)") from None
        before = sink.pending()
        sink.close(timeout_s=timeout)
    left = sink.left_in_spool
    if left:
        raise fail(f"{before - left} of {before} events sent; {left} still in {spool} (broker unreachable?)")
    console.print(f"sent {before} spooled events to {sink.topic}")


def register(
    app: typer.Typer, ingest_app: typer.Typer | None = None, serve_app: typer.Typer | None = None
) -> None:
    if ingest_app is not None:
        ingest_app.command("kafka")(ingest_kafka)
    app.command("replay")(replay_cmd)
    kafka_app = typer.Typer(help="Kafka bus utilities.", no_args_is_help=True)
    kafka_app.command("drain-spool")(drain_spool)
    app.add_typer(kafka_app, name="kafka")
