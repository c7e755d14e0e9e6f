"""Kafka commands: `ledger replay`, `ledger kafka drain-spool`, and the options and broker error
handling they share with `ledger ingest kafka` (in ingest_cmd)."""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runledger.cli.output import commits_counted, console, err_console, fail, plural, progress, user_errors
from runledger.cli.quarantine_summary import QuarantineTally, say_quarantined
from runledger.ingest.kafka_config import COMMIT_BATCH_MAX

if TYPE_CHECKING:  # kafka-python is slow to import: the CLI loads it only for Kafka commands
    from runledger.ingest.kafka_sink import Undelivered

BootstrapOption = Annotated[
    str | None,
    typer.Option(
        "--bootstrap",
        envvar="RUNLEDGER_KAFKA_BOOTSTRAP",
        help="Kafka bootstrap servers, host:port[,host:port].",
        show_default=False,
    ),
]
BatchMaxOption = Annotated[int, typer.Option("--batch-max", help="Most records per ledger commit.")]
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

    from runledger.ingest.kafka_config import BrokerUnavailableError, TopicUnavailableError

    with user_errors():
        try:
            yield
        except (BrokerUnavailableError, TopicUnavailableError) as exc:
            raise fail(str(exc)) from None
        except KafkaError as exc:
            raise fail(f"kafka: {exc}") from None


@contextlib.contextmanager
def stop_on_signals(event: threading.Event) -> Iterator[None]:
    """SIGTERM/SIGINT ask for a graceful stop: the batch in hand is committed first. SIGUSR1 dumps
    every thread's stack to stderr (`kill -USR1 PID`: where is a silent ingester?)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, lambda *_: event.set())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def replay(
    to: Annotated[Path, typer.Option("--to", help="The new ledger to build (a new or empty directory).")],
    bootstrap: BootstrapOption = None,
    topic: TopicOption = None,
    batch_max: BatchMaxOption = COMMIT_BATCH_MAX,
    connect_timeout: ConnectTimeoutOption = 15.0,
    ledger_id: Annotated[
        str | None,
        typer.Option(
            "--ledger-id",
            help="Keep the id of the ledger this one replaces (its id in LAKE.json, or ID in a signed "
            "checkpoint's origin runledger/ID/STREAM), so checkpoints signed before still verify. "
            "Default: a new log with a new id.",
            show_default=False,
        ),
    ] = None,
    registry_from: Annotated[
        Path | None,
        typer.Option(
            "--registry-from",
            help="Keep the producer registry and policy: the ledger this one replaces, or the file "
            "`ledger producers export` wrote. Each registry event goes back at the point of the log "
            "where it was, so every record is admitted as before.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Rebuild a ledger from the Kafka topics' beginning up to their current end.

    Example: ledger replay --bootstrap localhost:9092 --to /tmp/rebuilt
    """
    from runledger.ingest import kafka_replay
    from runledger.ledger.registry import read_registry

    with kafka_errors(), progress("replay", "records") as report:
        tally = QuarantineTally(then=commits_counted(report))
        registry = read_registry(registry_from) if registry_from is not None else []
        stats = kafka_replay.replay(
            bootstrap,
            to,
            topic or None,
            batch_max=batch_max,
            connect_timeout_s=connect_timeout,
            ledger_id=ledger_id,
            registry=registry,
            on_commit=tally,
        )
    rate = stats.metric_values / stats.seconds if stats.seconds else 0.0
    console.print(
        f"{'resumed' if stats.resumed else 'replayed'} {plural(stats.records, 'record')} from "
        f"{plural(stats.partitions, 'partition')} into {to}: {plural(stats.accepted, 'event')}, "
        f"{plural(stats.metric_values, 'metric value')} ({rate:,.0f}/s), {plural(stats.duplicates, 'duplicate')}, "
        f"{stats.quarantined} quarantined, in {stats.seconds:.1f} s; ledger id {stats.ledger_id}"
        + (f"; {plural(stats.registry_events, 'registry event')} kept" if registry_from is not None else "")
    )
    say_quarantined(tally, to)


