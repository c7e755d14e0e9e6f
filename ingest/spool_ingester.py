"""Fold a spool into the ledger, exactly once: positions come from the ledger, never from the reader.

The loop and the counts are ``ingest.ingester``'s; the spool supplies its records, named
``spool:<spool id>`` at their index in the spool."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ingest.ingester import Ingester, IngestStats
from ingest.spool import SpoolReader
from ledger.store import Ledger, SourceRecord
from schemas.codec import MAX_EVENT_BYTES

__all__ = ["IngestStats", "SpoolIngester", "ingest_spool"]


class SpoolIngester(Ingester):
    """Reads the spool from the ledger's position for it, ``batch_size`` records at a time."""

    def __init__(
        self,
        ledger: Ledger,
        spool_dir: str | Path,
        *,
        batch_size: int = 5000,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        super().__init__(ledger, writer=f"spool-ingest:{spool_dir}", max_event_bytes=max_event_bytes)
        self.reader = SpoolReader(spool_dir)
        self.source = f"spool:{self.reader.id}"
        self.batch_size = batch_size

    def read_batch(self) -> Sequence[SourceRecord] | None:
        start = self.ledger.positions().get(self.source, 0)
        batch = [
            SourceRecord(self.source, rec.index, rec.payload, rec.corrupt)
            for rec in self.reader.read(start, limit=self.batch_size)
        ]
        return batch or None  # drained: nothing after the ledger's position


def ingest_spool(
    ledger: Ledger,
    spool_dir: str | Path,
    *,
    batch_size: int = 5000,
    max_event_bytes: int = MAX_EVENT_BYTES,
) -> IngestStats:
    """Append everything in the spool that the ledger does not hold yet, in commits of ``batch_size``.

    Every record is accepted, a duplicate, or quarantined with a reason (damaged spool records, and
    records longer than ``max_event_bytes``, included): nothing a record holds stops the ingest."""
    return SpoolIngester(ledger, spool_dir, batch_size=batch_size, max_event_bytes=max_event_bytes).run()
