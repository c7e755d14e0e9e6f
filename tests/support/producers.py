"""Producer keys and events for the admission tests (tests/core/test_producers*.py): real Ed25519
key files, real envelopes, real ledger commits."""

from __future__ import annotations

from pathlib import Path

from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import Envelope, encode_event, make_event
from runledger.schemas.note import write_keypair
from runledger.schemas.payloads import StepMetrics
from runledger.schemas.signing import Sealer

SOURCE = "trainer/r/a1/rank0"


class Keys:
    """A key pair written to ``directory`` as a producer would keep it."""

    def __init__(self, directory: Path, name: str) -> None:
        private, public = write_keypair(directory, name)
        self.private_path, self.public_path = private, public
        self.private = private.read_text()
        self.public = public.read_text().strip()

    def sealer(self, *, chain: bool = True) -> Sealer:
        return Sealer(self.private, chain=chain)


def metric(seq: int, *, source: str = SOURCE, id: str | None = None, loss: float = 1.0) -> Envelope:
    return make_event(
        StepMetrics(loss=loss), source=source, stream="r", run_id="r", attempt=1, step=seq, seq=seq, id=id
    )


def commit(ledger: Ledger, envelopes: list[Envelope | bytes], feed: str = "spool:test") -> dict[str, str]:
    """Commit events at the next positions of ``feed``; returns {event id: quarantine code} refused."""
    start = ledger.positions().get(feed, 0)
    raws = [e if isinstance(e, bytes) else encode_event(e) for e in envelopes]
    result = ledger.commit([SourceRecord(feed, start + i, raw) for i, raw in enumerate(raws)])
    return {q.id or "": q.code for _, q in result.quarantined}