def drain_spool(
    spool: Annotated[
        Path, typer.Option("--spool", envvar="RUNLEDGER_SPOOL", help="The producer's outage spool.")
    ] = Path(".runledger/spool"),
    bootstrap: BootstrapOption = None,
    topic: Annotated[str | None, typer.Option("--topic", help="Default: <prefix>events.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to keep trying.")] = 60.0,
) -> None:
    """Send what a dead producer left in its outage spool to Kafka (in order), then exit.

    Safe to repeat, and after a kill: the spool keeps its acked position, so a second run sends only
    what is left; what a kill re-sends, the ledger drops as duplicates. Exits 3 (as every process
    that ends with events not on Kafka) when some are still in the spool after --timeout.

    Example: ledger kafka drain-spool --spool .runledger/spool --bootstrap localhost:9092
    """
    from runledger.ingest.kafka_sink import KafkaSink
    from runledger.ingest.spool import SpoolLockedError, pending_files, remove_pending

    if not spool.is_dir():
        raise fail(f"no spool at {spool}")
    with kafka_errors():
        try:
            sink = KafkaSink(bootstrap, spool, topic=topic)
        except SpoolLockedError as exc:
            raise fail(f"{exc} (its producer is alive and drains it itself)") from None
        before = sink.pending()
        # The drop reports producers kept beside the spool at their end (the bus was down then) go
        # too, as they are; a damaged one is left for `ledger ingest spool` to quarantine.
        kept = [report for report in pending_files(spool) if report.damaged is None]
        for report in kept:
            sink.emit_raw(report.raw)
        sink.close(timeout_s=timeout)
    undelivered = sink.undelivered()
    if undelivered.events:  # the kept reports stay too: sent again, the ledger keeps each once
        raise undelivered_exit(f"{before - undelivered.events} of {before} spooled events sent", undelivered)
    for report in kept:
        remove_pending(report.path)
    reports = f" and {plural(len(kept), 'kept drop report')}" if kept else ""
    console.print(f"sent {plural(before, 'spooled event')}{reports} to {sink.topic}")


def undelivered_of(sink: object) -> Undelivered | None:
    """What a closed producer sink left off Kafka (in its outage spool); None for the spool bus,
    where the spool is the bus and nothing waits off it."""
    from runledger.ingest.bus import SpoolSink

    if isinstance(sink, SpoolSink):  # spared kafka-python's import
        return None
    from runledger.ingest.kafka_sink import KafkaSink

    return sink.undelivered() if isinstance(sink, KafkaSink) else None


def undelivered_exit(done: str, undelivered: Undelivered) -> typer.Exit:
    """The end of a process that leaves events off Kafka: what it did, how many wait where, and the
    command that sends them, on one line; exit ``UNDELIVERED_EXIT_CODE`` (3). The caller raises it."""
    from runledger.ingest.kafka_sink import UNDELIVERED_EXIT_CODE

    return fail(f"{done}; {undelivered.line()}", UNDELIVERED_EXIT_CODE)


GroupLagOption = Annotated[
    str | None,
    typer.Option("--group", help="Also show this consumer group's members, committed offsets and lag."),
]


