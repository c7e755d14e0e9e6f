"""The producer side of the bus: where events go once a producer has made them.

Producers (the trainer, the webhook receiver, backfills) hold an ``EventSink``; they never know
whether Kafka or the embedded spool is behind it. ``open_sink`` picks: Kafka when a bootstrap
server is configured (``RUNLEDGER_KAFKA_BOOTSTRAP``), else the on-disk spool.

A sink given a ``Sealer`` (``runledger.schemas.signing``) signs (and, if the sealer chains,
chains per source) every envelope it emits, in emit order. The producer decides: the trainer's
``open_rank_sink`` passes the key named by ``RUNLEDGER_PRODUCER_KEY``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from runledger.ingest.spool import SpoolWriter
from runledger.schemas import Envelope, encode_event
from runledger.schemas.signing import Sealer

DEFAULT_SPOOL = Path(".runledger/spool")


class EventSink(Protocol):
    def emit(self, envelope: Envelope) -> None:
        """Hand one event to the bus. Must not block the caller for long."""

    def sync(self) -> None:
        """Return once everything emitted so far is durable (used before a crash exit)."""

    def close(self) -> None: ...


class SpoolSink:
    """The embedded default: events appended to a local spool."""

    def __init__(
        self, directory: str | Path, *, fsync_interval_s: float = 0.2, sealer: Sealer | None = None
    ) -> None:
        self.writer = SpoolWriter(directory, fsync_interval_s=fsync_interval_s)
        self.sealer = sealer

    def emit(self, envelope: Envelope) -> None:
        if self.sealer is not None:
            envelope = self.sealer.seal(envelope)
        self.writer.append(encode_event(envelope))

    def emit_raw(self, raw: bytes) -> None:
        self.writer.append(raw)

    def sync(self) -> None:
        self.writer.sync()

    def close(self) -> None:
        self.writer.close()


def default_spool_dir() -> Path:
    return Path(os.environ.get("RUNLEDGER_SPOOL", DEFAULT_SPOOL))


def open_sink(
    spool_dir: str | Path | None = None,
    kafka_bootstrap: str | None = None,
    *,
    sealer: Sealer | None = None,
) -> EventSink:
    """Kafka if a bootstrap server is given or configured, else the spool; events signed with
    ``sealer`` when one is given."""
    bootstrap = kafka_bootstrap or os.environ.get("RUNLEDGER_KAFKA_BOOTSTRAP")
    spool = Path(spool_dir) if spool_dir is not None else default_spool_dir()
    if bootstrap:
        from runledger.ingest.kafka_sink import KafkaSink  # imported lazily: kafka-python is heavy to import

        return KafkaSink(bootstrap=bootstrap, outage_spool=spool, sealer=sealer)
    return SpoolSink(spool, sealer=sealer)
