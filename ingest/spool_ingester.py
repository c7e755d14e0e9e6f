"""Fold a spool into the ledger, exactly once: positions come from the ledger, never from the reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ingest.spool import SpoolReader
from ledger.store import Ledger, SourceRecord
from schemas.codec import MAX_EVENT_BYTES


@dataclass
class IngestStats:
    commits: int = 0
    accepted: int = 0
    duplicates: int = 0
    quarantined: int = 0
    metric_values: int = 0


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
    reader = SpoolReader(spool_dir)
    source = f"spool:{reader.id}"
    stats = IngestStats()
    while True:
        start = ledger.positions().get(source, 0)
        batch = [
            SourceRecord(source, rec.index, rec.payload, rec.corrupt)
            for rec in reader.read(start, limit=batch_size)
        ]
        if not batch:
            return stats
        result = ledger.commit(batch, writer=f"spool-ingest:{spool_dir}", max_event_bytes=max_event_bytes)
        stats.commits += result.commit is not None
        stats.accepted += result.accepted
        stats.duplicates += result.duplicates
        stats.quarantined += len(result.quarantined)
        stats.metric_values += result.metric_values