def topic_create(
    topic: Annotated[str, typer.Argument(help="The topic, e.g. runledger.events.")],
    partitions: Annotated[
        int,
        typer.Option(
            "--partitions",
            min=1,
            help="Partitions (a group's ingesters share the work by whole partitions: at most this many work).",
        ),
    ] = 12,
    replication_factor: Annotated[
        int,
        typer.Option("--replication-factor", min=1, help="Copies of each partition (at most the brokers)."),
    ] = 1,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            help="A topic setting KEY=VALUE, e.g. retention.ms=-1 (repeatable; used only when the topic is made).",
            show_default=False,
        ),
    ] = None,
    bootstrap: BootstrapOption = None,
    connect_timeout: ConnectTimeoutOption = 15.0,
) -> None:
    """Create a topic with N partitions (a broker's auto-created topic has one: a second ingester of
    the group would sit idle). A topic already there with N partitions is fine (exit 0); with
    another count, one line and exit 1.

    Example: ledger kafka topic create runledger.events --partitions 12 --bootstrap localhost:9092
    """
    from runledger.ingest.kafka_admin import TopicExistsError, admin_client, create_topic

    configs = _topic_configs(config or [])
    with kafka_errors(), admin_client(bootstrap, connect_timeout) as admin:
        try:
            made, count = create_topic(admin, topic, partitions, replication_factor, configs)
        except TopicExistsError as exc:
            raise fail(
                f"{exc} (`ledger kafka topic add-partitions {topic} --partitions N` adds some)"
            ) from None
    said = "created" if made else "exists"
    console.print(f"topic {topic} {said} with {plural(count, 'partition')}", highlight=False)


def _topic_configs(pairs: list[str]) -> dict[str, str]:
    """``--config KEY=VALUE`` options as a dict; a malformed one is a usage error (exit 2)."""
    configs: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise fail(f"--config {pair!r}: give KEY=VALUE, e.g. retention.ms=-1", 2)
        configs[key.strip()] = value.strip()
    return configs


def topic_add_partitions(
    topic: Annotated[str, typer.Argument(help="The topic.")],
    partitions: Annotated[int, typer.Option("--partitions", min=1, help="The partition count to reach.")],
    bootstrap: BootstrapOption = None,
    connect_timeout: ConnectTimeoutOption = 15.0,
) -> None:
    """Raise a topic's partition count (Kafka cannot lower it). A key's partition follows the count,
    so a stream's events sent before and after the change may be read, and numbered, out of order
    across it: pick the count up front (docs/kafka.md); this is for a group that needs more.

    Example: ledger kafka topic add-partitions runledger.events --partitions 12
    """
    from runledger.ingest.kafka_admin import add_partitions, admin_client

    with kafka_errors(), admin_client(bootstrap, connect_timeout) as admin:
        try:
            before, after = add_partitions(admin, topic, partitions)
        except ValueError as exc:
            raise fail(str(exc)) from None
    change = "already has" if before == after else f"{before} ->"
    console.print(f"topic {topic} {change} {plural(after, 'partition')}", highlight=False)
    if before != after:  # the cost the docs warn of, said where it was paid
        err_console.print(
            "note: keys now map to other partitions: a stream's events sent across this change may "
            "be ledgered out of order across it",
            highlight=False,
        )


def topic_describe(
    topic: Annotated[str, typer.Argument(help="The topic.")],
    group: GroupLagOption = None,
    bootstrap: BootstrapOption = None,
    connect_timeout: ConnectTimeoutOption = 15.0,
) -> None:
    """A topic's partitions and their end offsets; with --group, the group's members, committed
    offsets and lag (Kafka's committed offsets are the ingester's hint: the ledger holds the truth).

    Example: ledger kafka topic describe runledger.events --group runledger-ingest
    """
    from runledger.ingest.kafka_admin import admin_client, describe_topic

    with kafka_errors(), admin_client(bootstrap, connect_timeout) as admin:
        info = describe_topic(admin, topic, group)
    head = f"topic {info.name}: {plural(len(info.partitions), 'partition')}, replication {info.replication_factor}"
    if info.group is not None:
        head += f"; group {info.group}: {plural(info.group_members or 0, 'member')}"
    console.print(head, highlight=False)
    for p in info.partitions:
        line = f"  partition {p.partition}: end {p.end_offset}"
        if info.group is not None:
            line += f", committed {'-' if p.committed is None else p.committed}, lag {'-' if p.lag is None else p.lag}"
        console.print(line, highlight=False)
