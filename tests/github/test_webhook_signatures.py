"""The webhook receiver signs what it stores with its own producer key and says that GitHub's HMAC was
checked; a ledger that registered the receiver admits those events and nothing forged in its name."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

from runledger.ingest.bus import SpoolSink
from runledger.ingest.github_webhook import create_app, signature_of
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.registry import register_producer
from runledger.ledger.store import Ledger
from runledger.ledger.verifier import VerificationError, verify_producer_signature
from runledger.schemas import Event, decode_event
from runledger.schemas.note import write_keypair
from runledger.schemas.payloads import ProducerScope
from runledger.schemas.signing import HMAC_CHECKED, Sealer
from tests.support.github import fixture_json, read_events, running_uvicorn

SECRET = b"It's a Secret to Everybody"


def post(url: str, body: bytes, event: str, secret: bytes = SECRET) -> httpx.Response:
    headers = {
        "Content-Type": "application/json",
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": str(uuid.uuid4()),
        "X-Hub-Signature-256": signature_of(secret, body),
    }
    return httpx.post(f"{url}/webhook", content=body, headers=headers, timeout=10)


def test_webhook_events_carry_the_receivers_signature_and_the_hmac_check(tmp_path: Path) -> None:
    private, public = write_keypair(tmp_path / "keys", "github-webhook")
    spool = tmp_path / "spool"
    sink = SpoolSink(spool, sealer=Sealer(private.read_text(), chain=False))
    app = create_app(SECRET, sink)
    body = json.dumps(fixture_json("webhook_issues_edited.json")).encode()
    try:
        with running_uvicorn(app) as url:
            assert post(url, body, "issues").status_code == 202
            assert post(url, body, "issues", secret=b"wrong").status_code == 401
    finally:
        sink.close()

    [event] = read_events(spool)
    envelope = event.envelope
    assert envelope.attested == HMAC_CHECKED and envelope.prev is None  # GitHub events: no chain
    assert verify_producer_signature(event.canonical, public.read_text()) == envelope.key_id

    # A ledger that registered the receiver for GitHub sources admits it: signature, scope and all.
    ledger = Ledger.create(tmp_path / "ledger")
    scope = ProducerScope(sources=["github-webhook/"], types=["github."])
    register_producer(ledger, "github-webhook", public.read_text(), scope)
    stats = ingest_spool(ledger, spool)
    assert (stats.accepted, stats.quarantined) == (1, 0)
    # The signed bytes include the attestation: claiming an HMAC check the receiver did not sign fails.
    forged = json.loads(event.canonical)
    forged["attested"] = "something-else"
    decoded = decode_event(json.dumps(forged).encode())
    assert isinstance(decoded, Event)
    with pytest.raises(VerificationError, match="does not verify"):
        verify_producer_signature(decoded.canonical, public.read_text())
