"""Fold a spool into the ledger, exactly once: positions come from the ledger, never from the reader.

The loop and the counts are ``runledger.ingest.ingester``'s; the spool supplies its records, named
``spool:<spool id>`` at their index in the spool.

Nothing is passed over in silence. A stretch of positions that holds no record any more (a deleted
or damaged segment, or positions below the spool's high-water mark that no segment holds) becomes a
``bus.positions_missing`` event (its count and range), committed at the stretch's last
position together with the record after it, so it is recorded exactly once. An entry a closed
segment holds past its last position (garbage or a record added to it) has no position: it is
quarantined from ``spool:<spool id>:beyond``, at ``segment base << 32 | byte offset``.

A producer whose bus was still down when it ended keeps its drop report in the spool's ``pending/``
folder (``runledger.ingest.spool.PendingSlot``). Once the spool is drained up to the producer's last position,
each such event is committed from ``spool:<spool id>:pending`` at that source's next position, and
its file is removed after the commit. The event is the producer's own (its source, seq, signature,
chain), not one the ingester makes: admission checks it as it checks the producer's other events,
and a second copy (the file found again after a crash before its removal, or the same report on
the spool) is a duplicate of the same source and id. A file that does not parse is quarantined."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from runledger.ingest.ingester import Ingester, IngestStats
from runledger.ingest.spool import (
    PendingFile,
    SpoolReader,
    SpoolRecord,
    pending_files,
    raise_high_water,
    remove_pending,
    writer_alive,
)
from runledger.ledger.store import CommitResult, Ledger, SourceRecord
from runledger.schemas import encode_event
from runledger.schemas import payloads as p
from runledger.schemas.codec import MAX_EVENT_BYTES, Event, decode_event, make_event

__all__ = ["IngestStats", "SpoolIngester", "ingest_spool"]

log = logging.getLogger(__name__)


class SpoolIngester(Ingester):
    """Reads the spool from the ledger's position for it, ``batch_size`` records at a time."""

    def __init__(
        self,
        ledger: Ledger,
        spool_dir: str | Path,
        *,
        batch_size: int = 5000,
        max_event_bytes: int = MAX_EVENT_BYTES,
        on_commit: Callable[[CommitResult], None] | None = None,
    ) -> None:
        super().__init__(
            ledger, writer=f"spool-ingest:{spool_dir}", max_event_bytes=max_event_bytes, on_commit=on_commit
        )
        self.reader = SpoolReader(spool_dir)  # one reader for the whole run: it remembers offsets
        self.source = f"spool:{self.reader.id}"
        self.beyond_source = f"{self.source}:beyond"
        self.pending_source = f"{self.source}:pending"
        self._pending_offered: set[Path] = set()  # each pending file is offered once per run
        self._pending_in_batch: dict[int, Path] = {}  # position -> file, until the commit
        self.batch_size = batch_size
        self.missing = 0  # positions found missing (and recorded) by this ingester

    def read_batch(self) -> Sequence[SourceRecord] | None:
        start = self.ledger.positions().get(self.source, 0)
        high_water = self.reader.high_water()  # read before the segments: every position below it is there
        if start > high_water and raise_high_water(self.reader.directory, start):
            # The ledger holds positions the mark does not cover (a spool from before the mark): a
            # writer started after this never hands them out again.
            high_water = start
        elif start > high_water:
            log.warning(
                "spool %s: a live writer is below the ledger's position %d (high-water mark %d): its "
                "records at positions it hands out again are not ingested",
                self.reader.directory,
                start,
                high_water,
            )
        batch: list[SourceRecord] = []
        expected = start
        read = 0
        for rec in self.reader.read(start, limit=self.batch_size, beyond=True):
            if rec.beyond:
                position = rec.segment << 32 | rec.offset  # unique and in read order
                batch.append(SourceRecord(self.beyond_source, position, rec.payload, rec.corrupt))
                continue
            read += 1
            if rec.index > expected:
                batch.append(self._missing(expected, rec.index - 1, rec))
            batch.append(SourceRecord(self.source, rec.index, rec.payload, rec.corrupt))
            expected = rec.index + 1
        if read < self.batch_size and high_water > expected:
            # The spool ends before its high-water mark: the records of its last positions are gone.
            batch.append(self._missing(expected, high_water - 1, None))
        elif expected > high_water and not raise_high_water(self.reader.directory, expected):
            # A dead writer's last records, and a writer started meanwhile: they wait for its mark.
            batch = [r for r in batch if r.source != self.source or r.position < high_water]
        if batch:
            return batch
        return self._pending_batch(start) or None  # drained: nothing after the ledger's position

    def _pending_batch(self, spool_position: int) -> list[SourceRecord]:
        """The pending events of producers whose every spool record the ledger holds (or whose
        spool has no writer left), each at the next position of ``spool:<id>:pending``."""
        ready = [f for f in pending_files(self.reader.directory) if f.path not in self._pending_offered]
        ready = [f for f in ready if self._after_its_records(f, spool_position)]
        position = self.ledger.positions().get(self.pending_source, 0)
        batch: list[SourceRecord] = []
        for offset, found in enumerate(ready):
            self._pending_offered.add(found.path)
            self._pending_in_batch[position + offset] = found.path
            batch.append(SourceRecord(self.pending_source, position + offset, found.raw, found.damaged))
        return batch

    def _after_its_records(self, found: PendingFile, spool_position: int) -> bool:
        if found.spool_next is None or spool_position >= found.spool_next:
            return True
        return not writer_alive(self.reader.directory)  # its last records are gone: they never come

    def committed(self, batch: Sequence[SourceRecord], result: CommitResult) -> None:
        """The pending files this commit recorded (stored, a duplicate or quarantined) are removed."""
        for record in batch:
            if record.source == self.pending_source:
                path = self._pending_in_batch.pop(record.position, None)
                if path is not None:
                    remove_pending(path)

    def _missing(self, first: int, last: int, after: SpoolRecord | None) -> SourceRecord:
        """The record of positions ``first``..``last`` gone missing, at position ``last``: on the
        stream of the record after them when that names a run (the run most likely to have lost
        them), else on the spool's own stream ``spool:<spool id>``."""
        count = last - first + 1
        self.missing += count
        log.warning(
            "spool %s: positions %d..%d hold no record (%d lost)", self.reader.directory, first, last, count
        )
        reason = "no segment of the spool holds them (deleted, or lost with a damaged stretch)"
        payload = p.BusPositionsMissing(
            source=self.source, first=first, last=last, count=count, reason=reason
        )
        decoded = decode_event(after.payload) if after is not None and after.corrupt is None else None
        env = decoded.envelope if isinstance(decoded, Event) else None
        run_id = env.run_id if env is not None else None
        envelope = make_event(
            payload,
            source=f"spool-ingest:{self.reader.id}",
            stream=run_id or self.source,
            seq=last,
            run_id=run_id,
            attempt=env.attempt if env is not None and run_id else None,
            step=env.step if env is not None and run_id else None,
            id=f"positions-missing-{first}-{last}",
            time=env.time if env is not None else None,
        )
        return SourceRecord(self.source, last, encode_event(envelope))


def ingest_spool(
    ledger: Ledger,
    spool_dir: str | Path,
    *,
    batch_size: int = 5000,
    max_event_bytes: int = MAX_EVENT_BYTES,
    on_commit: Callable[[CommitResult], None] | None = None,
) -> IngestStats:
    """Append everything in the spool that the ledger does not hold yet, in commits of ``batch_size``.

    Every record is accepted, a duplicate, or quarantined with a reason (damaged spool records, and
    records longer than ``max_event_bytes``, included); every stretch of missing positions is
    recorded (``bus.positions_missing``): nothing a record holds stops the ingest."""
    ingester = SpoolIngester(
        ledger, spool_dir, batch_size=batch_size, max_event_bytes=max_event_bytes, on_commit=on_commit
    )
    stats = ingester.run()
    stats.missing = ingester.missing
    return stats
